"""Small shared facts: where jaxllm keeps its caches, and the dtypes it runs in."""

from __future__ import annotations

import os


# The dtypes weights and the KV cache can have: name -> bytes per element.
DTYPES = {"float32": 4, "bfloat16": 2}
# What `dtype=` accepts: a dtype, or "auto" (the platform picks one: `Platform.default_dtype`).
DTYPE_CHOICES = ("auto", *DTYPES)


def check_dtype(dtype: str) -> str:
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {dtype!r}")
    return dtype


def resolve_kv_cache_dtype(kv_cache_dtype: str, asked_dtype: str, dtype: str) -> tuple[str, str]:
    """(KV cache dtype, why) for `kv_cache_dtype` ("fp8" as "fp8_e4m3"), given the `asked_dtype`
    and the `dtype` it resolved to. "auto" is `dtype`, except where dtype "auto" picked float32
    (a CPU without hardware bf16 dots, see `Platform.default_dtype`): there bf16 pages. Decode attention
    reads every cached token of every sequence at each step and waits on memory, and bf16 pages
    are half the bytes; the kernels still compute in float32, widening a page row costs a shift.
    Activations rounded to int8 (`w8a8`, `int8_activations`) take the same pages: over paired
    draws of the rounding, bf16 pages cost them nothing measurable (benchmarks/results/zen4/RESULTS.md,
    "paired draws of float32 against bf16 pages for int8 activations")."""
    if kv_cache_dtype != "auto":
        return {"fp8": "fp8_e4m3"}.get(kv_cache_dtype, kv_cache_dtype), "asked for"
    if asked_dtype == "auto" and dtype == "float32":
        return "bfloat16", "dtype auto picked float32 for this CPU; bf16 pages halve the bytes decode attention reads"
    return dtype, "the dtype"


def jnp_dtype(dtype: str):
    """The jax.numpy dtype named `dtype` ("float32" or "bfloat16")."""
    import jax.numpy as jnp

    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[check_dtype(dtype)]


def default_cache_root() -> str:
    """Root of jaxllm's caches (compiled programs in xla/, converted weights in params/,
    the C++ kernels in native/)."""
    xdg = os.environ.get("XDG_CACHE_HOME", os.path.join(os.path.expanduser("~"), ".cache"))
    return os.environ.get("JAXLLM_CACHE_DIR", os.path.join(xdg, "jaxllm"))


def cdiv(a, b):
    """Ceiling division (ints or numpy arrays)."""
    return -(-a // b)


__all__ = [
    "DTYPES",
    "DTYPE_CHOICES",
    "cdiv",
    "check_dtype",
    "default_cache_root",
    "jnp_dtype",
    "resolve_kv_cache_dtype",
]
