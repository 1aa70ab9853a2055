"""`mosaic`: the Pallas Mosaic GPU kernel (kernels/paged_attention_mgpu.py), Hopper's default."""

from __future__ import annotations

import logging

from jaxllm import kernels
from jaxllm.attention.base import AttentionBackend
from jaxllm.platforms import warpgroup_mma

logger = logging.getLogger("jaxllm.attention")


class MosaicBackend(AttentionBackend):
    """The Mosaic GPU kernel (warpgroup MMAs: compute capability 9.x), or the Triton kernel for a
    cache layout it does not read (decided per layer at trace time, logged once)."""

    name = "mosaic"

    def __init__(self):
        self._fallbacks: set[str] = set()

    def kernel(self, q, k_pages, *args, **options):
        from jaxllm.kernels import paged_attention_mgpu

        why = paged_attention_mgpu.unsupported(q.shape, k_pages.dtype, k_pages.shape[2])
        if why is None:
            return paged_attention_mgpu.ragged_paged_attention_mgpu(q, k_pages, *args, **options)
        if why not in self._fallbacks:
            self._fallbacks.add(why)
            logger.info("attention: the Triton kernel serves a %s", why)
        return kernels.ragged_paged_attention(q, k_pages, *args, **options)


def mosaic_gpu_capable(device) -> bool:
    """Whether `device` runs the Mosaic GPU kernel: a CUDA GPU with warpgroup MMAs
    (`platforms.warpgroup_mma`)."""
    return device.platform == "gpu" and warpgroup_mma(str(getattr(device, "compute_capability", "") or ""))
