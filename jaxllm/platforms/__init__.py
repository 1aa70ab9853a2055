"""What the machine a run lands on can do, asked in one place.

    platform = Platform.detect(device)        # before loading: the C++ build may still run
    platform = platform.confirmed()           # after: waits for the build, says what it has

A `Platform` is plain data (hashable, comparable), so the decisions that follow from it (the
weight plan: jaxllm/weights/plan.py; the default attention backend: `attention_backend`; whether
norms and sampling run in C++: `cpp_ops`) are pure functions that table-driven tests check
without the machine itself.
"""

from __future__ import annotations

import dataclasses

from jaxllm.utils import BF16_CPU_FLAGS, cpu_flags


@dataclasses.dataclass(frozen=True)
class Platform:
    """name: "cpu" | "gpu" | "tpu" (the device's platform).
    cpu_flags: the host CPU's feature flags (Linux names; empty off Linux).
    cpp_kernels: jaxllm's C++ kernels (kernels/native.py) are built, or expected to build (a
        compiler is there) while `build_confirmed` is False.
    cpp_bf16_dots: their bf16 GEMMs multiply with AVX512_BF16 dots (before the build is
        confirmed: the CPU's flags say it has them).
    build_confirmed: the two facts above come from the finished build."""

    name: str
    cpu_flags: frozenset[str] = frozenset()
    cpp_kernels: bool = False
    cpp_bf16_dots: bool = False
    build_confirmed: bool = False
    gpu_capability: str = ""  # a CUDA GPU's compute capability, e.g. "9.0"

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
            return cls(name, flags, build_confirmed=True)
        native.start_build()
        return cls(name, flags, native.expected(), "avx512_bf16" in flags)

    def confirmed(self) -> Platform:
        """This platform with the C++ facts from the finished build (waits for it)."""
        if self.name != "cpu" or self.build_confirmed:
            return self
        from jaxllm.kernels import native

        available = self.cpp_kernels and native.available()
        return dataclasses.replace(
            self, cpp_kernels=available, cpp_bf16_dots=available and native.has_bf16_dots(), build_confirmed=True
        )

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
