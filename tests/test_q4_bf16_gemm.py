"""The C++ GEMM of 4-bit codes x bf16 activations (`kernels.native.matmul_q4_bf16`,
csrc/gemm_q4bf16.cc) against NumPy and against the packed bf16 GEMM of the same weights
dequantized and rounded to bf16, which it must equal bit for bit, on every code path the build
has: the in-register rows, the converted panels, the SwiGLU epilogue, two-level scales, live
rows; then the weight type that carries such codes (`with_bf16_activations`) and the engine."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxllm.kernels import native
from jaxllm.quantization import QuantizedWeight, dequantize, matmul
from jaxllm.quantization.weights import _unpacked_codes, make_weight, with_bf16_activations

pytestmark = pytest.mark.skipif(not native.available(), reason=f"no C++ kernels: {native.unavailable_reason()}")


@pytest.fixture(autouse=True)
def on_the_cpu():
    """The C++ kernels run on the CPU device (on a GPU machine too)."""
    with jax.default_device(jax.devices("cpu")[0]):
        yield


def bf16(a) -> np.ndarray:
    return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def random_q4(rng, k: int, n: int, groups: int, with_offset: bool, scale_dtype):
    codes = rng.integers(0, 16, (k, n))
    scale = (rng.random((groups, n)) * 0.05 + 1e-3).astype(scale_dtype)
    offset = (-rng.random((groups, n)) * 0.3).astype(scale_dtype) if with_offset else None
    # The loader's dequantization (gguf's `d * q + m` in f32): the reference the kernel rounds.
    w = codes.astype(np.float32) * np.repeat(scale.astype(np.float32), k // groups, 0)
    if offset is not None:
        w = w + np.repeat(offset.astype(np.float32), k // groups, 0)
    return codes, scale, offset, w


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 13, 97])
@pytest.mark.parametrize("groups, with_offset, scale_dtype", [(3, True, np.float16), (1, False, np.float32),
                                                               (6, True, np.float32)])
def test_matmul_q4_bf16_is_the_bf16_gemm_of_the_rounded_weights(rows, groups, with_offset, scale_dtype):
    # K = 72 (groups of 72, 24, 12 rows), 7 panels: items of 4, 2 and 1 panels.
    rng = np.random.default_rng(rows * 7 + groups)
    k, n = 72, 112
    codes, scale, offset, w = random_q4(rng, k, n, groups, with_offset, scale_dtype)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    packed = native.pack_codes(codes, 4, pairs=True)
    assert packed.shape == (n // 16, k // 4, 32) and packed.dtype == np.uint8
    ref = bf16(x).astype(np.float64) @ bf16(w).astype(np.float64)
    bf16_panels = native.pack_weight(w.astype(ml_dtypes.bfloat16), dtype=ml_dtypes.bfloat16)
    for path in ("auto", *native.kernel_paths()):
        if path == "avx2":
            continue            # the bf16 kernels have portable and AVX-512 code only
        y = jax.jit(functools.partial(native.matmul_q4_bf16, path=path))(x, packed, scale, offset)
        np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
        same = jax.jit(functools.partial(native.matmul_packed, path=path))(x, bf16_panels)
        np.testing.assert_array_equal(y, same)


@pytest.mark.parametrize("rows", [1, 3, 7, 30])
def test_matmul_q4_bf16_swiglu_two_level_scales_and_live_rows(rows):
    # [gate | up], 3 panels each, with GGUF K-quant style scales: int8 sub-scales of f16 supers
    # (two groups to a super-group); then only the first rows - 1 rows live.
    rng = np.random.default_rng(rows)
    k, n, groups = 64, 96, 4
    codes = rng.integers(0, 16, (k, n))
    sub_s, sub_o = rng.integers(1, 64, (groups, n)).astype(np.int8), rng.integers(0, 64, (groups, n)).astype(np.int8)
    sup_s = (rng.random((groups // 2, n)) * 1e-3).astype(np.float16)
    sup_o = (-rng.random((groups // 2, n)) * 5e-3).astype(np.float16)
    s = sub_s.astype(np.float32) * np.repeat(sup_s.astype(np.float32), 2, 0)
    o = sub_o.astype(np.float32) * np.repeat(sup_o.astype(np.float32), 2, 0)
    w = codes * np.repeat(s, k // groups, 0) + np.repeat(o, k // groups, 0)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    h = bf16(x).astype(np.float64) @ bf16(w).astype(np.float64)
    ref = h[:, : n // 2] / (1 + np.exp(-h[:, : n // 2])) * h[:, n // 2:]
    packed = native.pack_codes(codes, 4, pairs=True)
    for path in ("auto", "portable"):
        call = functools.partial(native.matmul_q4_bf16, path=path, swiglu=True, super_scale=sup_s,
                                 super_offset=sup_o)
        y = jax.jit(call)(x, packed, sub_s, sub_o)
        np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max())
        live = jax.jit(call)(x, packed, sub_s, sub_o, rows=np.int32(rows - 1))
        np.testing.assert_array_equal(live[: rows - 1], y[: rows - 1])
        assert not np.asarray(live[rows - 1:]).any()


def test_matmul_q4_bf16_rejects_what_it_cannot_run():
    rng = np.random.default_rng(0)
    codes, scale, offset, _ = random_q4(rng, 24, 32, 4, True, np.float16)    # groups of 6 rows
    x = jnp.ones((2, 24), jnp.float32)
    with pytest.raises(Exception, match="groups of a multiple of 4 rows"):
        jax.block_until_ready(native.matmul_q4_bf16(x, native.pack_codes(codes, 4, pairs=True), scale, offset))


def test_with_bf16_activations_keeps_the_weight():
    # The pairs layout holds the same codes (dequantize, shape), multiplies as the bf16 GEMM of
    # the rounded weights, and is left out where it cannot apply (groups of 2 rows, 8-bit codes).
    rng = np.random.default_rng(1)
    w = rng.standard_normal((64, 48)).astype(np.float32)
    q = make_weight(w, "int4", panels=True, activations="float")
    p = with_bf16_activations(q)
    assert isinstance(p, QuantizedWeight) and p.activations == "bf16" and p.shape == q.shape == (64, 48)
    np.testing.assert_array_equal(_unpacked_codes(p, np), _unpacked_codes(q, np))
    np.testing.assert_array_equal(dequantize(p), dequantize(q))
    x = rng.standard_normal((5, 64)).astype(np.float32)
    ref = bf16(x).astype(np.float64) @ bf16(dequantize(q)).astype(np.float64)
    np.testing.assert_allclose(jax.jit(matmul)(x, p), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    assert with_bf16_activations(make_weight(w, "int8", panels=True, activations="float")).activations == "float"
    two_row_groups = QuantizedWeight(q.codes, jnp.repeat(q.scale, 16, 0), jnp.repeat(q.offset, 16, 0), 4, "panels",
                                     "float")
    assert with_bf16_activations(two_row_groups) is two_row_groups


@pytest.mark.skipif(not native.bf16_gemm_native(), reason="no AVX512_BF16 here: bf16 weights are not packed")
def test_int4_engine_under_bf16_matches_the_bf16_engine_on_quantized_values(tiny_model_dir, tmp_path):
    # Under dtype bfloat16 the int4 layers multiply bf16 activations by their codes rounded to
    # bf16: the bf16 engine on the same values, but for the tied embedding and LM head (8-bit
    # codes, rows and products in f32 there, bf16 in the reference; this random model's
    # first-token logprobs differed by up to 0.49 nats between the two engines), so the check
    # is the wiring (the layers take the bf16 GEMM), the same first token and logprobs within
    # 0.75 nats (a wrong scale or layout moves them by many); each product is checked exactly
    # above.
    from test_quantization import PROMPTS, fake_quantized_checkpoint
    from tiny_model import TINY_ENGINE_ARGS

    from jaxllm import LLM, SamplingParams

    args = {**TINY_ENGINE_ARGS, "dtype": "bfloat16"}
    first = SamplingParams(max_tokens=1, temperature=0.0, logprobs=5)
    ref = LLM(fake_quantized_checkpoint(tiny_model_dir, "int4", str(tmp_path / "int4")), **args)
    ref_out = ref.generate(PROMPTS, first, use_tqdm=False)
    del ref
    llm = LLM(tiny_model_dir, quantization="int4", **args)
    layer = llm.engine.runner.params["layers"][0]
    assert {layer[name].activations for name in ("wqkv", "wo", "w_gate_up", "w_down")} == {"bf16"}
    for a, b in zip(llm.generate(PROMPTS, first, use_tqdm=False), ref_out):
        a_lp, b_lp = a.outputs[0].logprobs[0], b.outputs[0].logprobs[0]
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for token in set(a_lp) & set(b_lp):
            assert abs(a_lp[token].logprob - b_lp[token].logprob) < 0.75
