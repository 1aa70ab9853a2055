"""GGUF's quantized blocks as integer codes with scales (`gguf_rows`), so a GGUF's matrices run
quantized as they are (`quantization="gguf"`) rather than dequantized on load.

Each block type maps exactly (up to the f32 rounding of code * scale + offset) onto
`QuantizedRows` codes with a scale (and offset) per group of input rows:

| type        | llama.cpp's weight          | codes here       | scale, offset per |
|-------------|-----------------------------|------------------|-------------------|
| Q4_0        | d * (q - 8)                 | 4-bit q          | 32 rows, f16      |
| Q4_1        | d * q + m                   | 4-bit q          | 32 rows, f16      |
| Q5_0        | d * (q - 16)                | int8 q - 16      | 32 rows, f16      |
| Q5_1        | d * q + m                   | int8 q           | 32 rows, f16      |
| Q8_0        | d * q                       | int8 q           | 32 rows, f16      |
| Q4_K        | d * sc_j * q - dmin * m_j   | 4-bit q          | 32 rows, two-level|
| Q5_K        | d * sc_j * q - dmin * m_j   | int8 q           | 32 rows, two-level|
| Q6_K        | d * sc_j * (q - 32)         | int8 q - 32      | 16 rows, two-level|

The K-quants keep their two-level scales: the sub-block's scale (and min) as an int8
sub-scale (`scale`, `offset`) of the super-block's f16 d (and -dmin: `super_scale`,
`super_offset`), multiplied out only where used (in the C++ GEMM a panel's group at a time;
exact in f32). Q4_K then takes 4.625 bits a weight (the file: 4.5, its 6-bit sub-scales
packed), Q5_K and Q6_K 8.6 (their 5- and 6-bit codes held a byte each). Other types (Q2_K,
Q3_K, the IQ types, ...) return None: the reader dequantizes them to float.
"""

from __future__ import annotations

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T

from jaxllm.quantization.checkpoint import QuantizedRows


def _f16(b: np.ndarray) -> np.ndarray:
    """Two bytes [..., 2] a value -> f16 [...]."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0]


def _nibbles(qs: np.ndarray, width: int) -> np.ndarray:
    """Bytes [..., n * width] -> 4-bit codes [..., n, 2 * width]: per chunk of `width` bytes,
    the low nibbles of its bytes, then the high ones (llama.cpp's order)."""
    chunks = qs.reshape(*qs.shape[:-1], -1, 1, width) >> np.array([0, 4], np.uint8).reshape(2, 1)
    return (chunks & 15).reshape(*qs.shape[:-1], -1, 2 * width)


def _bits(b: np.ndarray, shifts: list[int], mask: int) -> np.ndarray:
    """Bytes [..., c, w] -> [..., c, len(shifts), w]: bit fields (b >> s) & mask."""
    return (b[..., None, :] >> np.array(shifts, np.uint8).reshape(-1, 1)) & np.uint8(mask)


def _legacy(blocks: np.ndarray, t: int):
    """Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 blocks [..., bytes] -> (codes [..., 32], scale, offset)."""
    d = _f16(blocks[..., 0:2])
    if t == T.Q8_0:
        return blocks[..., 2:].view(np.int8), d, None
    with_min = t in (T.Q4_1, T.Q5_1)
    m = _f16(blocks[..., 2:4]) if with_min else None
    rest = blocks[..., 4 if with_min else 2 :]
    if t in (T.Q4_0, T.Q4_1):
        q = _nibbles(rest, 16)[..., 0, :]
        if with_min:
            return q, d, m
        with np.errstate(over="ignore"):
            return q, d, (np.float16(-8) * d).astype(np.float16)
    qh = np.ascontiguousarray(rest[..., :4]).view(np.uint32)  # bit j: code j's fifth bit
    high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
    q = (_nibbles(rest[..., 4:], 16)[..., 0, :] | (high << 4)).astype(np.int8)
    return (q, d, m) if with_min else (q - np.int8(16), d, None)


def _k_scales(scales: np.ndarray):
    """Q4_K / Q5_K's 12 bytes -> (8 scales, 8 mins), 6 bits each."""
    from gguf.quants import Q4_K

    sc, mins = Q4_K.get_scale_min(scales.reshape(-1, 12))
    return sc.reshape(*scales.shape[:-1], 8), mins.reshape(*scales.shape[:-1], 8)


def _k_quant(blocks: np.ndarray, t: int):
    """Q4_K / Q5_K / Q6_K super-blocks [..., bytes] -> (codes [..., 256], (sub-scales int8
    [..., sub-blocks], super-scale f16 [...]), (sub-offsets, super-offset) or None)."""
    if t == T.Q6_K:
        ql, qh, sc, d = blocks[..., :128], blocks[..., 128:192], blocks[..., 192:208], _f16(blocks[..., 208:210])
        low = _nibbles(ql, 64)  # [..., 2, 128]
        high = _bits(qh.reshape(*qh.shape[:-1], 2, 32), [0, 2, 4, 6], 3).reshape(low.shape)
        q = (low | (high << 4)).astype(np.int8) - np.int8(32)
        return q.reshape(*q.shape[:-2], 256), (sc.view(np.int8), d), None
    d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
    sc, mins = _k_scales(blocks[..., 4:16])  # 6 bits each: int8 holds them
    scale, offset = (sc.astype(np.int8), d), (mins.astype(np.int8), -dmin)
    if t == T.Q4_K:
        return _nibbles(blocks[..., 16:144], 32).reshape(*blocks.shape[:-1], 256), scale, offset
    qh, qs = blocks[..., 16:48], blocks[..., 48:176]
    high = _bits(qh, list(range(8)), 1)  # [..., 8, 32]: sub-block j is bit j
    q = _nibbles(qs, 32).reshape(high.shape) | (high << 4)
    return q.reshape(*blocks.shape[:-1], 256).astype(np.int8), scale, offset


_LEGACY = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0)
_K_QUANTS = (T.Q4_K, T.Q5_K, T.Q6_K)
SUPPORTED = _LEGACY + _K_QUANTS
# The types whose codes the C++ GEMM multiplies by int8 activations under float32 (4-bit codes,
# and 8-bit ones within 6 bits: quantization/activations.py `with_int8_activations`); not Q8_0.
INT8_DOT_TYPES = (T.Q4_0, T.Q4_1, T.Q4_K, T.Q5_0, T.Q5_1, T.Q5_K, T.Q6_K)


def int8_dot_codes(tensors: dict) -> bool:
    """Whether every matrix a step of this GGUF multiplies (its 2-D tensors, less a token table
    that an `output.weight` leaves a lookup) has codes of `INT8_DOT_TYPES`, and no tensor has
    more dimensions (stacked experts). `tensors`: name -> anything with `shape` and `ggml_type`
    (models/gguf_checkpoint.py `read_gguf`)."""
    untied = "output.weight" in tensors
    matrices = [t for name, t in tensors.items() if len(t.shape) >= 2 and not (untied and name == "token_embd.weight")]
    return bool(matrices) and all(len(t.shape) == 2 and t.ggml_type in INT8_DOT_TYPES for t in matrices)


def gguf_rows(data: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> QuantizedRows | None:
    """A 2-D GGUF tensor's raw rows (uint8 [out, bytes a row]) of `shape` [out, in] as
    QuantizedRows, or None when its type is not kept quantized (float types included)."""
    if ggml_type not in SUPPORTED or len(shape) != 2:
        return None
    out, k = shape
    block_elems, block_bytes = GGML_QUANT_SIZES[ggml_type]
    blocks = np.asarray(data).reshape(out, k // block_elems, block_bytes)
    bits = 4 if ggml_type in (T.Q4_0, T.Q4_1, T.Q4_K) else 8
    if ggml_type in _K_QUANTS:
        codes, (scale, super_scale), offset = _k_quant(blocks, ggml_type)
        offset, super_offset = (None, None) if offset is None else offset
        flat = lambda a: None if a is None else np.ascontiguousarray(a.reshape(out, -1))  # noqa: E731
        return QuantizedRows(
            np.ascontiguousarray(codes.reshape(out, k)),
            flat(scale),
            flat(offset),
            bits,
            None,
            flat(super_scale),
            flat(super_offset),
        )
    codes, scale, offset = _legacy(blocks, ggml_type)
    scale = scale.reshape(out, -1)
    if offset is not None:
        offset = offset.reshape(out, -1)
        if not np.isfinite(offset).all():  # Q4_0's -8 d past f16's range: keep it in f32
            scale, offset = scale.astype(np.float32), -8 * scale.astype(np.float32)
    return QuantizedRows(np.ascontiguousarray(codes.reshape(out, k)), scale, offset, bits)
