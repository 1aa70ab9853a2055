"""6-bit codes x int8 activations (`kernels.gemm.matmul_quantized(..., bits=6, act8=True)`,
csrc/gemm_q6a8.cc) against NumPy: the `six_bit_quads` layout, the scales of GGUF's Q6_K (int8
sub-scales of groups of 16 rows), Q5_0 (one f16 scale a group of 32), Q5_K (two-level with
offsets) and Q4_K parts fused with Q6_K ones (offsets of groups of 16 rows), every code path
the build has, the SwiGLU epilogue, live rows, `with_int8_activations`' repacking and the calls
it refuses."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from jaxllm.kernels import gemm, native

from tests.helpers.int8_rows import act8_expected, check_every_row_count, int8_rows_reference

P = gemm.pack_scales

pytestmark = pytest.mark.skipif(not native.available(), reason=f"no C++ kernels: {native.unavailable_reason()}")


def case(kind: str, k: int, n: int, rng):
    """Codes [K, N] in [-32, 31] and the kernel's scale arguments for a GGUF type's layout, with
    the weights [K, N] and offsets per row (or None) they stand for, in float64."""
    if kind == "q5_0":  # one f16 scale a group of 32 rows, codes in [-16, 15]
        codes = rng.integers(-16, 16, (k, n))
        scale = (rng.random((k // 32, n)) * 0.1).astype(np.float16)
        rows = np.repeat(scale.astype(np.float64), 32, 0)
        return codes, (P(scale), None), {}, codes * rows, None
    # Q6_K; Q5_K (offsets); Q4_K parts fused with Q6_K ones (a GGUF's QKV): offsets of groups of 16.
    groups, per_super, lo, hi = {"q6_k": (k // 16, 16, -32, 32), "q5_k": (k // 32, 8, 0, 32)}.get(
        kind, (k // 16, 16, -32, 32)
    )
    codes = rng.integers(lo, hi, (k, n))
    codes[0, :3] = [0, 31, 0] if kind == "q5_k" else [-32, 31, 0]
    sub = rng.integers(-128, 128, (groups, n)).astype(np.int8)
    sup = (rng.random((groups // per_super, n)) * 0.01).astype(np.float16)
    scale_rows = np.repeat(sub.astype(np.float64) * np.repeat(sup.astype(np.float64), per_super, 0), k // groups, 0)
    if kind == "q6_k":
        return codes, (P(sub), None), dict(super_scale=P(sup)), codes * scale_rows, None
    sub_o = rng.integers(0, 64, (groups, n)).astype(np.int8)
    sup_o = -(rng.random((groups // per_super, n)) * 0.01).astype(np.float16)
    offset_rows = sub_o.astype(np.float64) * np.repeat(sup_o.astype(np.float64), per_super, 0)
    offset_rows = np.repeat(offset_rows, k // groups, 0)
    return codes, (P(sub), P(sub_o)), dict(super_scale=P(sup), super_offset=P(sup_o)), codes * scale_rows, offset_rows


def test_six_bit_quads_round_trip():
    rng = np.random.default_rng(0)
    codes = rng.integers(-32, 32, (64, 48)).astype(np.int8)
    panels = gemm.pack_codes(codes, 8)
    six = gemm.pack_codes(codes, 6, quads=True)
    assert six.shape == (3, 8, 96) and six.dtype == np.uint8
    np.testing.assert_array_equal(six, gemm.six_bit_quads(panels))
    np.testing.assert_array_equal(gemm.six_bit_quads_codes(six, np), panels)
    np.testing.assert_array_equal(np.asarray(gemm.six_bit_quads_codes(six)), panels)
    # The first 64 bytes of a block are the low 4 bits in the 4-bit quads order.
    low = gemm.pack_codes((codes.astype(np.int16) + 32) & 15, 4, quads=True)
    np.testing.assert_array_equal(six[..., :64].reshape(3, 64, 8), low)
    with pytest.raises(ValueError, match=r"\[-32, 31\]"):
        gemm.six_bit_quads(gemm.pack_codes(np.full((64, 16), 32), 8))


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 33])
@pytest.mark.parametrize("kind", ["q6_k", "q5_0", "q5_k", "q4_k+q6_k"])
def test_matmul_six_bit_int8_activations_matches_numpy(rows, kind):
    # K = 512: two Q6_K super-blocks of 16 groups; a zero block of x, a row whose largest |x|
    # sits on a block's edge; rows around the 4-row register blocks.
    rng = np.random.default_rng(rows)
    k, n = 512, 48
    codes, scales, supers, w, offset_rows = case(kind, k, n, rng)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    x[0, 32:64] = 0.0
    x[-1, 95] = 9.0
    ref = int8_rows_reference(x, w, offset_rows)
    six = gemm.pack_codes(codes, 6, quads=True)
    for path in ("auto", *native.kernel_paths()):
        call = functools.partial(gemm.matmul_quantized, bits=6, path=path, act8=True, **supers)
        y = jax.jit(call)(x, six, *scales)
        want = act8_expected(x, w, offset_rows, path, 6)
        np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    # The float product it approximates: within 2% of its largest value.
    exact = x.astype(np.float64) @ (w if offset_rows is None else w + offset_rows)
    assert np.abs(ref - exact).max() < 0.02 * np.abs(exact).max()


@pytest.mark.parametrize("kind, k", [("q6_k", 256), ("q5_0", 96), ("q5_k", 256), ("q4_k+q6_k", 512)])
def test_six_bit_int8_rows_take_the_same_numbers_on_every_row_count(kind, k):
    # As the 4-bit codes' test in test_quantized_gemm.py: on AMX's int8 tiles (set to take calls
    # from 2 rows) each row of a call of 2-35 rows equals the row alone and the call without the
    # tiles, for each scale layout (Q5_0 at K = 96: an odd number of activation groups), SwiGLU.
    rng = np.random.default_rng(k)
    codes, scales, supers, _, _ = case(kind, k, 64, rng)
    six = gemm.pack_codes(codes, 6, quads=True)
    x = rng.standard_normal((35, k)).astype(np.float32)
    check_every_row_count(6, x, six, scales, supers)


@pytest.mark.parametrize("kind", ["q6_k", "q4_k+q6_k"])
def test_codes_on_bf16_dots_walk_a_long_k_in_chunks(kind):
    # From 2,048 k-pairs AMX's bf16 tiles walk K in chunks, the sums kept between them, over up
    # to 16 panels an item: K = 4,352 (17 chunks of 128 k-pairs and a Q6_K super-block's
    # multiple), 40 rows (a block of 32 and one of 8), 20 panels (an item of 16 and one of 4;
    # on VDPBF16PS items of 4, 2 and 1), with and without SwiGLU: the rounded weights' product
    # within f32 rounding. (Calls take bf16 dots here from 17 rows, as on AMX.)
    with native.act8_bf16_rows_set(6, 17):
        if not gemm.act8_on_bf16("auto", 40, 6):
            pytest.skip("no bf16 dots for the codes on this CPU (AVX512_BF16 and AVX512_VBMI)")
        rng = np.random.default_rng(5)
        k, n = 4352, 320
        codes, scales, supers, w, offset_rows = case(kind, k, n, rng)
        x = (rng.standard_normal((40, k)) * 2e-3).astype(np.float32)  # (sums near SiLU's bend)
        six = gemm.pack_codes(codes, 6, quads=True)
        want = act8_expected(x, w, offset_rows, "auto", 6)
        for swiglu in (False, True):
            call = functools.partial(gemm.matmul_quantized, bits=6, act8=True, swiglu=swiglu, **supers)
            y = np.asarray(jax.jit(call)(x, six, *scales))
            if swiglu:
                g, u = np.split(want, 2, axis=1)
                ref = g / (1 + np.exp(-g)) * u
            else:
                ref = want
            np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("rows", [2, 7])
def test_matmul_six_bit_int8_activations_swiglu_and_live_rows(rows):
    rng = np.random.default_rng(rows)
    k, n = 256, 64
    codes, scales, supers, w, _ = case("q6_k", k, n, rng)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    ref = int8_rows_reference(x, w, None)
    six = gemm.pack_codes(codes, 6, quads=True)
    for path in ("auto", *native.kernel_paths()):
        call = functools.partial(gemm.matmul_quantized, bits=6, path=path, act8=True, swiglu=True, **supers)
        y = jax.jit(call)(x, six, *scales)
        g, u = np.split(act8_expected(x, w, None, path, 6), 2, axis=1)
        np.testing.assert_allclose(y, g / (1 + np.exp(-g)) * u, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    live = jax.jit(functools.partial(gemm.matmul_quantized, bits=6, act8=True, **supers))(
        x, six, *scales, rows=np.int32(rows - 1)
    )
    np.testing.assert_allclose(live[: rows - 1], ref[: rows - 1], rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    assert not np.asarray(live[rows - 1 :]).any()


def test_with_int8_activations_six_bit_repacks_fitting_codes():
    # GGUF-like 8-bit float panels (Q6_K's layout): with six_bit, repacked in 6 bits with the
    # same unpacked codes and dequantized weights, multiplying as the reference; without it, or
    # with a code outside [-32, 31], left as they are.
    from jaxllm.quantization.activations import with_int8_activations
    from jaxllm.quantization.weights import QuantizedWeight, _unpacked_codes, dequantize, matmul, relayout

    rng = np.random.default_rng(5)
    k, n = 256, 32
    codes, (sub, _), supers, w, _ = case("q6_k", k, n, rng)
    q = QuantizedWeight(gemm.pack_codes(codes, 8), sub, None, 8, "panels", "float", super_scale=supers["super_scale"])
    assert with_int8_activations(q) is q
    p = with_int8_activations(q, six_bit=True)
    assert (p.bits, p.activations, p.shape) == (6, "int8", (k, n))
    assert p.codes.nbytes == q.codes.nbytes * 3 // 4
    np.testing.assert_array_equal(_unpacked_codes(p, np), codes)
    np.testing.assert_array_equal(dequantize(p), dequantize(q))
    assert with_int8_activations(p, six_bit=True) is p
    x = rng.standard_normal((3, k)).astype(np.float32)
    ref = int8_rows_reference(x, w, None)
    np.testing.assert_allclose(jax.jit(matmul)(x, p), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    with pytest.raises(ValueError, match="6-bit codes for int8 activations live in the C.. GEMM's panels only"):
        relayout(p, panels=False)
    wide = codes.copy()
    wide[5, 5] = 40
    q_wide = QuantizedWeight(gemm.pack_codes(wide, 8), sub, None, 8, "panels", "float", super_scale=q.super_scale)
    assert with_int8_activations(q_wide, six_bit=True) is q_wide


def test_matmul_six_bit_refuses_what_it_cannot_run():
    rng = np.random.default_rng(1)
    k, n = 64, 16
    x = rng.standard_normal((2, k)).astype(np.float32)
    six = gemm.pack_codes(rng.integers(-32, 32, (k, n)), 6, quads=True)
    f16 = lambda g: np.ones((1, g, 16), np.float16)  # noqa: E731
    with pytest.raises(Exception, match="6-bit codes multiply int8 activations only"):
        jax.block_until_ready(gemm.matmul_quantized(x, six, f16(2), None, 6))
    with pytest.raises(Exception, match="6-bit codes multiply int8 activations only"):  # one level, 16 rows
        jax.block_until_ready(gemm.matmul_quantized(x, six, f16(4), None, 6, act8=True))
    with pytest.raises(Exception, match="needs x"):  # codes of another K
        jax.block_until_ready(gemm.matmul_quantized(x[:, :32], six, f16(1), None, 6, act8=True))
