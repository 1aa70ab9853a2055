"""Quantized weights split over a mesh: codes and scales that each shard takes its part of,
with the one-device weight's values (`make_sharded_weight` for float weights quantized on load,
`shard_checkpoint_weight` for a checkpoint's own codes), and a checkpoint's matrices stacked
over pipeline stages (`stack_stages`); `weights.permute_columns` regroups their columns for
tensor parallelism."""

from __future__ import annotations

import numpy as np

from jaxllm.quantization.checkpoint import widest_format
from jaxllm.quantization.weights import (
    METHODS,
    QuantizedWeight,
    _pack_plain_int4,
    _unpacked_codes,
    flat_scales,
    quantize_matrix,
    w8a8_act_group,
)


def make_sharded_weight(
    w: np.ndarray, method: str, activations: str, columns: int = 1, rows: int = 1
) -> QuantizedWeight:
    """Quantize w [K, N] (or a stack [..., K, N]: a pipeline's stages, experts; each matrix on
    its own) into a plain-layout QuantizedWeight of host arrays that split evenly into `columns` parts
    along N or `rows` parts along K (`parallel.shard_params` places them): the codes and scales
    are those of the whole matrix, so every shard computes with the one-device weight's values
    (`_shard_fields`)."""
    bits, group_size = METHODS[method]
    w = np.asarray(w, np.float32)
    parts = [
        _shard_fields(*quantize_matrix(x, bits, group_size), bits, columns, rows, method)
        for x in w.reshape(-1, *w.shape[-2:])
    ]
    act_group = w8a8_act_group(w.shape[-2], rows) if activations == "int8" else 0
    return QuantizedWeight(*_stacked(parts, w.shape[:-2]), bits, "plain", activations, act_group=act_group)


def _stacked(parts: list[tuple], lead: tuple) -> tuple:
    """Per-matrix (codes, scale, offset) -> the same fields stacked to `lead` + each's shape."""
    return tuple(
        None if parts[0][i] is None else np.stack([p[i] for p in parts]).reshape(*lead, *parts[0][i].shape)
        for i in range(3)
    )


def _shard_fields(codes, scale, offset, bits: int, columns: int, rows: int, what: str):
    """One matrix's (codes [K, N] one a byte, scale, offset) as plain-layout fields that split
    into `columns` parts along N or `rows` along K. Split over rows, one scale row per output
    channel is repeated for each part (each shard then holds [1, N]) and groups must not
    straddle parts; 4-bit codes are packed within each column part."""
    k, n = codes.shape
    groups = scale.shape[0]
    if rows > 1 and groups == 1:
        scale, offset = np.repeat(scale, rows, axis=0), None if offset is None else np.repeat(offset, rows, axis=0)
    elif groups % rows:
        raise ValueError(
            f"{what}: a [{k}, {n}] matrix in {groups} groups of {k // groups} rows cannot be split "
            f"over {rows} shards along its rows"
        )
    if bits == 4:
        if n % (2 * columns):
            raise ValueError(f"{what}: {n} columns do not split into {columns} parts of an even width")
        codes = np.concatenate([_pack_plain_int4(c) for c in np.split(codes, columns, axis=1)], axis=1)
    return codes, scale, offset


def shard_checkpoint_weight(w: QuantizedWeight, columns: int, rows: int, what: str) -> QuantizedWeight:
    """A checkpoint's quantized matrix (GGUF, AWQ, GPTQ; after `layout.tp_layout`) as host
    arrays that split into `columns` or `rows` shards (`_shard_fields`); act-order weights
    (`perm`) only along their columns."""
    if w.perm is not None and rows > 1:
        raise ValueError(f"{what}: act-order weights (GPTQ's g_idx) cannot be split along their input rows")
    w = flat_scales(w)

    def flat(a):  # [..., rows, columns] (a stack of pipeline stages) -> [matrices, rows, columns]
        return np.asarray(a).reshape(-1, *a.shape[-2:])

    codes, scale = _unpacked_codes(w, np), flat(w.scale)
    offsets = [None] * len(scale) if w.offset is None else flat(w.offset)
    parts = [_shard_fields(c, g, o, w.bits, columns, rows, what) for c, g, o in zip(flat(codes), scale, offsets)]
    return QuantizedWeight(
        *_stacked(parts, codes.shape[:-2]),
        w.bits,
        "plain",
        w.activations,
        None if w.perm is None else np.asarray(w.perm),
    )


def stack_stages(ws: list, what: str) -> QuantizedWeight:
    """One layer slot's checkpoint-quantized matrices on each pipeline stage -> one plain-layout
    weight of host arrays stacked [stages, ...], in the `widest_format` of theirs (as
    `checkpoint.concat_rows` fuses parts); act-order rows in each stage's own order (the
    identity where a stage has none)."""
    if not all(isinstance(w, QuantizedWeight) for w in ws):
        raise ValueError(
            f"{what} is quantized on some pipeline stages and float on others; run it without "
            f"pipeline stages (or dequantize it: for a GGUF, leave `quantization` unset)"
        )
    ws = [flat_scales(w) for w in ws]
    fmt = widest_format([(w.bits, w.scale.shape[-2], w.scale.dtype, w.offset is not None) for w in ws])
    if fmt is None:
        raise ValueError(
            f"{what}: groups of different sizes on different pipeline stages "
            f"({sorted({w.shape[0] // w.scale.shape[-2] for w in ws})} rows) cannot be stacked"
        )
    bits, groups, dtype, with_offset = fmt

    def widen(w: QuantizedWeight):
        codes, rep = _unpacked_codes(w, np), groups // w.scale.shape[-2]
        if bits == 8:
            codes = codes.astype(np.int8)
        elif codes.shape[-1] % 2:
            raise ValueError(f"{what}: 4-bit codes need an even number of columns, not {codes.shape[-1]}")
        else:
            codes = _pack_plain_int4(codes)
        scale = np.repeat(np.asarray(w.scale), rep, axis=-2).astype(dtype)
        offset = np.zeros_like(scale) if w.offset is None else np.repeat(np.asarray(w.offset), rep, axis=-2)
        return codes, scale, offset.astype(dtype) if with_offset else None

    perm = None
    if any(w.perm is not None for w in ws):
        perm = np.stack(
            [np.arange(w.shape[0], dtype=np.int32) if w.perm is None else np.asarray(w.perm, np.int32) for w in ws]
        )
    return QuantizedWeight(*_stacked([widen(w) for w in ws], (len(ws),)), bits, "plain", ws[0].activations, perm)
