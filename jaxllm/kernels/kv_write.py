"""Writing new keys/values into the paged KV cache.

Pages are `[num_kv_heads, num_pages, page_size, head_dim]`. A bfloat16 cache is *stored* as
uint16 bit patterns: XLA:CPU lowers a bf16 scatter as "convert the whole pool to f32,
scatter, convert back" (12 ms per layer for a 12 MB pool), while a uint16 scatter into a
donated buffer is in place (0.02 ms). The bitcast between the two is free.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def storage_dtype(dtype) -> jnp.dtype:
    """The dtype a cache of logical `dtype` is stored in."""
    dtype = jnp.dtype(dtype)
    return jnp.dtype(jnp.uint16) if dtype == jnp.bfloat16 else dtype


def logical_pages(pages: jax.Array) -> jax.Array:
    """View stored pages (or a gather of them) in their logical dtype."""
    if pages.dtype == jnp.uint16:
        return jax.lax.bitcast_convert_type(pages, jnp.bfloat16)
    return pages


def to_storage(x: jax.Array, storage: jnp.dtype) -> jax.Array:
    if storage == jnp.uint16:
        return jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16)
    return x.astype(storage)


def write_kv(k_pages, v_pages, k_new, v_new, slot_mapping):
    """Scatter this step's keys/values into their slots.

    k_new, v_new: [T, num_kv_heads, head_dim]; slot_mapping: [T] int32 flat slot
    `page * page_size + offset`. A negative slot marks a padding token: it is dropped and
    writes nowhere. Donate the pages to the enclosing jit so the update is in place.
    """
    num_kv_heads, num_pages, page_size, head_dim = k_pages.shape
    num_slots = num_pages * page_size
    # Out-of-range index + mode="drop" skips padding (a negative index would wrap around).
    slots = jnp.where(slot_mapping < 0, num_slots, slot_mapping)

    def write(pages, new):
        flat = pages.reshape(num_kv_heads, num_slots, head_dim)
        new = to_storage(new, pages.dtype).transpose(1, 0, 2)
        flat = flat.at[:, slots].set(new, mode="drop")
        return flat.reshape(pages.shape)

    return write(k_pages, k_new), write(v_pages, v_new)


def allocate_kv_cache(num_layers, num_kv_heads, num_pages, page_size, head_dim, dtype):
    """A zeroed cache: list over layers of `(k_pages, v_pages)` in storage dtype."""
    shape = (num_kv_heads, num_pages, page_size, head_dim)
    store = storage_dtype(dtype)
    return [(jnp.zeros(shape, store), jnp.zeros(shape, store)) for _ in range(num_layers)]
