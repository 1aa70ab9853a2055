"""Tensor parallelism on 4 virtual CPU devices (tests/sharding_worker.py, in a subprocess so the
other tests keep one device): TP 2 and TP 4 (fewer KV heads than shards: replicated groups)
generate exactly what one device does (float32 greedy, 64 requests, chunked prefill and
preemption), and each device holds 1/tp of the split weights and of the KV pages."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import transformers

HERE = os.path.dirname(os.path.abspath(__file__))
SIZES = (2, 4)


@pytest.fixture(scope="module")
def results(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("sharding") / "results.json"
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "PYTHONPATH": HERE}
    run = subprocess.run([sys.executable, os.path.join(HERE, "sharding_worker.py"), tiny_model_dir, str(out),
                          *map(str, SIZES)], env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    return {int(tp): r for tp, r in json.loads(out.read_text()).items()}


@pytest.mark.parametrize("tp", SIZES)
def test_tensor_parallel_generates_what_one_device_does(results, tp):
    one, many = results[1], results[tp]
    assert many["preemptions"] > 0 and one["preemptions"] > 0     # the pool is small enough to preempt
    assert many["token_ids"] == one["token_ids"]
    worst = max(abs(a - b) for la, lb in zip(one["logprobs"], many["logprobs"]) for a, b in zip(la, lb))
    assert worst < 1e-4


@pytest.mark.parametrize("tp", SIZES)
def test_each_device_holds_its_share(results, tiny_model_dir, tp):
    config = transformers.AutoConfig.from_pretrained(tiny_model_dir)
    hidden, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    head_dim = hidden // config.num_attention_heads
    kv_heads = max(config.num_key_value_heads, tp)          # a copy per shard when fewer than shards
    q_size, kv_size = config.num_attention_heads * head_dim, kv_heads * head_dim
    split = 4 * (layers * (hidden * (q_size + 2 * kv_size) + q_size * hidden + 3 * hidden * inter)
                 + config.vocab_size * hidden)              # float32 wqkv, wo, w_gate_up, w_down, tied embed
    replicated = 4 * (layers * 2 * hidden + hidden)          # the norms
    param_bytes, kv_bytes = results[tp]["param_bytes"], results[tp]["kv_bytes"]
    assert len(param_bytes) == len(kv_bytes) == tp
    assert set(param_bytes.values()) == {split // tp + replicated}
    one_kv = sum(results[1]["kv_bytes"].values())
    assert set(kv_bytes.values()) == {one_kv * kv_heads // config.num_key_value_heads // tp}
