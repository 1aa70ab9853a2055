"""The int8-activation GEMMs' reference (`gemm.matmul_quantized(..., act8=True)`), in NumPy."""

from __future__ import annotations

import numpy as np


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
