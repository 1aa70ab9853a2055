"""Paged attention kernels: the Pallas GPU kernel, the C++ CPU kernel, the jnp rows path, the
jnp reference (the oracle), the KV write."""

from jaxllm.kernels.kv_write import (
    allocate_kv_cache,
    cache_dtype,
    logical_pages,
    row_width,
    storage_dtype,
    write_kv,
)
from jaxllm.kernels.native import paged_attention_cpu
from jaxllm.kernels.paged_attention import ragged_paged_attention
from jaxllm.kernels.reference import ragged_paged_attention_reference
from jaxllm.kernels.rows import paged_attention_rows, ragged_to_rows

__all__ = [
    "allocate_kv_cache",
    "cache_dtype",
    "logical_pages",
    "paged_attention_cpu",
    "paged_attention_rows",
    "ragged_paged_attention",
    "ragged_paged_attention_reference",
    "ragged_to_rows",
    "row_width",
    "storage_dtype",
    "write_kv",
]
