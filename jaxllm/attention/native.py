"""`native`: the C++ kernel through XLA's FFI (kernels/native.py), CPUs' default; built (or
loaded from the cache) when the backend is made."""

from __future__ import annotations

from jaxllm.attention.base import AttentionBackend


class NativeBackend(AttentionBackend):
    name = "native"

    def __init__(self):
        from jaxllm.kernels import native

        native.require()  # builds (or loads from the cache) and registers the C++ kernels
        self._native = native

    def write_kv(self, k_pages, v_pages, k, v, slot_mapping):
        return self._native.write_kv(k_pages, v_pages, k, v, slot_mapping)

    def kernel(self, *args, **options):
        return self._native.paged_attention_cpu(*args, **options)
