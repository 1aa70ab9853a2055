"""jaxllm's CPU kernels in C++ (csrc/), as XLA FFI calls.

`paged_attention_cpu` has the ragged contract of `ragged_paged_attention_reference`
(csrc/paged_attention.h, .cc, and paged_attention_avx512.cc / paged_attention_avx2.cc for
CPUs with AVX-512 / AVX2 + FMA; `kernel_paths()` lists the paths the build has);
`argmax_logsumexp` gives greedy sampling's two row reductions in one pass and `sample_rows`
a sampled row's token (csrc/sampling.cc);
`matmul_packed` multiplies by an f32 or bf16 weight packed once by `pack_weight` (csrc/gemm.cc,
csrc/gemm_bf16.cc: AVX512_BF16 dots where the CPU has them, `has_bf16_dots()`),
`matmul_quantized` by int8 or int4 codes packed by `pack_codes` (csrc/gemm_quant.cc, and
csrc/gemm_q4a8.cc / gemm_w8a8.cc for int4 / int8 codes x int8 activations), `matmul_quantized_bf16`
by 8-bit codes or 4-bit ones packed with `pairs=True` (csrc/gemm_quant_bf16.cc: the bf16 GEMM's
numbers); `write_kv` is
kv_write.py's `write_kv` in place (csrc/kv_write.cc: one handler instead of an LLVM module per layer's scatter);
`rms_norm` is RMSNorm with the residual add before it in one call (csrc/norm.cc).
csrc/cpu_kernels_attention.cc and cpu_kernels_gemm.cc, which include them all, are compiled
side by side on first use (on a thread of their own: `start_build`) with the system C++
compiler (`$CXX`, else `c++`) against the XLA FFI headers that ship with jaxlib, with
`-O3 -march=native` and fast math, into `<cache root>/native/` (keyed by every file in csrc/,
the flags, the compiler, jaxlib's version and the CPU), then loaded with ctypes and registered
as FFI targets. Later processes load the cached library. `available()` says whether that
worked; without a compiler the engine falls back to the jnp rows backend
(`attention_backend="cpu"`, see jaxllm/attention.py).
"""

from __future__ import annotations

import ctypes
import hashlib
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

from jaxllm.utils import default_cache_root

# FFI target name -> symbol of its handler in the library
TARGETS = {
    "jaxllm_paged_attention_cpu": "JaxllmPagedAttentionCpu",
    "jaxllm_argmax_logsumexp_cpu": "JaxllmArgmaxLogsumexpCpu",
    "jaxllm_sample_rows_cpu": "JaxllmSampleRowsCpu",
    "jaxllm_matmul_packed_cpu": "JaxllmMatmulPackedCpu",
    "jaxllm_matmul_packed_bf16_cpu": "JaxllmMatmulPackedBf16Cpu",
    "jaxllm_matmul_quantized_cpu": "JaxllmMatmulQuantCpu",
    "jaxllm_matmul_quantized_bf16_cpu": "JaxllmMatmulQuantBf16Cpu",
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
    os.makedirs(cache_dir, exist_ok=True)
    path = os.path.join(cache_dir, f"cpu_kernels-{key}.so")
    if os.path.exists(path):
        return path
    # Compile to a private name, then rename: concurrent processes never load a partial file.
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
                os.unlink(tmp)
                raise RuntimeError(f"compiling the CPU kernels failed:\n{' '.join(cmd)}\n{stderr[-4000:]}")
    finally:
        for obj in objs:
            if os.path.exists(obj):
                os.unlink(obj)
    os.replace(tmp, path)
    return path


# The kernels' code paths, narrowest first (csrc/simd.h's KernelPath).
PATHS = ("portable", "avx2", "avx512")
_path_bits = 0
_bf16_dots = False


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
    global _lib, _path_bits, _bf16_dots
    try:
        lib = ctypes.cdll.LoadLibrary(build())
        for target, symbol in TARGETS.items():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
        _path_bits = lib.JaxllmKernelPaths()
        _bf16_dots = bool(lib.JaxllmBf16GemmHasDots())
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


def available() -> bool:
    return _load() is None


def unavailable_reason() -> str | None:
    return _load()


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


PANEL = 16  # columns per panel of a packed weight (csrc/gemm.cc)


def pack_weight(w: np.ndarray, transposed: bool = False, dtype=np.float32) -> np.ndarray:
    """A weight w [K, N] (or, `transposed`, [N, K]: an embedding table used as the LM head)
    as the panels `matmul_packed` reads: float32 [N / 16, K, 16]; or with dtype bfloat16
    [N / 16, K / 2, 16, 2], rows 2 kp and 2 kp + 1 of a column side by side (the pairs
    AVX512_BF16's dot multiplies). N must be a multiple of 16 (and K even for bf16)."""
    w = np.asarray(w).astype(dtype, copy=False)  # a bf16 weight is rearranged without an f32 copy
    if transposed:
        n, k = w.shape
        panels = w.reshape(n // PANEL, PANEL, k).transpose(0, 2, 1)
    else:
        k, n = w.shape
        panels = w.reshape(k, n // PANEL, PANEL).transpose(1, 0, 2)
    if w.dtype == np.float32:
        return np.ascontiguousarray(panels)
    return np.ascontiguousarray(panels.reshape(n // PANEL, k // 2, 2, PANEL).transpose(0, 1, 3, 2))


def packable(shape, transposed: bool = False, dtype=np.float32) -> bool:
    """Whether a 2-D weight of this shape can be packed (its output dimension splits into
    panels; for bf16, its input dimension into pairs)."""
    if len(shape) != 2:
        return False
    k, n = (shape[1], shape[0]) if transposed else shape
    return n % PANEL == 0 and (np.dtype(dtype) == np.float32 or k % 2 == 0)


def _path_attr(path: str) -> np.int32:
    """A `path` argument ("auto" or one of `kernel_paths()`) as the kernels' KernelPath number."""
    if path == "auto":
        return np.int32(0)
    if path not in kernel_paths():
        raise ValueError(f"kernel path {path!r} is not in this build: {kernel_paths()}")
    return np.int32(PATHS.index(path) + 1)


def _live_rows(rows) -> jax.Array:
    """The `rows` argument of the GEMMs as the kernels take it: an int32 scalar, or [0] for all."""
    return jnp.zeros((0,), jnp.int32) if rows is None else jnp.asarray(rows, jnp.int32).reshape(())


def matmul_packed(x: jax.Array, w_packed: jax.Array, path: str = "auto", rows=None, swiglu: bool = False) -> jax.Array:
    """x [..., K] @ the weight packed by `pack_weight` -> [..., N] f32: with f32 panels x in f32
    (csrc/gemm.cc), with bf16 panels x rounded to bf16 and f32 sums (csrc/gemm_bf16.cc).
    `path`: as for `paged_attention_cpu` (f32: portable and AVX2 code; bf16: portable and
    AVX-512, the latter with AVX512_BF16 only). `rows` (an
    int32 scalar, may be traced): only x's first `rows` rows (of x flattened to 2-D) are
    multiplied, the rest of the result is zeros; None: all. `swiglu`: the weight is a gated
    MLP's [gate | up] (N / 2 columns each, N / 2 a multiple of 16) and the result
    `silu(x @ gate) * (x @ up)` [..., N / 2], in one pass."""
    require()
    path_attr = _path_attr(path)
    n = w_packed.shape[0] * PANEL // (2 if swiglu else 1)
    lead = x.shape[:-1]
    bf16 = w_packed.dtype == jnp.bfloat16
    x2 = x.reshape(-1, x.shape[-1]).astype(jnp.bfloat16 if bf16 else jnp.float32)
    call = jax.ffi.ffi_call(
        "jaxllm_matmul_packed_bf16_cpu" if bf16 else "jaxllm_matmul_packed_cpu",
        jax.ShapeDtypeStruct((x2.shape[0], n), jnp.float32),
    )
    return call(x2, w_packed, _live_rows(rows), path=path_attr, swiglu=np.int32(swiglu)).reshape(*lead, n)


def pack_codes(codes: np.ndarray, bits: int, w8a8: bool = False, pairs: bool = False) -> np.ndarray:
    """Integer codes [K, N] (int8 for 8 bits, 0..15 for 4 bits) as the panels
    `matmul_quantized` reads: int8 [N / 16, K, 16], or for 4 bits uint8 [N / 16, K, 8] with
    column j of a panel in byte j's low nibble and column j + 8 in its high nibble. `w8a8` (8
    bits, K a multiple of 4: the codes of `act8=True`): each panel's rows in groups of 4, a
    column's 4 codes side by side ([N / 16, K / 4, 16, 4] in the same [N / 16, K, 16] array), as
    the int8 dot instructions take them. `pairs` (4 bits, K a multiple of 4: the codes of
    `matmul_quantized_bf16`): uint8 [N / 16, K / 4, 32], a block of 4 rows of a panel in 32 bytes, byte
    2 c + t holding row 4 b + t of column c in its low nibble and row 4 b + 2 + t in its high one."""
    k, n = codes.shape
    panels = np.asarray(codes).reshape(k, n // PANEL, PANEL).transpose(1, 0, 2)
    if pairs:
        u = panels.astype(np.uint8).reshape(n // PANEL, k // 4, 2, 2, PANEL).transpose(0, 1, 2, 4, 3)
        u = u.reshape(n // PANEL, k // 4, 2, 2 * PANEL)
        return np.ascontiguousarray(u[:, :, 0] | (u[:, :, 1] << 4))
    if bits == 8 and w8a8:
        panels = panels.reshape(n // PANEL, k // 4, 4, PANEL).transpose(0, 1, 3, 2).reshape(n // PANEL, k, PANEL)
    if bits == 8:
        return np.ascontiguousarray(panels, np.int8)
    u = panels.astype(np.uint8)
    return np.ascontiguousarray(u[..., : PANEL // 2] | (u[..., PANEL // 2 :] << 4))


def codes_to_bf16_panels(codes, scale, offset, bits: int, super_scale=None, super_offset=None) -> np.ndarray:
    """The packed bf16 weight (`pack_weight(w, dtype=bfloat16)`'s layout) of codes laid out for
    `matmul_quantized_bf16` (same arguments), each weight bf16(code * scale + offset) as that GEMM
    computes it, in one C++ pass on the host (csrc/gemm_quant_bf16.cc)."""
    require()
    host = lambda a: None if a is None else np.ascontiguousarray(np.asarray(a))  # noqa: E731
    codes, scale, offset, super_scale, super_offset = map(host, (codes, scale, offset, super_scale, super_offset))
    n = codes.shape[0] * PANEL
    k = codes.shape[1] * (4 if bits == 4 else 1)
    groups = scale.shape[0] if scale.ndim == 2 else 0
    supers_ok = super_scale is None or (
        super_scale.shape[1:] == (n,)
        and groups % super_scale.shape[0] == 0
        and (super_offset is None or super_offset.shape == super_scale.shape)
    )
    if (
        scale.shape != (groups, n)
        or not groups
        or k % groups
        or (offset is not None and offset.shape != scale.shape)
        or not supers_ok
    ):
        raise ValueError(f"codes_to_bf16_panels: codes {codes.shape} with scales {scale.shape} have no bf16 panels")
    out = np.empty((n // PANEL, k // 2, PANEL, 2), np.uint16)
    ptr = lambda a: None if a is None else a.ctypes.data_as(ctypes.c_void_p)  # noqa: E731
    err = _lib.JaxllmCodesToBf16Panels(
        ptr(codes),
        ctypes.c_int32(bits),
        ctypes.c_int64(k),
        ctypes.c_int64(n),
        ctypes.c_int64(scale.shape[0]),
        ptr(scale),
        ptr(offset),
        ctypes.c_int32(scale.dtype == np.float16),
        ptr(super_scale),
        ptr(super_offset),
        ctypes.c_int64(scale.shape[0] // super_scale.shape[0] if super_scale is not None else 1),
        ptr(out),
    )
    if err:
        raise ValueError(f"codes_to_bf16_panels: codes {codes.shape} with scales {scale.shape} have no bf16 panels")
    return out.view(jnp.bfloat16)


def matmul_quantized(
    x: jax.Array,
    codes: jax.Array,
    scale: jax.Array,
    offset: jax.Array | None,
    bits: int,
    path: str = "auto",
    rows=None,
    swiglu: bool = False,
    act8: bool = False,
    super_scale: jax.Array | None = None,
    super_offset: jax.Array | None = None,
    bias: jax.Array | None = None,
    act_group: int = 0,
) -> jax.Array:
    """x [..., K] f32 @ w -> [..., N] f32, w [K, N] given by the panels of `pack_codes`, and
    scale (and offset, or None) [G, N], f32 or f16: w[k, n] = code * scale[g, n] + offset[g, n]
    for the group g = k // (K / G) (csrc/gemm_quant.cc dequantizes a panel at a time; x stays
    f32). Two-level scales (GGUF's K-quants): scale and offset are int8 sub-scales of
    `super_scale` and `super_offset`, f16 [G / S, N]: group g's scale is
    scale[g, n] * super_scale[g // S, n], its offset likewise. `act8`: x is first quantized to
    int8 and the products are integer sums. With 4-bit codes (K / G a multiple of `ACT_GROUP`)
    per row and group of 32 columns (q = round(x * 127 / max|x|), the scale max|x| / 127), as
    llama.cpp does (csrc/gemm_q4a8.cc); with 8-bit codes in [-127, 127], one scale per column
    and no offset (W8A8; K a multiple of 4, at most `W8A8_MAX_K`; the codes packed with
    `w8a8=True`) per row and group of `act_group` columns (0: the row whole; else a multiple of 4
    dividing K), as `kv_write.int8_rows` does a row (csrc/gemm_w8a8.cc); `bias`, int32 [K /
    act_group (1 for 0), N] or None, is then 128 times each column's code sum over each group
    (`QuantizedWeight.bias`; None: summed in the call). `rows`, `swiglu`: as for `matmul_packed`."""
    bias = jnp.zeros((0,), jnp.int32) if bias is None else bias
    return _quantized_call(
        "jaxllm_matmul_quantized_cpu",
        x.astype(jnp.float32),
        codes,
        scale,
        offset,
        super_scale,
        super_offset,
        rows,
        swiglu,
        bias,
        bits=np.int32(bits),
        path=_path_attr(path),
        act8=np.int32(act8),
        act_group=np.int32(act_group),
    )


def matmul_quantized_bf16(
    x: jax.Array,
    codes: jax.Array,
    scale: jax.Array,
    offset: jax.Array | None,
    bits: int,
    path: str = "auto",
    rows=None,
    swiglu: bool = False,
    super_scale: jax.Array | None = None,
    super_offset: jax.Array | None = None,
) -> jax.Array:
    """x [..., K] @ w -> [..., N] f32 with x rounded to bf16 and w [K, N] given by 8-bit codes
    packed by `pack_codes` or 4-bit ones packed by `pack_codes(..., pairs=True)`, scale/offset as
    for `matmul_quantized` (K and the groups multiples of 4 rows): each weight rounded to bf16
    as it is read and multiplied by AVX512_BF16's bf16 dot (csrc/gemm_quant_bf16.cc), the packed
    bf16 GEMM's product of the dequantized weights bit for bit. `path`: "portable" or "avx512"
    (AVX512_BF16 builds only); `rows`, `swiglu`: as for `matmul_packed`."""
    return _quantized_call(
        "jaxllm_matmul_quantized_bf16_cpu",
        x.astype(jnp.bfloat16),
        codes,
        scale,
        offset,
        super_scale,
        super_offset,
        rows,
        swiglu,
        bits=np.int32(bits),
        path=_path_attr(path),
    )


def _quantized_call(
    target: str, x, codes, scale, offset, super_scale, super_offset, rows, swiglu: bool, *extra, **attrs
):
    """The quantized GEMMs' FFI call: x [..., K] (in the kernel's dtype) -> [..., N] f32, absent
    offsets and super-scales as empty arrays; `extra` arrays go after them."""
    require()
    n = codes.shape[0] * PANEL // (2 if swiglu else 1)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    offset = jnp.zeros((0,), scale.dtype) if offset is None else offset
    supers = [jnp.zeros((0,), jnp.float16) if a is None else a for a in (super_scale, super_offset)]
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((x2.shape[0], n), jnp.float32))
    return call(x2, codes, scale, offset, *supers, *extra, _live_rows(rows), swiglu=np.int32(swiglu), **attrs).reshape(
        *lead, n
    )


ACT_GROUP = 32  # columns of x per int8 scale with `matmul_quantized(..., act8=True)` and 4-bit codes
W8A8_MAX_K = 131072  # the largest K of 8-bit codes x int8 rows (csrc/gemm_w8a8.cc: exact int32 sums)


def paged_attention_cpu(
    q,
    k_pages,
    v_pages,
    kv_lens,
    block_tables,
    cu_q_lens,
    num_seqs,
    *,
    sm_scale=None,
    sliding_window=None,
    logits_soft_cap=None,
    path="auto",
):
    """Ragged paged attention on XLA:CPU (contract: `ragged_paged_attention_reference`).

    q is computed in float32; pages are float32, bf16 stored as uint16, or int8 or fp8 (uint8 bits)
    rows of codes and scales (kv_write.py). The
    result has q's dtype. `path` ("auto", or one of `kernel_paths()`) is the widest code path
    the kernel may take; a shape a path has no code for falls back to a narrower one.
    """
    require()
    path_attr = _path_attr(path)
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
        jnp.asarray(block_tables, jnp.int32),
        jnp.asarray(cu_q_lens, jnp.int32),
        jnp.asarray(num_seqs, jnp.int32).reshape(()),
        sm_scale=np.float32(sm_scale),
        sliding_window=np.int32(sliding_window or 0),
        soft_cap=np.float32(logits_soft_cap or 0.0),
        path=path_attr,
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
        _live_rows(rows),
        eps=np.float32(eps),
    )
    return (s, normed) if add else normed
