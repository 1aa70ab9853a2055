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
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Bytes after an int8 row's codes: its f32 scale.
INT8_SCALE_BYTES = 4


def cache_dtype(name: str) -> jnp.dtype:
    """The logical dtype of a cache named as `CacheConfig.dtype` ("float32", "bfloat16", "int8")."""
    return jnp.dtype({"float32": jnp.float32, "bfloat16": jnp.bfloat16, "int8": jnp.int8}[name])


def storage_dtype(dtype) -> jnp.dtype:
    """The dtype a cache of logical `dtype` is stored in."""
    dtype = jnp.dtype(dtype)
    return jnp.dtype(jnp.uint16) if dtype == jnp.bfloat16 else dtype


def row_width(head_dim: int, dtype) -> int:
    """Elements of a cache row (one token, one head) in storage."""
    return head_dim + INT8_SCALE_BYTES if jnp.dtype(dtype) == jnp.int8 else head_dim


def int8_rows(x: jax.Array, amax: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """x [..., D] -> (int8 codes [..., D], f32 scales [...]): symmetric, a scale of max |x| / 127
    per row (1 for a zero row), or of `amax` [...] when given. The int8 KV cache's rows, and
    W8A8's activations."""
    x = x.astype(jnp.float32)
    scale = (jnp.max(jnp.abs(x), axis=-1) if amax is None else amax) / 127.0
    scale = jnp.where(scale > 0, scale, 1.0)
    return jnp.clip(jnp.round(x / scale[..., None]), -127, 127).astype(jnp.int8), scale


def quantize_rows(x: jax.Array) -> jax.Array:
    """x [..., head_dim] -> int8 rows [..., head_dim + 4]: codes and the f32 scale's bytes."""
    codes, scale = int8_rows(x)
    return jnp.concatenate([codes, jax.lax.bitcast_convert_type(scale, jnp.int8)], axis=-1)


def int8_row_scales(rows: jax.Array) -> jax.Array:
    """int8 rows [..., head_dim + 4] -> their f32 scales [...]."""
    return jax.lax.bitcast_convert_type(rows[..., -INT8_SCALE_BYTES:], jnp.float32)


def logical_pages(pages: jax.Array) -> jax.Array:
    """View stored pages (or a gather of them) in their logical dtype (int8: dequantized to f32)."""
    if pages.dtype == jnp.uint16:
        return jax.lax.bitcast_convert_type(pages, jnp.bfloat16)
    if pages.dtype == jnp.int8:
        return pages[..., :-INT8_SCALE_BYTES].astype(jnp.float32) * int8_row_scales(pages)[..., None]
    return pages


def to_storage(x: jax.Array, storage: jnp.dtype) -> jax.Array:
    if storage == jnp.uint16:
        return jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16)
    if storage == jnp.int8:
        return quantize_rows(x)
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


def allocate_kv_cache(num_layers, num_kv_heads, num_pages, page_size, head_dim, dtype):
    """A zeroed cache: list over layers of `(k_pages, v_pages)` in storage dtype."""
    shape = (num_kv_heads, num_pages, page_size, row_width(head_dim, dtype))
    store = storage_dtype(dtype)
    return [(jnp.zeros(shape, store), jnp.zeros(shape, store)) for _ in range(num_layers)]
