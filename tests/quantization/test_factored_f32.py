"""A GGUF's codes under float32 (the f32 GEMM's panels: csrc/gemm_quant.cc, AVX2) factor each
group's scale and offset out of the sums of calls of one or two rows (`small_step_factored`, on
by default there): the greedy outputs stay those of the unfactored codes (the dequantized
weights' numbers, to f32 rounding), and the plan leaves the codes unfactored where it must
(speculative decoding, whose checks of 3 rows and more dequantize); with `int8_activations` the
4-bit codes (and 8-bit ones that fit 6 bits) multiply int8 rows instead. The kernels themselves
are checked against numpy in tests/kernels/test_quantized_gemm.py and test_quantized_gemm_six.py."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.kernels import native
from jaxllm.quantization import QuantizedWeight

from tests.helpers.quantized_checkpoints import write_quantized_gguf
from tests.helpers.tiny_model import TINY_ENGINE_ARGS

pytestmark = pytest.mark.skipif(
    not native.available() or "avx2" not in native.kernel_paths(), reason="no AVX2 C++ kernels here"
)

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, logprobs=0, detokenize=False)
PROMPTS = [{"prompt_token_ids": list(range(3 + i, 12 + 4 * i))} for i in range(3)]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """The tiny GGUF (every kept block type) and its float32 engine arguments, with the greedy
    outputs of its unfactored codes (`small_step_factored=False`), one request at a time."""
    folder = tmp_path_factory.mktemp("f32codes")
    path = write_quantized_gguf(str(folder / "tiny.gguf"))
    args = dict(TINY_ENGINE_ARGS, params_cache_dir=str(folder / "params"))
    plain = LLM(path, small_step_factored=False, **args)
    assert plain.engine.config.dtype == "float32" and not kinds(plain) & {(4, True), (8, True)}
    return path, args, [plain.generate([p], GREEDY, use_tqdm=False)[0].outputs[0] for p in PROMPTS]


def kinds(llm) -> set[tuple[int, bool]]:
    """(bits, factored) of the codes of llm's layers and LM head."""
    params = llm.engine.runner.params
    weights = [w for layer in params["layers"] for w in layer.values()] + [params.get("lm_head"), params["embed"]]
    return {(w.bits, w.factored) for w in weights if isinstance(w, QuantizedWeight) and w.layout == "panels"}


def test_float32_codes_factor_by_default_and_keep_the_outputs(tiny_gguf, caplog):
    path, args, want = tiny_gguf
    with caplog.at_level(logging.INFO, logger="jaxllm"):
        llm = LLM(path, **args)
    assert "f32, scales factored out" in caplog.text  # the plan's log line
    assert llm.engine.config.quantization == "gguf"
    assert kinds(llm) == {(4, True), (8, True)}  # every layer's codes: their groups have even rows
    diffs = []
    for together in (False, True):  # one request at a time (factored), then three sharing each step
        outs = (
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
            if together
            else [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in PROMPTS]
        )
        for out, b in zip(outs, want):
            a = out.outputs[0]
            assert a.token_ids == b.token_ids
            diffs += [abs(x[t].logprob - y[t].logprob) for x, y, t in zip(a.logprobs, b.logprobs, a.token_ids)]
    # Other last bits than the dequantized weights' (the factored sums ran), within f32 rounding.
    assert 0 < max(diffs) < 1e-4, diffs


def test_float32_codes_with_drafts_stay_unfactored(tiny_gguf):
    # A stream's checks (1 + 3 rows) take the dequantizing kernel, so with drafts the decodes do
    # too: the file drafting for itself accepts every draft, and the tokens and logprobs are the
    # unfactored codes' without drafts.
    path, args, want = tiny_gguf
    spec = LLM(path, **args, speculative_config={"model": path, "num_speculative_tokens": 3})
    assert kinds(spec) == {(4, False), (8, False)}
    for p, b in zip(PROMPTS, want):
        got = spec.generate([p], GREEDY, use_tqdm=False)[0].outputs[0]
        assert got.token_ids == b.token_ids and got.logprobs == b.logprobs
    stats = spec.engine.stats
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0


def test_float32_codes_stay_unfactored_where_the_run_needs_it(tiny_gguf, tiny_model_dir):
    # batch_invariant (a row's numbers must not depend on the step's row count) turns the
    # default off; asked for without a GGUF's codes (an HF checkpoint): a clear error.
    path, args, want = tiny_gguf
    invariant = LLM(path, batch_invariant=True, **args)
    assert kinds(invariant) == {(4, False), (8, False)}
    out = invariant.generate([PROMPTS[0]], GREEDY, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == want[0].token_ids  # (its logprobs: batch_invariant's own numbers)
    with pytest.raises(ValueError, match="small_step_factored needs"):
        LLM(tiny_model_dir, small_step_factored=True, **args)


def test_float32_int8_activations_take_the_4_and_6bit_codes_and_factor_the_others(tiny_gguf, caplog):
    # int8_activations under float32: every step's 4-bit codes multiply int8 rows (repacked in
    # quads), so do the 8-bit ones that fit 6 bits (Q6_K's, Q5_0's, Q5_K's, Q5_1's: repacked in 6
    # bits), the others (Q8_0's, and fused matrices holding some) factor their scales in decodes
    # as without it. The numbers move from
    # the unfactored codes' by x's rounding to int8 (llama.cpp's scheme), a little; a row's numbers
    # do not depend on the rows beside it (below: with drafts).
    path, args, want = tiny_gguf
    with caplog.at_level(logging.INFO, logger="jaxllm"):
        llm = LLM(path, int8_activations=True, **args)
    assert "int8 for 4- and 6-bit codes, else f32 with scales factored out" in caplog.text
    params = llm.engine.runner.params
    weights = [w for layer in params["layers"] for w in layer.values()] + [params.get("lm_head")]
    panels = [w for w in weights if isinstance(w, QuantizedWeight) and w.layout == "panels"]
    assert {(w.bits, w.activations, w.factored) for w in panels} == {
        (4, "int8", False),
        (6, "int8", False),
        (8, "float", True),
    }
    got = [llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0] for p in PROMPTS]
    diffs = []  # each unfactored token's logprob, as long as the contexts are the same
    for a, b in zip(got, want):
        for x, y, s, t in zip(a.logprobs, b.logprobs, a.token_ids, b.token_ids):
            diffs += [abs(x[t].logprob - y[t].logprob)] if t in x else []
            if s != t:
                break
    # (measured: most within 0.05, the largest 0.14; 0 would mean the int8 rows never ran)
    assert 0 < max(diffs) < 0.3 and np.median(diffs) < 0.05, diffs
    # With drafts the 8-bit codes that stay float are not factored: the run is then the one
    # without drafts and without factoring, token for token, logprob for logprob (against the
    # factored run, x's last bits can move a rounding to int8: up to 0.05 measured).
    unfactored = LLM(path, int8_activations=True, small_step_factored=False, **args)
    spec = LLM(path, int8_activations=True, speculative_config={"model": path, "num_speculative_tokens": 3}, **args)
    for p in PROMPTS:
        a = unfactored.generate([p], GREEDY, use_tqdm=False)[0].outputs[0]
        b = spec.generate([p], GREEDY, use_tqdm=False)[0].outputs[0]
        assert b.token_ids == a.token_ids and b.logprobs == a.logprobs
    assert spec.engine.stats.num_accepted_tokens > 0
