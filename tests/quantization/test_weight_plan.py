"""The weight plan (jaxllm/weights/plan.py): every linear's storage and kernel from the platform,
the mesh, the options and the checkpoint, as a table of hand-worked cases; then that the
engine's weights are what the plan says."""

from __future__ import annotations

import dataclasses
import os

import pytest

from jaxllm.config import EngineArgs
from jaxllm import platforms
from jaxllm.platforms import Platform
from jaxllm.weights.plan import LINEARS, UNKNOWN, LinearPlan, resolve_weight_plan

ZEN3 = Platform("cpu", frozenset({"avx2", "fma"}), cpp_kernels=True, cpp_bf16_dots=False, build_confirmed=True)
ZEN4 = Platform(
    "cpu",
    frozenset({"avx2", "fma", "avx512f", "avx512_bf16"}),
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

# (id, platform, EngineArgs fields, one device, checkpoint,
#  expected (quantization, load, cpp_gemm, pack_floats, smooth, small_step_codes),
#  expected linears {name: LinearPlan} (the rest not checked here))
CASES = [
    (
        "avx2 defaults, before loading: keep a GGUF's blocks",
        ZEN3,
        F32,
        True,
        UNKNOWN,
        (None, "auto", True, True, False, False),
        {"wqkv": LinearPlan(None, "cpp")},
    ),
    (
        "avx2 defaults, a GGUF loaded: its blocks in the C++ GEMM",
        ZEN3,
        F32,
        True,
        "gguf",
        ("gguf", "auto", True, True, False, False),
        {  # (the C++ GEMM's calls of up to 16 rows factor the group scales out of their sums)
            "wqkv": LinearPlan("gguf", "cpp", "float_factored"),
            "lm_head": LinearPlan("gguf", "cpp", "float_factored"),
            "experts_down": LinearPlan("gguf", "xla"),
            "embed": LinearPlan("gguf", "cpp", "float_factored"),
        },
    ),
    (
        "avx2, a GGUF with int8_activations: 4-bit codes x int8 rows, the others factored",
        ZEN3,
        dict(F32, int8_activations=True),
        True,
        "gguf",
        ("gguf", "auto", True, True, False, False),
        {
            "wqkv": LinearPlan("gguf", "cpp", "int8_float_factored"),
            "lm_head": LinearPlan("gguf", "cpp", "int8_float_factored"),
        },
    ),
    (
        "avx2, a GGUF with int8_activations and drafts: nothing factored",
        ZEN3,
        dict(F32, int8_activations=True, speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
        True,
        "gguf",
        ("gguf", "auto", True, True, False, False),
        {"wqkv": LinearPlan("gguf", "cpp", "int8")},
    ),
    (
        "avx2 defaults, an HF checkpoint: packed float32",
        ZEN3,
        F32,
        True,
        None,
        (None, "auto", True, True, False, False),
        {"wqkv": LinearPlan(None, "cpp"), "w_down": LinearPlan(None, "cpp")},
    ),
    (
        "avx2, packed_weights off: float matrices through XLA, codes still C++",
        ZEN3,
        dict(F32, packed_weights=False),
        True,
        "gguf",
        ("gguf", "auto", True, False, False, False),
        {"wqkv": LinearPlan("gguf", "cpp", "float_factored")},
    ),
    (
        "avx2, a GGUF's blocks kept, then the build failed: dequantized",
        NO_COMPILER,
        F32,
        True,
        "gguf",
        (None, None, False, False, False, False),
        {"wqkv": LinearPlan(None, "xla")},
    ),
    (
        "avx2, asked gguf under bf16 (no bf16 dots): codes in C++, x float",
        ZEN3,
        dict(BF16, quantization="gguf"),
        True,
        "gguf",
        ("gguf", "gguf", True, False, False, False),
        {"wqkv": LinearPlan("gguf", "cpp", "float")},
    ),
    (
        "avx512_bf16 defaults, before loading: blocks for small steps",
        ZEN4,
        BF16,
        True,
        UNKNOWN,
        (None, "auto", True, True, False, True),
        {"wqkv": LinearPlan(None, "cpp", small_step_codes=True, small_step_activations="factored")},
    ),
    (
        "avx512_bf16 defaults, a GGUF: bf16 panels + small-step codes, their scales factored out",
        ZEN4,
        BF16,
        True,
        "gguf",
        (None, "auto", True, True, False, True),
        {
            "wqkv": LinearPlan(None, "cpp", small_step_codes=True, small_step_activations="factored"),
            "lm_head": LinearPlan(None, "cpp", small_step_codes=True, small_step_activations="factored"),
            "experts_gate_up": LinearPlan(None, "xla"),
            "embed": LinearPlan(None, "cpp", small_step_codes=True, small_step_activations="factored"),
        },
    ),
    (
        "avx512_bf16, a GGUF with int8_activations: the small steps' layer codes x int8 rows",
        ZEN4,
        dict(BF16, int8_activations=True),
        True,
        "gguf",
        (None, "auto", True, True, False, True),
        {
            "wqkv": LinearPlan(None, "cpp", small_step_codes=True, small_step_activations="int8"),
            "w_down": LinearPlan(None, "cpp", small_step_codes=True, small_step_activations="int8"),
            "lm_head": LinearPlan(None, "cpp", small_step_codes=True),
            "embed": LinearPlan(None, "cpp", small_step_codes=True),
        },
    ),
    (
        "avx512_bf16, a GGUF under batch_invariant: the small-step codes' bf16 numbers",
        ZEN4,
        dict(BF16, batch_invariant=True),
        True,
        "gguf",
        (None, "auto", True, True, False, True),
        {"wqkv": LinearPlan(None, "cpp", small_step_codes=True)},
    ),
    (
        "avx512_bf16, a GGUF with speculative decoding: the small steps keep the bf16 numbers",
        ZEN4,
        dict(BF16, speculative_config={"method": "ngram", "num_speculative_tokens": 4}),
        True,
        "gguf",
        (None, "auto", True, True, False, True),
        {"wqkv": LinearPlan(None, "cpp", small_step_codes=True)},
    ),
    (
        "avx512_bf16, a GGUF without small_step_factored: the bf16 numbers",
        ZEN4,
        dict(BF16, small_step_factored=False),
        True,
        "gguf",
        (None, "auto", True, True, False, True),
        {"w_down": LinearPlan(None, "cpp", small_step_codes=True)},
    ),
    (
        "avx512_bf16 defaults, a GGUF whose bf16 panels would take over 1/16 of the memory: its blocks alone",
        ZEN4_16G,
        BF16,
        True,
        "gguf",
        ("gguf", "auto", True, True, False, False),
        {
            "wqkv": LinearPlan("gguf", "cpp", "factored"),
            "w_down": LinearPlan("gguf", "cpp", "factored"),
            "lm_head": LinearPlan("gguf", "cpp", "factored"),
            "embed": LinearPlan("gguf", "cpp", "factored"),
            "experts_down": LinearPlan("gguf", "xla"),
        },
    ),
    (
        "avx512_bf16, a GGUF's blocks alone with speculative decoding: factored, as a stream's 5-row checks",
        ZEN4_16G,
        dict(BF16, speculative_config={"method": "ngram", "num_speculative_tokens": 4}),
        True,
        "gguf",
        ("gguf", "auto", True, True, False, False),
        {"wqkv": LinearPlan("gguf", "cpp", "factored")},
    ),
    (
        "avx512_bf16, a GGUF's blocks alone, small_step_factored off: the bf16 numbers",
        ZEN4_16G,
        dict(BF16, small_step_factored=False),
        True,
        "gguf",
        ("gguf", "auto", True, True, False, False),
        {"w_gate_up": LinearPlan("gguf", "cpp", "bf16")},
    ),
    (
        "avx512_bf16 defaults, a GGUF whose bf16 panels take under 1/16 of the memory: the split",
        ZEN4_64G,
        BF16,
        True,
        "gguf",
        (None, "auto", True, True, False, True),
        {"wqkv": LinearPlan(None, "cpp", small_step_codes=True, small_step_activations="factored")},
    ),
    (
        "avx512_bf16, quantization gguf asked: its blocks alone, their codes factored",
        ZEN4,
        dict(BF16, quantization="gguf"),
        True,
        "gguf",
        ("gguf", "gguf", True, True, False, False),
        {"w_down": LinearPlan("gguf", "cpp", "factored"), "embed": LinearPlan("gguf", "cpp", "factored")},
    ),
    (
        "avx512_bf16, quantization gguf under batch_invariant: the bf16 numbers",
        ZEN4,
        dict(BF16, quantization="gguf", batch_invariant=True),
        True,
        "gguf",
        ("gguf", "gguf", True, True, False, False),
        {"w_down": LinearPlan("gguf", "cpp", "bf16")},
    ),
    (
        "avx512_bf16, small_step_codes asked where the panels would be large: the split",
        ZEN4_16G,
        dict(BF16, small_step_codes=True),
        True,
        "gguf",
        (None, "auto", True, True, False, True),
        {"wqkv": LinearPlan(None, "cpp", small_step_codes=True, small_step_activations="factored")},
    ),
    (
        "amx, small_step_factored: its blocks alone, their codes factored",
        XEON_AMX,
        dict(BF16, small_step_factored=True),
        True,
        "gguf",
        ("gguf", "auto", True, True, False, False),
        {"w_down": LinearPlan("gguf", "cpp", "factored"), "lm_head": LinearPlan("gguf", "cpp", "factored")},
    ),
    (
        "amx defaults, before loading: keep a GGUF's blocks",
        XEON_AMX,
        BF16,
        True,
        UNKNOWN,
        (None, "auto", True, True, False, False),
        {"wqkv": LinearPlan(None, "cpp")},
    ),
    (
        "amx defaults, a GGUF: its blocks alone, x as bf16",
        XEON_AMX,
        BF16,
        True,
        "gguf",
        ("gguf", "auto", True, True, False, False),
        {
            "wqkv": LinearPlan("gguf", "cpp", "bf16"),
            "lm_head": LinearPlan("gguf", "cpp", "bf16"),
            "embed": LinearPlan("gguf", "cpp", "bf16"),
            "experts_down": LinearPlan("gguf", "xla"),
        },
    ),
    (
        "amx defaults, an HF checkpoint: bf16 panels",
        XEON_AMX,
        BF16,
        True,
        None,
        (None, None, True, True, False, False),
        {"wqkv": LinearPlan(None, "cpp")},
    ),
    (
        "amx, small_step_codes asked: bf16 panels + small-step codes",
        XEON_AMX,
        dict(BF16, small_step_codes=True),
        True,
        "gguf",
        (None, "auto", True, True, False, True),
        {"wqkv": LinearPlan(None, "cpp", small_step_codes=True, small_step_activations="factored")},
    ),
    (
        "amx, int8_activations: the small-step split (the large steps stay on AMX)",
        XEON_AMX,
        dict(BF16, int8_activations=True),
        True,
        "gguf",
        (None, "auto", True, True, False, True),
        {"wqkv": LinearPlan(None, "cpp", small_step_codes=True, small_step_activations="int8")},
    ),
    (
        "avx512_bf16 defaults, an HF checkpoint: bf16 panels",
        ZEN4,
        BF16,
        True,
        None,
        (None, None, True, True, False, False),
        {"wqkv": LinearPlan(None, "cpp")},
    ),
    (
        "avx512_bf16, small_step_codes off",
        ZEN4,
        dict(BF16, small_step_codes=False),
        True,
        UNKNOWN,
        (None, None, True, True, False, False),
        {"wqkv": LinearPlan(None, "cpp")},
    ),
    (
        "avx512_bf16, int4: codes x bf16, an 8-bit LM head",
        ZEN4,
        dict(BF16, quantization="int4"),
        True,
        None,
        ("int4", None, True, True, False, False),
        {
            "wqkv": LinearPlan("int4", "cpp", "bf16"),
            "lm_head": LinearPlan("int8_weight_only", "cpp", "bf16"),
            "embed": LinearPlan("int8_weight_only", "cpp", "bf16"),
            "experts_down": LinearPlan("int4", "xla"),
        },
    ),
    (
        "avx2, w8a8: smoothed, int8 x int8 in C++, experts weight-only",
        ZEN3,
        dict(F32, quantization="w8a8"),
        True,
        None,
        ("w8a8", None, True, True, True, False),
        {
            "wqkv": LinearPlan("w8a8", "cpp", "int8"),
            "lm_head": LinearPlan("w8a8", "cpp", "int8"),
            "experts_gate_up": LinearPlan("int8_weight_only", "xla"),
        },
    ),
    (
        "avx2, int4 with int8_activations",
        ZEN3,
        dict(F32, quantization="int4", int8_activations=True),
        True,
        None,
        ("int4", None, True, True, False, False),
        {"w_gate_up": LinearPlan("int4", "cpp", "int8")},
    ),
    (
        "a mesh: plain codes through XLA",
        ZEN3,
        dict(F32, quantization="int8_weight_only"),
        False,
        None,
        ("int8_weight_only", None, False, False, False, False),
        {"wo": LinearPlan("int8_weight_only", "xla")},
    ),
    (
        "a mesh, defaults: float through XLA, no GGUF blocks kept",
        ZEN3,
        F32,
        False,
        UNKNOWN,
        (None, None, False, False, False, False),
        {"wqkv": LinearPlan(None, "xla")},
    ),
    (
        "the jnp attention backend: no C++ GEMM",
        ZEN3,
        dict(F32, attention_backend="cpu"),
        True,
        UNKNOWN,
        (None, None, False, False, False, False),
        {"wqkv": LinearPlan(None, "xla")},
    ),
    (
        "a GPU, int4: the Pallas kernel",
        GPU,
        dict(BF16, quantization="int4"),
        True,
        None,
        ("int4", None, False, False, False, False),
        {"wqkv": LinearPlan("int4", "pallas")},
    ),
    (
        "a GPU, w8a8: int8 dots in XLA",
        GPU,
        dict(BF16, quantization="w8a8"),
        True,
        None,
        ("w8a8", None, False, False, True, False),
        {"wqkv": LinearPlan("w8a8", "xla", "int8")},
    ),
    (
        "quantization none: a GGUF dequantized",
        ZEN3,
        dict(F32, quantization="none"),
        True,
        None,
        (None, None, True, True, False, False),
        {"wqkv": LinearPlan(None, "cpp")},
    ),
    (
        "an AWQ checkpoint with nothing asked: its codes",
        ZEN4,
        BF16,
        True,
        "awq",
        ("awq", None, True, True, False, False),
        {"wqkv": LinearPlan("awq", "cpp", "bf16")},
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_plan_table(case):
    _, platform, fields, one_device, checkpoint, expected, linears = case
    plan = resolve_weight_plan(
        EngineArgs(**fields), platform, one_device=one_device, checkpoint=checkpoint, tied=True, panels_bytes=PANELS
    )
    assert (
        plan.quantization,
        plan.load,
        plan.cpp_gemm,
        plan.pack_floats,
        plan.smooth,
        plan.small_step_codes,
    ) == expected
    assert set(plan.linears) == set(LINEARS)
    for name, want in linears.items():
        assert plan.linear(name) == want, name


def test_untied_embedding_is_a_float_table():
    plan = resolve_weight_plan(EngineArgs(dtype="float32", quantization="int4"), ZEN3, one_device=True, checkpoint=None)
    assert plan.linear("embed") == LinearPlan(None, "xla")
    assert plan.linear("lm_head") == LinearPlan("int8_weight_only", "cpp")


@pytest.mark.parametrize(
    "platform, fields, checkpoint, match",
    [
        (ZEN3, dict(BF16, small_step_codes=True), UNKNOWN, "AVX512_BF16"),
        (ZEN4, dict(BF16, small_step_codes=True, quantization="int4"), UNKNOWN, "no quantization asked"),
        (ZEN4, dict(BF16, small_step_codes=True), None, "needs a GGUF model"),
        (ZEN3, dict(F32, quantization="gptq"), "awq", "already quantized"),
        (ZEN3, dict(F32, quantization="int4"), "gguf", "already quantized"),
        (ZEN3, dict(F32, quantization="gguf"), None, "needs a checkpoint quantized so"),
        (ZEN4, dict(F32, small_step_factored=True, quantization="int4"), UNKNOWN, "small_step_factored needs"),
        (ZEN4, dict(BF16, small_step_factored=True), None, "small_step_factored needs a GGUF.s codes"),
        (ZEN4, dict(BF16, small_step_factored=True, int8_activations=True), "gguf", "neither int8_activations"),
        (ZEN4, dict(BF16, small_step_factored=True, batch_invariant=True), "gguf", "nor batch_invariant"),
    ],
    ids=[
        "small codes without bf16 dots",
        "small codes and a method",
        "small codes of an HF checkpoint",
        "gptq asked of an awq checkpoint",
        "int4 asked of a GGUF's blocks",
        "gguf asked of float weights",
        "factored of codes quantized on load",
        "factored of an HF checkpoint",
        "factored with int8 activations",
        "factored under batch_invariant",
    ],
)
def test_plans_that_cannot_hold(platform, fields, checkpoint, match):
    with pytest.raises(ValueError, match=match):
        resolve_weight_plan(EngineArgs(**fields), platform, one_device=True, checkpoint=checkpoint)


@pytest.mark.parametrize(
    "platform, backend",
    [
        (ZEN3, "native"),
        (NO_COMPILER, "cpu"),
        (Platform("gpu", gpu_capability="9.0"), "mosaic"),
        (Platform("gpu", gpu_capability="8.6"), "pallas"),
        (Platform("gpu", gpu_capability="10.0"), "pallas"),
        (Platform("gpu"), "pallas"),
    ],
    ids=["cpu with the C++ kernels", "cpu without", "hopper", "ampere", "blackwell", "gpu of no capability"],
)
def test_default_attention_backend(platform, backend):
    # The C++ kernel where it is built, else jnp rows; Mosaic GPU on warpgroup-MMA GPUs, else Triton.
    assert platform.attention_backend == backend


def test_detected_platform_is_this_machine():
    from jaxllm.kernels import native
    from jaxllm.platforms import cpu_flags

    platform = Platform.detect().confirmed()
    assert platform.name == "cpu" and platform.cpu_flags == cpu_flags()
    assert platform.cpp_kernels == native.available()
    assert platform.cpp_bf16_dots == (native.available() and native.has_bf16_dots())
    assert platform.cpp_amx == (native.available() and "amx" in native.kernel_paths())
    assert not Platform.detect(use_cpp=False).cpp_kernels


def test_engine_weights_follow_the_plan(tiny_model_dir):
    # What the engine prepares is what its plan says, linear by linear (the tiny model ties its
    # embeddings: the table is the LM head's linear).
    from jaxllm import LLM
    from jaxllm.models.linear import PackedWeight
    from jaxllm.weights.prepare import load_with_plan
    from jaxllm.quantization import QuantizedWeight
    from tests.helpers.tiny_model import TINY_ENGINE_ARGS

    for extra in ({}, {"quantization": "int4"}, {"packed_weights": False}):
        args = EngineArgs(model=tiny_model_dir, **TINY_ENGINE_ARGS, **extra)
        llm = LLM(tiny_model_dir, **TINY_ENGINE_ARGS, **extra)
        _, plan = load_with_plan(
            dataclasses.replace(args, dtype=llm.engine.config.dtype),
            Platform.detect(),
            None,
            one_device=True,
            progress=False,
        )
        params = llm.engine.runner.params
        weights = {name: params["layers"][0][name] for name in ("wqkv", "wo", "w_down")} | {"embed": params["embed"]}
        for name, w in weights.items():
            lp = plan.linear(name)
            if lp.codes is not None:
                assert isinstance(w, QuantizedWeight) and (w.layout == "panels") == (lp.kernel == "cpp"), (extra, name)
            else:
                assert isinstance(w, PackedWeight) == (lp.kernel == "cpp"), (extra, name)


def test_host_memory_is_the_cgroup_limit_where_lower(tmp_path, monkeypatch):
    # The bf16 panels' share is of the memory this process may use: a container's cgroup limit
    # where it is below the host's physical memory ("max": no limit; no file: not in a cgroup v2).
    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    limit = tmp_path / "memory.max"
    monkeypatch.setattr(platforms, "CGROUP_MEMORY_MAX", str(limit))
    assert platforms.host_memory() == physical
    limit.write_text("max\n")
    assert platforms.host_memory() == physical
    limit.write_text(f"{2**30}\n")
    assert platforms.host_memory() == min(physical, 2**30)
    limit.write_text(f"{physical * 2}\n")
    assert platforms.host_memory() == physical
