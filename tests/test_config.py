"""EngineArgs -> EngineConfig: the KV budget from kv_cache_memory / gpu_memory_utilization,
swap space, and clear errors for options that cannot work."""

import pytest

from jaxllm.config import EngineArgs, kv_bytes_per_token, resolve_config
from jaxllm.engine.llm_engine import _available_memory
from jaxllm.models.llama import ModelSpec

SPEC = ModelSpec(architecture="LlamaForCausalLM", vocab_size=100, hidden_size=64, intermediate_size=128,
                 num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=1e4,
                 max_position_embeddings=512)
GiB = 1 << 30


def resolve(available=None, **kw):
    return resolve_config(EngineArgs(**kw), SPEC, "tiny", available_memory=available)


def test_kv_budget_from_memory_options():
    page = kv_bytes_per_token(SPEC, "bfloat16") * 16           # 2 layers * 2 * 2 heads * 16 * 2 bytes * 16
    assert page == 4096
    assert resolve().cache.num_blocks == 2 * GiB // page        # the 2 GiB default
    assert resolve(kv_cache_memory=64 << 20).cache.num_blocks == (64 << 20) // page
    assert resolve(4 * GiB, gpu_memory_utilization=0.25).cache.num_blocks == GiB // page
    assert resolve(num_gpu_blocks_override=7).cache.num_blocks == 7
    assert resolve(dtype="float32", kv_cache_memory=1 << 20).cache.num_blocks == (1 << 20) // (2 * page)


def test_swap_space_only_with_swap_preemption():
    page = kv_bytes_per_token(SPEC, "bfloat16") * 16
    assert resolve(swap_space=1.0).cache.num_swap_blocks == 0
    config = resolve(swap_space=0.5, preemption_mode="swap")
    assert config.cache.num_swap_blocks == GiB // 2 // page and config.scheduler.preemption_mode == "swap"


@pytest.mark.parametrize("kw, available, message", [
    (dict(gpu_memory_utilization=1e-9), 4 * GiB, "holds 0 pages"),
    (dict(gpu_memory_utilization=0.5), None, "does not report"),
    (dict(gpu_memory_utilization=1.5), GiB, r"in \(0, 1\]"),
    (dict(gpu_memory_utilization=0.5, kv_cache_memory=GiB), GiB, "not both"),
    (dict(kv_cache_memory=8 * GiB), 4 * GiB, "exceeds"),
    (dict(preemption_mode="swap", swap_space=0), None, "swap_space > 0"),
    (dict(preemption_mode="later"), None, "preemption_mode"),
    (dict(attention_backend="triton"), None, "attention_backend"),
    (dict(dtype="float16"), None, "dtype"),
    (dict(max_model_len=4096), None, "max_position_embeddings"),
])
def test_impossible_options_are_clear_errors(kw, available, message):
    with pytest.raises(ValueError, match=message):
        resolve(available, **kw)


def test_config_names_every_attention_backend():
    from jaxllm.attention import BACKENDS
    from jaxllm.config import ATTENTION_BACKENDS

    assert sorted(BACKENDS) == sorted(ATTENTION_BACKENDS)


def test_available_memory_is_read_from_the_platform():
    assert _available_memory(EngineArgs()) is None              # not needed: not measured
    assert _available_memory(EngineArgs(gpu_memory_utilization=0.5)) > 0
