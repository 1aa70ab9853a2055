"""Quantized weights as checkpoints hold them: `QuantizedRows`, what the GGUF, AWQ and GPTQ
readers give `models/checkpoint.build_params` in place of a float `[out, in]` Linear weight,
and the params cache's round trip of `QuantizedWeight` leaves (`to_saved`, `from_saved`).
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.quantization.weights import QuantizedWeight, _pack_plain_int4, two_level

logger = logging.getLogger(__name__)


def widest_format(parts: list[tuple]) -> tuple | None:
    """The one format that holds each of `parts` ((bits, groups, scale dtype, has an offset) per
    quantized matrix) exactly: 8-bit codes when any has them, the finest groups, f32 scales unless
    all are f16, offsets when any has them -> (bits, groups, scale dtype, offsets); None when the
    group counts do not all divide the finest."""
    bits, groups = max(p[0] for p in parts), max(p[1] for p in parts)
    if any(groups % p[1] for p in parts):
        return None
    dtype = np.float16 if all(np.dtype(p[2]) == np.float16 for p in parts) else np.float32
    return bits, groups, dtype, any(p[3] for p in parts)


@dataclasses.dataclass
class QuantizedRows:
    """A quantized Linear weight in HF's `[out, in]` orientation, one code a byte:
    w[o, perm[i]] = codes[o, i] * scale[o, g] (+ offset[o, g]) for the group g = i // (in / G).

    codes: uint8 [out, in] in 0..15 (bits 4) or int8 [out, in] (bits 8).
    scale, offset: f16 or f32 [out, G] (offset None: symmetric codes).
    perm: None, or int32 [in] (GPTQ act-order: the input rows sorted by group).
    super_scale, super_offset: None, or (GGUF's K-quants) f16 [out, G / S], scale and offset
        then int8 sub-scales: group g's scale is scale[o, g] * super_scale[o, g // S].
    """

    codes: np.ndarray
    scale: np.ndarray
    offset: np.ndarray | None
    bits: int
    perm: np.ndarray | None = None
    super_scale: np.ndarray | None = None
    super_offset: np.ndarray | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape

    def take(self, rows: np.ndarray) -> QuantizedRows:
        """The output rows `rows`, in that order."""
        pick = lambda a: None if a is None else a[rows]  # noqa: E731
        return QuantizedRows(
            self.codes[rows],
            self.scale[rows],
            pick(self.offset),
            self.bits,
            self.perm,
            pick(self.super_scale),
            pick(self.super_offset),
        )

    def scales(self):
        """(scale, offset or None) [out, G], two-level scales multiplied out (f32)."""
        return two_level(self.scale, self.super_scale, 1, np), two_level(self.offset, self.super_offset, 1, np)

    def flat(self) -> QuantizedRows:
        """These rows with one level of scales."""
        return self if self.super_scale is None else QuantizedRows(self.codes, *self.scales(), self.bits, self.perm)

    def dequantize(self) -> np.ndarray:
        """The f32 weight [out, in]."""
        scale, offset = self.scales()
        rep = self.codes.shape[1] // scale.shape[1]
        w = self.codes.astype(np.float32) * np.repeat(scale.astype(np.float32), rep, axis=1)
        if offset is not None:
            w += np.repeat(offset.astype(np.float32), rep, axis=1)
        if self.perm is None:
            return w
        out = np.empty_like(w)
        out[:, self.perm] = w
        return out

    def to_weight(self) -> QuantizedWeight:
        """The QuantizedWeight [in, out] (plain layout, weight-only) on the default device."""
        codes = np.ascontiguousarray(self.codes.T)
        if self.bits == 4:
            if codes.shape[1] % 2:
                raise ValueError(f"4-bit codes need an even number of outputs, not {codes.shape[1]}")
            codes = _pack_plain_int4(codes)

        def put_t(a):  # [out, ...] -> [..., out]
            return None if a is None else jnp.asarray(np.ascontiguousarray(a.T))

        return QuantizedWeight(
            jnp.asarray(codes),
            put_t(self.scale),
            put_t(self.offset),
            self.bits,
            "plain",
            "float",
            None if self.perm is None else jnp.asarray(self.perm),
            put_t(self.super_scale),
            put_t(self.super_offset),
        )


def permute_rows(w, fn):
    """fn(w) for an array; for QuantizedRows, its rows taken in the order fn gives to row numbers
    (fn: a permutation of rows along the first axis, e.g. a reshape and swapaxes)."""
    if isinstance(w, QuantizedRows):
        return w.take(fn(np.arange(w.shape[0])))
    return fn(w)


def dense(w) -> np.ndarray:
    """A checkpoint tensor as a float array (QuantizedRows dequantized)."""
    return w.dequantize() if isinstance(w, QuantizedRows) else np.asarray(w)


def concat_rows(parts: list) -> QuantizedRows | np.ndarray:
    """Parts of one fused matrix concatenated along `out`. Quantized parts of different formats
    (as a GGUF's Q4_K q/k with its Q6_K v) share the widest (`widest_format`). Float
    parts, act-order parts with different orders, or group counts that do not divide, make the
    whole float."""
    if not all(isinstance(p, QuantizedRows) for p in parts):
        return np.concatenate([dense(p) for p in parts])
    perms = [p.perm for p in parts]
    if any((a is None) != (perms[0] is None) or (a is not None and not np.array_equal(a, perms[0])) for a in perms):
        logger.warning("fused parts with different act-orders: dequantized to float")
        return np.concatenate([p.dequantize() for p in parts])
    if len(parts) == 1:
        return parts[0]
    # Two-level scales stay so when every part has them over the same super-groups (Q4_K with
    # Q6_K: int8 sub-scales both); otherwise all are multiplied out first.
    if len({None if p.super_scale is None else p.super_scale.shape[1] for p in parts}) > 1:
        parts = [p.flat() for p in parts]
    two = parts[0].super_scale is not None
    fmt = widest_format([(p.bits, p.scale.shape[1], p.scale.dtype, p.offset is not None) for p in parts])
    if fmt is None:
        return np.concatenate([p.dequantize() for p in parts])
    bits, groups, dtype, with_offset = fmt
    dtype = np.int8 if two else dtype

    def widen(p: QuantizedRows):
        rep = groups // p.scale.shape[1]
        offset = np.zeros_like(p.scale) if p.offset is None else p.offset
        super_offset = None
        if two and with_offset:
            super_offset = np.zeros_like(p.super_scale) if p.super_offset is None else p.super_offset
        return (
            p.codes.astype(np.int8) if bits == 8 else p.codes,
            np.repeat(p.scale, rep, axis=1).astype(dtype),
            np.repeat(offset, rep, axis=1).astype(dtype),
            p.super_scale,
            super_offset,
        )

    codes, scale, offset, super_scale, super_offset = zip(*(widen(p) for p in parts))
    join = lambda arrays: None if arrays[0] is None else np.concatenate(arrays)  # noqa: E731
    return QuantizedRows(
        np.concatenate(codes),
        np.concatenate(scale),
        join(offset) if with_offset else None,
        bits,
        perms[0],
        join(super_scale),
        join(super_offset),
    )


# ----------------------------------------------------------------------------- params cache

_FIELDS = ("codes", "scale", "offset", "perm", "super_scale", "super_offset")


def to_saved(params: dict) -> tuple[dict, dict]:
    """(a params tree of arrays only, {path: [bits, layout, activations]}) for saving: each
    QuantizedWeight becomes a dict of its arrays."""
    statics = {}

    def convert(path, x):
        if isinstance(x, QuantizedWeight):
            statics[jax.tree_util.keystr(path)] = [x.bits, x.layout, x.activations]
            return {f: getattr(x, f) for f in _FIELDS if getattr(x, f) is not None}
        return x

    tree = jax.tree_util.tree_map_with_path(convert, params, is_leaf=lambda x: isinstance(x, QuantizedWeight))
    return tree, statics


def from_saved(tree: dict, statics: dict) -> dict:
    """The inverse of `to_saved`."""
    if not statics:
        return tree

    def walk(path, node):
        key = jax.tree_util.keystr(path)
        if key in statics:
            bits, layout, activations = statics[key]
            return QuantizedWeight(
                node["codes"],
                node["scale"],
                node.get("offset"),
                bits,
                layout,
                activations,
                node.get("perm"),
                node.get("super_scale"),
                node.get("super_offset"),
            )
        if isinstance(node, dict):
            return {k: walk((*path, jax.tree_util.DictKey(k)), v) for k, v in node.items()}
        if isinstance(node, list):
            return [walk((*path, jax.tree_util.SequenceKey(i)), v) for i, v in enumerate(node)]
        return node

    return walk((), tree)
