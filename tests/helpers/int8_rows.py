"""The int8-activation GEMMs' references (`gemm.matmul_quantized(..., act8=True)`), in NumPy: int8
rows, and the bf16 dots (AMX's tiles, VDPBF16PS) that take a call of many rows; and the check that a call of any
row count (on AMX's int8 tiles or not) computes each row's numbers."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.kernels import gemm, native


def int8_rows_reference(x: np.ndarray, w: np.ndarray, offset_rows: np.ndarray | None) -> np.ndarray:
    """x [M, K] rounded per row and block of 32 columns to q * d (d = max|x| / 127, f32 as the
    kernel computes it) times w [K, N] (codes times their scales, float64), plus x @ the
    offsets (a group's offset meets x's float sum over it)."""
    m, k = x.shape
    xb = x.astype(np.float32).reshape(m, k // 32, 32)
    amax = np.abs(xb).max(-1, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    q = np.rint(xb * inv).astype(np.float64)
    d = (amax / np.float32(127)).astype(np.float64)[..., 0]
    y = np.einsum("mbk,bkn,mb->mn", q, w.reshape(k // 32, 32, -1), d)
    return y if offset_rows is None else y + x.astype(np.float64) @ offset_rows


def bf16_dots_reference(x: np.ndarray, w: np.ndarray, offset_rows: np.ndarray | None) -> np.ndarray:
    """What bf16 dots compute for the same call (`gemm.act8_on_bf16`): x rounded to bf16
    times each weight (code times scale plus offset, rounded to f32 once, then to bf16), summed
    in float64."""

    def bf16(a):
        return np.asarray(jnp.asarray(np.asarray(a, np.float32), jnp.bfloat16), np.float64)

    return bf16(x) @ bf16(w if offset_rows is None else w + offset_rows)


def act8_expected(x: np.ndarray, w: np.ndarray, offset_rows: np.ndarray | None, path: str, bits: int) -> np.ndarray:
    """`matmul_quantized(..., act8=True, path=path)`'s product over codes of `bits` (4 or 6): the
    int8 rows', or the bf16 dots' where the call takes them."""
    if gemm.act8_on_bf16(path, x.shape[0], bits):
        return bf16_dots_reference(x, w, offset_rows)
    return int8_rows_reference(x, w, offset_rows)


def check_every_row_count(bits: int, x: np.ndarray, codes, scales, supers: dict) -> None:
    """`matmul_quantized(..., act8=True, path="avx512")` of 4- or 6-bit codes, with and without
    SwiGLU: each row of calls of 2-35 rows of x (35 rows) equals the row computed alone, both on
    AMX's int8 tiles (where the CPU has them, here set to take calls from 2 rows) and without them."""
    for swiglu in (False, True):
        call = jax.jit(
            functools.partial(gemm.matmul_quantized, bits=bits, act8=True, swiglu=swiglu, path="avx512", **supers)
        )
        alone = np.concatenate([np.asarray(call(x[i : i + 1], codes, *scales)) for i in range(len(x))])
        for rows in (2, 5, 16, 17, 35):
            for tile_rows in (2, 0):
                with native.int8_tile_rows_set(tile_rows):
                    np.testing.assert_array_equal(np.asarray(call(x[:rows], codes, *scales)), alone[:rows])
