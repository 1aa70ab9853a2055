"""EngineArgs -> EngineConfig: the KV budget from kv_cache_memory / gpu_memory_utilization,
swap space, the dtype "auto" picks, and clear errors for options that cannot work."""

import logging

import pytest

from jaxllm.config import EngineArgs

from jaxllm.engine_config import kv_bytes_per_token, resolve_config
from jaxllm.engine_config import available_memory
from jaxllm.models.decoder import ModelConfig
from jaxllm.platforms import AMX_CPU_FLAGS, Platform, cpu_flags
from jaxllm.utils import resolve_kv_cache_dtype

from tests.helpers.cpu_host import lscpu_flags

MODEL = ModelConfig(
    architecture="LlamaForCausalLM",
    vocab_size=100,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    norm_eps=1e-5,
    rope_theta=1e4,
    max_position_embeddings=512,
)
GiB = 1 << 30


def resolve(available=None, platform="cpu", **kw):
    kw.setdefault("dtype", "bfloat16")
    kw.setdefault("block_size", 16)  # the arithmetic below is written for pages of 16
    return resolve_config(EngineArgs(**kw), MODEL, "tiny", available_memory=available, platform=platform)


def test_page_size_default_follows_the_platform():
    # Unset: 64 tokens on CPU, 16 on accelerators; given, it is kept (a power of two).
    assert resolve(block_size=None).cache.page_size == 64
    assert resolve(block_size=None, platform="gpu").cache.page_size == 16
    assert resolve(block_size=None).cache.num_pages == 2 * GiB // (kv_bytes_per_token(MODEL, "bfloat16") * 64)
    assert resolve(block_size=32).cache.page_size == 32
    with pytest.raises(ValueError, match="power of two"):
        resolve(block_size=48)


def test_kv_budget_from_memory_options():
    page = kv_bytes_per_token(MODEL, "bfloat16") * 16  # 2 layers * 2 * 2 heads * 16 * 2 bytes * 16
    assert page == 4096
    assert resolve().cache.num_pages == 2 * GiB // page  # the 2 GiB default
    assert resolve(kv_cache_memory=64 << 20).cache.num_pages == (64 << 20) // page
    assert resolve(4 * GiB, gpu_memory_utilization=0.25).cache.num_pages == GiB // page
    assert resolve(num_gpu_blocks_override=7).cache.num_pages == 7
    assert resolve(dtype="float32", kv_cache_memory=1 << 20).cache.num_pages == (1 << 20) // (2 * page)


def test_swap_space_only_with_swap_preemption():
    page = kv_bytes_per_token(MODEL, "bfloat16") * 16
    assert resolve(swap_space=1.0).cache.num_swap_pages == 0
    config = resolve(swap_space=0.5, preemption_mode="swap")
    assert config.cache.num_swap_pages == GiB // 2 // page and config.scheduler.preemption_mode == "swap"


@pytest.mark.parametrize(
    "kw, available, message",
    [
        (dict(gpu_memory_utilization=1e-9), 4 * GiB, "holds 0 pages"),
        (dict(gpu_memory_utilization=0.5), None, "does not report"),
        (dict(gpu_memory_utilization=1.5), GiB, r"in \(0, 1\]"),
        (dict(gpu_memory_utilization=0.5, kv_cache_memory=GiB), GiB, "not both"),
        (dict(kv_cache_memory=8 * GiB), 4 * GiB, "exceeds"),
        (dict(preemption_mode="swap", swap_space=0), None, "swap_space > 0"),
        (dict(preemption_mode="later"), None, "preemption_mode"),
        (dict(num_processes=2, warmup=False), None, "warmup=False is not supported over several processes"),
        (dict(attention_backend="triton"), None, "attention_backend"),
        (dict(dtype="float16"), None, "dtype"),
        (dict(max_model_len=4096), None, "max_position_embeddings"),
        (dict(async_scheduling="False"), None, "async_scheduling must be True or False"),
        (dict(small_step_codes="off"), None, "small_step_codes must be True, False or None"),
    ],
)
def test_impossible_options_are_clear_errors(kw, available, message):
    with pytest.raises(ValueError, match=message):
        resolve(available, **kw)


def test_config_names_every_attention_backend():
    from jaxllm.attention import BACKENDS
    from jaxllm.config import ATTENTION_BACKENDS

    assert sorted(BACKENDS) == sorted(ATTENTION_BACKENDS)


def test_available_memory_is_read_from_the_platform():
    assert available_memory(EngineArgs()) is None  # not needed: not measured
    assert available_memory(EngineArgs(gpu_memory_utilization=0.5)) > 0


@pytest.mark.parametrize(
    "flags, platform, expected",
    [
        ({"avx2", "fma"}, "cpu", "float32"),  # Zen 2 / Zen 3: bf16 widened per dot
        ({"avx512f", "avx512_vnni"}, "cpu", "float32"),  # AVX-512 without BF16 (Skylake)
        ({"avx512f", "avx512_bf16", "avx512_vnni"}, "cpu", "bfloat16"),  # Zen 4 / Zen 5
        ({"avx512f", "avx512_vnni", "amx_bf16", "amx_int8"}, "cpu", "bfloat16"),  # Xeon with AMX
        (set(), "gpu", "bfloat16"),
        (set(), "tpu", "bfloat16"),
    ],
)
def test_auto_dtype_follows_the_device(flags, platform, expected):
    platform = Platform(platform, frozenset(flags))
    dtype, why = platform.resolve_dtype("auto")
    assert dtype == expected and why
    for explicit in ("float32", "bfloat16"):  # an explicit dtype always wins
        assert platform.resolve_dtype(explicit)[0] == explicit
    with pytest.raises(ValueError, match="dtype"):
        platform.resolve_dtype("float16")
    # KV pages: "auto" is the dtype, but bf16 where dtype "auto" took float32 on a CPU; an
    # explicit dtype keeps its own pages, an explicit cache dtype always wins.
    assert resolve_kv_cache_dtype("auto", "auto", dtype)[0] == "bfloat16"
    for explicit in ("float32", "bfloat16"):
        assert resolve_kv_cache_dtype("auto", explicit, explicit)[0] == explicit
        for kv in ("float32", "bfloat16", "int8", "fp8_e4m3"):
            assert resolve_kv_cache_dtype(kv, "auto", explicit) == (kv, "asked for")
    assert resolve_kv_cache_dtype("fp8", "auto", dtype)[0] == "fp8_e4m3"


@pytest.mark.parametrize(
    "flags, kernels, expected",
    [
        ({"avx512f", "avx512_bf16", "avx512_vnni"}, True, "float32"),  # Zen 4 / Zen 5: int8 dots
        ({"avx512f", "avx512_bf16", "avx512_vnni"}, False, "bfloat16"),  # no C++ kernels built
        ({"avx512f", "avx512_bf16"}, True, "bfloat16"),  # bf16 dots without int8 ones
        ({"avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16"}, True, "float32"),  # AMX: prompts on tiles
        ({"avx2", "fma"}, True, "float32"),  # float32 for every model there
    ],
)
def test_auto_dtype_for_a_gguf_of_int8_dot_codes(flags, kernels, expected):
    flags = frozenset(flags)
    amx = kernels and AMX_CPU_FLAGS <= flags
    platform = Platform(
        "cpu", flags, cpp_kernels=kernels, cpp_bf16_dots=kernels and "avx512_bf16" in flags, cpp_amx=amx
    )
    dtype, why = platform.resolve_dtype("auto", int8_codes=True)
    assert dtype == expected and why
    assert platform.weighs_int8_codes is (kernels and flags >= {"avx512_bf16", "avx512_vnni"})
    assert platform.resolve_dtype("auto") == platform.default_dtype  # any other checkpoint: the CPU's rule
    assert platform.resolve_dtype("bfloat16", int8_codes=True)[0] == "bfloat16"  # an explicit dtype wins
    assert Platform("gpu").resolve_dtype("auto", int8_codes=True)[0] == "bfloat16"


def test_auto_is_the_default_and_picks_for_this_cpu():
    """On whichever CPU runs the tests: bf16 only with hardware bf16 dots, as lscpu reports them."""
    flags = lscpu_flags()
    assert cpu_flags() == flags
    expected = "bfloat16" if flags & {"avx512_bf16", "amx_bf16"} else "float32"
    assert EngineArgs().dtype == "auto"
    config = resolve_config(EngineArgs(), MODEL, "tiny")
    assert config.dtype == expected
    assert config.cache.dtype == "bfloat16"  # float32 on a CPU keeps bf16 pages
    assert config.cache.num_pages == 2 * GiB // (kv_bytes_per_token(MODEL, "bfloat16") * 64)  # pages of 64 on CPU
    config = resolve_config(EngineArgs(dtype="float32"), MODEL, "tiny")
    assert config.cache.dtype == "float32"
    for args in (EngineArgs(quantization="w8a8"), EngineArgs(int8_activations=True)):  # int8 activations: the same
        assert resolve_config(args, MODEL, "tiny").cache.dtype == "bfloat16"


def test_engine_logs_the_dtype_auto_picks_and_loads_in_it(tiny_model_dir, tmp_path, caplog):
    import jax

    from jaxllm import LLM
    from tests.helpers.tiny_model import TINY_ENGINE_ARGS

    expected = "bfloat16" if lscpu_flags() & {"avx512_bf16", "amx_bf16"} else "float32"
    with caplog.at_level(logging.INFO, logger="jaxllm"):
        llm = LLM(tiny_model_dir, **{**TINY_ENGINE_ARGS, "dtype": "auto"}, params_cache_dir=str(tmp_path / "params"))
    assert llm.engine.config.dtype == expected
    # Matrices in the picked dtype (packed or not); norms and biases stay float32 (load_model).
    assert {leaf.dtype.name for leaf in jax.tree.leaves(llm.engine.runner.params) if leaf.ndim >= 2} == {expected}
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("dtype auto")] == [
        f"dtype auto: {expected} ({Platform.named('cpu').default_dtype[1]})"
    ]
    # bf16 pages either way (stored as uint16 bits); with float32 chosen, logged as such.
    assert llm.engine.config.cache.dtype == "bfloat16"
    assert llm.engine.runner.kv_cache[0][0].dtype == jax.numpy.uint16
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("kv_cache_dtype auto")]
    assert logged == (
        [f"kv_cache_dtype auto: bfloat16 ({resolve_kv_cache_dtype('auto', 'auto', 'float32')[1]})"]
        if expected == "float32"
        else []
    )


def test_native_kernels_build_wherever_a_compiler_exists():
    # The kernel tests skip without the native library; this one does not, so a build that
    # fails on some CPU's -march (as a duplicate AVX2/AVX-512 helper once did on AVX-512 CPUs,
    # silently sending them to the jnp fallback) fails the suite on that CPU.
    from jaxllm.kernels import native

    if native._compiler() is None:
        pytest.skip("no C++ compiler here: the engine uses the jnp attention backend")
    assert native.available(), native.unavailable_reason()
