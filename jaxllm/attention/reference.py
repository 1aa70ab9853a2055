"""`reference`: the dense `jnp` oracle (kernels/reference.py) as a backend (slow; for tests)."""

from __future__ import annotations

from jaxllm import kernels
from jaxllm.attention.base import AttentionBackend


class ReferenceBackend(AttentionBackend):
    name = "reference"
    bidirectional = True

    def kernel(self, *args, **options):
        return kernels.ragged_paged_attention_reference(*args, **options)
