"""Small-step codes (`EngineArgs.small_step_codes`): a GGUF's quantized blocks kept beside the
bf16 weights, for the steps of at most SMALL_STEP_ROWS rows (or, where AMX multiplies bf16, the
blocks alone for every step). The bf16 weights are made from the codes in C++
(`gemm.codes_to_bf16_panels`), which must give what packing the dequantized weights gives, bit
for bit; the engine must then be the bf16 engine of the dequantized file
(`quantization="none"`), token for token and logprob for logprob, in small steps and large."""

from __future__ import annotations

import jax
import ml_dtypes
import numpy as np
import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.kernels import gemm, native
from jaxllm.models.linear import PackedWeight
from jaxllm.quantization import SMALL_STEP_ROWS, QuantizedWeight, dequantize, weight_bytes
from jaxllm.quantization.activations import with_bf16_activations
from jaxllm.quantization.weights import _unpacked_codes, make_weight
from jaxllm.platforms import cpu_flags
from jaxllm.weights import plan

from tests.helpers.quantized_checkpoints import write_quantized_gguf
from tests.helpers.tiny_model import TINY_ENGINE_ARGS, WARM_ENGINE_ARGS, all_steps_loaded

pytestmark = pytest.mark.skipif(not native.available(), reason=f"no C++ kernels: {native.unavailable_reason()}")
needs_bf16_dots = pytest.mark.skipif(not native.has_bf16_dots(), reason="no AVX512_BF16 dots here")


@pytest.fixture(autouse=True)
def on_the_cpu():
    with jax.default_device(jax.devices("cpu")[0]):
        yield


@pytest.mark.parametrize("method", ["int4", "int8"])
@pytest.mark.parametrize("k", [64, 200])
def test_codes_to_bf16_panels_is_packing_the_dequantized_weights(method, k):
    # 4-bit codes (f16 scales and offsets in groups of 32, or one group where 32 does not divide
    # K) and 8-bit ones (an f32 scale per column), 3 panels; the build's widest path (AVX-512, or
    # the portable loop).
    rng = np.random.default_rng(k)
    w = (rng.standard_normal((k, 48)) * 0.05).astype(np.float32)
    q = with_bf16_activations(make_weight(w, method, panels=True, activations="float"))
    assert q.activations == "bf16"
    panels = gemm.codes_to_bf16_panels(q.codes, q.scale, q.offset, q.bits)
    dense = np.asarray(dequantize(q, np)).astype(ml_dtypes.bfloat16)
    expected = gemm.pack_weight(dense, dtype=ml_dtypes.bfloat16)
    assert panels.dtype == expected.dtype and panels.shape == expected.shape
    assert (panels.view(np.uint16) == expected.view(np.uint16)).all()


def test_codes_to_bf16_panels_rejects_scales_that_do_not_fit_the_codes():
    q = with_bf16_activations(make_weight(np.ones((64, 32), np.float32), "int4", panels=True, activations="float"))
    for scale, offset in [
        (q.scale[:1], q.offset[:1]),  # one panel's scales for two panels' codes
        (np.ones((2, 3, 16), np.float16), np.ones((2, 3, 16), np.float16)),  # 3 groups of 64 rows
        (np.ones((2, 32, 16), np.float16), np.ones((2, 32, 16), np.float16)),  # groups of 2 rows
        (q.scale, q.offset[:, :1]),
        (gemm.unpack_scales(q.scale), gemm.unpack_scales(q.offset)),  # [G, N]: not the kernels' layout
    ]:
        with pytest.raises(ValueError, match="no bf16 panels"):
            gemm.codes_to_bf16_panels(q.codes, scale, offset, q.bits)


@needs_bf16_dots
def test_gguf_engine_with_small_step_codes_is_the_dequantized_bf16_engine(tmp_path):
    # Every kept block type of the tiny GGUF (Q4_0/Q4_1, K-quants' two-level scales, 8-bit
    # Q5/Q6/Q8_0, fused parts of different types, the Q8_0 tied embedding). 1 and 3 sequences
    # decode in the small steps; 6 in the 8-row step and the prompts in mixed steps, from the
    # bf16 weights the codes became.
    path = write_quantized_gguf(str(tmp_path / "tiny.gguf"))
    # (every step shape loaded: a step runs in the smallest that holds it, not in a mixed one)
    args = dict(WARM_ENGINE_ARGS, dtype="bfloat16", params_cache_dir=str(tmp_path / "params"))
    greedy = SamplingParams(max_tokens=12, temperature=0.0, logprobs=2, detokenize=False)
    batches = [[{"prompt_token_ids": list(range(3 + i, 12 + 4 * i))} for i in range(n)] for n in (1, 3, 6)]
    ref_llm = all_steps_loaded(LLM(path, quantization="none", **args))
    assert not ref_llm.engine.config.small_step_codes and ref_llm.engine.runner.small_params is None
    refs = [ref_llm.generate(b, greedy, use_tqdm=False) for b in batches]
    ref_params = ref_llm.engine.runner.params
    # (small-step codes: the default where the CPU has no AMX; their bf16 numbers, not factored)
    llm = all_steps_loaded(LLM(path, small_step_codes=True, small_step_factored=False, **args))
    assert llm.engine.config.small_step_codes and llm.engine.config.quantization is None
    runner = llm.engine.runner
    large, small = runner.params, runner.small_params
    for i in range(2):
        for name in ("wqkv", "wo", "w_gate_up", "w_down"):
            assert isinstance(large["layers"][i][name], PackedWeight)
            # (equal values: a zero weight may be -0.0 in one and +0.0 in the other, as a Q6_K
            # code of 0 times a negative scale is in gguf-py and plus a zero offset here)
            assert (
                np.asarray(large["layers"][i][name].panels, np.float32)
                == np.asarray(ref_params["layers"][i][name].panels, np.float32)
            ).all(), (i, name)
            q = small["layers"][i][name]
            assert isinstance(q, QuantizedWeight) and q.activations == "bf16"
    assert (np.asarray(large["embed"].panels, np.float32) == np.asarray(ref_params["embed"].panels, np.float32)).all()
    assert isinstance(small["embed"], QuantizedWeight) and small["embed"].bits == 8
    assert small["layers"][0]["attn_norm"] is large["layers"][0]["attn_norm"]  # the rest is shared
    seen = set()
    step = runner.step_params
    runner.step_params = lambda bucket: seen.add(bucket.num_tokens) or step(bucket)
    for batch, ref in zip(batches, refs):
        for a, b in zip(llm.generate(batch, greedy, use_tqdm=False), ref):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            assert [{t: lp.logprob for t, lp in d.items()} for d in a.outputs[0].logprobs] == [
                {t: lp.logprob for t, lp in d.items()} for d in b.outputs[0].logprobs
            ]
    assert min(seen) <= SMALL_STEP_ROWS < max(seen), seen
    assert weight_bytes(large, small) > weight_bytes(large) > weight_bytes(ref_params) * 0.99

    # From the codes alone (quantization="gguf"; the default where AMX multiplies bf16), their
    # bf16 numbers: every step converts the codes as it reads them, and AMX or VDPBF16PS decide
    # by a call's rows on both sides, so the tokens and logprobs are still the reference's, in
    # under half the bytes.
    alone = all_steps_loaded(LLM(path, quantization="gguf", small_step_factored=False, **args))
    assert alone.engine.config.quantization == "gguf" and alone.engine.runner.small_params is None
    assert isinstance(alone.engine.runner.params["layers"][0]["w_gate_up"], QuantizedWeight)
    for batch, ref in zip(batches, refs):
        for a, b in zip(alone.generate(batch, greedy, use_tqdm=False), ref):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            assert a.outputs[0].logprobs == b.outputs[0].logprobs
    assert weight_bytes(alone.engine.runner.params) < weight_bytes(ref_params) / 2


GREEDY = SamplingParams(max_tokens=8, temperature=0.0, logprobs=0, detokenize=False)
# Codes serving alone factor by default without AMX; with it, where asked (and in one-row calls).
FACTORED_ON_AMX = {"small_step_factored": True} if native.available() and "amx" in native.kernel_paths() else {}
PROMPTS = [{"prompt_token_ids": list(range(3 + i, 12 + 4 * i))} for i in range(3)]


@pytest.fixture(scope="module")
def exact_small_steps(tmp_path_factory):
    """The tiny GGUF, its engine arguments and the exact small-step codes' greedy outputs
    (`small_step_factored=False`) for PROMPTS, one request at a time: built once for the tests
    that measure other numbers against them."""
    folder = tmp_path_factory.mktemp("exact")
    path = write_quantized_gguf(str(folder / "tiny.gguf"))
    args = dict(WARM_ENGINE_ARGS, dtype="bfloat16", params_cache_dir=str(folder / "params"))
    ref = all_steps_loaded(LLM(path, small_step_factored=False, **args))
    return path, args, [ref.generate([p], GREEDY, use_tqdm=False)[0].outputs[0] for p in PROMPTS]


def decodes_against_the_bf16_numbers(exact_small_steps, prompt_exact: bool = True, **options):
    """A tiny GGUF's engine with `options` and its decode logprobs' distances from the exact
    small-step codes' (`exact_small_steps`) over each greedy run's common prefix: (engine,
    distances). One request at a time, so that its prompt runs in a large step (the bf16 panels':
    with `prompt_exact` its token and logprob must be the reference's, else they count among the
    distances) and every decode in a small one (with several, a decode sharing a step with a
    prompt chunk takes the bf16 panels)."""
    path, args, want = exact_small_steps
    prompts, greedy = PROMPTS, GREEDY
    llm = all_steps_loaded(LLM(path, **options, **args))
    diffs = []
    for p, b in zip(prompts, want):
        a = llm.generate([p], greedy, use_tqdm=False)[0].outputs[0]
        assert not prompt_exact or (a.token_ids[0] == b.token_ids[0] and a.logprobs[0] == b.logprobs[0])
        same = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), len(a.token_ids))
        diffs += [
            abs(a.logprobs[i][a.token_ids[i]].logprob - b.logprobs[i][b.token_ids[i]].logprob)
            for i in range(int(prompt_exact), same)
        ]
    return llm, diffs


@needs_bf16_dots
def test_small_step_codes_with_int8_activations(exact_small_steps):
    # `int8_activations`: the small steps' 4-bit layer codes multiply int8 rows (llama.cpp's
    # numbers); the 8-bit codes, the LM head and the large steps' bf16 panels stay as they were
    # (the batch-dependence the option brings). The kernel's own numbers are checked against
    # numpy in tests/kernels/test_quantized_gemm.py; here, that the engine runs them where it should.
    llm, diffs = decodes_against_the_bf16_numbers(exact_small_steps, int8_activations=True)
    small = llm.engine.runner.small_params
    kinds = {(w.bits, w.activations) for layer in small["layers"] for w in layer.values() if hasattr(w, "bits")}
    assert (4, "int8") in kinds and (4, "bf16") not in kinds and (8, "bf16") in kinds, kinds
    assert small["embed"].activations == "bf16"
    # The decodes moved by the int8 rounding: a little, and not nothing (the int8 rows ran).
    assert diffs and 0 < max(diffs) and float(np.mean(diffs)) < 0.3, diffs


def assert_factored_where_the_codes_allow(params):
    """Every codes x bf16 matrix of `params` (layers, LM head, tied table) factors its scales
    where its codes allow it, and only there: 4-bit codes, 8-bit ones within [-64, 63] (the tiny
    GGUF's Q5/Q6 and widened 4-bit ones, not its Q8_0 ones), those within [-32, 31] repacked in
    6 bits where the build reads them; every kind is there."""
    weights = [w for layer in params["layers"] for w in layer.values()] + [params.get("lm_head"), params["embed"]]
    seen = set()
    six = native.has_six_bit_codes()
    for w in weights:
        if isinstance(w, QuantizedWeight) and w.activations == "bf16":
            codes = _unpacked_codes(w, np).astype(np.int32)
            low, high = codes.min(), codes.max()
            narrow = w.bits == 4 or (low >= -64 and high <= 63)
            assert w.factored == narrow, (w.bits, low, high)
            assert (w.bits == 6) == (six and w.bits != 4 and low >= -32 and high <= 31), (w.bits, low, high)
            seen.add((w.bits, w.factored))
    assert {(4, True), (6 if six else 8, True), (8, False)} <= seen, seen


@needs_bf16_dots
def test_small_step_codes_with_factored_scales(exact_small_steps):
    # `small_step_factored` (the default where small-step codes serve): the small steps' codes
    # factor their group scales out of the sums where the codes allow it (exact products, f32
    # sums: csrc/gemm_quant_factored.h, against numpy in tests/kernels/test_quantized_gemm_bf16.py);
    # the large steps stay as they were.
    llm, diffs = decodes_against_the_bf16_numbers(exact_small_steps, small_step_factored=True, small_step_codes=True)
    assert_factored_where_the_codes_allow(llm.engine.runner.small_params)
    # Without the weights' bf16 rounding the decodes move, by less than int8 activations move them.
    assert diffs and 0 < max(diffs) and float(np.mean(diffs)) < 0.05, diffs


@needs_bf16_dots
def test_codes_alone_with_factored_scales(exact_small_steps):
    # A GGUF's codes serving every step alone (`quantization="gguf"`, or by default where its
    # bf16 panels would take over 1/16 of the memory) factor their scales where the codes allow
    # it in the calls of up to 16 rows (prompts of 9-17 tokens included), the rest as the bf16
    # GEMM over codes computes it; the decodes move as the small-step split's do. (With AMX
    # only where asked, and in one-row calls: the tiles take two rows or more.)
    llm, diffs = decodes_against_the_bf16_numbers(
        exact_small_steps, prompt_exact=False, quantization="gguf", **FACTORED_ON_AMX
    )
    assert llm.engine.config.quantization == "gguf" and llm.engine.runner.small_params is None
    assert_factored_where_the_codes_allow(llm.engine.runner.params)
    assert diffs and 0 < max(diffs) and float(np.mean(diffs)) < 0.05, diffs


@needs_bf16_dots
def test_codes_alone_factor_the_checks_of_drafts_too(exact_small_steps, monkeypatch):
    # Under speculative decoding the codes serving alone factor too: a stream's verification
    # steps (1 + 3 rows, within the factored calls' 16) compute each row as its decode alone
    # does, so the greedy tokens and their logprobs equal those without drafts (the file drafting
    # for itself: every draft accepted, each check's rows all used; its Q8_0 codes not rounded to
    # 6 bits, as a draft's are, so that it has the target's numbers).
    from jaxllm.spec_decode import draft_model

    monkeypatch.setattr(draft_model, "factored_draft", lambda model, int8=False: model)
    path, args, _ = exact_small_steps
    plain = all_steps_loaded(LLM(path, quantization="gguf", **args, **FACTORED_ON_AMX))
    spec = all_steps_loaded(
        LLM(
            path,
            quantization="gguf",
            **args,
            **FACTORED_ON_AMX,
            speculative_config={"model": path, "num_speculative_tokens": 3},
        )
    )
    assert_factored_where_the_codes_allow(spec.engine.runner.params)
    for p in PROMPTS:
        want = plain.generate([p], GREEDY, use_tqdm=False)[0].outputs[0]
        got = spec.generate([p], GREEDY, use_tqdm=False)[0].outputs[0]
        assert got.token_ids == want.token_ids and got.logprobs == want.logprobs
    stats = spec.engine.stats
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0


def test_small_step_codes_follow_the_cpu_and_the_run(tiny_model_dir, tmp_path, monkeypatch):
    # On by default for a GGUF under bf16 where the CPU has AVX512_BF16 but no AMX (with AMX the
    # codes serve every step alone: quantization "gguf"); off for float32 runs, asked
    # quantizations and HF checkpoints; asked for where it cannot apply: a clear error.
    path = write_quantized_gguf(str(tmp_path / "tiny.gguf"))
    args = dict(TINY_ENGINE_ARGS, params_cache_dir=str(tmp_path / "params"))
    dots = "avx512_bf16" in cpu_flags() and native.has_bf16_dots()
    amx = dots and "amx" in native.kernel_paths()
    config = LLM(path, **{**args, "dtype": "bfloat16"}).engine.config
    assert (config.small_step_codes, config.quantization) == (dots and not amx, "gguf" if amx else None)
    assert not LLM(path, **args).engine.config.small_step_codes  # float32
    assert not LLM(path, quantization="gguf", **{**args, "dtype": "bfloat16"}).engine.config.small_step_codes
    with pytest.raises(ValueError, match="small_step_codes needs"):
        LLM(path, small_step_codes=True, **args)
    if dots:
        with pytest.raises(ValueError, match="small_step_codes needs a GGUF"):
            LLM(tiny_model_dir, small_step_codes=True, **{**args, "dtype": "bfloat16"})
    # Where the bf16 panels would take more than PANELS_MEMORY_SHARE of the host's memory (here
    # any), the codes serve alone by default; small_step_codes=True keeps the split.
    monkeypatch.setattr(plan, "PANELS_MEMORY_SHARE", 0.0)
    # (The same file as its own draft: the draft's plan is its own, from the options asked, so
    # it keeps its codes too, where it once took the target's small_step_codes=False and
    # dequantized.)
    engine = LLM(path, **{**args, "dtype": "bfloat16"}, speculative_config={"model": path, "num_speculative_tokens": 2})
    config = engine.engine.config
    assert (config.small_step_codes, config.quantization) == (False, "gguf" if dots else None)
    draft_wqkv = engine.engine.scheduler.proposer.runner.params["layers"][0]["wqkv"]
    assert isinstance(draft_wqkv, QuantizedWeight) == dots
    if dots:
        assert LLM(path, small_step_codes=True, **{**args, "dtype": "bfloat16"}).engine.config.small_step_codes
