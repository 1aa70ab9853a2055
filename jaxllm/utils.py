"""Small shared facts: where jaxllm keeps its caches, and the dtypes it runs in."""

from __future__ import annotations

import os


# The dtypes weights and the KV cache can have: name -> bytes per element.
DTYPES = {"float32": 4, "bfloat16": 2}


def check_dtype(dtype: str) -> str:
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {dtype!r}")
    return dtype


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


__all__ = ["DTYPES", "cdiv", "check_dtype", "default_cache_root", "jnp_dtype"]
