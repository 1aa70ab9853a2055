"""jaxllm's C++ GEMMs (kernels/csrc/gemm*.cc) as XLA FFI calls, and the layouts they read.

`matmul_packed` multiplies by an f32 or bf16 weight packed once by `pack_weight` (csrc/gemm.cc,
csrc/gemm_bf16.cc: AVX512_BF16 dots where the build has them, `native.has_bf16_dots()`);
`matmul_quantized` by int8 or int4 codes packed by `pack_codes` (csrc/gemm_quant.cc, and
csrc/gemm_q4a8.cc / gemm_w8a8.cc for int4 / int8 codes x int8 activations);
`matmul_quantized_bf16` by 8-bit codes or 4-bit ones packed with `pairs=True`
(csrc/gemm_quant_bf16.cc: the bf16 GEMM's numbers); `codes_to_bf16_panels` turns such codes into
the packed bf16 weight on the host. The library is built and loaded by kernels/native.py.
"""

from __future__ import annotations

import ctypes

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.kernels import native

PANEL = 16  # columns per panel of a packed weight (csrc/gemm.cc)


def pack_weight(w, transposed: bool = False, dtype=np.float32):
    """A weight w [K, N] (or, `transposed`, [N, K]: an embedding table used as the LM head)
    as the panels `matmul_packed` reads: float32 [N / 16, K, 16]; or with dtype bfloat16
    [N / 16, K / 2, 16, 2], rows 2 kp and 2 kp + 1 of a column side by side (the pairs
    AVX512_BF16's dot multiplies). N must be a multiple of 16 (and K even for bf16). A numpy
    w gives numpy panels; a jax.Array is rearranged (and cast) where it lies, by XLA, 2-6x faster
    than numpy on 2 cores: it counts in every weight update."""
    if isinstance(w, jax.Array):
        return _panels_on_device(w, transposed, np.dtype(dtype))
    w = np.asarray(w).astype(dtype, copy=False)  # a bf16 weight is rearranged without an f32 copy
    return np.ascontiguousarray(_panels(w, transposed))


def _panels(w, transposed: bool, dtype=None):
    """`pack_weight`'s rearrangement, one transpose (numpy, or jnp with the cast fused in)."""
    if dtype is not None:
        w = w.astype(dtype)
    n = w.shape[0] if transposed else w.shape[1]
    if w.dtype == np.float32:
        if transposed:  # [n, k]: panel p, row k, column c = w[16 p + c, k]
            return w.reshape(n // PANEL, PANEL, -1).transpose(0, 2, 1)
        return w.reshape(-1, n // PANEL, PANEL).transpose(1, 0, 2)
    if transposed:  # panel p, pair kp, column c, j = w[16 p + c, 2 kp + j]
        return w.reshape(n // PANEL, PANEL, -1, 2).transpose(0, 2, 1, 3)
    return w.reshape(-1, 2, n // PANEL, PANEL).transpose(2, 0, 3, 1)


_panels_on_device = jax.jit(_panels, static_argnums=(1, 2))


def packable(shape, transposed: bool = False, dtype=np.float32) -> bool:
    """Whether a 2-D weight of this shape can be packed (its output dimension splits into
    panels; for bf16, its input dimension into pairs)."""
    if len(shape) != 2:
        return False
    k, n = (shape[1], shape[0]) if transposed else shape
    return n % PANEL == 0 and (np.dtype(dtype) == np.float32 or k % 2 == 0)


def matmul_packed(
    x: jax.Array, w_packed: jax.Array, path: str = "auto", rows=None, swiglu: bool = False, lora=None
) -> jax.Array:
    """x [..., K] @ the weight packed by `pack_weight` -> [..., N] f32: with f32 panels x in f32
    (csrc/gemm.cc), with bf16 panels x rounded to bf16 and f32 sums (csrc/gemm_bf16.cc).
    `path`: as for `paged_attention_cpu` (f32: portable and AVX2 code; bf16: portable and
    AVX-512, the latter with AVX512_BF16 only). `rows` (an
    int32 scalar, may be traced): only x's first `rows` rows (of x flattened to 2-D) are
    multiplied, the rest of the result is zeros; None: all. `swiglu`: the weight is a gated
    MLP's [gate | up] (N / 2 columns each, N / 2 a multiple of 16) and the result
    `silu(x @ gate) * (x @ up)` [..., N / 2], in one pass. `lora` (bf16 panels only): a
    `lora_shrink` result and its b and panel_part, whose product joins the sums (csrc/gemm_bf16.cc's
    `LoraTerm`)."""
    native.require()
    kernel_path = native.path_attr(path)
    n = w_packed.shape[0] * PANEL // (2 if swiglu else 1)
    lead = x.shape[:-1]
    bf16 = w_packed.dtype == jnp.bfloat16
    x2 = x.reshape(-1, x.shape[-1]).astype(jnp.bfloat16 if bf16 else jnp.float32)
    call = jax.ffi.ffi_call(
        "jaxllm_matmul_packed_bf16_cpu" if bf16 else "jaxllm_matmul_packed_cpu",
        jax.ShapeDtypeStruct((x2.shape[0], n), jnp.float32),
    )
    if lora is not None and not bf16:
        raise ValueError("a LoRA term joins bf16 panels' products only")
    extra = _lora_args(lora) if bf16 else ()
    return call(x2, w_packed, native.live_rows(rows), *extra, path=kernel_path, swiglu=np.int32(swiglu)).reshape(
        *lead, n
    )


def _lora_args(lora) -> tuple:
    """The bf16 GEMMs' three LoRA arguments (csrc/gemm_bf16.cc's lora_term): (xa, b, panel_part),
    or empty arrays for none."""
    if lora is None:
        return tuple(jnp.zeros((0,), dtype) for dtype in (jnp.bfloat16, jnp.bfloat16, jnp.int32))
    xa, b, part = lora
    return xa, b, jnp.asarray(np.asarray(part, np.int32))


def lora_add(
    y: jax.Array,
    x: jax.Array,
    token_slots: jax.Array,
    a_packed,
    b_packed,
    panel_part,
    num_slots: int,
    rows=None,
    path="auto",
) -> jax.Array:
    """y [M, N] f32 plus multi-LoRA's products, each row against its own adapter only
    (csrc/lora.cc): row r gains (x[r] @ a_s) @ b_s for s = token_slots[r]; rows with s < 0 or
    past `rows` stay as they are. y is updated in place where XLA can. a_packed: each slot's a
    [K, W] packed (`pack_weight`), slot after slot along the panels ([S * W / 16, K, 16], or bf16
    [S * W / 16, K / 2, 16, 2]); b_packed every slot's [width, N] stacked along K and packed
    ([N / 16, S * width, 16], or bf16 [N / 16, S * width / 2, 16, 2]); panel_part [N / 16]:
    output panel p multiplies columns [k width, (k + 1) width) of x a_s, k = panel_part[p]. x is
    rounded to the panels' dtype."""
    native.require()
    bf16 = a_packed.dtype == jnp.bfloat16
    call = jax.ffi.ffi_call(
        "jaxllm_lora_add_bf16_cpu" if bf16 else "jaxllm_lora_add_cpu",
        jax.ShapeDtypeStruct(y.shape, jnp.float32),
        input_output_aliases={0: 0},
    )
    return call(
        y.astype(jnp.float32),
        x.astype(jnp.bfloat16 if bf16 else jnp.float32),
        token_slots.astype(jnp.int32),
        native.live_rows(rows),
        a_packed,
        b_packed,
        jnp.asarray(np.asarray(panel_part, np.int32)),
        path=native.path_attr(path),
        num_slots=np.int64(num_slots),
    )


def lora_shrink(x: jax.Array, token_slots: jax.Array, a_packed, num_slots: int, parts: int, rows=None, path="auto"):
    """Multi-LoRA's first product laid out for the bf16 GEMMs that add the second as they make
    their sums (their `lora=` argument): xa [parts, M, num_slots * width] bf16, row r's part k of
    x[r] @ a_s (s = token_slots[r]) in columns [s width, (s + 1) width), zeros elsewhere and for
    rows without a slot or past `rows` (csrc/lora.cc). a_packed as for `lora_add`, bf16."""
    native.require()
    W = a_packed.shape[0] * PANEL // num_slots
    call = jax.ffi.ffi_call(
        "jaxllm_lora_shrink_bf16_cpu", jax.ShapeDtypeStruct((parts, x.shape[0], num_slots * W // parts), jnp.bfloat16)
    )
    return call(
        x.astype(jnp.bfloat16),
        token_slots.astype(jnp.int32),
        native.live_rows(rows),
        a_packed,
        path=native.path_attr(path),
        num_slots=np.int64(num_slots),
    )


def pack_codes(
    codes: np.ndarray, bits: int, w8a8: bool = False, pairs: bool = False, quads: bool = False
) -> np.ndarray:
    """Integer codes [K, N] (int8 for 8 bits, 0..15 for 4 bits, -32..31 for 6 bits) as the panels
    `matmul_quantized` reads: int8 [N / 16, K, 16], or for 4 bits uint8 [N / 16, K, 8] with
    column j of a panel in byte j's low nibble and column j + 8 in its high nibble. `w8a8` (8
    bits, K a multiple of 4: the codes of `act8=True`): each panel's rows in groups of 4, a
    column's 4 codes side by side ([N / 16, K / 4, 16, 4] in the same [N / 16, K, 16] array), as
    the int8 dot instructions take them. `pairs` (4 bits, K a multiple of 4: the codes of
    `matmul_quantized_bf16`): uint8 [N / 16, K / 4, 32], a block of 4 rows of a panel in 32 bytes, byte
    2 c + t holding row 4 b + t of column c in its low nibble and row 4 b + 2 + t in its high one.
    `quads` (4 bits, K a multiple of 8: the codes of `act8=True`): uint8 [N / 16, K, 8], 8 rows
    of a panel in 64 bytes, byte 4 c + j holding row 8 b + j of column c in its low nibble and
    row 8 b + 4 + j in its high one (masked, each nibble half is the 16 columns' 4 codes side by
    side, as the int8 dot instructions take them). 6 bits (K a multiple of 4, for
    `matmul_quantized_bf16`): `six_bit_blocks`; with `quads` (K a multiple of 8, for
    `matmul_quantized(..., act8=True)`): `six_bit_quads`."""
    if bits == 6:
        panels = pack_codes(np.asarray(codes, np.int8), 8)
        return six_bit_quads(panels) if quads else six_bit_blocks(panels)
    k, n = codes.shape
    panels = np.asarray(codes).reshape(k, n // PANEL, PANEL).transpose(1, 0, 2)
    if quads:
        u = panels.astype(np.uint8).reshape(n // PANEL, k // 8, 2, 4, PANEL).transpose(0, 1, 2, 4, 3)
        return np.ascontiguousarray((u[:, :, 0] | (u[:, :, 1] << 4)).reshape(n // PANEL, k, PANEL // 2))
    if pairs:
        u = panels.astype(np.uint8).reshape(n // PANEL, k // 4, 2, 2, PANEL).transpose(0, 1, 2, 4, 3)
        u = u.reshape(n // PANEL, k // 4, 2, 2 * PANEL)
        return np.ascontiguousarray(u[:, :, 0] | (u[:, :, 1] << 4))
    if bits == 8 and w8a8:
        panels = panels.reshape(n // PANEL, k // 4, 4, PANEL).transpose(0, 1, 3, 2).reshape(n // PANEL, k, PANEL)
    if bits == 8:
        return np.ascontiguousarray(panels, np.int8)
    u = panels.astype(np.uint8)
    return np.ascontiguousarray(u[..., : PANEL // 2] | (u[..., PANEL // 2 :] << 4))


def quads_from_panels(panels: np.ndarray) -> np.ndarray:
    """4-bit panels of `pack_codes` (uint8 [N / 16, K, 8]) in its `quads` order, panel by panel
    (as `pairs_from_panels`)."""
    p, k, half = panels.shape
    x = panels.reshape(p, k // 8, 2, 4, half)  # rows 8 b + 4 h + j; byte c: columns c (low), c + 8 (high)
    cols = np.concatenate([x & 15, x >> 4], axis=-1).transpose(0, 1, 2, 4, 3)  # [P, K / 8, h, column, j]
    return np.ascontiguousarray((cols[:, :, 0] | (cols[:, :, 1] << 4)).reshape(p, k, half))


def pairs_from_panels(panels: np.ndarray) -> np.ndarray:
    """4-bit panels of `pack_codes` (uint8 [N / 16, K, 8]) as its `pairs` order ([N / 16, K / 4,
    32]), panel by panel: the same result as unpacking to [K, N] and packing again, without the
    two transposes across panels (every start under bf16 repacks a GGUF's 4-bit matrices so)."""
    p, k, half = panels.shape
    x = panels.reshape(p, k // 4, 4, half)  # a block's rows 4 b + r, r = 2 h + t
    low, high = x[:, :, :2], x[:, :, 2:]  # [P, K / 4, t, byte j]: columns j (low nibble), j + 8 (high)
    first = (low & 15) | (high << 4)  # columns 0-7: row t's code low, row 2 + t's high
    second = (low >> 4) | (high & 0xF0)  # columns 8-15
    both = np.concatenate([first, second], axis=-1)  # [P, K / 4, t, column]
    return np.ascontiguousarray(np.stack([both[:, :, 0], both[:, :, 1]], axis=-1).reshape(p, k // 4, 4 * half))


def six_bit_blocks(panels: np.ndarray) -> np.ndarray:
    """8-bit panels of `pack_codes` (int8 [N / 16, K, 16]) whose codes c all lie in [-32, 31] as
    6-bit codes: uint8 [N / 16, K / 4, 48], a block of 4 rows of a panel in 48 bytes. The block's
    rows (4 b, 4 b + 1) and (4 b + 2, 4 b + 3) are two runs of 32 words, word 2 c + t holding row
    t of the pair, column c, as `pairs` orders them; bytes 6 j .. 6 j + 5 hold words 4 j .. 4 j + 3
    of the first run and then of the second, c + 32 six bits a word, lowest first (repacked in
    C++, csrc/gemm_quant_bf16.cc; `six_bit_words` in csrc/gemm_quant_factored.h reads them)."""
    native.require()
    panels = np.ascontiguousarray(panels, np.int8)
    p, k, _ = panels.shape
    out = np.empty((p, k // 4, 48), np.uint8)
    ptr = lambda a: a.ctypes.data_as(ctypes.c_void_p)  # noqa: E731
    if native.library().JaxllmSixBitBlocks(ptr(panels), ctypes.c_int64(p), ctypes.c_int64(k), ptr(out)):
        raise ValueError(f"six_bit_blocks: panels {panels.shape} need K a multiple of 4 and codes in [-32, 31]")
    return out


def six_bit_quads(panels: np.ndarray) -> np.ndarray:
    """8-bit panels of `pack_codes` (int8 [N / 16, K, 16], K a multiple of 8) whose codes c all
    lie in [-32, 31] as the 6-bit codes of int8 activations (csrc/gemm_q6a8.cc): uint8 [N / 16,
    K / 8, 96], a block of 8 rows in 96 bytes, u = c + 32: its low 4 bits in the 4-bit `quads`
    order (64 bytes), then 32 bytes, byte i holding the top 2 bits of the codes in quad byte i
    (low nibble: bits 0-1, high nibble: bits 2-3) and in quad byte 32 + i (bits 4-5, 6-7)."""
    panels = np.asarray(panels)
    p, k, _ = panels.shape
    if k % 8 or panels.min(initial=0) < -32 or panels.max(initial=0) > 31:
        raise ValueError(f"six_bit_quads: panels {panels.shape} need K a multiple of 8 and codes in [-32, 31]")
    u = (panels.astype(np.int16) + 32).astype(np.uint8)
    low = quads_from_panels((u[..., :8] & 15) | ((u[..., 8:] & 15) << 4)).reshape(p, k // 8, 64)
    top = quads_from_panels((u[..., :8] >> 4) | ((u[..., 8:] >> 4) << 4)).reshape(p, k // 8, 64)
    a, b = top[..., :32], top[..., 32:]  # nibbles of quad bytes i and 32 + i
    top = (a & 3) | ((a >> 4) << 2) | ((b & 3) << 4) | ((b >> 4) << 6)
    return np.ascontiguousarray(np.concatenate([low, top], axis=-1))


def six_bit_quads_codes(blocks, xp=jnp):
    """`six_bit_quads`' inverse on [..., K / 8, 96] -> int8 [..., K, 16] (`xp`: jnp or numpy)."""
    b = xp.asarray(blocks)
    low, top = b[..., :64], b[..., 64:]
    top = xp.concatenate([(top & 3) | (((top >> 2) & 3) << 4), ((top >> 4) & 3) | ((top >> 6) << 4)], axis=-1)
    lead, nb = b.shape[:-2], b.shape[-2]
    u = [xp.stack([x & 15, x >> 4], axis=-2) for x in (low, top)]  # [..., K / 8, h, 64]: rows 4 h + j
    u = (u[0] | (u[1] << 4)).reshape(*lead, nb, 2, PANEL, 4)  # [..., K / 8, h, column, j]
    u = xp.swapaxes(u, -1, -2).reshape(*lead, 8 * nb, PANEL)
    return (u.astype(xp.int16) - 32).astype(xp.int8)


def six_bit_codes(blocks, xp=jnp):
    """`six_bit_blocks`' inverse on [..., K / 4, 48] -> int8 [..., K, 16] (`xp`: jnp or numpy)."""
    b = xp.asarray(blocks).astype(xp.uint32)
    lead, nb = b.shape[:-2], b.shape[-2]
    b = b.reshape(*lead, nb, 8, 2, 3)
    runs = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)  # [..., K / 4, j, run]
    words = (runs[..., None] >> (6 * xp.arange(4, dtype=xp.uint32))) & 63  # [..., K / 4, j, run, word]
    nd = len(lead)
    words = xp.moveaxis(words, nd + 2, nd + 1).reshape(*lead, nb, 2, PANEL, 2)  # [..., K / 4, run, c, t]
    u = xp.swapaxes(words, -1, -2).reshape(*lead, 4 * nb, PANEL)
    return (u.astype(xp.int32) - 32).astype(xp.int8)


def pack_scales(a):
    """Scales (or offsets, super-scales) [G, N] as the quantized GEMMs read them: [N / 16, G, 16],
    each panel's groups side by side (numpy or jax arrays; None stays None)."""
    if a is None:
        return None
    g, n = a.shape
    return a.reshape(g, n // PANEL, PANEL).transpose(1, 0, 2)


def unpack_scales(a):
    """`pack_scales`'s inverse: [N / 16, G, 16] -> [G, N]."""
    if a is None:
        return None
    p, g, _ = a.shape
    return a.transpose(1, 0, 2).reshape(g, p * PANEL)


def codes_to_bf16_panels(codes, scale, offset, bits: int, super_scale=None, super_offset=None) -> np.ndarray:
    """The packed bf16 weight (`pack_weight(w, dtype=bfloat16)`'s layout) of codes laid out for
    `matmul_quantized_bf16` (same arguments), each weight bf16(code * scale + offset) as that GEMM
    computes it, in one C++ pass on the host (csrc/gemm_quant_bf16.cc)."""
    native.require()
    host = lambda a: None if a is None else np.ascontiguousarray(np.asarray(a))  # noqa: E731
    codes, scale, offset, super_scale, super_offset = map(host, (codes, scale, offset, super_scale, super_offset))
    n = codes.shape[0] * PANEL
    k = codes.shape[1] * (4 if bits in (4, 6) else 1)
    groups = scale.shape[1] if scale.ndim == 3 else 0
    supers_ok = super_scale is None or (
        super_scale.ndim == 3
        and super_scale.shape[::2] == (n // PANEL, PANEL)
        and super_scale.shape[1] > 0
        and groups % super_scale.shape[1] == 0
        and (super_offset is None or super_offset.shape == super_scale.shape)
    )
    if (
        scale.shape != (n // PANEL, groups, PANEL)
        or not groups
        or k % groups
        or (offset is not None and offset.shape != scale.shape)
        or not supers_ok
    ):
        raise ValueError(f"codes_to_bf16_panels: codes {codes.shape} with scales {scale.shape} have no bf16 panels")
    out = np.empty((n // PANEL, k // 2, PANEL, 2), np.uint16)
    ptr = lambda a: None if a is None else a.ctypes.data_as(ctypes.c_void_p)  # noqa: E731
    err = native.library().JaxllmCodesToBf16Panels(
        ptr(codes),
        ctypes.c_int32(bits),
        ctypes.c_int64(k),
        ctypes.c_int64(n),
        ctypes.c_int64(groups),
        ptr(scale),
        ptr(offset),
        ctypes.c_int32(scale.dtype == np.float16),
        ptr(super_scale),
        ptr(super_offset),
        ctypes.c_int64(groups // super_scale.shape[1] if super_scale is not None else 1),
        ptr(out),
    )
    if err:
        raise ValueError(f"codes_to_bf16_panels: codes {codes.shape} with scales {scale.shape} have no bf16 panels")
    return out.view(jnp.bfloat16)


def matmul_quantized(
    x: jax.Array,
    codes: jax.Array,
    scale: jax.Array,
    offset: jax.Array | None,
    bits: int,
    path: str = "auto",
    rows=None,
    swiglu: bool = False,
    act8: bool = False,
    super_scale: jax.Array | None = None,
    super_offset: jax.Array | None = None,
    bias: jax.Array | None = None,
    act_group: int = 0,
    factored: bool = False,
) -> jax.Array:
    """x [..., K] f32 @ w -> [..., N] f32, w [K, N] given by the panels of `pack_codes`, and scale
    (and offset, or None) [G, N] laid out by `pack_scales`, f32 or f16: w[k, n] = code *
    scale[g, n] + offset[g, n] for the group g = k // (K / G) (csrc/gemm_quant.cc dequantizes a
    panel at a time; x stays f32). Two-level scales (GGUF's K-quants): scale and offset are int8
    sub-scales of `super_scale` and `super_offset`, f16 [G / S, N] (also by `pack_scales`):
    group g's scale is scale[g, n] * super_scale[g // S, n], its offset likewise. `act8`: x is
    first quantized to int8 and the products are integer sums. With 4-bit codes (K / G a
    multiple of `ACT_GROUP`) per row and group of 32 columns (q = round(x * 127 / max|x|), the
    scale max|x| / 127), as llama.cpp does (csrc/gemm_q4a8.cc); with 8-bit codes in [-127, 127],
    one scale per column and no offset (W8A8; K a multiple of 4, at most `W8A8_MAX_K`; the codes
    packed with `w8a8=True`) per row and group of `act_group` columns (0: the row whole; else a
    multiple of 4 dividing K), as `kv_write.int8_rows` does a row (csrc/gemm_w8a8.cc); `bias`,
    int32 [K / act_group (1 for 0), N] or None, is then 128 times each column's code sum over
    each group (`QuantizedWeight.bias`; None: summed in the call). `rows`, `swiglu`: as for
    `matmul_packed`. With AMX-INT8, a call of 4- or 6-bit codes x int8 rows from
    `native.int8_tile_rows()` rows (path auto or avx512) sums its products on the int8 tiles,
    the VNNI kernels' numbers exactly. A call of 4- or 6-bit codes x int8 rows takes bf16 dots
    instead from `native.act8_bf16_rows(bits)` rows (path auto; with AMX every call with path
    "amx"): x and the weights rounded to bf16, a prompt's rows faster, on AMX's tiles several
    times (csrc/gemm_codes_tiles.cc; `act8_on_bf16`). `factored` (float activations, groups of an
    even number of rows, AVX2): calls of one or two rows take each group's scale and offset out of
    their sums (csrc/gemm_quant.cc): within f32 rounding of the dequantized product, each row's
    numbers the same in either."""
    bias = jnp.zeros((0,), jnp.int32) if bias is None else bias
    return _quantized_call(
        "jaxllm_matmul_quantized_cpu",
        x.astype(jnp.float32),
        codes,
        scale,
        offset,
        super_scale,
        super_offset,
        rows,
        swiglu,
        bias,
        bits=np.int32(bits),
        path=native.path_attr(path),
        act8=np.int32(act8),
        act_group=np.int32(act_group),
        factored=np.int32(factored),
    )


def matmul_quantized_bf16(
    x: jax.Array,
    codes: jax.Array,
    scale: jax.Array,
    offset: jax.Array | None,
    bits: int,
    path: str = "auto",
    rows=None,
    swiglu: bool = False,
    super_scale: jax.Array | None = None,
    super_offset: jax.Array | None = None,
    lora=None,
    factored: bool = False,
) -> jax.Array:
    """x [..., K] @ w -> [..., N] f32 with x rounded to bf16 and w [K, N] given by 8-bit codes
    packed by `pack_codes`, 4-bit ones packed by `pack_codes(..., pairs=True)` or 6-bit ones
    (`six_bit_blocks`: builds where `native.has_six_bit_codes()`), scale/offset as
    for `matmul_quantized` (K and the groups multiples of 4 rows): each weight rounded to bf16
    as it is read and multiplied by AVX512_BF16's bf16 dot (csrc/gemm_quant_bf16.cc), the packed
    bf16 GEMM's product of the dequantized weights bit for bit. `path`: "portable" or "avx512"
    (AVX512_BF16 builds only); `rows`, `swiglu`, `lora`: as for `matmul_packed`. `factored` (4- and 6-bit
    codes, or 8-bit ones that all lie in [-64, 63], which the caller promises:
    `quantization.activations.with_factored` checks): calls of up to 16 live rows on the AVX-512
    path factor each group's scale and offset out of its sums instead
    (csrc/gemm_quant_factored.h): exact products and f32 sums, not the bf16 GEMM's numbers;
    other calls are unchanged."""
    return _quantized_call(
        "jaxllm_matmul_quantized_bf16_cpu",
        x.astype(jnp.bfloat16),
        codes,
        scale,
        offset,
        super_scale,
        super_offset,
        rows,
        swiglu,
        *_lora_args(lora),
        bits=np.int32(bits),
        path=native.path_attr(path),
        factored=np.int32(factored),
    )


def _quantized_call(
    target: str, x, codes, scale, offset, super_scale, super_offset, rows, swiglu: bool, *extra, **attrs
):
    """The quantized GEMMs' FFI call: x [..., K] (in the kernel's dtype) -> [..., N] f32, absent
    offsets and super-scales as empty arrays; `extra` arrays go after them."""
    native.require()
    n = codes.shape[0] * PANEL // (2 if swiglu else 1)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    offset = jnp.zeros((0,), scale.dtype) if offset is None else offset
    supers = [jnp.zeros((0,), jnp.float16) if a is None else a for a in (super_scale, super_offset)]
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((x2.shape[0], n), jnp.float32))
    return call(
        x2, codes, scale, offset, *supers, *extra, native.live_rows(rows), swiglu=np.int32(swiglu), **attrs
    ).reshape(*lead, n)


def act8_on_bf16(path: str, rows: int, bits: int) -> bool:
    """Whether `matmul_quantized(..., act8=True)` over codes of `bits` (4 or 6) multiplies a call of
    `rows` rows on bf16 dots (x and the weights rounded to bf16: AMX's tiles or VDPBF16PS) rather
    than as int8 rows."""
    if path == "amx":  # (every call, on the tiles)
        return "amx" in native.kernel_paths()
    from_rows = native.act8_bf16_rows(bits)
    return path == "auto" and from_rows > 0 and rows >= from_rows


ACT_GROUP = 32  # columns of x per int8 scale with `matmul_quantized(..., act8=True)` and 4-bit codes
W8A8_MAX_K = 131072  # the largest K of 8-bit codes x int8 rows (csrc/gemm_w8a8.cc: exact int32 sums)
