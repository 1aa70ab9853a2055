"""Small shared facts: where jaxllm keeps its caches, and the dtypes it runs in."""

from __future__ import annotations

import os


# The dtypes weights and the KV cache can have: name -> bytes per element.
DTYPES = {"float32": 4, "bfloat16": 2}
# What `dtype=` accepts: a dtype, or "auto" (`resolve_dtype` picks one for the device).
DTYPE_CHOICES = ("auto", *DTYPES)
# x86 features (Linux /proc/cpuinfo names) that give bf16 dots a hardware path in XLA:CPU:
# AVX-512 BF16 (Zen 4/5, Cooper Lake+) and AMX (Sapphire Rapids+). Without them XLA widens
# bf16 operands to f32 on every dot, and float32 measured 2x faster end to end (Zen 2).
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


def check_dtype(dtype: str) -> str:
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {dtype!r}")
    return dtype


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux names them (/proc/cpuinfo "flags"); empty elsewhere."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "flags":
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


def resolve_dtype(dtype: str, platform_name: str, flags: frozenset[str] | None = None) -> tuple[str, str]:
    """(dtype, why): `dtype` itself unless it is "auto"; then bfloat16 on accelerators and on
    CPUs with hardware bf16 dots (`BF16_CPU_FLAGS`), float32 on other CPUs, where bf16 is the
    slow dtype. `flags` defaults to this machine's `cpu_flags()`."""
    if dtype != "auto":
        return check_dtype(dtype), "asked for"
    if platform_name != "cpu":
        return "bfloat16", f"{platform_name} computes bfloat16 in hardware"
    flags = cpu_flags() if flags is None else flags
    hardware = [flag for flag in BF16_CPU_FLAGS if flag in flags]
    if hardware:
        return "bfloat16", f"this CPU has hardware bf16 dots ({', '.join(hardware)})"
    return "float32", (
        f"this CPU has no hardware bf16 dots (no {' or '.join(BF16_CPU_FLAGS)}): float32 is the faster dtype there"
    )


def resolve_kv_cache_dtype(kv_cache_dtype: str, asked_dtype: str, dtype: str) -> tuple[str, str]:
    """(KV cache dtype, why) for `kv_cache_dtype` ("fp8" as "fp8_e4m3"), given the `asked_dtype`
    and the `dtype` it resolved to. "auto" is `dtype`, except where dtype "auto" picked float32
    (a CPU without hardware bf16 dots, see `resolve_dtype`): there bf16 pages. Decode attention
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
    "BF16_CPU_FLAGS",
    "DTYPES",
    "DTYPE_CHOICES",
    "cdiv",
    "check_dtype",
    "cpu_flags",
    "default_cache_root",
    "jnp_dtype",
    "resolve_dtype",
    "resolve_kv_cache_dtype",
]
