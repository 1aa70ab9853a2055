"""What the machine a run lands on can do, asked in one place.

    platform = Platform.detect(device)        # before loading: the C++ build may still run
    platform = platform.confirmed()           # after: waits for the build, says what it has

A `Platform` is plain data (hashable, comparable), so the decisions that follow from it (the
weight plan: jaxllm/weights/plan.py; the default dtype, KV page size and attention backend:
`default_dtype`, `default_page_size`, `attention_backend`; whether norms and sampling run in
C++: `cpp_ops`) are pure functions that table-driven tests check without the machine itself.
"""

from __future__ import annotations

import dataclasses
import os

from jaxllm.utils import check_dtype

# x86 features (Linux /proc/cpuinfo names) that give bf16 dots a hardware path in XLA:CPU:
# AVX-512 BF16 (Zen 4/5, Cooper Lake+) and AMX (Sapphire Rapids+). Without them XLA widens
# bf16 operands to f32 on every dot, and float32 measured 2x faster end to end (Zen 2).
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")
# AMX's bf16 tiles (Sapphire Rapids+), which the C++ bf16 GEMMs use from two rows.
AMX_CPU_FLAGS = frozenset({"amx_tile", "amx_bf16"})
# The int8 dots the C++ GEMMs over 4- and 6-bit codes take int8 activations with (vpdpbusd).
INT8_DOTS_CPU_FLAG = "avx512_vnni"


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


CGROUP_MEMORY_MAX = "/sys/fs/cgroup/memory.max"  # cgroup v2's limit on this process's group


def host_memory() -> int:
    """The memory this process may use, in bytes: the host's physical memory, or the cgroup's
    limit (a container's) where that is lower; 0 where the OS does not say."""
    try:
        physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0
    try:
        with open(CGROUP_MEMORY_MAX) as f:  # "max" where unlimited
            limit = f.read().strip()
    except OSError:
        return physical
    return min(physical, int(limit)) if limit.isdigit() else physical


@dataclasses.dataclass(frozen=True)
class Platform:
    """name: "cpu" | "gpu" | "tpu" (the device's platform).
    cpu_flags: the host CPU's feature flags (Linux names; empty off Linux).
    cpp_kernels: jaxllm's C++ kernels (kernels/native.py) are built, or expected to build (a
        compiler is there) while `build_confirmed` is False.
    cpp_bf16_dots: their bf16 GEMMs multiply with AVX512_BF16 dots (before the build is
        confirmed: the CPU's flags say it has them).
    cpp_amx: and with AMX tiles from two rows (the build has the path and Linux lets the process
        use the tiles; before the build is confirmed: the CPU's flags say it has them).
    build_confirmed: the facts above come from the finished build.
    memory_bytes: on a CPU, the memory the process may use (`host_memory`; 0: not known)."""

    name: str
    cpu_flags: frozenset[str] = frozenset()
    cpp_kernels: bool = False
    cpp_bf16_dots: bool = False
    cpp_amx: bool = False
    build_confirmed: bool = False
    gpu_capability: str = ""  # a CUDA GPU's compute capability, e.g. "9.0"
    memory_bytes: int = 0

    @classmethod
    def detect(cls, device=None, *, use_cpp: bool = True) -> Platform:
        """The platform of `device` (default: JAX's first device), without waiting for anything.
        On a CPU with `use_cpp` (the run may use jaxllm's C++ kernels: its attention backend is
        theirs or the default), their build starts on its thread (a first start compiles them
        while the model loads); without it, `cpp_kernels` is False and nothing is built."""
        import jax

        from jaxllm.kernels import native

        device = device or jax.devices()[0]
        name = device.platform
        if name != "cpu":
            return cls(name, gpu_capability=str(getattr(device, "compute_capability", "") or ""))
        flags = cpu_flags()
        if not use_cpp:
            return cls(name, flags, build_confirmed=True, memory_bytes=host_memory())
        native.start_build()
        expected, bf16_dots = native.expected(), "avx512_bf16" in flags
        return cls(name, flags, expected, bf16_dots, bf16_dots and AMX_CPU_FLAGS <= flags, memory_bytes=host_memory())

    def confirmed(self) -> Platform:
        """This platform with the C++ facts from the finished build (waits for it)."""
        if self.name != "cpu" or self.build_confirmed:
            return self
        from jaxllm.kernels import native

        available = self.cpp_kernels and native.available()
        return dataclasses.replace(
            self,
            cpp_kernels=available,
            cpp_bf16_dots=available and native.has_bf16_dots(),
            cpp_amx=available and "amx" in native.kernel_paths(),
            build_confirmed=True,
        )

    @classmethod
    def named(cls, name: str) -> Platform:
        """A platform known by its name only (config resolution without a device): a CPU is
        this host's CPU, with its flags."""
        return cls(name, cpu_flags() if name == "cpu" else frozenset())

    def resolve_dtype(self, dtype: str, int8_codes: bool = False) -> tuple[str, str]:
        """(dtype, why): `dtype` itself unless it is "auto", then `default_dtype` (for a GGUF of
        int8-dot codes where `int8_codes`: see `auto_dtype`)."""
        return (check_dtype(dtype), "asked for") if dtype != "auto" else self.auto_dtype(int8_codes)

    @property
    def default_dtype(self) -> tuple[str, str]:
        """(dtype, why) for dtype "auto": bfloat16 on accelerators and on CPUs with hardware bf16
        dots (`BF16_CPU_FLAGS`), float32 on other CPUs, where bf16 is the slow dtype."""
        return self.auto_dtype(False)

    def auto_dtype(self, int8_codes: bool) -> tuple[str, str]:
        """`default_dtype`, but float32 for a GGUF whose matrices all have codes the int8 dot
        kernels take (`int8_codes`: weights/prepare.py `int8_dot_checkpoint`) on a CPU with
        AVX512_VNNI and the C++ kernels: there, as on CPUs without bf16 dots, dtype auto's float32
        multiplies the codes by int8 activations (`EngineArgs.int8_activations`, llama.cpp's
        scheme), on bf16 KV pages (`resolve_kv_cache_dtype`). A prompt's calls take the same codes
        to bf16 dots (`kernels.gemm.act8_on_bf16`: AMX's tiles; without AMX 6-bit codes only).
        On the 1.5B Q4_K_M: on a 2-vCPU Zen 4 1.04-1.15x bfloat16's output across a serving
        sweep, on a 2-vCPU Xeon with AMX one stream 1.6x and 4 streams 2.3x bfloat16's, prompts
        level (docs/quantization.md)."""
        if self.name != "cpu":
            return "bfloat16", f"{self.name} computes bfloat16 in hardware"
        hardware = [flag for flag in BF16_CPU_FLAGS if flag in self.cpu_flags]
        if int8_codes and self.weighs_int8_codes:
            return "float32", (
                f"a GGUF of 4- to 6-bit codes on a CPU with int8 dots ({INT8_DOTS_CPU_FLAG}): its codes "
                "multiply int8 activations under float32, faster there than bfloat16"
            )
        if hardware:
            return "bfloat16", f"this CPU has hardware bf16 dots ({', '.join(hardware)})"
        return "float32", (
            f"this CPU has no hardware bf16 dots (no {' or '.join(BF16_CPU_FLAGS)}): float32 is the faster dtype there"
        )

    @property
    def weighs_int8_codes(self) -> bool:
        """Whether dtype auto's pick here depends on the checkpoint's codes (`auto_dtype`): a CPU
        with bf16 dots, AVX512_VNNI and the C++ kernels. Elsewhere the engine does not read a
        GGUF's header for it."""
        bf16 = any(flag in self.cpu_flags for flag in BF16_CPU_FLAGS)
        return self.name == "cpu" and bf16 and INT8_DOTS_CPU_FLAG in self.cpu_flags and self.cpp_kernels

    @property
    def default_page_size(self) -> int:
        """KV page size where `block_size` is left unset: 64 tokens on CPU (vLLM's CPU backend
        uses 128), 16 elsewhere (vLLM's GPU default). A CPU decode reads each sequence's pages
        from RAM, and each page of a KV head is one contiguous run: on a Zen 4 EPYC, 128 decodes at
        context 256 took about 0.7x the attention time with pages of 64 as with pages of 16 (8 KiB
        runs against 2 KiB; 128 measured the same as 64), and the standard workload ran 416-420
        against 368-401 output tok/s (benchmarks/results/zen4/RESULTS.md). The cost: prefix
        caching shares whole pages only, and each sequence's last page is partly empty (the
        standard workload's sequences waste 14.1% of their slots against 3.8%: 417 fit in 2 GiB
        against 467, `benchmarks/memory.py`)."""
        return 64 if self.name == "cpu" else 16

    @property
    def attention_backend(self) -> str:
        """The attention backend that serves this platform best (`attention_backend=None`): on a
        CPU the C++ kernel where it is built, else the `jnp` rows; on a CUDA GPU with warpgroup
        MMAs the Mosaic GPU kernel, on other GPUs the Triton one (jaxllm/attention/)."""
        if self.name == "cpu":
            return "native" if self.cpp_kernels else "cpu"
        return "mosaic" if self.name == "gpu" and warpgroup_mma(self.gpu_capability) else "pallas"

    @property
    def cpp_ops(self) -> bool:
        """Whether a step's norms and sampling run in the C++ kernels (`models.decoder.add_norm`,
        `runner.sampler.sampling_ops`): on a CPU whose build of them serves this run."""
        return self.name == "cpu" and self.cpp_kernels

    @property
    def bf16_dots(self) -> bool:
        """Whether XLA's bf16 dots run in hardware (accelerators; CPUs with `BF16_CPU_FLAGS`)."""
        return self.name != "cpu" or any(flag in self.cpu_flags for flag in BF16_CPU_FLAGS)


def warpgroup_mma(capability: str) -> bool:
    """Whether a CUDA compute capability has Hopper's warpgroup MMAs, which the Mosaic GPU
    kernel is written for (9.x; Blackwell's tcgen05 MMAs would be another kernel)."""
    return capability.split(".")[0] == "9"


__all__ = ["Platform", "warpgroup_mma"]
