"""The KV cache's pages: allocating them (`kv_cache_maker`), and whole-page moves
(copy-on-write copies, swaps to and from host memory), jitted with index arrays padded to
powers of two so only a few shapes are ever compiled."""

from __future__ import annotations

import ctypes
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm import kernels


def kv_cache_maker(layer_pages, num_kv_heads: int, block_size: int, head_dim: int, dtype: str, stages: int, where):
    """A jitted function making zeroed pages where they live (`where`: a sharding; each device
    only its own stage's layers and its own heads): a list over layers of (k, v) `[kv_heads,
    pages, page, head_dim]`, or with pipeline stages over a stage's layer slots of `[stages,
    kv_heads, ...]`. `layer_pages[i]`: layer (slot) i's number of pages (its KV cache group's)."""
    def make():
        cache = [kernels.allocate_kv_cache(1, num_kv_heads, pages, block_size, head_dim, kernels.cache_dtype(dtype))[0]
                 for pages in layer_pages]
        if stages == 1:
            return cache
        return [tuple(jnp.broadcast_to(x, (stages, *x.shape)) for x in kv) for kv in cache]

    return jax.jit(make, out_shardings=where)


_HUGE = 2 << 20
_MADV_HUGEPAGE, _MADV_COLLAPSE = 14, 25


def advise_huge_pages(cache) -> int:
    """Move the CPU arrays of `cache` (the KV pool) onto 2 MiB pages where Linux allows it, and
    return the bytes moved (0 elsewhere). Decode attention reads each sequence's pages scattered
    over the pool, and with 4 KiB pages nearly every page read misses the TLB: on a Zen 4 EPYC,
    128 decodes at context 256 spent about a tenth less time in attention on 2 MiB pages. How:
    `madvise` MADV_HUGEPAGE, then MADV_COLLAPSE, which copies the pages already there into huge
    ones (Linux 6.1+, transparent huge pages on `madvise` or `always`). It costs ~1 s for a 2 GiB
    pool, on the thread that zeroes the pool while the steps load (a warm start on that machine:
    3.0 -> 4.0 s). Tried: collapsing on a thread of its own once the engine was up delayed the
    first token more (4.3-4.5 s), and handing the zeroed pages back to be refaulted as huge pages
    when first written (MADV_DONTNEED) ran the standard workload 0.94x as fast (the faults land
    in the steps). The step donates the cache, so its buffers keep their addresses. Best effort."""
    if not sys.platform.startswith("linux"):
        return 0
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return 0
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    moved = 0
    for x in jax.tree_util.tree_leaves(cache):
        if any(d.platform != "cpu" for d in x.devices()) or x.nbytes < 2 * _HUGE:
            continue
        start = x.unsafe_buffer_pointer()
        lo, hi = -(-start // _HUGE) * _HUGE, (start + x.nbytes) // _HUGE * _HUGE
        if libc.madvise(lo, hi - lo, _MADV_HUGEPAGE) == 0 and libc.madvise(lo, hi - lo, _MADV_COLLAPSE) == 0:
            moved += hi - lo
    return moved


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
