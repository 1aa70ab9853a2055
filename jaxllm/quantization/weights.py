"""Quantized weight matrices: the pytree leaf type, quantizing on load, and the matmul (see
the package docstring for the methods and paths)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

# method -> (bits, rows of K per scale group; None: one group, a scale per output channel)
METHODS = {"int8": (8, None), "int8_weight_only": (8, None), "int4": (4, 32), "w8a8": (8, None)}
# Methods whose quantized weights come from the checkpoint as they are (models/loader.py).
CHECKPOINT_METHODS = ("gguf", "awq", "gptq")
# A layer's linears by their params names (models/decoder.py; the weight plan's `LINEARS` adds
# the LM head and a tied embedding), and the MoE experts' stacks [E, K, N] (weight-only codes,
# plain layout, whatever the method: models/moe.py dequantizes them).
LAYER_MATRICES = ("wqkv", "wo", "w_gate_up", "w_up", "w_down")
EXPERT_MATRICES = ("experts_gate_up", "experts_down")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class QuantizedWeight:
    """A weight w [K, N] (K inputs, N outputs) as integer codes with scales:
    w[k, n] = code[k, n] * scale[g, n] (+ offset[g, n]) for the group g = k // (K / G).

    codes: `layout="plain"`: int8 [K, N] (8 bits), or uint8 [K, N / 2] holding two 4-bit codes
        (column j in the low nibble, column j + N / 2 in the high one);
        `layout="panels"`: as `kernels.gemm.pack_codes` lays them out for the C++ GEMM (with
        `w8a8=True` for 8-bit codes that multiply int8 activations: `_w8a8_panels`; with
        `pairs=True` for 4-bit codes that multiply bf16 activations: `_bf16_pairs`; with
        `quads=True` for 4-bit codes that multiply int8 activations: `_int8_quads`; `bits=6`:
        8-bit codes within [-32, 31] in 6 bits, `gemm.six_bit_blocks` for bf16 activations (made
        by `with_factored`), `gemm.six_bit_quads` for int8 ones (`with_int8_activations`)).
    scale, offset: [G, N], f32 (8 bits) or f16 (4 bits); offset is None for symmetric codes
        (the 8-bit ones). In the "panels" layout these and the super-scales are stored as
        `kernels.gemm.pack_scales` lays them out ([N / 16, G, 16]: each panel's in one run);
        `group_scales` gives them back as [G, N].
    activations: "int8" multiplies as W8A8 (x quantized per row and group of `act_group`
        columns, int8 dots; with 4-bit panels, per row and group of 32:
        `with_int8_activations`), "float" as
        weight-only (x stays f32), "bf16" as weight-only with x and the dequantized weights
        rounded to bf16 (panels on AVX512_BF16 CPUs under dtype bfloat16:
        `with_bf16_activations`; the packed bf16 GEMM's numbers).
    perm: None, or int32 [K] (GPTQ's act-order): the codes' row i is the weight's row perm[i],
        so that the groups are contiguous; x's columns are taken in that order first.
    super_scale, super_offset: None, or (GGUF's K-quants, two-level scales) f16 [G / S, N] with
        scale and offset int8 sub-scales [G, N]: group g's scale is
        scale[g, n] * super_scale[g // S, n] (exact in f32), its offset likewise
        (`group_scales`). super_offset is None when offset is.
    bias: None, or (W8A8 panels, `_w8a8_panels`) int32 [K / act_group (1 for 0), N]: 128 times
        each column's code sum over each group, what `vpdpbusd`'s unsigned activations (q + 128)
        add to the sums, taken once at packing (None: the C++ GEMM sums the codes on every call).
    act_group: W8A8's columns of x per int8 scale (`w8a8_act_group`); 0: a scale per row.
    factored: panel codes whose calls of up to 16 rows (float activations: 2) factor each
        group's scale and offset out of its sums (`factored=True` of `gemm.matmul_quantized_bf16`
        or `gemm.matmul_quantized`; `EngineArgs.small_step_factored`): f32 sums, not the
        dequantized GEMM's numbers. Set by `with_factored` (8-bit codes x bf16: within [-64, 63]).
    """

    codes: jax.Array
    scale: jax.Array
    offset: jax.Array | None
    bits: int = dataclasses.field(metadata=dict(static=True))
    layout: str = dataclasses.field(metadata=dict(static=True))
    activations: str = dataclasses.field(metadata=dict(static=True))
    perm: jax.Array | None = None
    super_scale: jax.Array | None = None
    super_offset: jax.Array | None = None
    bias: jax.Array | None = None
    act_group: int = dataclasses.field(default=0, metadata=dict(static=True))
    path: str = dataclasses.field(default="auto", metadata=dict(static=True))  # the C++ GEMM's kernel path
    factored: bool = dataclasses.field(default=False, metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, int]:
        """(K, N), as the float weight's (of each matrix of a stack)."""
        if self.layout == "panels":
            rows = 8 if _six_quads(self) else 4 if _bf16_pairs(self) or self.bits == 6 else 1
            return self.codes.shape[1] * rows, self.codes.shape[0] * _PANEL
        return self.codes.shape[-2], self.scale.shape[-1]

    @property
    def groups(self) -> int:
        """G: the scale groups along K."""
        return self.scale.shape[1 if self.layout == "panels" else -2]

    # The linear-weight protocol (models/linear.py).
    def apply(self, x, *, axis=None, rows=None, swiglu=False, lora=None):
        return matmul(x, self, axis, rows, swiglu, lora)

    @property
    def input_dtype(self):
        """bf16 for codes that multiply bf16 activations (the rounding a norm before does once)."""
        return jnp.bfloat16 if self.layout == "panels" and self.activations == "bf16" else jnp.float32

    @property
    def fuses_swiglu(self) -> bool:
        """C++ panels whose gate and up halves are whole panels."""
        return self.layout == "panels" and self.codes.shape[0] % 2 == 0

    @property
    def takes_lora(self) -> bool:
        """Codes x bf16 rows (`matmul_quantized_bf16`: its `lora` argument)."""
        return self.layout == "panels" and self.activations == "bf16" and self.perm is None

    def embedding_rows(self, token_ids):
        return embedding_rows(self, token_ids)

    def first_columns(self, n: int) -> QuantizedWeight:
        """The weight of the first n outputs (`linear.first_columns`): the first n / 16 panels,
        or plain codes' first columns (4-bit plain codes repacked)."""
        if self.layout == "plain":
            cut = permute_columns(self, np.arange(n))
            return jax.device_put(cut, self.codes.sharding) if isinstance(self.codes, jax.Array) else cut
        fields = ("codes", "scale", "offset", "super_scale", "super_offset")
        panels = {f: None if getattr(self, f) is None else getattr(self, f)[: n // _PANEL] for f in fields}
        return dataclasses.replace(self, **panels, bias=None if self.bias is None else self.bias[..., :n])


def quantize_matrix(w: np.ndarray, bits: int, group_size: int | None):
    """w [K, N] float -> (codes [K, N], scale [G, N], offset [G, N] or None).

    8 bits: symmetric, codes in [-127, 127], scale = max|w| / 127 per group and column (f32).
    4 bits: affine, codes in [0, 15], offset = the group's minimum, scale = its range / 15 (f16).
    `group_size` rows of K per group (None: all of K); a K it does not divide gets one group."""
    w = np.asarray(w, np.float32)
    k, n = w.shape
    groups = 1 if group_size is None or k % group_size else k // group_size
    # Codes are rounded in float64 against the scales as stored (f32 or f16).
    wg = w.reshape(groups, k // groups, n).astype(np.float64)
    if bits == 8:
        scale = (np.abs(wg).max(axis=1) / 127.0).astype(np.float32)
        scale[scale == 0] = 1.0
        codes = np.clip(np.rint(wg / scale[:, None]), -127, 127).astype(np.int8)
        return codes.reshape(k, n), scale, None
    if bits != 4:
        raise ValueError(f"{bits}-bit codes are not supported (8 or 4)")
    # f16 scales and offsets (as GGUF's Q4_1 keeps its d and m): 5 bits a weight, not 6.
    lo = wg.min(axis=1).astype(np.float16)
    scale = ((wg.max(axis=1) - lo) / 15.0).astype(np.float16)
    scale[scale == 0] = 1.0
    codes = np.clip(np.rint((wg - lo[:, None]) / scale[:, None]), 0, 15).astype(np.uint8)
    return codes.reshape(k, n), scale, lo


def permute_columns(w: QuantizedWeight, index: np.ndarray) -> QuantizedWeight:
    """The plain-layout weight whose column j is w's column index[j] (a checkpoint's quantized
    matrix regrouped for tensor parallelism: `layout.tp_layout`; a draft's LM head cut to its
    first columns: `QuantizedWeight.first_columns`), as host arrays."""
    codes = _unpacked_codes(w, np)[:, index]
    fields = ("scale", "offset", "super_scale", "super_offset")
    columns = {f: None if getattr(w, f) is None else np.asarray(getattr(w, f))[:, index] for f in fields}
    codes = _pack_plain_int4(codes) if w.bits == 4 else codes
    perm = None if w.perm is None else np.asarray(w.perm)
    return QuantizedWeight(codes, bits=w.bits, layout="plain", activations=w.activations, perm=perm, **columns)


def _pack_plain_int4(codes: np.ndarray) -> np.ndarray:  # columns j (low nibble) and j + N / 2 (high)
    return np.ascontiguousarray(codes[:, : codes.shape[1] // 2] | (codes[:, codes.shape[1] // 2 :] << 4))


def make_weight(
    w: np.ndarray, method: str, *, panels: bool, activations: str, device=None, group_size: int | None = None
) -> QuantizedWeight:
    """Quantize w [K, N] by `method` into a QuantizedWeight on `device`: packed for the C++
    GEMM when `panels` (and N allows it), else plain; `group_size` rows a group where given,
    else the method's (`METHODS`)."""
    from jaxllm.kernels import gemm

    bits, default_group = METHODS[method]
    group_size = group_size or default_group
    codes, scale, offset = quantize_matrix(w, bits, group_size)
    k, n = codes.shape
    if activations == "int8" and (bits != 8 or scale.shape[0] != 1):
        raise ValueError("W8A8 needs 8-bit codes with one scale per output channel")
    layout = "panels" if panels and _fits_panels(k, n, activations) else "plain"
    bias, act_group = None, w8a8_act_group(k) if activations == "int8" else 0
    if layout == "panels":
        bias = _w8a8_bias(codes, act_group) if activations == "int8" else None
        codes = gemm.pack_codes(codes, bits, w8a8=activations == "int8")
        scale, offset = gemm.pack_scales(scale), gemm.pack_scales(offset)
    elif bits == 4:
        if n % 2:
            raise ValueError(f"4-bit codes need an even number of columns, not {n}")
        codes = _pack_plain_int4(codes)
    put = functools.partial(jax.device_put, device=device)
    return QuantizedWeight(
        put(codes),
        put(scale),
        None if offset is None else put(offset),
        bits,
        layout,
        activations,
        bias=put(bias),
        act_group=act_group,
    )


# W8A8's activations: an int8 scale per row and group of up to this many columns. A scale per row
# cost the default model 1.1-1.4% perplexity (its MLP's act(gate) * up has a few large channels);
# groups of 192 and 256 columns took most of that back for 3-4% of the layer GEMMs' time, groups
# of 64 the rest of it for 7-10% (benchmarks/results/zen4/RESULTS.md).
W8A8_ACT_GROUP = 256


def w8a8_act_group(k: int, rows: int = 1) -> int:
    """`QuantizedWeight.act_group` of a W8A8 weight with k rows: the largest multiple of 32 up to
    W8A8_ACT_GROUP that divides k, else 0 (a scale per row, as also when that group is the whole
    row). Split along its rows into `rows` shards: the same where it divides a shard's rows (a
    scale per row, 0, is taken over every shard), else the shard's own (other groups than one
    device's)."""
    group = next((b for b in range(W8A8_ACT_GROUP, 0, -32) if k % b == 0), 0)
    group = 0 if group == k else group
    return w8a8_act_group(k // rows) if group and (k // rows) % group else group


def _w8a8_bias(codes: np.ndarray, act_group: int) -> np.ndarray:
    """`QuantizedWeight.bias` of W8A8 codes [K, N]: int32 [K / act_group (1 for 0), N], 128 times
    each column's sum over each group."""
    codes = np.asarray(codes, np.int64)
    k, n = codes.shape
    return (128 * codes.reshape(k // (act_group or k), -1, n).sum(axis=1)).astype(np.int32)


def _fits_panels(k: int, n: int, activations: str) -> bool:
    """Whether a [K, N] weight goes into the C++ GEMM's panels: weight-only, or W8A8 (8-bit
    codes x int8 rows, csrc/gemm_w8a8.cc) with K a multiple of 4 up to `gemm.W8A8_MAX_K`."""
    from jaxllm.kernels import gemm

    return gemm.packable((k, n)) and (activations == "float" or (k % 4 == 0 and k <= gemm.W8A8_MAX_K))


def _unpacked_codes(w: QuantizedWeight, xp=jnp):
    """The codes [..., K, N], one a byte, as `xp` (jnp inside a step, numpy on the host) arrays."""
    c = xp.asarray(w.codes)
    if w.bits == 6:  # [P, K / 4, 48] or [P, K / 8, 96] -> [P, K, 16] -> [K, N]
        from jaxllm.kernels import gemm

        c = gemm.six_bit_quads_codes(c, xp) if _six_quads(w) else gemm.six_bit_codes(c, xp)
        return xp.transpose(c, (1, 0, 2)).reshape(c.shape[1], -1)
    if _bf16_pairs(w) or _int8_quads(w):  # [P, K / 2r, 16 r] -> [P, K / 2r, 2 halves, 16, r] -> [K, N]
        r, p, k = 2 if _bf16_pairs(w) else 4, c.shape[0], c[0].size // 8
        c = c.reshape(p, k // (2 * r), _PANEL * r)
        c = xp.stack([c & 15, c >> 4], axis=2).reshape(p, k // (2 * r), 2, _PANEL, r)
        c = xp.transpose(c, (0, 1, 2, 4, 3)).reshape(p, k, _PANEL)
        return xp.transpose(c, (1, 0, 2)).reshape(k, -1)
    if w.layout == "panels":
        if w.bits == 4:
            c = xp.concatenate([c & 15, c >> 4], axis=-1)
        if _w8a8_panels(w):  # [P, K / 4, 16, 4] -> [P, K, 16]
            p, k, n = c.shape
            c = xp.transpose(c.reshape(p, k // 4, n, 4), (0, 1, 3, 2)).reshape(p, k, n)
        c = xp.transpose(c, (1, 0, 2)).reshape(c.shape[1], -1)
    elif w.bits == 4:
        c = xp.concatenate([c & 15, c >> 4], axis=-1)
    return c


_PANEL = 16  # columns of a C++ GEMM panel (kernels.gemm.PANEL)


def _bf16_pairs(w: QuantizedWeight) -> bool:
    """Whether w's codes are 4-bit panels in the row-pairs order of the bf16 C++ GEMM
    (`kernels.gemm.matmul_quantized_bf16`; its 8-bit codes are the usual panels)."""
    return w.layout == "panels" and w.bits == 4 and w.activations == "bf16"


def _int8_quads(w: QuantizedWeight) -> bool:
    """Whether w's codes are 4-bit panels in the order of `pack_codes(..., quads=True)`, for int8
    activations (`matmul_quantized(..., act8=True)`)."""
    return w.layout == "panels" and w.bits == 4 and w.activations == "int8"


def _six_quads(w: QuantizedWeight) -> bool:
    """Whether w's codes are 6-bit ones for int8 activations (`gemm.six_bit_quads`)."""
    return w.layout == "panels" and w.bits == 6 and w.activations == "int8"


def _w8a8_panels(w: QuantizedWeight) -> bool:
    """Whether w's codes are 8-bit panels in the row-groups-of-4 order of W8A8's C++ GEMM."""
    return w.layout == "panels" and w.bits == 8 and w.activations == "int8"


def two_level(sub, sup, axis: int, xp=jnp):
    """Sub-scales (int8, G along `axis`) times their super-scales (f16, G / S along `axis`),
    as f32; `sub` as it is when `sup` is None (one level)."""
    if sup is None or sub is None:
        return sub
    rep = sub.shape[axis] // sup.shape[axis]
    return xp.asarray(sub).astype(xp.float32) * xp.repeat(xp.asarray(sup).astype(xp.float32), rep, axis=axis)


def group_scales(w: QuantizedWeight, xp=jnp, take=None):
    """w's (scale, offset or None) [..., G, N], two-level scales multiplied out (f32); `take`
    first selects from each array as it is stored (e.g. columns; the default takes all, as
    [..., G, N])."""
    if take is None:
        take = _scales_gn if w.layout == "panels" else lambda a: a
    pick = lambda a: None if a is None else take(a)  # noqa: E731
    return (
        two_level(pick(w.scale), pick(w.super_scale), -2, xp),
        two_level(pick(w.offset), pick(w.super_offset), -2, xp),
    )


def group_scale_fields(w: QuantizedWeight, xp=jnp) -> list:
    """w's scale, offset, super_scale and super_offset as stored in the plain layout ([..., G, N]
    and [..., G / S, N]; None where absent), as `xp` arrays."""
    unpack = _scales_gn if w.layout == "panels" else lambda a: a
    return [None if a is None else unpack(xp.asarray(a)) for a in (w.scale, w.offset, w.super_scale, w.super_offset)]


def flat_scales(w: QuantizedWeight) -> QuantizedWeight:
    """w with two-level scales multiplied out into f32 ones (host arrays), for the paths that
    take one level (sharding, stacking pipeline stages, the GPU kernel: `relayout`); w itself when it
    has one level."""
    if w.super_scale is None:
        return w
    scale, offset = group_scales(w, np)
    if w.layout == "panels":
        scale, offset = _scales_as(scale, w.layout), _scales_as(offset, w.layout)
    return dataclasses.replace(w, scale=scale, offset=offset, super_scale=None, super_offset=None)


def _scales_gn(a):
    """Scales stored panel-major ([N / 16, G, 16]) as [G, N]."""
    from jaxllm.kernels import gemm

    return gemm.unpack_scales(a)


def _scales_as(a, layout: str):
    """Scales [G, N] as the layout stores them (host arrays)."""
    from jaxllm.kernels import gemm

    return gemm.pack_scales(a) if layout == "panels" and a is not None else a


def dequantize(w: QuantizedWeight, xp=jnp) -> jax.Array:
    """The f32 weight [..., K, N] the codes stand for (its rows in `perm` order when there is one),
    as an `xp` array (numpy on the host: each product is exact in f32 and the offset's add rounds
    once, as GGUF's own dequantization computes)."""
    codes = _unpacked_codes(w, xp).astype(xp.float32)
    scale, offset = group_scales(w, xp)
    rows = codes.shape[-2] // scale.shape[-2]
    out = codes * xp.repeat(xp.asarray(scale).astype(xp.float32), rows, axis=-2)
    return out if offset is None else out + xp.repeat(xp.asarray(offset).astype(xp.float32), rows, axis=-2)


def matmul(x: jax.Array, w: QuantizedWeight, axis=None, rows=None, swiglu: bool = False, lora=None) -> jax.Array:
    """x [..., K] f32 @ w -> [..., N] f32 (the paths: see the package docstring). `axis`: the
    tensor-parallel mesh axis when w is a row-parallel shard (x holds a slice of K): W8A8 then
    scales each row by its largest |x| over every shard, as one device would. `rows`: see
    `models.linear.apply`; `swiglu` too, for the "panels" layout only (`fuses_swiglu`); `lora`
    for codes x bf16 rows only (`takes_lora`)."""
    if lora is not None and not w.takes_lora:
        raise ValueError("a LoRA term joins the products of codes x bf16 rows only")
    if w.perm is not None:
        x = jnp.take(x, w.perm, axis=-1)
    if w.layout == "panels":
        from jaxllm.kernels import gemm

        args = (x, w.codes, w.scale, w.offset, w.bits)
        both = dict(rows=rows, swiglu=swiglu, super_scale=w.super_scale, super_offset=w.super_offset, path=w.path)
        if w.activations == "bf16":
            return gemm.matmul_quantized_bf16(*args, **both, lora=lora, factored=w.factored)
        act8 = w.activations == "int8"
        return gemm.matmul_quantized(*args, **both, act8=act8, bias=w.bias, act_group=w.act_group, factored=w.factored)
    assert not swiglu, "the SwiGLU epilogue needs the panels layout"
    if w.activations == "int8":
        return _w8a8_plain(x, w, axis)
    if _platform() == "gpu":  # the codes dequantized tile by tile in a Pallas (Triton) kernel
        from jaxllm.kernels import quant_matmul

        k, n = w.shape
        if quant_matmul.supported(k, n, w.groups, w.bits):  # (two-level scales: flat since `relayout`)
            return quant_matmul.quantized_matmul(x, w.codes, *group_scales(w), bits=w.bits)
    return jnp.dot(x.astype(jnp.float32), dequantize(w), preferred_element_type=jnp.float32)


def _w8a8_plain(x: jax.Array, w: QuantizedWeight, axis) -> jax.Array:
    """x [..., K] @ a plain W8A8 weight in XLA: x's rows quantized per group of w.act_group
    columns (or whole, each scaled by its largest |x| over every shard of a row-parallel weight),
    int8 dots of each group, the f32 sums over the groups scaled by the columns' scales."""
    from jaxllm.kernels.kv_write import int8_rows

    if not w.act_group:
        amax = None if axis is None else jax.lax.pmax(jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1), axis)
        xq, x_scale = int8_rows(x, amax)
        acc = jax.lax.dot_general(xq, w.codes, (((x.ndim - 1,), (0,)), ((), ())), preferred_element_type=jnp.int32)
        return acc.astype(jnp.float32) * x_scale[..., None] * w.scale[0]
    k, n = w.codes.shape
    groups = k // w.act_group
    xq, x_scale = int8_rows(x.reshape(*x.shape[:-1], groups, w.act_group))  # [..., groups, B], [..., groups]
    acc = jnp.einsum("...bk,bkn->...bn", xq, w.codes.reshape(groups, w.act_group, n), preferred_element_type=jnp.int32)
    return jnp.einsum("...bn,...b->...n", acc.astype(jnp.float32), x_scale) * w.scale[0]


def _platform() -> str:
    """The platform arrays land on by default: `jax.default_device`'s where one is set (a CPU
    device on a GPU machine runs the CPU paths), else the default backend's."""
    device = jax.config.jax_default_device
    if device is None:
        return jax.default_backend()
    return device if isinstance(device, str) else device.platform


def embedding_rows(w: QuantizedWeight, token_ids: jax.Array) -> jax.Array:
    """Rows [T, K] f32 of a tied embedding table stored as its LM head (token t is column t)."""
    t = token_ids
    c = w.codes
    assert not (_bf16_pairs(w) or _int8_quads(w) or _six_quads(w)), "pairs and quads: layer matrices, not tables"
    if w.layout == "panels":
        col = t % 16
        if w.bits == 6:  # the tokens' panels' codes [T, K, 16], then each token's column
            from jaxllm.kernels import gemm

            codes = jnp.take_along_axis(gemm.six_bit_codes(c[t // 16]), col[:, None, None], axis=2)[..., 0]
        elif _w8a8_panels(w):
            p, k, n = c.shape
            codes = c.reshape(p, k // 4, n, 4)[t // 16, :, col, :].reshape(t.shape[0], k)
        elif w.bits == 8:
            codes = c[t // 16, :, col]
        else:
            byte = c[t // 16, :, col % 8]
            codes = jnp.where((col >= 8)[:, None], byte >> 4, byte & 15)
    elif w.bits == 8:
        codes = c[:, t].T
    else:
        half = c.shape[1]
        byte = c[:, t % half].T
        codes = jnp.where((t >= half)[:, None], byte >> 4, byte & 15)
    take = (lambda a: a[t // 16, :, t % 16].T) if w.layout == "panels" else (lambda a: a[:, t])
    scale, offset = group_scales(w, take=take)
    rows = codes.shape[1] // scale.shape[0]
    out = codes.astype(jnp.float32) * jnp.repeat(scale.T.astype(jnp.float32), rows, axis=1)
    out = out if offset is None else out + jnp.repeat(offset.T.astype(jnp.float32), rows, axis=1)
    # With bf16 activations, the rows of a bf16 table (the packed bf16 engine's numbers).
    return out.astype(jnp.bfloat16).astype(jnp.float32) if w.activations == "bf16" else out


def relayout(w: QuantizedWeight, panels: bool, device=None) -> QuantizedWeight:
    """A QuantizedWeight in the packed layout of the C++ GEMM when `panels` (and its shape allows
    it: `_fits_panels`), else plain; on `device`."""
    from jaxllm.kernels import gemm

    k, n = w.shape
    panels = panels and _fits_panels(k, n, w.activations)
    if not panels and w.layout == "panels" and (w.bits == 6 or _int8_quads(w)):
        raise ValueError(f"{w.bits}-bit codes for {w.activations} activations live in the C++ GEMM's panels only")
    if not panels and (device.platform if device is not None else _platform()) == "gpu":
        w = flat_scales(w)  # once here, not in every step: the Pallas kernel takes one level
    if (w.layout == "panels") == panels:
        return jax.device_put(w, device)
    codes = _unpacked_codes(w, np)  # on the host: jnp ops here would compile a program per shape
    bias = _w8a8_bias(codes, w.act_group) if panels and w.bits == 8 and w.activations == "int8" else None
    if panels:
        int8 = w.activations == "int8"
        codes = gemm.pack_codes(codes, w.bits, w8a8=int8 and w.bits == 8, quads=int8 and w.bits in (4, 6))
    elif w.bits == 4:
        codes = _pack_plain_int4(codes)
    layout = "panels" if panels else "plain"
    put = functools.partial(jax.device_put, device=device)
    scales = [_scales_as(a, layout) for a in group_scale_fields(w, np)]
    return QuantizedWeight(
        put(codes),
        *map(put, scales[:2]),
        w.bits,
        layout,
        w.activations,
        put(w.perm),
        *map(put, scales[2:]),
        put(bias),
        w.act_group,
    )
