"""`native`: the C++ kernel through XLA's FFI (kernels/native.py), CPUs' default; built (or
loaded from the cache) when the backend is made."""

from __future__ import annotations

from jaxllm.attention.base import AttentionBackend


class NativeBackend(AttentionBackend):
    """`batch_invariant`: every work item on one code path (AVX2 where built, which reads K and V
    in place: decodes' fastest; prompt chunks take about 1.1x AVX-512's time), so a query row's
    result never depends on how many rows share its item (a decode, a chunk, a prefix-cache hit's
    remainder). Otherwise `auto` picks per item."""

    name = "native"
    bidirectional = True

    def __init__(self, batch_invariant: bool = False):
        from jaxllm.kernels import native

        native.require()  # builds (or loads from the cache) and registers the C++ kernels
        self._native = native
        self.path = "auto"
        if batch_invariant:
            self.path = "avx2" if "avx2" in native.kernel_paths() else "portable"

    def __repr__(self) -> str:
        return "NativeBackend()" if self.path == "auto" else f"NativeBackend(path={self.path!r})"

    def write_kv(self, k_pages, v_pages, k, v, slot_mapping):
        return self._native.write_kv(k_pages, v_pages, k, v, slot_mapping)

    def kernel(self, *args, **options):
        return self._native.paged_attention_cpu(*args, **{"path": self.path, **options})
