"""Writing new keys/values into the paged KV cache, and the cache's storage formats.

Pages are `[num_kv_heads, num_pages, page_size, row]`, a row per token and head:

- float32: `row = head_dim` floats;
- bfloat16: *stored* as uint16 bit patterns: XLA:CPU lowers a bf16 scatter as "convert the
  whole pool to f32, scatter, convert back" (12 ms per layer for a 12 MB pool), while a uint16
  scatter into a donated buffer is in place (0.02 ms). The bitcast between the two is free;
- int8 (`kv_cache_dtype="int8"`): `row = head_dim + 4` int8: the row's codes, then the 4 bytes
  of its f32 scale (symmetric, max |x| / 127 per token and head); value = code * scale. One
  array per page pool, as for the float caches, so page copies and swaps move the scales with
  the codes; half a bf16 row and a quarter of an f32 one, plus 4 bytes.
- fp8 (`kv_cache_dtype="fp8_e4m3"`): the same row layout with float8 E4M3 (OCP "e4m3fn": 4
  exponent bits, 3 mantissa bits, largest 448, no infinities) codes, stored as their uint8 bit
  patterns, and scale = max |x| / 448; value = code * scale. Where int8's 255 steps are even
  over [-max, max], E4M3's are relative (6-12% apart at every magnitude down to about 2^-15 of
  the row's largest), so small entries of a row keep more of their precision and large ones less.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Bytes after a quantized row's codes (int8 or fp8): its f32 scale.
INT8_SCALE_BYTES = 4
# The largest fp8 (E4M3) code's value: a row's largest |x| maps onto it.
FP8_MAX = 448.0


def cache_dtype(name: str) -> jnp.dtype:
    """The logical dtype of a cache named as `CacheConfig.dtype` ("float32", "bfloat16", "int8",
    "fp8_e4m3")."""
    return jnp.dtype(
        {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "int8": jnp.int8, "fp8_e4m3": jnp.float8_e4m3fn}[name]
    )


def storage_dtype(dtype) -> jnp.dtype:
    """The dtype a cache of logical `dtype` is stored in: bf16 as uint16 bits, fp8 as uint8 bits."""
    dtype = jnp.dtype(dtype)
    return jnp.dtype({jnp.dtype(jnp.bfloat16): jnp.uint16, jnp.dtype(jnp.float8_e4m3fn): jnp.uint8}.get(dtype, dtype))


def quantized_rows(dtype) -> bool:
    """Whether pages of (logical or storage) `dtype` hold codes and a scale per row (int8, fp8)."""
    return jnp.dtype(dtype) in (jnp.dtype(jnp.int8), jnp.dtype(jnp.uint8), jnp.dtype(jnp.float8_e4m3fn))


def row_width(head_dim: int, dtype) -> int:
    """Elements of a cache row (one token, one head) in storage."""
    return head_dim + INT8_SCALE_BYTES if quantized_rows(dtype) else head_dim


def _row_scales(x: jax.Array, top: float, amax: jax.Array | None = None) -> jax.Array:
    """x [..., D] (f32) -> a scale per row, max |x| (or `amax`) / top; 1 for a zero row. Times the
    f32 reciprocal, not divided: XLA rewrites a division by a constant so, and the C++ KV write
    (csrc/kv_write.cc) must store the same scale."""
    scale = (jnp.max(jnp.abs(x), axis=-1) if amax is None else amax) * (1.0 / top)
    return jnp.where(scale > 0, scale, 1.0)


def int8_rows(x: jax.Array, amax: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """x [..., D] -> (int8 codes [..., D], f32 scales [...]): symmetric, a scale of max |x| / 127
    per row (1 for a zero row), or of `amax` [...] when given. The int8 KV cache's rows, and
    W8A8's activations."""
    x = x.astype(jnp.float32)
    scale = _row_scales(x, 127.0, amax)
    return jnp.clip(jnp.round(x / scale[..., None]), -127, 127).astype(jnp.int8), scale


def fp8_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [..., D] -> (E4M3 codes as uint8 bits [..., D], f32 scales [...]): a scale of
    max |x| / 448 per row (1 for a zero row), each x / scale rounded to the nearest E4M3 value."""
    x = x.astype(jnp.float32)
    scale = _row_scales(x, FP8_MAX)
    codes = jnp.clip(x / scale[..., None], -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
    return jax.lax.bitcast_convert_type(codes, jnp.uint8), scale


def fp8_bits_to_f32(bits: jax.Array) -> jax.Array:
    """E4M3 codes as integer bits (any int dtype, 0..255) -> their f32 values, with integer ops
    and a same-width bitcast only (what a Triton kernel can lower; exact, NaN codes excepted:
    none is ever written). A normal code's exponent and mantissa bits, shifted into an f32's and
    rebiased (7 -> 127), are its value; the subnormals (exponent 0) are mantissa * 2^-9."""
    bits = bits.astype(jnp.int32) & 0xFF
    mag = bits & 0x7F
    normal = jax.lax.bitcast_convert_type((mag << 20) + (120 << 23), jnp.float32)
    value = jnp.where(mag < 8, mag.astype(jnp.float32) * 2.0**-9, normal)
    return jnp.where(bits >= 0x80, -value, value)


def quantize_rows(x: jax.Array, dtype=jnp.int8) -> jax.Array:
    """x [..., head_dim] -> rows [..., head_dim + 4] of `dtype`'s storage: the codes (int8, or
    fp8 E4M3 bits as uint8), then the bytes of the f32 scale."""
    codes, scale = fp8_rows(x) if jnp.dtype(dtype) != jnp.int8 else int8_rows(x)
    return jnp.concatenate([codes, jax.lax.bitcast_convert_type(scale, codes.dtype)], axis=-1)


def int8_row_scales(rows: jax.Array) -> jax.Array:
    """Quantized rows [..., head_dim + 4] (int8 or fp8) -> their f32 scales [...]."""
    return jax.lax.bitcast_convert_type(rows[..., -INT8_SCALE_BYTES:], jnp.float32)


def logical_pages(pages: jax.Array) -> jax.Array:
    """View stored pages (or a gather of them) in their logical dtype (int8 and fp8: dequantized
    to f32)."""
    if pages.dtype == jnp.uint16:
        return jax.lax.bitcast_convert_type(pages, jnp.bfloat16)
    if pages.dtype == jnp.int8:
        return pages[..., :-INT8_SCALE_BYTES].astype(jnp.float32) * int8_row_scales(pages)[..., None]
    if pages.dtype == jnp.uint8:
        codes = jax.lax.bitcast_convert_type(pages[..., :-INT8_SCALE_BYTES], jnp.float8_e4m3fn)
        return codes.astype(jnp.float32) * int8_row_scales(pages)[..., None]
    return pages


def to_storage(x: jax.Array, storage: jnp.dtype) -> jax.Array:
    if storage == jnp.uint16:
        return jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16)
    if quantized_rows(storage):
        return quantize_rows(x, storage)
    return x.astype(storage)


def write_kv(k_pages, v_pages, k_new, v_new, slot_mapping):
    """Scatter this step's keys/values into their slots.

    k_new, v_new: [T, num_kv_heads, head_dim]; slot_mapping: [T] int32 flat slot
    `page * page_size + offset`. A negative slot marks a padding token: it is dropped and
    writes nowhere. Donate the pages to the enclosing jit so the update is in place.
    """
    num_kv_heads, num_pages, page_size, row = k_pages.shape
    num_slots = num_pages * page_size
    # Out-of-range index + mode="drop" skips padding (a negative index would wrap around).
    slots = jnp.where(slot_mapping < 0, num_slots, slot_mapping)

    def write(pages, new):
        flat = pages.reshape(num_kv_heads, num_slots, row)
        new = to_storage(new, pages.dtype).transpose(1, 0, 2)
        flat = flat.at[:, slots].set(new, mode="drop")
        return flat.reshape(pages.shape)

    return write(k_pages, k_new), write(v_pages, v_new)


def allocate_kv_cache(num_layers, num_kv_heads, num_pages, page_size, head_dim, dtype, zeros=jnp.zeros):
    """A zeroed cache: list over layers of `(k_pages, v_pages)` in storage dtype (`zeros(shape,
    dtype)` makes each array: `native.zeros` puts a CPU pool on 2 MiB pages)."""
    shape = (num_kv_heads, num_pages, page_size, row_width(head_dim, dtype))
    store = storage_dtype(dtype)
    return [(zeros(shape, store), zeros(shape, store)) for _ in range(num_layers)]
