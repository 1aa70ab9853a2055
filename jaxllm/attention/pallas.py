"""`pallas`: the Pallas Triton kernel (kernels/paged_attention.py), GPUs' default off Hopper."""

from __future__ import annotations

from jaxllm import kernels
from jaxllm.attention.base import AttentionBackend


class PallasBackend(AttentionBackend):
    name = "pallas"

    def kernel(self, *args, **options):
        return kernels.ragged_paged_attention(*args, **options)
