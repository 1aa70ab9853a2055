"""jaxllm's CPU kernels in C++ (csrc/), as XLA FFI calls.

`paged_attention_cpu` has the ragged contract of `ragged_paged_attention_reference`
(csrc/paged_attention.h, .cc, and paged_attention_avx512.cc / paged_attention_avx2.cc for
CPUs with AVX-512 / AVX2 + FMA; `kernel_paths()` lists the paths the build has);
`argmax_logsumexp` gives greedy sampling's two row reductions in one pass and `sample_rows`
a sampled row's token (csrc/sampling.cc);
the GEMMs are kernels/gemm.py's (AVX512_BF16 dots where the build has them: `has_bf16_dots()`);
`write_kv` is
kv_write.py's `write_kv` in place (csrc/kv_write.cc: one handler instead of an LLVM module per layer's scatter);
`rms_norm` is RMSNorm with the residual add before it in one call (csrc/norm.cc).
csrc/cpu_kernels_attention.cc and cpu_kernels_gemm.cc, which include them all, are compiled
side by side on first use (on a thread of their own: `start_build`) with the system C++
compiler (`$CXX`, else `c++`) against the XLA FFI headers that ship with jaxlib, with
`-O3 -march=native` and fast math, into `<cache root>/native/` (keyed by every file in csrc/,
the flags, the compiler, jaxlib's version and the CPU; a SHA-256 sidecar checked on load; a file
lock so that processes starting at once compile it once; a private temporary folder when the
cache cannot be written), then loaded with ctypes and registered as FFI targets. Later
processes load the cached library. `available()` says whether that
worked; without a compiler the engine falls back to the jnp rows backend
(`attention_backend="cpu"`, see jaxllm/attention/).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import Future

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.utils import default_cache_root, folder_lock

logger = logging.getLogger("jaxllm")

# FFI target name -> symbol of its handler in the library
TARGETS = {
    "jaxllm_paged_attention_cpu": "JaxllmPagedAttentionCpu",
    "jaxllm_argmax_logsumexp_cpu": "JaxllmArgmaxLogsumexpCpu",
    "jaxllm_sample_rows_cpu": "JaxllmSampleRowsCpu",
    "jaxllm_matmul_packed_cpu": "JaxllmMatmulPackedCpu",
    "jaxllm_matmul_packed_bf16_cpu": "JaxllmMatmulPackedBf16Cpu",
    "jaxllm_matmul_quantized_cpu": "JaxllmMatmulQuantCpu",
    "jaxllm_matmul_quantized_bf16_cpu": "JaxllmMatmulQuantBf16Cpu",
    "jaxllm_lora_add_cpu": "JaxllmLoraAddCpu",
    "jaxllm_lora_add_bf16_cpu": "JaxllmLoraAddBf16Cpu",
    "jaxllm_lora_shrink_bf16_cpu": "JaxllmLoraShrinkBf16Cpu",
    "jaxllm_write_kv_cpu": "JaxllmWriteKvCpu",
    "jaxllm_rms_norm_cpu": "JaxllmRmsNormCpu",
    "jaxllm_zeros_cpu": "JaxllmZerosCpu",
}
# The translation units, compiled side by side: they include the other files of their folder.
SOURCES = tuple(
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", name)
    for name in ("cpu_kernels_attention.cc", "cpu_kernels_gemm.cc")
)
# -ffast-math for vectorised reductions, but with infinities kept: banned tokens' logits are -inf.
FLAGS = ("-O3", "-march=native", "-ffast-math", "-fno-finite-math-only", "-std=c++17", "-fPIC")
# Linked in a second command without -ffast-math: linking with it adds crtfastmath.o, whose
# constructor sets flush-to-zero/denormals-are-zero for the whole process when the library is
# loaded (every numpy and XLA computation after it would lose subnormal floats).
LINK_FLAGS = ("-shared",)


def _cpu_id() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return platform.processor()


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++") or shutil.which("clang++")


def _sources_digest() -> bytes:
    """Hash of every file beside SOURCES (names and bytes): a changed header rebuilds too."""
    folder = os.path.dirname(SOURCES[0])
    h = hashlib.sha256()
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            with open(path, "rb") as f:
                h.update(name.encode() + b"\0" + f.read() + b"\0")
    return h.digest()


def build(cache_dir: str | None = None) -> str:
    """Compile the kernel library (or find it in the cache); returns its path."""
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set $CXX or install g++)")
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(
        b"\0".join(
            [
                _sources_digest(),
                " ".join(FLAGS + LINK_FLAGS).encode(),
                version.encode(),
                jax.lib.__version__.encode(),
                _cpu_id().encode(),
            ]
        )
    ).hexdigest()[:16]
    cache_dir = cache_dir or os.path.join(default_cache_root(), "native")
    try:
        return _build_in(cache_dir, key, cxx)
    except OSError as e:  # a read-only or full cache: build in a private folder instead
        fallback = os.path.join(tempfile.gettempdir(), f"jaxllm-native-{os.getuid()}")
        logger.warning("cannot keep the C++ kernels in %s (%s); building them in %s", cache_dir, e, fallback)
        return _build_in(fallback, key, cxx)


def _build_in(cache_dir: str, key: str, cxx: str) -> str:
    """The library `key` in `cache_dir`: the cached one if its checksum (a sidecar file) holds,
    else compiled, under a lock (two processes starting at once compile it once)."""
    os.makedirs(cache_dir, exist_ok=True)
    path = os.path.join(cache_dir, f"cpu_kernels-{key}.so")
    with folder_lock(cache_dir):
        if os.path.exists(path):
            damage = _checksum_mismatch(path)
            if damage is None:
                return path
            logger.warning("the cached C++ kernels %s are damaged (%s): compiling them again", path, damage)
        for name in os.listdir(cache_dir):  # what a build killed mid-way left (the lock is ours)
            if name.startswith("tmp") and name.endswith((".so", ".o", ".tmp")):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(cache_dir, name))
        _compile(cxx, path)
    return path


def _checksum_mismatch(path: str) -> str | None:
    """Why the library at `path` is not as it was written (its sidecar's SHA-256), or None. A
    library from before the sidecars gets one."""
    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    try:
        with open(f"{path}.sha256") as f:
            written = f.read().strip()
    except FileNotFoundError:
        with contextlib.suppress(OSError):
            _write_atomically(f"{path}.sha256", digest.encode())
        return None
    return None if written == digest else "its checksum does not match"


def _write_atomically(path: str, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _compile(cxx: str, path: str) -> None:
    """Compile the library to a private name, then rename it into place (its checksum beside it
    first): concurrent processes never load a partial file."""
    cache_dir = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache_dir)
    os.close(fd)
    objs = [f"{tmp[:-3]}-{i}.o" for i in range(len(SOURCES))]
    try:
        steps = [[cxx, *FLAGS, "-I", jax.ffi.include_dir(), "-c", src, "-o", obj] for src, obj in zip(SOURCES, objs)]
        procs = [subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for cmd in steps]
        errors = [proc.communicate()[1] for proc in procs]  # (the units compile side by side)
        steps.append([cxx, *LINK_FLAGS, *objs, "-o", tmp])
        if all(proc.returncode == 0 for proc in procs):
            procs.append(subprocess.run(steps[-1], capture_output=True, text=True))
            errors.append(procs[-1].stderr)
        for cmd, proc, stderr in zip(steps, procs, errors):
            if proc.returncode != 0:
                raise RuntimeError(f"compiling the CPU kernels failed:\n{' '.join(cmd)}\n{stderr[-4000:]}")
        with open(tmp, "rb") as f:
            _write_atomically(f"{path}.sha256", hashlib.sha256(f.read()).hexdigest().encode())
        os.replace(tmp, path)
    finally:
        for leftover in [*objs, tmp]:
            if os.path.exists(leftover):
                os.unlink(leftover)


# The kernels' code paths, narrowest first (csrc/simd.h's KernelPath).
PATHS = ("portable", "avx2", "avx512", "amx")
_path_bits = 0
_bf16_dots = False
_six_bit_codes = False


def start_build() -> None:
    """Start building (or loading) the kernels on a thread of their own, and return: a cold
    build takes 10-20 s on two cores (its two units side by side), which `LLMEngine` spends
    reading the model meanwhile. `available()` and every kernel wait for it."""
    global _loading
    with _loading_lock:
        if _loading is None:
            _loading = Future()
            threading.Thread(target=_load_into, args=(_loading,), name="jaxllm-native-build").start()


def _load_into(future: Future) -> None:
    try:
        reason = _load_once()
    except BaseException as e:  # (waiters must never hang)
        reason = f"{type(e).__name__}: {e}"
    future.set_result(reason)


def expected() -> bool:
    """Whether the kernels are loaded, or are being built or could be (a compiler is there),
    without waiting: a build that fails later says so through `available()`."""
    if _loading is not None and _loading.done():
        return _loading.result() is None
    return _loading is not None or _compiler() is not None


def _load() -> str | None:
    """Build, load and register the kernels once per process (waiting for `start_build`'s
    thread); None on success, else why not."""
    start_build()
    return _loading.result()


_loading: Future | None = None
_lib = None  # the loaded library (ctypes), for its plain C functions
_loading_lock = threading.Lock()


def _load_once() -> str | None:
    global _lib, _path_bits, _bf16_dots, _six_bit_codes
    try:
        lib = ctypes.cdll.LoadLibrary(build())
        for target, symbol in TARGETS.items():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
        _path_bits = lib.JaxllmKernelPaths()
        _bf16_dots = bool(lib.JaxllmBf16GemmHasDots())
        _six_bit_codes = bool(lib.JaxllmHasSixBitCodes())
        _lib = lib
    except (OSError, RuntimeError, AttributeError) as e:
        return str(e)
    return None


def kernel_paths() -> tuple[str, ...]:
    """The kernels' code paths in this build (what -march=native allows), narrowest first."""
    require()
    return tuple(name for i, name in enumerate(PATHS, start=1) if _path_bits & (1 << i))


def has_bf16_dots() -> bool:
    """Whether bf16 packed weights multiply with AVX512_BF16 dots in this build (else a portable
    loop, slower than XLA's bf16 dot: the engine then leaves bf16 weights unpacked)."""
    return available() and _bf16_dots


def has_six_bit_codes() -> bool:
    """Whether codes x bf16 rows take 6-bit codes in this build (AVX512_VBMI beside AVX512_BF16:
    `gemm.pack_codes(codes, 6)`)."""
    return available() and _six_bit_codes


def act8_bf16_rows(bits: int) -> int:
    """The fewest rows from which `gemm.matmul_quantized(..., act8=True)` over codes of `bits` (4
    or 6) multiplies bf16 dots under path auto (csrc/gemm_codes_tiles.cc: the codes converted to
    bf16, on AMX's tiles where the process has them, else with VDPBF16PS), 0 where it never does
    (no AVX512_BF16 and AVX512_VBMI here, or 4-bit codes without AMX)."""
    return int(_lib.JaxllmAct8Bf16Rows(bits, -1)) if available() else 0


@contextlib.contextmanager
def act8_bf16_rows_set(bits: int, rows: int):
    """Within the block, calls over codes of `bits` take bf16 dots from `rows` rows (0: none), as
    `act8_bf16_rows` says; for benchmarks and tests. Process-wide, as `int8_tile_rows_set`."""
    before = int(_lib.JaxllmAct8Bf16Rows(bits, rows)) if available() else 0
    try:
        yield
    finally:
        if available():
            _lib.JaxllmAct8Bf16Rows(bits, before)


def int8_tile_rows() -> int:
    """The fewest rows from which `gemm.matmul_quantized(..., act8=True)` over 4- and 6-bit codes
    runs on AMX's int8 tiles under path auto or avx512 (the VNNI kernels' numbers exactly, at fewer
    instructions), 0 where it never does (no AMX-INT8 or tile permission here)."""
    return int(_lib.JaxllmInt8TileRows(-1)) if available() else 0


@contextlib.contextmanager
def int8_tile_rows_set(rows: int):
    """Within the block, the int8 tiles take calls from `rows` rows (0: none), as
    `int8_tile_rows` says; for benchmarks and tests that compare them with the VNNI kernels.
    Process-wide: only where no other thread runs these kernels meanwhile."""
    before = int(_lib.JaxllmInt8TileRows(rows)) if available() else 0
    try:
        yield
    finally:
        if available():
            _lib.JaxllmInt8TileRows(before)


def available() -> bool:
    return _load() is None


def unavailable_reason() -> str | None:
    return _load()


def library():
    """The loaded library (ctypes), for its plain C functions (building it if need be)."""
    require()
    return _lib


def require() -> None:
    """Build and register the kernels if needed; RuntimeError saying why when they cannot be."""
    reason = _load()
    if reason is not None:
        raise RuntimeError(f"jaxllm's native CPU kernels are unavailable: {reason}")


def argmax_logsumexp(x: jax.Array, token_mask: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """x [rows, vocab] -> (first index of each row's max [rows] int32, logsumexp [rows] f32),
    over the tokens `token_mask` allows (a packed bitmask [rows, ceil(vocab / 32)] int32, as
    runner.sampler.apply_token_mask reads it; None: all)."""
    require()
    rows = x.shape[0]
    mask = jnp.zeros((0, 0), jnp.int32) if token_mask is None else jnp.asarray(token_mask, jnp.int32)
    call = jax.ffi.ffi_call(
        "jaxllm_argmax_logsumexp_cpu",
        (jax.ShapeDtypeStruct((rows,), jnp.int32), jax.ShapeDtypeStruct((rows,), jnp.float32)),
    )
    return call(x.astype(jnp.float32), mask)


def sample_rows(logits, temperature, min_p, top_k, top_p, draft_tokens, u, u_draft) -> jax.Array:
    """Each row's sampled token, as `runner.sampler.draw_xla` draws it (temperature, min_p,
    top_k, top_p, a draft accepted or taken out, inverse CDF with the uniform `u`); logits
    [rows, vocab], the rest [rows]. A greedy row (temperature 0) gets 0."""
    require()
    rows = logits.shape[0]
    f32, i32 = (lambda a: jnp.asarray(a, jnp.float32)), (lambda a: jnp.asarray(a, jnp.int32))
    call = jax.ffi.ffi_call("jaxllm_sample_rows_cpu", jax.ShapeDtypeStruct((rows,), jnp.int32))
    return call(
        f32(logits), f32(temperature), f32(min_p), i32(top_k), f32(top_p), i32(draft_tokens), f32(u), f32(u_draft)
    )


def path_attr(path: str) -> np.int32:
    """A `path` argument ("auto" or one of `kernel_paths()`) as the kernels' KernelPath number."""
    if path == "auto":
        return np.int32(0)
    if path not in kernel_paths():
        raise ValueError(f"kernel path {path!r} is not in this build: {kernel_paths()}")
    return np.int32(PATHS.index(path) + 1)


def live_rows(rows) -> jax.Array:
    """The `rows` argument of the GEMMs as the kernels take it: an int32 scalar, or [0] for all."""
    return jnp.zeros((0,), jnp.int32) if rows is None else jnp.asarray(rows, jnp.int32).reshape(())


def paged_attention_cpu(
    q,
    k_pages,
    v_pages,
    kv_lens,
    page_tables,
    cu_q_lens,
    num_seqs,
    *,
    sm_scale=None,
    sliding_window=None,
    logits_soft_cap=None,
    path="auto",
    causal=True,
):
    """Ragged paged attention on XLA:CPU (contract: `ragged_paged_attention_reference`).
    `causal` False: each query sees every key of its sequence (an encoder's whole prompt, all in
    this step).

    q is computed in float32; pages are float32, bf16 stored as uint16, or int8 or fp8 (uint8 bits)
    rows of codes and scales (kv_write.py). The
    result has q's dtype. `path` ("auto", or one of `kernel_paths()`) is the widest code path
    the kernel may take; a shape a path has no code for falls back to a narrower one.
    """
    require()
    kernel_path = path_attr(path)
    head_dim = q.shape[-1]
    sm_scale = head_dim**-0.5 if sm_scale is None else sm_scale
    if k_pages.dtype == jnp.bfloat16:  # callers normally pass the uint16 storage already
        k_pages = jax.lax.bitcast_convert_type(k_pages, jnp.uint16)
        v_pages = jax.lax.bitcast_convert_type(v_pages, jnp.uint16)
    call = jax.ffi.ffi_call("jaxllm_paged_attention_cpu", jax.ShapeDtypeStruct(q.shape, jnp.float32))
    out = call(
        q.astype(jnp.float32),
        k_pages,
        v_pages,
        jnp.asarray(kv_lens, jnp.int32),
        jnp.asarray(page_tables, jnp.int32),
        jnp.asarray(cu_q_lens, jnp.int32),
        jnp.asarray(num_seqs, jnp.int32).reshape(()),
        sm_scale=np.float32(sm_scale),
        sliding_window=np.int32(sliding_window or 0),
        soft_cap=np.float32(logits_soft_cap or 0.0),
        path=kernel_path,
        causal=np.int32(causal),
    )
    return out.astype(q.dtype)


def zeros(shape, dtype):
    """Zeros in a new CPU buffer, on 2 MiB pages where Linux allows it (`madvise` before the zeros
    are written; best effort): the KV pool's pages (csrc/kv_write.cc)."""
    require()
    # A side effect, so that XLA never merges two of them (K and V) into one buffer.
    return jax.ffi.ffi_call("jaxllm_zeros_cpu", jax.ShapeDtypeStruct(shape, dtype), has_side_effect=True)()


def write_kv(k_pages, v_pages, k_new, v_new, slot_mapping):
    """`kernels.write_kv` (same contract, same stored bytes) as one in-place FFI call: the pages
    are aliased to the results, so donate them to the enclosing jit as for the scatter."""
    require()
    call = jax.ffi.ffi_call(
        "jaxllm_write_kv_cpu",
        (jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype), jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype)),
        input_output_aliases={0: 0, 1: 1},
    )
    return call(
        k_pages, v_pages, k_new.astype(jnp.float32), v_new.astype(jnp.float32), jnp.asarray(slot_mapping, jnp.int32)
    )


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, delta: jax.Array | None = None, rows=None, dtype=jnp.float32):
    """RMSNorm of x [T, H] f32 (of `x + delta` when delta is given) in one call (csrc/norm.cc):
    `s * rsqrt(mean(s * s) + eps) * weight` in `dtype` (float32 or bfloat16, rounded as XLA's
    convert), and with delta also `s` itself: returns `(s, normed)`, else `normed`. `rows`: as
    for `matmul_packed` (rows past it are zeros in both results)."""
    require()
    t, h = x.shape
    add = delta is not None
    call = jax.ffi.ffi_call(
        "jaxllm_rms_norm_cpu",
        (jax.ShapeDtypeStruct((t, h) if add else (0,), jnp.float32), jax.ShapeDtypeStruct((t, h), dtype)),
    )
    s, normed = call(
        x.astype(jnp.float32),
        delta.astype(jnp.float32) if add else jnp.zeros((0,), jnp.float32),
        weight.astype(jnp.float32),
        live_rows(rows),
        eps=np.float32(eps),
    )
    return (s, normed) if add else normed
