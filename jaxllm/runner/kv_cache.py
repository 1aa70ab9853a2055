"""The KV cache's pages on the device(s): `KVCache` allocates them (on a thread), moves whole
pages as the scheduler asks (copy-on-write copies, swaps to and from a host pool) and
reallocates them after a failed step; the moves are jitted with index arrays padded to powers
of two, so only a few shapes are ever compiled."""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm import kernels


def kv_cache_maker(
    layer_pages, num_kv_heads: int, page_size: int, head_dim: int, dtype: str, stages: int, where, zeros=jnp.zeros
):
    """A jitted function making zeroed pages where they live (`where`: a sharding; each device
    only its own stage's layers and its own heads): a list over layers of (k, v) `[kv_heads,
    pages, page, head_dim]`, or with pipeline stages over a stage's layer slots of `[stages,
    kv_heads, ...]`. `layer_pages[i]`: layer (slot) i's number of pages (its KV cache group's)."""

    def make():
        cache = [
            kernels.allocate_kv_cache(1, num_kv_heads, pages, page_size, head_dim, kernels.cache_dtype(dtype), zeros)[0]
            for pages in layer_pages
        ]
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
    return [
        (k.at[..., dst, :, :].set(k[..., src, :, :]), v.at[..., dst, :, :].set(v[..., src, :, :]))
        if i in layers
        else (k, v)
        for i, (k, v) in enumerate(kv_cache)
    ]


@jax.jit
def gather_pages(kv_cache, pages):
    """-> [layers, 2, (stages,) kv_heads, len(pages), page_size, head_dim]"""
    return jnp.stack([jnp.stack([k[..., pages, :, :], v[..., pages, :, :]]) for k, v in kv_cache])


@functools.partial(jax.jit, donate_argnums=(0,))
def scatter_pages(kv_cache, pages, data):
    return [
        (k.at[..., pages, :, :].set(data[i, 0]), v.at[..., pages, :, :].set(data[i, 1]))
        for i, (k, v) in enumerate(kv_cache)
    ]


class KVCache:
    """The pages of every layer (slot of a stage), `[kv_heads, pages, page, row]` each (with
    pipeline stages `[stages, ...]`), and the host swap pool.

    `layer_groups[i]`: layer (slot) i's KV cache group (core/kv_cache_manager.py); `where`: the
    pages' sharding; `huge`: on one CPU device with the C++ kernels, the pages lie on 2 MiB
    pages (`native.zeros`). Zeroing them (~1 s for 2 GiB, mostly page faults) runs in C++
    without the GIL, so a thread does it while the weights load and the steps compile."""

    def __init__(
        self,
        cache_config,
        cfg,
        *,
        layer_groups: tuple[int, ...],
        num_kv_heads: int,
        num_stages: int,
        where,
        huge: bool = False,
    ):
        self.layer_groups = layer_groups
        self._make = kv_cache_maker(
            [cache_config.group_num_pages[g] for g in layer_groups],
            num_kv_heads,
            cache_config.page_size,
            cfg.head_dim,
            cache_config.dtype,
            num_stages,
            where,
            zeros=kernels.native.zeros if huge else jnp.zeros,
        )
        self.shapes = jax.eval_shape(self._make)  # (with shardings) for compiling without pages
        pool = ThreadPoolExecutor(1, thread_name_prefix="jaxllm-kv")
        self._pages, self._pending = None, pool.submit(self._make)
        pool.shutdown(wait=False)
        # Host pages for swapped-out requests: [layers, k/v, kv_heads, slots, page_size, row]
        # ([layer slots, k/v, stages, ...] with pipeline stages; numpy zeros: the OS commits
        # memory only for slots ever written).
        kv_dtype = kernels.cache_dtype(cache_config.dtype)
        stages = (num_stages,) if num_stages > 1 else ()
        self.swap_pool = np.zeros(
            (
                len(layer_groups),
                2,
                *stages,
                num_kv_heads,
                cache_config.num_swap_pages,
                cache_config.page_size,
                kernels.row_width(cfg.head_dim, kv_dtype),
            ),
            kernels.storage_dtype(kv_dtype),
        )

    @property
    def pages(self):
        """The pages (waiting for their allocation if it is under way)."""
        if self._pending is not None:
            self._pages, self._pending = self._pending.result(), None
        return self._pages

    @pages.setter
    def pages(self, value) -> None:
        self._pages, self._pending = value, None

    def free(self) -> None:
        """Give the pages' memory back (`LLMEngine.sleep`); `allocate` makes them again."""
        pages, self._pages, self._pending = self.pages, None, None
        for x in jax.tree_util.tree_leaves(pages):
            x.delete()

    def allocate(self) -> None:
        """Zeroed pages again after `free` (the same shapes and shardings: nothing recompiles)."""
        if self._pages is None and self._pending is None:
            self.pages = self._make()

    def recover(self, force: bool = False) -> bool:
        """After a failed step: reallocate the pages if the failure consumed them (the step
        donates them), or with `force`. Returns whether it did, i.e. whether every page's
        contents are lost."""
        if not force and not any(x.is_deleted() for x in jax.tree_util.tree_leaves(self.pages)):
            return False
        self.pages = self._make()
        return True

    def copy_pages(self, copies: list[tuple[list[int], list[int]]]) -> None:
        """Per KV cache group, copy whole pages src[i] -> dst[i] in each of its layers (copy-on-write)."""
        for g, (src, dst) in enumerate(copies):
            if len(src):
                src, dst = pad_pow2(src, dst)
                layers = tuple(i for i, group in enumerate(self.layer_groups) if group == g)
                self.pages = copy_pages(self.pages, src, dst, layers=layers)

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Save device pages to host slots: pairs of (page, slot)."""
        if pairs:
            pages, slots = pad_pow2(*zip(*pairs))
            self.swap_pool[..., slots, :, :] = np.asarray(gather_pages(self.pages, pages))

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Restore host slots into device pages: pairs of (slot, page)."""
        if pairs:
            slots, pages = pad_pow2(*zip(*pairs))
            saved = jnp.asarray(self.swap_pool[..., slots, :, :])
            self.pages = scatter_pages(self.pages, pages, saved)
