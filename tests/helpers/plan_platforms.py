"""Platforms and option sets the weight-plan tests resolve plans for (tests/quantization/test_weight_plan*.py)."""

from __future__ import annotations

import dataclasses

from jaxllm.platforms import Platform

ZEN3 = Platform("cpu", frozenset({"avx2", "fma"}), cpp_kernels=True, cpp_bf16_dots=False, build_confirmed=True)
ZEN4 = Platform(
    "cpu",
    frozenset({"avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni"}),
    cpp_kernels=True,
    cpp_bf16_dots=True,
    build_confirmed=True,
)
# Hosts of 16 and 64 GiB, for a checkpoint whose quantized matrices take 2 GiB as bf16
# (`PANELS`): more than 1/16 of the first's memory, less of the second's. ZEN4's memory is not known.
PANELS = 2 * 2**30
ZEN4_16G = dataclasses.replace(ZEN4, memory_bytes=16 * 2**30)
ZEN4_64G = dataclasses.replace(ZEN4, memory_bytes=64 * 2**30)
XEON_AMX = dataclasses.replace(ZEN4, cpu_flags=ZEN4.cpu_flags | {"amx_tile", "amx_bf16"}, cpp_amx=True)
NO_COMPILER = dataclasses.replace(ZEN3, cpp_kernels=False)
GPU = Platform("gpu")

F32, BF16 = dict(dtype="float32"), dict(dtype="bfloat16")
