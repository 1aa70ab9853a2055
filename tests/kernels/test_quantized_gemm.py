"""The C++ quantized GEMM (`kernels.gemm.matmul_quantized`, csrc/gemm_quant.cc, gemm_q4a8.cc,
gemm_w8a8.cc) against NumPy: weight-only int8 / int4 panels, 4-bit codes x int8 activations per
block of 32, W8A8 (8-bit codes x int8 rows), each on every code path the build has, with the
SwiGLU epilogue and live-row counts, and the calls it refuses."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from jaxllm.kernels import gemm, native

from tests.helpers.int8_rows import check_every_row_count, bf16_dots_reference

P = gemm.pack_scales  # [G, N] scales as the kernels read them

pytestmark = pytest.mark.skipif(not native.available(), reason=f"no C++ kernels: {native.unavailable_reason()}")


def check_live_rows(call, args, ref: np.ndarray, atol: float):
    """call(*args, rows=R) with R one less than x's rows: those rows as `ref`'s, the last zeros."""
    rows = args[0].shape[0]
    live = jax.jit(call)(*args, rows=np.int32(rows - 1))
    np.testing.assert_allclose(live[: rows - 1], ref[: rows - 1], rtol=1e-5, atol=atol)
    assert not np.asarray(live[rows - 1 :]).any()


@pytest.mark.parametrize("rows", [1, 4, 5, 6, 13, 97])
@pytest.mark.parametrize("bits, groups, with_offset", [(8, 1, False), (8, 3, True), (4, 3, True), (4, 1, True)])
@pytest.mark.parametrize("scale_dtype", [np.float32, np.float16])
def test_matmul_quantized_matches_numpy(rows, bits, groups, with_offset, scale_dtype):
    # Row counts around the 4-row in-register path, the 6-row register blocks and the 96-row
    # work items; K = 39 (not a multiple of the vector width), 3 panels; f16 scales include
    # subnormal, zero-exponent-edge and negative values.
    rng = np.random.default_rng(rows * 10 + bits)
    k, n = 39, 48
    x = rng.standard_normal((rows, k)).astype(np.float32)
    codes = rng.integers(-127, 128, (k, n)) if bits == 8 else rng.integers(0, 16, (k, n))
    scale = rng.random((groups, n)).astype(scale_dtype)
    offset = rng.standard_normal((groups, n)).astype(scale_dtype) if with_offset else None
    if scale_dtype == np.float16:
        scale[0, :4] = [6e-8, 3e-5, 6.1e-5, 65504.0]
        if offset is not None:
            offset[0, :2] = [-3e-6, 0.0]
    w = codes * np.repeat(scale.astype(np.float64), k // groups, 0) + (
        0 if offset is None else np.repeat(offset.astype(np.float64), k // groups, 0)
    )
    ref = x.astype(np.float64) @ w
    packed = gemm.pack_codes(codes, bits)
    assert packed.shape == (n // 16, k, 16 if bits == 8 else 8)
    for path in ("auto", *native.kernel_paths()):
        y = jax.jit(functools.partial(gemm.matmul_quantized, bits=bits, path=path))(x, packed, P(scale), P(offset))
        np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("rows", [1, 5, 13])
@pytest.mark.parametrize("bits", [8, 4])
def test_matmul_quantized_swiglu_matches_numpy(rows, bits):
    # silu(x @ gate) * (x @ up) from the codes of [gate | up] (2 panels each), with offsets,
    # every code path, and a live-row count.
    rng = np.random.default_rng(rows + bits)
    k, n = 40, 64
    x = rng.standard_normal((rows, k)).astype(np.float32)
    codes = rng.integers(-127, 128, (k, n)) if bits == 8 else rng.integers(0, 16, (k, n))
    scale = rng.random((2, n)).astype(np.float32) * 0.3
    offset = rng.standard_normal((2, n)).astype(np.float32)
    w = codes * np.repeat(scale.astype(np.float64), k // 2, 0) + np.repeat(offset.astype(np.float64), k // 2, 0)
    g, u = np.split(x.astype(np.float64) @ w, 2, axis=1)
    ref = g / (1 + np.exp(-g)) * u
    packed = gemm.pack_codes(codes, bits)
    for path in ("auto", *native.kernel_paths()):
        y = jax.jit(functools.partial(gemm.matmul_quantized, bits=bits, path=path, swiglu=True))(
            x, packed, P(scale), P(offset)
        )
        np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    check_live_rows(
        functools.partial(gemm.matmul_quantized, bits=bits, swiglu=True),
        (x, packed, P(scale), P(offset)),
        ref,
        atol=1e-5 * np.abs(ref).max(),
    )


def test_matmul_quantized_rejects_mismatched_shapes():
    x = np.ones((2, 32), np.float32)
    codes = gemm.pack_codes(np.zeros((32, 16), np.int8), 8)
    with pytest.raises(Exception, match="matmul_quantized"):  # 5 groups do not divide K = 32
        jax.block_until_ready(gemm.matmul_quantized(x, codes, np.ones((1, 5, 16), np.float32), None, 8))
    with pytest.raises(Exception, match="matmul_quantized"):  # 8-bit codes called as 4-bit
        jax.block_until_ready(gemm.matmul_quantized(x, codes, np.ones((1, 1, 16), np.float32), None, 4))
    with pytest.raises(Exception, match="matmul_quantized"):  # scales [G, N], not laid out by pack_scales
        jax.block_until_ready(gemm.matmul_quantized(x, codes, np.ones((1, 16), np.float32), None, 8))


def act8_reference(
    x: np.ndarray, codes: np.ndarray, scale: np.ndarray, offset: np.ndarray | None, path: str = "auto"
) -> np.ndarray:
    """4-bit codes x int8 activations by hand: each row of x rounded per block of 32 columns to
    q * d (d = max|x| / 127, in f32 as the kernel computes it), the blocks' integer sums scaled;
    where a call of x's rows with `path` takes bf16 dots instead, their product."""
    m, k = x.shape
    rows = k // scale.shape[0]
    if gemm.act8_on_bf16(path, m, 4):
        offset_rows = None if offset is None else np.repeat(offset.astype(np.float64), rows, 0)
        return bf16_dots_reference(x, codes * np.repeat(scale.astype(np.float64), rows, 0), offset_rows)
    xb = x.astype(np.float32).reshape(m, k // 32, 32)
    amax = np.abs(xb).max(-1, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    q = np.rint(xb * inv).astype(np.float64)
    d = (amax / np.float32(127)).astype(np.float64)[..., 0]
    cb = codes.reshape(k // 32, 32, -1).astype(np.float64)
    s = np.repeat(scale.astype(np.float64), rows // 32, 0)  # per block of 32
    y = np.einsum("mbk,bkn,bn,mb->mn", q, cb, s, d)
    if offset is not None:
        y += xb.astype(np.float64).sum(-1) @ np.repeat(offset.astype(np.float64), rows // 32, 0)
    return y


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 9, 24, 97])
@pytest.mark.parametrize("groups, with_offset, scale_dtype", [(4, True, np.float16), (2, False, np.float32)])
def test_matmul_quantized_int8_activations_matches_numpy(rows, groups, with_offset, scale_dtype):
    # act8: rows around the 4-row register blocks and the 96-row work items (and 24: with AMX, on
    # the int8 tiles under path auto, where 6-bit codes would take the bf16 tiles); K = 128 in
    # groups of 32 or 64 rows (each scale spans 1 or 2 activation blocks), 3 panels, a zero
    # block, a row whose largest |x| sits on a block's edge.
    rng = np.random.default_rng(rows)
    k, n = 128, 48
    x = rng.standard_normal((rows, k)).astype(np.float32)
    x[0, 32:64] = 0.0
    x[-1, 95] = 9.0
    codes = rng.integers(0, 16, (k, n))
    scale = (rng.random((groups, n)) * 0.3).astype(scale_dtype)
    offset = rng.standard_normal((groups, n)).astype(scale_dtype) if with_offset else None
    ref = act8_reference(x, codes, scale, offset)
    packed = gemm.pack_codes(codes, 4, quads=True)
    for path in ("auto", *native.kernel_paths()):
        y = jax.jit(functools.partial(gemm.matmul_quantized, bits=4, path=path, act8=True))(
            x, packed, P(scale), P(offset)
        )
        want = act8_reference(x, codes, scale, offset, path)
        np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    # The float product it approximates: within 2% of its largest value.
    w = codes * np.repeat(scale.astype(np.float64), k // groups, 0)
    w = w if offset is None else w + np.repeat(offset.astype(np.float64), k // groups, 0)
    exact = x.astype(np.float64) @ w
    assert np.abs(ref - exact).max() < 0.02 * np.abs(exact).max()


def test_four_bit_codes_on_bf16_dots_walk_a_long_k_in_chunks():
    # As the 6-bit codes' test in test_quantized_gemm_six.py: K = 4,352 (on AMX's tiles 17 chunks
    # of 128 k-pairs), 40 rows, 20 panels (items of 16 and 4 on the tiles; of 4, 2 and 1 on
    # VDPBF16PS), offsets, with and without SwiGLU. (Without AMX 4-bit codes take bf16 dots only
    # where set, as here.)
    with native.act8_bf16_rows_set(4, 17):
        if not gemm.act8_on_bf16("auto", 40, 4):
            pytest.skip("no bf16 dots for the codes on this CPU (AVX512_BF16 and AVX512_VBMI)")
        rng = np.random.default_rng(4)
        k, n = 4352, 320
        x = (rng.standard_normal((40, k)) * 0.05).astype(np.float32)
        codes = rng.integers(0, 16, (k, n))
        scale = (rng.random((k // 32, n)) * 0.1).astype(np.float16)
        offset = (-rng.random((k // 32, n)) * 0.5).astype(np.float16)
        want = act8_reference(x, codes, scale, offset)
        packed = gemm.pack_codes(codes, 4, quads=True)
        for swiglu in (False, True):
            call = functools.partial(gemm.matmul_quantized, bits=4, act8=True, swiglu=swiglu)
            y = np.asarray(jax.jit(call)(x, packed, P(scale), P(offset)))
            ref = want
            if swiglu:
                g, u = np.split(want, 2, axis=1)
                ref = g / (1 + np.exp(-g)) * u
            np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("rows", [1, 2, 4, 6])
def test_matmul_quantized_int8_activations_two_level_scales(rows):
    # GGUF's K-quants (int8 sub-scales of f16 supers, 4 groups a super): the same numbers as the
    # f32 scales they stand for (exact products), in the decode's few rows (the codes read as
    # packed where the CPU has AVX512_VBMI) and beyond; gate and up through the SwiGLU epilogue.
    rng = np.random.default_rng(rows)
    k, n, groups = 256, 64, 8
    x = rng.standard_normal((rows, k)).astype(np.float32)
    codes = rng.integers(0, 16, (k, n))
    sub_s, sub_o = rng.integers(1, 64, (groups, n)).astype(np.int8), rng.integers(-64, 0, (groups, n)).astype(np.int8)
    sup_s = (rng.random((groups // 4, n)) * 0.01).astype(np.float16)
    sup_o = (rng.random((groups // 4, n)) * 0.01).astype(np.float16)
    scale = sub_s.astype(np.float32) * np.repeat(sup_s.astype(np.float32), 4, 0)
    offset = sub_o.astype(np.float32) * np.repeat(sup_o.astype(np.float32), 4, 0)
    packed = gemm.pack_codes(codes, 4, quads=True)
    for swiglu in (False, True):
        for path in ("auto", *native.kernel_paths()):
            call = functools.partial(gemm.matmul_quantized, bits=4, path=path, act8=True, swiglu=swiglu)
            want = jax.jit(call)(x, packed, P(scale), P(offset))
            got = jax.jit(call)(x, packed, P(sub_s), P(sub_o), super_scale=P(sup_s), super_offset=P(sup_o))
            np.testing.assert_array_equal(got, want)
    ref = act8_reference(x, codes, scale, offset)
    y = jax.jit(functools.partial(gemm.matmul_quantized, bits=4, act8=True))(
        x, packed, P(sub_s), P(sub_o), super_scale=P(sup_s), super_offset=P(sup_o)
    )
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("k, levels", [(96, 1), (256, 2)])
def test_int8_rows_take_the_same_numbers_on_every_row_count(k, levels):
    # 4-bit codes x int8 rows: on AMX's int8 tiles (from `native.int8_tile_rows()` rows with path
    # auto or avx512, here set to 2) the VNNI kernels' numbers exactly, so each row of a call of
    # 2-35 rows (blocks of 16 and the rest; an odd and an even number of activation groups) equals
    # the row computed alone and the call without the tiles; one- and two-level scales, SwiGLU.
    rng = np.random.default_rng(k)
    n, groups = 64, k // 32
    x = rng.standard_normal((35, k)).astype(np.float32)
    codes = gemm.pack_codes(rng.integers(0, 16, (k, n)), 4, quads=True)
    if levels == 1:
        scales = (P(rng.random((groups, n)).astype(np.float16)), P(rng.standard_normal((groups, n)).astype(np.float16)))
        supers = {}
    else:
        scales = (
            P(rng.integers(1, 64, (groups, n)).astype(np.int8)),
            P(rng.integers(-64, 0, (groups, n)).astype(np.int8)),
        )
        sup = [P((rng.random((groups // 8 or 1, n)) * 0.01).astype(np.float16)) for _ in range(2)]
        supers = {"super_scale": sup[0], "super_offset": sup[1]}
    check_every_row_count(4, x, codes, scales, supers)


def test_with_int8_activations_repacks_codes_in_quads():
    # The quads order holds the same codes (unpacked, dequantized, shape) as the float panels,
    # repacked panel by panel as packing them afresh, and multiplies as act8_reference says.
    from jaxllm.quantization.activations import with_int8_activations
    from jaxllm.quantization.weights import _unpacked_codes, dequantize, group_scales, make_weight, matmul

    rng = np.random.default_rng(3)
    w = rng.standard_normal((64, 48)).astype(np.float32)
    q = make_weight(w, "int4", panels=True, activations="float")
    p = with_int8_activations(q)
    assert p.activations == "int8" and p.shape == q.shape == (64, 48)
    codes = _unpacked_codes(q, np)
    np.testing.assert_array_equal(_unpacked_codes(p, np), codes)
    np.testing.assert_array_equal(np.asarray(p.codes), gemm.pack_codes(codes, 4, quads=True))
    assert not np.array_equal(np.asarray(p.codes), np.asarray(q.codes))
    np.testing.assert_array_equal(dequantize(p), dequantize(q))
    assert with_int8_activations(p) is p
    x = rng.standard_normal((3, 64)).astype(np.float32)
    scale, offset = (np.asarray(a) for a in group_scales(q, np))
    ref = act8_reference(x, codes, scale, offset)
    np.testing.assert_allclose(jax.jit(matmul)(x, p), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("rows", [2, 7])
def test_matmul_quantized_int8_activations_swiglu_and_live_rows(rows):
    rng = np.random.default_rng(rows)
    k, n = 64, 64
    x = rng.standard_normal((rows, k)).astype(np.float32)
    codes = rng.integers(0, 16, (k, n))
    scale = (rng.random((2, n)) * 0.3).astype(np.float16)
    offset = rng.standard_normal((2, n)).astype(np.float16)
    packed = gemm.pack_codes(codes, 4, quads=True)
    for path in ("auto", *native.kernel_paths()):
        y = jax.jit(functools.partial(gemm.matmul_quantized, bits=4, path=path, swiglu=True, act8=True))(
            x, packed, P(scale), P(offset)
        )
        g, u = np.split(act8_reference(x, codes, scale, offset, path), 2, axis=1)
        ref = g / (1 + np.exp(-g)) * u
        np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    check_live_rows(
        functools.partial(gemm.matmul_quantized, bits=4, act8=True),
        (x, packed, P(scale), P(offset)),
        act8_reference(x, codes, scale, offset),
        atol=1e-4,
    )


def w8a8_rows_reference(x: np.ndarray, codes: np.ndarray, scale: np.ndarray, act_group: int = 0) -> np.ndarray:
    """8-bit codes x int8 rows by hand: each row of x rounded per block of `act_group` columns (0:
    whole) to q * d (d = max|x| / 127 over the block, in f32 as `kv_write.int8_rows` computes it
    under XLA, x times 1 / d; 1 for a zero block), exact integer dots of the blocks, both scales."""
    rows, k = x.shape
    b = act_group or k
    xb = x.reshape(rows, k // b, b)
    d = np.abs(xb).max(2, keepdims=True) * np.float32(1 / 127)
    d = np.where(d > 0, d, np.float32(1)).astype(np.float32)
    q = np.clip(np.rint(xb * (np.float32(1) / d)), -127, 127).astype(np.int64)
    sums = np.einsum("rbk,bkn->rbn", q, codes.astype(np.int64).reshape(k // b, b, -1))
    return (sums * d.astype(np.float64)).sum(axis=1) * scale.astype(np.float64)


@pytest.mark.parametrize("rows", [1, 3, 5, 8, 11, 97])
@pytest.mark.parametrize("scale_dtype", [np.float32, np.float16])
@pytest.mark.parametrize("act_group", [0, 12, 44])
def test_matmul_quantized_w8a8_matches_numpy(rows, scale_dtype, act_group):
    # W8A8 in the C++ GEMM (csrc/gemm_w8a8.cc): rows around the register blocks (4 rows on AVX2,
    # 6 rows of 4, 2 or 1 panels with VNNI) and the 96-row work items, 7 panels, codes at +-127, a
    # zero row, an outlier column; activations scaled per row or per block of 12 or 44 columns
    # (shorter than, and not a multiple of, the VNNI kernel's prefetch segments); the SwiGLU
    # epilogue over 3 gate and 3 up panels and a live-row count; every code path the build has.
    rng = np.random.default_rng(rows)
    k, n = 132, 112
    x = rng.standard_normal((rows, k)).astype(np.float32)
    x[:, 7] *= 40
    x[rows // 2] = 0.0
    codes = rng.integers(-127, 128, (k, n)).astype(np.int8)
    codes[0, :2] = (-127, 127)
    scale = (rng.random((1, n)) * 0.01).astype(scale_dtype)
    ref = w8a8_rows_reference(x, codes, scale, act_group)
    packed = gemm.pack_codes(codes, 8, w8a8=True)
    g, u = np.split(ref[:, :96], 2, axis=1)
    for path in ("auto", *native.kernel_paths()):
        call = functools.partial(gemm.matmul_quantized, bits=8, path=path, act8=True, act_group=act_group)
        y = jax.jit(call)(x, packed, P(scale), None)
        np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-6 * np.abs(ref).max())
        y = jax.jit(functools.partial(call, swiglu=True))(x, packed[:6], P(scale[:, :96]), None)
        np.testing.assert_allclose(y, g / (1 + np.exp(-g)) * u, rtol=1e-5, atol=1e-5)
    check_live_rows(
        functools.partial(gemm.matmul_quantized, bits=8, act8=True, act_group=act_group),
        (x, packed, P(scale), None),
        ref,
        atol=1e-6 * np.abs(ref).max(),
    )


@pytest.mark.parametrize("rows", [1, 7])
@pytest.mark.parametrize("act_group", [0, 16])
def test_matmul_quantized_w8a8_bias_taken_at_packing(rows, act_group):
    # 128 x the columns' code sums (per block of activations) given with the weight
    # (`QuantizedWeight.bias`, what make_weight packs with W8A8 panels): the same products as
    # summed in the call, with and without SwiGLU; on a VNNI CPU the kernel reads it (a wrong
    # one changes the result).
    from jaxllm.quantization.weights import _unpacked_codes, make_weight
    from jaxllm.platforms import cpu_flags

    rng = np.random.default_rng(rows)
    k, n = 64, 96
    x = rng.standard_normal((rows, k)).astype(np.float32)
    codes = rng.integers(-127, 128, (k, n)).astype(np.int8)
    scale = P((rng.random((1, n)) * 0.01).astype(np.float32))
    packed = gemm.pack_codes(codes, 8, w8a8=True)
    bias = (128 * codes.astype(np.int64).reshape(k // (act_group or k), -1, n).sum(axis=1)).astype(np.int32)
    call = jax.jit(functools.partial(gemm.matmul_quantized, bits=8, act8=True, act_group=act_group))
    np.testing.assert_array_equal(call(x, packed, scale, None, bias=bias), call(x, packed, scale, None))
    glu = jax.jit(functools.partial(gemm.matmul_quantized, bits=8, act8=True, swiglu=True, act_group=act_group))
    np.testing.assert_array_equal(glu(x, packed, scale, None, bias=bias), glu(x, packed, scale, None))
    if "avx512_vnni" in cpu_flags() and "avx512" in native.kernel_paths():  # (not a build for AVX2 only)
        wrong = bias.copy()
        wrong[-1] += 128  # the last block's only
        assert not np.array_equal(call(x, packed, scale, None, bias=wrong), call(x, packed, scale, None))
    with pytest.raises(Exception, match="bias int32"):  # a bias of another block size
        jax.block_until_ready(call(x, packed, scale, None, bias=bias[:1] if act_group else np.tile(bias, (2, 1))))
    w = rng.standard_normal((k, n)).astype(np.float32)
    q = make_weight(w, "w8a8", panels=True, activations="int8")
    b = q.act_group or k
    np.testing.assert_array_equal(q.bias, 128 * _unpacked_codes(q, np).astype(np.int64).reshape(k // b, b, n).sum(1))


def test_matmul_quantized_int8_activations_rejects_what_it_cannot_run():
    x = np.ones((2, 64), np.float32)
    int8_codes = gemm.pack_codes(np.zeros((64, 16), np.int8), 8)
    with pytest.raises(Exception, match="int8 activations"):  # 8-bit codes with offsets (W8A8 has none)
        jax.block_until_ready(
            gemm.matmul_quantized(
                x, int8_codes, np.ones((1, 1, 16), np.float32), np.ones((1, 1, 16), np.float32), 8, act8=True
            )
        )
    with pytest.raises(Exception, match="int8 activations"):  # 8-bit codes, two scales per column
        jax.block_until_ready(gemm.matmul_quantized(x, int8_codes, np.ones((1, 2, 16), np.float32), None, 8, act8=True))
    k = gemm.W8A8_MAX_K + 4  # int32 sums could overflow
    with pytest.raises(Exception, match="int8 activations"):
        jax.block_until_ready(
            gemm.matmul_quantized(
                np.ones((1, k), np.float32),
                np.zeros((1, k, 16), np.int8),
                np.ones((1, 1, 16), np.float32),
                None,
                8,
                act8=True,
            )
        )
    w8a8 = functools.partial(
        gemm.matmul_quantized,
        x,
        gemm.pack_codes(np.zeros((64, 16), np.int8), 8, w8a8=True),
        np.ones((1, 1, 16), np.float32),
        None,
        8,
    )
    for act_group in (24, 2, -4):  # not dividing K, not a multiple of 4, negative
        with pytest.raises(Exception, match="int8 activations"):
            jax.block_until_ready(w8a8(act8=True, act_group=act_group))
    with pytest.raises(Exception, match="act_group needs act8"):
        jax.block_until_ready(w8a8(act_group=16))
    int4_codes = gemm.pack_codes(np.zeros((64, 16), np.uint8), 4)
    with pytest.raises(Exception, match="int8 activations"):  # groups of 16 rows: not whole blocks of 32
        jax.block_until_ready(gemm.matmul_quantized(x, int4_codes, np.ones((1, 4, 16), np.float16), None, 4, act8=True))
    with pytest.raises(Exception, match="int8 activations"):  # 4-bit codes take blocks of 32, no other
        jax.block_until_ready(
            gemm.matmul_quantized(x, int4_codes, np.ones((1, 2, 16), np.float16), None, 4, act8=True, act_group=16)
        )


def factored_case(bits: int, levels: int, n: int, rng):
    """K = 96 in 3 groups of 32 rows (one-level) or 6 of 16 under 2 supers (two-level, GGUF's
    K-quants), n columns: (codes, matmul_quantized's scale arguments, the f64 weight)."""
    k = 96
    codes = rng.integers(-128, 128, (k, n)) if bits == 8 else rng.integers(0, 16, (k, n))
    if levels == 1:
        scale = (rng.random((3, n)) * 0.02).astype(np.float16)
        offset = (-rng.random((3, n)) * 0.1).astype(np.float16) if bits == 4 else None
        args, s, o = (
            {"scale": P(scale), "offset": None if offset is None else P(offset)},
            scale.astype(np.float64),
            offset,
        )
    else:
        sub_s, sub_o = rng.integers(1, 64, (6, n)).astype(np.int8), rng.integers(-64, 0, (6, n)).astype(np.int8)
        sup_s, sup_o = (rng.random((2, n)) * 0.01).astype(np.float16), (rng.random((2, n)) * 0.01).astype(np.float16)
        args = {"scale": P(sub_s), "offset": P(sub_o), "super_scale": P(sup_s), "super_offset": P(sup_o)}
        s = sub_s.astype(np.float64) * np.repeat(sup_s.astype(np.float64), 3, 0)
        o = sub_o.astype(np.float64) * np.repeat(sup_o.astype(np.float64), 3, 0)
    rows = k // s.shape[0]
    w = codes * np.repeat(s, rows, 0) + (0 if o is None else np.repeat(np.asarray(o, np.float64), rows, 0))
    return gemm.pack_codes(codes, bits), args, w


@pytest.mark.parametrize("bits, levels", [(4, 1), (4, 2), (8, 1), (8, 2)])
@pytest.mark.parametrize("swiglu", [False, True])
def test_matmul_quantized_factored_matches_numpy_and_each_row_alone(bits, levels, swiglu):
    # factored=True (float activations): calls of one or two rows take each group's scale and
    # offset out of their sums (one row over two panels at once: a gate panel and its up panel,
    # or two neighbours in the work items of 2 panels that 101 panels make, one of them alone;
    # two rows a panel at a time). Within f32 rounding of the dequantized product, each row's
    # numbers those of the row alone; from 3 rows the dequantized path.
    rng = np.random.default_rng(bits * 10 + levels)
    packed, scales, w = factored_case(bits, levels, 64 if swiglu else 16 * 101, rng)
    x = rng.standard_normal((17, w.shape[0])).astype(np.float32)
    ref = x.astype(np.float64) @ w
    if swiglu:
        g, u = np.split(ref, 2, axis=1)
        ref = g / (1 + np.exp(-g)) * u
    atol = 2e-6 * np.abs(ref).max()
    for path in ["auto"] + [p for p in native.kernel_paths() if p == "avx2"]:
        call = functools.partial(gemm.matmul_quantized, bits=bits, path=path, swiglu=swiglu, factored=True, **scales)
        jitted = jax.jit(lambda x, rows=None: call(x, packed, rows=rows))
        alone = [np.asarray(jitted(x[r : r + 1]))[0] for r in range(2)]
        for rows in (1, 2, 3, 4, 17):
            y = np.asarray(jitted(x[:rows]))
            np.testing.assert_allclose(y, ref[:rows], rtol=2e-6, atol=atol)
            if rows <= 2:
                np.testing.assert_array_equal(y, np.stack(alone[:rows]))
        check_live_rows(lambda x, rows: call(x, packed, rows=rows), (x[:3],), ref[:3], atol)
