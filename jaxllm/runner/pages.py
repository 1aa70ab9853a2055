"""The KV cache's pages: allocating them (`kv_cache_maker`), and whole-page moves
(copy-on-write copies, swaps to and from host memory), jitted with index arrays padded to
powers of two so only a few shapes are ever compiled."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm import kernels


def kv_cache_maker(layer_pages, num_kv_heads: int, block_size: int, head_dim: int, dtype: str, stages: int, where,
                   zeros=jnp.zeros):
    """A jitted function making zeroed pages where they live (`where`: a sharding; each device
    only its own stage's layers and its own heads): a list over layers of (k, v) `[kv_heads,
    pages, page, head_dim]`, or with pipeline stages over a stage's layer slots of `[stages,
    kv_heads, ...]`. `layer_pages[i]`: layer (slot) i's number of pages (its KV cache group's)."""
    def make():
        cache = [kernels.allocate_kv_cache(1, num_kv_heads, pages, block_size, head_dim, kernels.cache_dtype(dtype),
                                          zeros)[0]
                 for pages in layer_pages]
        if stages == 1:
            return cache
        return [tuple(jnp.broadcast_to(x, (stages, *x.shape)) for x in kv) for kv in cache]

    return jax.jit(make, out_shardings=where)


def pad_pow2(a, b) -> tuple[np.ndarray, np.ndarray]:
    """Pad index pairs to a power of two by repeating the first pair (an identical copy), so
    only log2(n) shapes are ever compiled."""
    pad = (1 << (len(a) - 1).bit_length()) - len(a)
    return (np.asarray(list(a) + [a[0]] * pad, np.int32), np.asarray(list(b) + [b[0]] * pad, np.int32))


# The page axis is the third from last in both cache layouts (`kv_cache_maker`).

@functools.partial(jax.jit, donate_argnums=(0,), static_argnames=("layers",))
def copy_pages(kv_cache, src, dst, *, layers: tuple[int, ...]):
    """Copy pages src -> dst in the cache's `layers` (one KV cache group's)."""
    return [(k.at[..., dst, :, :].set(k[..., src, :, :]), v.at[..., dst, :, :].set(v[..., src, :, :]))
            if i in layers else (k, v) for i, (k, v) in enumerate(kv_cache)]


@jax.jit
def gather_pages(kv_cache, pages):
    """-> [layers, 2, (stages,) kv_heads, len(pages), block_size, head_dim]"""
    return jnp.stack([jnp.stack([k[..., pages, :, :], v[..., pages, :, :]]) for k, v in kv_cache])


@functools.partial(jax.jit, donate_argnums=(0,))
def scatter_pages(kv_cache, pages, data):
    return [(k.at[..., pages, :, :].set(data[i, 0]), v.at[..., pages, :, :].set(data[i, 1]))
            for i, (k, v) in enumerate(kv_cache)]
