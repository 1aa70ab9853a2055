"""LoRA adapters (jaxllm/lora) against PEFT: requests of several adapters and of the base model
in the same steps give the greedy tokens and logprobs of the merged HF model of each; fewer
slots than adapters only makes requests wait; the prefix cache never shares pages across
adapters; adapters that cannot be served are refused with the reason, and the engine goes on."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from jaxllm import LLM, LoRARequest, SamplingParams
from jaxllm.lora import LoRAError

from tests.helpers.hf_reference import build_hf_model, from_gguf
from tests.helpers.tiny_model import FAMILY_ENGINE_ARGS

pytest.importorskip("peft")
from tests.helpers.lora_reference import build_adapter, greedy, logprobs_of  # noqa: E402

ENGINE_ARGS = dict(FAMILY_ENGINE_ARGS, enable_lora=True, max_lora_rank=16)
MAX_TOKENS = 8
ALL_LLAMA = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 256, int(rng.integers(5, 40))).tolist() for _ in range(n)]


@pytest.fixture(scope="module")
def qwen2_adapters(tmp_path_factory):
    """A tiny Qwen2 (QKV biases) and three adapters: every projection at rank 8; q and v at rank
    4 with rsLoRA; o, up and down at rank 16 with an alpha_pattern. Each with its merged model."""
    root = tmp_path_factory.mktemp("lora")
    base = build_hf_model("qwen2", root / "model")
    base.generation_config.eos_token_id = None
    specs = {
        "all": dict(r=8, targets=ALL_LLAMA, seed=1),
        "qv": dict(r=4, targets=("q_proj", "v_proj"), use_rslora=True, alpha=8, seed=2),
        "mlp": dict(r=16, targets=("o_proj", "up_proj", "down_proj"), alpha_pattern={"down_proj": 4}, seed=3),
    }
    merged = {name: build_adapter(base, root / name, **spec) for name, spec in specs.items()}
    requests = {name: LoRARequest(name, i + 1, str(root / name)) for i, name in enumerate(specs)}
    return root, base, merged, requests


def _check_against_peft(llm, base, merged, requests, prompts, assigned, atol=2e-4):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, detokenize=False, logprobs=0)
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        params,
        use_tqdm=False,
        lora_request=[None if a is None else requests[a] for a in assigned],
    )
    differs = 0
    for prompt, adapter, out in zip(prompts, assigned, outputs):
        hf = base if adapter is None else merged[adapter]
        tokens = out.outputs[0].token_ids
        assert tokens == greedy(hf, prompt, MAX_TOKENS), adapter
        got = [next(iter(lp.values())).logprob for lp in out.outputs[0].logprobs]
        np.testing.assert_allclose(got, logprobs_of(hf, prompt, tokens), atol=atol)
        differs += adapter is not None and tokens != greedy(base, prompt, MAX_TOKENS)
    assert differs >= 2  # the adapters change what the model says


def test_adapters_and_base_mixed_in_steps_match_peft(qwen2_adapters):
    root, base, merged, requests = qwen2_adapters
    llm = LLM(str(root / "model"), params_cache_dir=str(root / "cache"), max_loras=3, **ENGINE_ARGS)
    prompts = _prompts(8)
    assigned = ["all", None, "qv", "mlp", "all", "qv", None, "mlp"]
    _check_against_peft(llm, base, merged, requests, prompts, assigned)
    assert llm.engine.runner.lora.num_loads == 3
    assert llm.engine.list_loras() == {1, 2, 3}


def test_fewer_slots_than_adapters_makes_requests_wait(qwen2_adapters):
    root, base, merged, requests = qwen2_adapters
    llm = LLM(str(root / "model"), params_cache_dir=str(root / "cache"), max_loras=1, max_cpu_loras=2, **ENGINE_ARGS)
    prompts = _prompts(6, seed=1)
    assigned = ["all", "qv", "mlp", None, "qv", "all"]
    _check_against_peft(llm, base, merged, requests, prompts, assigned)
    assert llm.engine.runner.lora.num_loads >= 3  # one slot, taken in turn


def test_prefix_cache_keeps_adapters_apart(qwen2_adapters):
    root, base, merged, requests = qwen2_adapters
    llm = LLM(str(root / "model"), params_cache_dir=str(root / "cache"), max_loras=2, **ENGINE_ARGS)
    prompt = {"prompt_token_ids": _prompts(1, seed=2)[0] + list(range(10, 30))}
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, detokenize=False)
    engine = llm.engine
    runs = [None, requests["all"], requests["qv"], requests["all"]]
    hits = []
    for adapter in runs:
        before = engine.prefix_cache_tokens[1]
        out = llm.generate(prompt, params, use_tqdm=False, lora_request=adapter)[0]
        hits.append(engine.prefix_cache_tokens[1] - before)
        hf = base if adapter is None else merged[adapter.lora_name]
        assert out.outputs[0].token_ids == greedy(hf, prompt["prompt_token_ids"], 4)
    assert hits[:3] == [0, 0, 0] and hits[3] > 0  # only the same adapter's pages are reused


@pytest.mark.parametrize(
    "kind, targets",
    [
        ("phi3", ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")),  # fused projections
        ("gpt_neox", ("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h")),  # per-head QKV rows
        ("opt", ("q_proj", "v_proj", "out_proj", "fc1", "fc2")),
        ("gemma3", ALL_LLAMA),
        ("mixtral", ("q_proj", "k_proj", "v_proj", "o_proj")),  # routed experts stay the base's
    ],
)
def test_each_family_matches_peft(kind, targets, tmp_path):
    base = build_hf_model(kind, tmp_path / "model")
    base.generation_config.eos_token_id = None
    merged = {"a": build_adapter(base, tmp_path / "a", r=8, targets=targets, seed=5)}
    requests = {"a": LoRARequest("a", 1, str(tmp_path / "a"))}
    llm = LLM(str(tmp_path / "model"), params_cache_dir=str(tmp_path / "cache"), **ENGINE_ARGS)
    _check_against_peft(llm, base, merged, requests, _prompts(4, seed=3), ["a", None, "a", "a"])


LAYOUTS = ["1x1", "2x1", "4x1", "1x2", "2x2"]


def test_tensor_and_pipeline_parallel_adapters_match_peft(qwen2_adapters, run_on_virtual_devices):
    """Tensor parallel over 2 and 4 devices (4: each shard repeats a KV head; b split by output
    column for the column-parallel matrices, a by input row for the row-parallel ones), two
    pipeline stages (each layer slot's slots stacked over the stages), and both."""
    root, base, merged, requests = qwen2_adapters
    adapters = {name: r.lora_path for name, r in requests.items()}
    prompts = _prompts(6, seed=5)
    assigned = ["all", None, "qv", "mlp", "all", "qv"]
    model = str(root / "model")
    runs = run_on_virtual_devices(4, "lora_layouts", model, adapters, prompts, assigned, LAYOUTS)
    for name in LAYOUTS:
        tokens, logprobs = runs[name]
        for prompt, adapter, got in zip(prompts, assigned, tokens):
            assert got == greedy(base if adapter is None else merged[adapter], prompt, 8), (name, adapter)
        np.testing.assert_allclose(np.concatenate(logprobs), np.concatenate(runs["1x1"][1]), atol=1e-4, err_msg=name)


def test_adapter_weights_updated_in_memory(qwen2_adapters):
    """A trainer's LoRA parameters (PEFT names, JAX arrays) replace an adapter's weights without a
    file, or make a new adapter; the old weights' pages are not reused; bad ones change nothing."""
    import jax.numpy as jnp
    from safetensors.numpy import load_file

    root, base, merged, requests = qwen2_adapters
    llm = LLM(str(root / "model"), params_cache_dir=str(root / "cache"), max_loras=2, **ENGINE_ARGS)
    engine = llm.engine
    prompt = _prompts(1, seed=6)[0] + list(range(40, 60))
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, detokenize=False)

    def run(lora):
        before = engine.prefix_cache_tokens[1]
        out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False, lora_request=lora)[0]
        return out.outputs[0].token_ids, engine.prefix_cache_tokens[1] - before

    def tensors(name):
        return {k: jnp.asarray(v) for k, v in load_file(str(root / name / "adapter_model.safetensors")).items()}

    def config(name):
        return json.loads((root / name / "adapter_config.json").read_text())

    assert run(requests["all"])[0] == greedy(merged["all"], prompt, 6)
    assert run(requests["all"])[1] > 0  # its pages are reused
    engine.update_lora(requests["all"], tensors("mlp"), config("mlp"))  # "all" now serves mlp's weights
    tokens, hits = run(requests["all"])
    assert tokens == greedy(merged["mlp"], prompt, 6) and hits == 0  # the old weights' pages are not
    fresh = LoRARequest("fresh", 7, "")  # an adapter with no file
    with pytest.raises(LoRAError, match="give its config"):
        engine.update_lora(fresh, tensors("qv"))
    engine.update_lora(fresh, tensors("qv"), config("qv"))
    assert run(fresh)[0] == greedy(merged["qv"], prompt, 6)
    wrong = {k: v[:, :3] if k.endswith("lora_A.weight") else v for k, v in tensors("qv").items()}
    with pytest.raises(LoRAError, match="another model"):
        engine.update_lora(fresh, wrong)
    assert run(fresh)[0] == greedy(merged["qv"], prompt, 6)  # unchanged
    assert engine.list_loras() == {1, 7}
    # Through AsyncLLM: the tensors are laid out off the engine's thread.
    import asyncio

    from jaxllm.engine.async_llm import AsyncLLM

    served = AsyncLLM(engine=engine)

    async def update_then_generate():
        await served.update_lora(requests["all"], tensors("qv"), config("qv"))
        async for out in served.generate({"prompt_token_ids": prompt}, params, lora_request=requests["all"]):
            last = out
        return last.outputs[0].token_ids

    try:
        assert asyncio.run(update_then_generate()) == greedy(merged["qv"], prompt, 6)
    finally:
        served.shutdown()


def test_adapters_with_n_preemption_and_structured_output(qwen2_adapters, tiny_model_dir, tmp_path):
    root, base, merged, requests = qwen2_adapters
    # A pool of 24 pages of 4 tokens for 6 requests of up to 47: they preempt one another.
    llm = LLM(
        str(root / "model"),
        params_cache_dir=str(root / "cache"),
        max_loras=2,
        num_gpu_blocks_override=24,
        **ENGINE_ARGS,
    )
    prompts = _prompts(6, seed=7)
    _check_against_peft(llm, base, merged, requests, prompts, ["all", "qv", None, "all", "mlp", "qv"])
    assert llm.engine.scheduler.num_preemptions > 0
    swap = LLM(
        str(root / "model"),
        params_cache_dir=str(root / "cache"),
        max_loras=2,
        num_gpu_blocks_override=24,
        preemption_mode="swap",
        swap_space=0.01,
        **ENGINE_ARGS,
    )
    _check_against_peft(swap, base, merged, requests, prompts, ["qv", "all", "mlp", None, "all", "qv"])
    assert swap.engine.scheduler.num_preemptions > 0
    params = SamplingParams(n=2, max_tokens=6, temperature=0, ignore_eos=True, detokenize=False)
    out = llm.generate({"prompt_token_ids": prompts[0]}, params, use_tqdm=False, lora_request=requests["qv"])[0]
    assert [c.token_ids for c in out.outputs] == [greedy(merged["qv"], prompts[0], 6)] * 2
    # A grammar constrains an adapter's output as the base model's (the tiny Llama has a tokenizer).
    import transformers

    from jaxllm import StructuredOutputsParams
    from tests.helpers.tiny_model import TINY_ENGINE_ARGS

    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    build_adapter(hf, tmp_path / "tiny", r=8, targets=ALL_LLAMA, seed=3)
    tiny = LLM(tiny_model_dir, **TINY_ENGINE_ARGS, enable_lora=True)
    yes_no = StructuredOutputsParams(choice=["yes", "no"])
    choice = SamplingParams(max_tokens=8, temperature=0, structured_outputs=yes_no)
    out = tiny.generate("Is it?", choice, use_tqdm=False, lora_request=LoRARequest("tiny", 1, str(tmp_path / "tiny")))
    assert out[0].outputs[0].text in ("yes", "no")
    with pytest.raises(ValueError, match="enable_lora is not supported with speculative decoding"):
        LLM(
            tiny_model_dir,
            **TINY_ENGINE_ARGS,
            enable_lora=True,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2},
        )


@pytest.mark.parametrize("quantization", ["int8_weight_only", "int4", "w8a8"])
def test_adapters_over_quantized_bases(qwen2_adapters, quantization):
    """The adapters stay float beside a base quantized on load: the engine's base requests are the
    quantized engine's own, and the adapter changes the answers. (Against PEFT: the float and
    GGUF-block bases, the other tests.)"""
    root, base, merged, requests = qwen2_adapters
    llm = LLM(str(root / "model"), params_cache_dir=str(root / "cache"), quantization=quantization, **ENGINE_ARGS)
    quantized = LLM(
        str(root / "model"),
        params_cache_dir=str(root / "cache"),
        quantization=quantization,
        **{**ENGINE_ARGS, "enable_lora": False},
    )
    prompts = _prompts(3, seed=9)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, detokenize=False, logprobs=0)
    with_lora = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=requests["all"]
    )
    alone = quantized.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    same_base = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in same_base] == [o.outputs[0].token_ids for o in alone]
    assert [o.outputs[0].token_ids for o in with_lora] != [o.outputs[0].token_ids for o in alone]


def test_beam_search_under_an_adapter_matches_hf(qwen2_adapters):
    from jaxllm import BeamSearchParams
    from tests.helpers.hf_reference import hf_beam_search

    root, base, merged, requests = qwen2_adapters
    llm = LLM(str(root / "model"), params_cache_dir=str(root / "cache"), **ENGINE_ARGS)
    prompts = _prompts(2, seed=8)
    params = BeamSearchParams(beam_width=3, max_tokens=6)
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params, lora_request=requests["all"])
    for prompt, out in zip(prompts, outputs):
        expected = hf_beam_search(
            merged["all"], prompt, width=3, max_tokens=6, eos=None, early_stopping=False, length_penalty=1.0
        )
        assert [s.output_token_ids for s in out.sequences] == [tokens for tokens, _ in expected]
        assert [s.score for s in out.sequences] == pytest.approx([score for _, score in expected], abs=1e-4)


def _broken(root, name: str, **change) -> LoRARequest:
    """A copy of adapter "all" with its config changed (or its weights truncated)."""
    src, dst = root / "all", root / name
    dst.mkdir(exist_ok=True)
    config = json.loads((src / "adapter_config.json").read_text())
    weights = (src / "adapter_model.safetensors").read_bytes()
    if change.pop("truncate", False):
        weights = weights[: len(weights) // 2]
    (dst / "adapter_config.json").write_text(json.dumps({**config, **change}))
    (dst / "adapter_model.safetensors").write_bytes(weights)
    return LoRARequest(name, 50 + len(name), str(dst))


def test_adapters_that_cannot_be_served_are_refused_and_the_engine_goes_on(qwen2_adapters, tmp_path):
    root, base, merged, requests = qwen2_adapters
    args = {**ENGINE_ARGS, "max_lora_rank": 8}
    llm = LLM(str(root / "model"), params_cache_dir=str(root / "cache"), max_loras=2, **args)
    other = build_hf_model("qwen2", tmp_path / "wide", hidden_size=96, intermediate_size=160)
    build_adapter(other, tmp_path / "wide_lora", r=4, targets=("q_proj",))
    head = build_adapter(base, tmp_path / "head", r=4, targets=("q_proj", "lm_head"))
    del head
    cases = {
        LoRARequest("missing", 9, str(tmp_path / "nowhere")): "no adapter_config.json",
        requests["mlp"]: "rank 16 exceeds max_lora_rank=8",
        LoRARequest("wide", 10, str(tmp_path / "wide_lora")): "trained for another model",
        LoRARequest("head", 11, str(tmp_path / "head")): "lm_head",
        _broken(root, "dora", use_dora=True): "DoRA",
        _broken(root, "cut", truncate=True): "truncated or corrupt",
        LoRARequest("clash", 1, str(root / "qv")): "lora_int_id 1 is adapter",
    }
    params = SamplingParams(max_tokens=4, temperature=0, detokenize=False)
    llm.generate({"prompt_token_ids": [5, 6, 7]}, params, use_tqdm=False, lora_request=requests["all"])
    for request, reason in cases.items():
        with pytest.raises(LoRAError, match=reason):
            llm.generate({"prompt_token_ids": [5, 6, 7]}, params, use_tqdm=False, lora_request=request)
    assert llm.engine.list_loras() == {1}
    assert not llm.engine.has_unfinished_requests()
    _check_against_peft(llm, base, merged, requests, _prompts(3, seed=4), ["all", None, "qv"])
    plain = LLM(str(root / "model"), params_cache_dir=str(root / "cache"), **{**ENGINE_ARGS, "enable_lora": False})
    with pytest.raises(LoRAError, match="without enable_lora"):
        plain.generate({"prompt_token_ids": [5, 6, 7]}, params, use_tqdm=False, lora_request=requests["all"])
    assert os.path.isdir(root / "all")


@pytest.mark.slow
def test_default_model_with_a_rank_16_adapter_matches_peft(tmp_path):
    """The real SmolLM2 GGUF (its blocks kept, float32) with a random rank-16 adapter on every
    projection, beside requests of the base model, against transformers' own GGUF load + PEFT."""
    import transformers

    from jaxllm.models.loader import default_model_path

    path = default_model_path()
    base = from_gguf(transformers.AutoModelForCausalLM, path)
    base.generation_config.eos_token_id = None
    merged = {"a": build_adapter(base, tmp_path / "a", r=16, targets=ALL_LLAMA, alpha=16, seed=7)}
    requests = {"a": LoRARequest("a", 1, str(tmp_path / "a"))}
    llm = LLM(
        None,
        dtype="float32",
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_model_len=256,
        warmup=False,
        enable_lora=True,
        max_loras=2,
    )
    tokenizer = llm.get_tokenizer()
    texts = ["The capital of France is", "def fibonacci(n):", "Water boils at a temperature of"]
    prompts = [tokenizer.encode(t) for t in texts]
    _check_against_peft(llm, base, merged, requests, prompts + prompts[:1], ["a", "a", "a", None], atol=2e-3)
