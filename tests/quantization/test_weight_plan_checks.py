"""The weight plan's other checks: the options it refuses, the attention backend it picks, the
platform it detects, the engine's weights against the plan, the host memory it reads."""

from __future__ import annotations

import dataclasses
import os

import pytest

from jaxllm import platforms
from jaxllm.config import EngineArgs
from jaxllm.platforms import Platform
from jaxllm.weights.plan import UNKNOWN, LinearPlan, resolve_weight_plan

from tests.helpers.plan_platforms import BF16, F32, NO_COMPILER, XEON_AMX, ZEN3, ZEN4


@pytest.mark.parametrize(
    "platform, fields, int8_codes, int8",
    [
        (ZEN3, dict(dtype="auto"), False, True),  # float32 picked: a GGUF's codes x int8 rows
        (ZEN3, dict(dtype="float32"), False, False),  # float32 asked: the codes' own numbers
        (ZEN3, dict(dtype="float32", int8_activations=True), False, True),
        (ZEN4, dict(dtype="auto"), False, False),  # bfloat16 picked: its own default path
        (ZEN4, dict(dtype="auto"), True, True),  # a GGUF of int8-dot codes, VNNI: float32 picked
        (XEON_AMX, dict(dtype="auto"), True, True),  # AMX too (a prompt's calls take the codes to its tiles)
        (ZEN4, dict(dtype="float32"), True, False),
    ],
)
def test_int8_activations_default_where_dtype_auto_picks_float32(platform, fields, int8_codes, int8):
    from jaxllm.engine_config import resolve_dtypes

    args = resolve_dtypes(EngineArgs(**fields), platform, many_processes=False, int8_codes=int8_codes)
    # Left to the plan where the dtype was picked, else False unless asked.
    assert args.int8_activations is (None if fields == dict(dtype="auto") else int8)
    gguf = resolve_weight_plan(args, platform, one_device=True, checkpoint="gguf", tied=True)
    assert gguf.int8_activations is int8
    int8_linear = (
        gguf.linear("wqkv").activations.startswith("int8") or gguf.linear("wqkv").small_step_activations == "int8"
    )
    assert int8_linear is int8
    hf = resolve_weight_plan(args, platform, one_device=True, checkpoint=None, tied=True)
    assert hf.int8_activations is (fields.get("int8_activations") is True)


@pytest.mark.parametrize("platform, path", [(XEON_AMX, "avx512"), (ZEN4, "auto"), (ZEN3, "auto")])
def test_batch_invariant_keeps_int8_rows_off_the_tiles(platform, path):
    # With AMX, path auto takes the int8 rows' calls of many rows to the bf16 tiles (other
    # numbers than the rows'): the mode pins the int8 kernels for every call there.
    args = EngineArgs(dtype="float32", int8_activations=True, batch_invariant=True)
    plan = resolve_weight_plan(args, platform, one_device=True, checkpoint="gguf", tied=True)
    assert plan.int8_activations and plan.linear("wqkv").activations.startswith("int8")
    assert plan.gemm_path == path
    free = resolve_weight_plan(
        EngineArgs(dtype="float32", int8_activations=True), platform, one_device=True, checkpoint="gguf", tied=True
    )
    assert free.gemm_path == "auto"


@pytest.mark.parametrize(
    "platform, fields, checkpoint, path",
    [
        (XEON_AMX, dict(dtype="float32", int8_activations=True), "gguf", "avx512"),  # int8 rows: tiles from 17
        (XEON_AMX, BF16, "gguf", "avx512"),  # codes alone: tiles from two rows
        (XEON_AMX, BF16, None, "avx512"),  # bf16 panels likewise
        (XEON_AMX, F32, None, None),  # f32 panels: no tiles
        (XEON_AMX, dict(BF16, batch_invariant=True), "gguf", None),  # every call pinned already
        (ZEN4, dict(dtype="float32", int8_activations=True), "gguf", "avx512"),  # 6-bit codes: bf16 dots from 64
        (ZEN3, dict(dtype="float32", int8_activations=True), "gguf", None),  # no bf16 dots
        (ZEN4, BF16, "gguf", None),
    ],
)
def test_verification_steps_keep_off_the_paths_of_larger_calls(platform, fields, checkpoint, path):
    # A verification row must compute what its decode would (one row: never on AMX's tiles nor,
    # as int8 rows, on bf16 dots).
    draft = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    args = EngineArgs(**fields, speculative_config=draft)
    plan = resolve_weight_plan(args, platform, one_device=True, checkpoint=checkpoint, tied=True)
    assert plan.check_path == path
    assert ("verification steps on path avx512" in plan.describe()) == (path is not None)  # (the log says so)
    assert (
        resolve_weight_plan(EngineArgs(**fields), platform, one_device=True, checkpoint=checkpoint).check_path is None
    )


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
