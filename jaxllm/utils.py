"""Small shared facts: where jaxllm keeps its caches (and how its entries are guarded), the
dtypes and quantization methods it runs in, and a flag's JSON object."""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import os


# The dtypes weights and the KV cache can have: name -> bytes per element.
DTYPES = {"float32": 4, "bfloat16": 2}
# What `dtype=` accepts: a dtype, or "auto" (the platform picks one: `Platform.default_dtype`).
DTYPE_CHOICES = ("auto", *DTYPES)
# jaxllm.quantization's METHODS + CHECKPOINT_METHODS (config checks import no JAX code);
# tests/quantization/test_quantization.py checks they agree.
QUANTIZATION_METHODS = ("int8", "int8_weight_only", "int4", "w8a8", "gguf", "awq", "gptq", "none")
# Other names of a method: "int8" is W8A8 (as vLLM's "INT8 W8A8" and the issue that asked for it
# have it); EngineArgs and `quantize_params` know it by its canonical name only.
QUANTIZATION_ALIASES = {"int8": "w8a8"}


def json_object(text: str) -> dict:
    """A command-line flag's JSON object."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object, got {text!r}")
    return value


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


@contextlib.contextmanager
def folder_lock(directory: str):
    """Hold an exclusive lock on the cache folder `directory` (created if need be; the lock is on
    the folder itself, so it leaves no file) against other processes that build an entry there:
    the second waits, then finds the entry built. Yields whether it locked; where the folder
    cannot be made (a read-only cache) it does not, and the entries' atomic renames still keep
    each whole."""
    try:
        os.makedirs(directory, exist_ok=True)
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        yield False
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield True
    finally:
        os.close(fd)  # (releases the lock)


def file_sizes(directory: str) -> dict[str, int]:
    """Every file under `directory`: its path relative to it -> its size in bytes."""
    sizes = {}
    for root, _, files in os.walk(directory):
        for name in files:
            path = os.path.join(root, name)
            sizes[os.path.relpath(path, directory)] = os.path.getsize(path)
    return sizes


def size_mismatch(directory: str, expected: dict[str, int]) -> str | None:
    """What differs between the files under `directory` and `expected` (`file_sizes` as written):
    the first missing or resized file, or None when all are as written."""
    for name, size in sorted(expected.items()):
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            return f"{name} is missing"
        if os.path.getsize(path) != size:
            return f"{name} has {os.path.getsize(path)} bytes, {size} were written"
    return None


def release_freed_memory() -> None:
    """Hand the C heap's freed pages back to the system (glibc's `malloc_trim`; nothing elsewhere).
    Loading weights and compiling steps free about as much as they keep, in arenas of threads
    that are then idle, which glibc keeps mapped otherwise (benchmarks/results/zen4/RESULTS.md)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def cdiv(a, b):
    """Ceiling division (ints or numpy arrays)."""
    return -(-a // b)


__all__ = [
    "DTYPES",
    "DTYPE_CHOICES",
    "QUANTIZATION_ALIASES",
    "QUANTIZATION_METHODS",
    "cdiv",
    "check_dtype",
    "default_cache_root",
    "folder_lock",
    "file_sizes",
    "size_mismatch",
    "jnp_dtype",
    "json_object",
    "release_freed_memory",
    "resolve_kv_cache_dtype",
]
