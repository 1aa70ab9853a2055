"""Tensor, pipeline and data parallelism on 4 virtual CPU devices (the `run_on_virtual_devices`
fixture runs tests/helpers/sharded_checks.py's `parallel_layouts` in a subprocess, so that the
other tests keep one device): TP 2, TP 4 (fewer KV heads than shards:
replicated groups), DP 2, PP 2, PP 4 (on a 4-layer model) and TP 2 x PP 2 (also on a caller's
Mesh) generate exactly what one device does (float32 greedy, 16 requests, chunked prefill and
preemption; TP x DP: the server test below);
each device holds 1/(tp * pp) of the split weights and of its replica's KV pages; data-parallel
replicas share the requests."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import transformers

from tests.helpers import ROOT

# tensor x data [x pipeline] parallel sizes; "mesh:": on a caller's ("data", ["stage",] "model")
# Mesh, with the weights restored from the params cache the layout before it wrote; "deep:": a
# 4-layer model; "int8:": an int8 KV cache and int4 weights; "w8a8:": W8A8 weights; "+swap":
# preemption swaps pages to the host
LAYOUTS = ("2x1", "4x1", "1x2", "2x1x2", "mesh:2x1x2", "deep:1x1x4", "int8:2x1x2+swap", "w8a8:2x2")


def sizes(layout: str) -> tuple[int, int, int]:
    """ "[mesh:|deep:|int8:|w8a8:]TPxDP[xPP][+swap]" -> (tp, dp, pp)."""
    tp, dp, pp = (list(map(int, layout.split(":")[-1].removesuffix("+swap").split("x"))) + [1])[:3]
    return tp, dp, pp


def reference(layout: str) -> str:
    """The one-device run a layout is compared with (the same model and quantization)."""
    prefix = layout.partition(":")[0]
    return f"{prefix}:1x1" if prefix in ("deep", "int8", "w8a8") else "1x1"


def tiny_config(num_layers: int = 2):
    from jaxllm.models import decoder

    return decoder.ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_layers=num_layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        norm_eps=1e-5,
        rope_theta=1e4,
        max_position_embeddings=512,
    )


def test_sizes_that_do_not_divide_the_model_are_refused_clearly():
    import jax

    from jaxllm import parallel
    from jaxllm.models import layout

    with pytest.raises(ValueError, match="4 attention heads.*2 KV heads.*intermediate size 128"):
        layout.check_tensor_parallel(tiny_config(), 3)
    with pytest.raises(ValueError, match="pipeline_parallel_size=3 does not divide this model's 2 layers"):
        layout.shard_layout({"layers": [{}, {}]}, tiny_config(), 1, 3)
    with pytest.raises(ValueError, match="vocabulary size 49152"):
        layout.check_pipeline_parallel(tiny_config(num_layers=5), 1, 5)
    with pytest.raises(ValueError, match=f"needs 4 devices; {jax.device_count()} cpu device.*device_count=4"):
        parallel.make_mesh(2, 1, 2, devices=jax.devices()[:1])


def test_pipeline_layout_stacks_each_stage_s_layers_by_slot():
    import numpy as np

    from jaxllm.models import layout

    cfg = tiny_config(num_layers=4)
    layers = [{"attn_norm": np.full(3, i, np.float32), "wo": np.full((2, 2), 10 + i, np.float32)} for i in range(4)]
    out = layout.shard_layout({"layers": layers, "final_norm": np.ones(3)}, cfg, 1, 2)
    assert len(out["layers"]) == 2 and out["final_norm"].shape == (3,)
    for slot in range(2):
        for stage in range(2):  # stage s holds layers 2s, 2s + 1
            assert (out["layers"][slot]["attn_norm"][stage] == 2 * stage + slot).all()
            assert (out["layers"][slot]["wo"][stage] == 10 + 2 * stage + slot).all()


@pytest.fixture(scope="module")
def results(tiny_model_dir, run_on_virtual_devices):
    return run_on_virtual_devices(4, "parallel_layouts", tiny_model_dir, LAYOUTS)


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", LAYOUTS)
def test_parallel_generates_what_one_device_does(results, layout):
    one, many = results[reference(layout)], results[layout]
    assert many["preemptions"] > 0 and one["preemptions"] > 0  # the pool is small enough to preempt
    # W8A8 (below) may part from one device only where one device's top two tokens were within
    # the 0.1 its logprobs may move; everything else generates the same tokens.
    same = []
    for a, b, margins in zip(many["token_ids"], one["token_ids"], one["margins"]):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert n == len(a) == len(b) or (layout.startswith("w8a8:") and n < len(b) and margins[n] < 0.1), (
            layout,
            n,
            a,
            b,
        )
        same.append(n)
    for text, reason in many["constrained"]:
        assert re.fullmatch(many["constraint"], text if reason == "stop" else text.rsplit(" ", 1)[0]), text
    diffs = [abs(a - b) for la, lb, n in zip(one["logprobs"], many["logprobs"], same) for a, b in zip(la[:n], lb[:n])]
    # int8 pages: keys and values summed in another order may round to a neighbouring code (a
    # step of max / 127), which moves logprobs by ~1e-3 where f32 moves them by ~1e-6. W8A8
    # rounds every layer's activations so (each row scaled by its maximum over every shard, as
    # on one device): a few codes of the ~10^6 a step makes flip and move a logprob by up to a
    # few 1e-2; the typical token must not move.
    if layout.startswith("w8a8:"):
        assert max(diffs) < 0.1 and float(np.median(diffs)) < 1e-4, (max(diffs), float(np.median(diffs)))
    else:
        assert max(diffs) < (1e-2 if layout.startswith("int8:") else 1e-4)


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_device_holds_its_share(results, layout):
    tp, dp, pp = sizes(layout)
    config = transformers.AutoConfig.from_pretrained(results[layout]["model"])
    hidden, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    head_dim = hidden // config.num_attention_heads
    kv_heads = max(config.num_key_value_heads, tp)  # a copy per shard when fewer than shards
    q_size, kv_size = config.num_attention_heads * head_dim, kv_heads * head_dim
    # wqkv, wo, w_gate_up, w_down: each stage its layers, split over its shards; the tied
    # embedding split over every device of the replica. float32: 4 bytes a weight. int4: half a
    # byte and an f16 scale and offset per 32 rows; the embedding (the LM head) int8 with an f32
    # scale per token. w8a8: a byte and an f32 scale per output column (the row-parallel wo and
    # w_down: every shard holds all of its columns' scales).
    columns = hidden * (q_size + 2 * kv_size) + 2 * hidden * inter  # weights of the column-parallel ones
    rows = q_size * hidden + inter * hidden  # and of the row-parallel ones
    if layout.startswith("int8:"):
        columns, rows, embed = columns * 5 // 8, rows * 5 // 8, config.vocab_size * (hidden + 4)
    elif layout.startswith("w8a8:"):
        columns += 4 * (q_size + 2 * kv_size + 2 * inter)
        rows += 4 * 2 * hidden * tp
        embed = config.vocab_size * (hidden + 4)
    else:
        columns, rows, embed = 4 * columns, 4 * rows, 4 * config.vocab_size * hidden
    split = layers // pp * (columns + rows) // tp + embed // (tp * pp)
    norms = 4 * (layers // pp * 2 * hidden + hidden)  # each stage's layer norms, and the final norm
    # The first replica's arrays: on tp * pp devices, each with its share.
    param_bytes, kv_bytes = results[layout]["param_bytes"], results[layout]["kv_bytes"]
    assert len(param_bytes) == len(kv_bytes) == tp * pp
    assert set(param_bytes.values()) == {split + norms}
    one_kv = sum(results[reference(layout)]["kv_bytes"].values())
    assert set(kv_bytes.values()) == {one_kv * kv_heads // config.num_key_value_heads // tp // pp}
    # Every replica: its own devices, its own pool.
    assert len(results[layout]["kv_bytes_all"]) == tp * pp * dp
    queries = results[layout]["replica_prompt_queries"]
    assert len(queries) == dp and min(queries) > 0.25 * sum(queries)  # balanced by load


@pytest.mark.multiprocess
def test_serve_tensor_and_data_parallel_answers_the_openai_client(tiny_model_dir, tmp_path):
    from jaxllm import SamplingParams
    from tests.helpers.live_server import start_server
    from tests.helpers.tiny_model import offline_llm

    server = start_server(
        tiny_model_dir,
        str(tmp_path),
        "--tensor-parallel-size",
        "2",
        "--data-parallel-size",
        "2",
        env={"XLA_FLAGS": "--xla_force_host_platform_device_count=4"},
        offline=lambda: offline_llm(tiny_model_dir),
    )
    try:
        prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "Hello"]
        response = server.client.completions.create(
            model=server.model, prompt=prompts, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
        )
        expected = server.offline.generate(
            prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False
        )
        assert [c.text for c in response.choices] == [o.outputs[0].text for o in expected]
        server.assert_healthy()
    finally:
        assert server.stop() == 0


@pytest.mark.multiprocess
@pytest.mark.parametrize("extra", [{}, {"quantization": "int4", "kv_cache_dtype": "int8"}], ids=["float", "int4"])
def test_two_processes_generate_what_one_does(extra, tiny_model_dir, tmp_path):
    """Multi-host on one machine: two processes on 127.0.0.1 (jax.distributed, gloo), one CPU
    device each, the model split over both; process 0 schedules, process 1 follows its steps.
    Quantized: each process quantizes the weights it read and places its shards; the KV cache int8."""
    import random

    from tests.helpers.multihost_worker import PROMPTS, sampling_params
    from jaxllm import LLM
    from tests.helpers.tiny_model import TINY_ENGINE_ARGS

    out, port = tmp_path / "out.json", random.Random().randrange(20000, 40000)
    pythonpath = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "PYTHONPATH": pythonpath}
    worker = [sys.executable, "-m", "tests.helpers.multihost_worker", tiny_model_dir, str(out), str(port)]
    tail = [json.dumps(extra)] if extra else []
    follower = subprocess.Popen(
        [*worker, "1", *tail], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    try:
        leader = subprocess.run([*worker, "0", *tail], env=env, capture_output=True, text=True, timeout=600)
        assert leader.returncode == 0, leader.stderr[-4000:]
        assert follower.wait(timeout=120) == 0, follower.stderr.read()[-4000:]  # released by the leader
    finally:
        follower.kill()
    if extra:
        expected = LLM(tiny_model_dir, **{**TINY_ENGINE_ARGS, **extra}).generate(
            PROMPTS, sampling_params(), use_tqdm=False
        )
        assert json.loads(out.read_text()) == [o.outputs[0].token_ids for o in expected]
        return
    # dtype="auto": both processes run in process 0's pick, though process 1's flags say otherwise.
    from jaxllm.platforms import Platform

    picked = Platform.named("cpu").default_dtype[0]
    assert [(tmp_path / f"out.json.dtype{i}").read_text() for i in (0, 1)] == [picked, picked]
    # One process with dtype "auto" here: the same dtype, and the KV pages "auto" gives it.
    one = LLM(tiny_model_dir, **{**TINY_ENGINE_ARGS, "dtype": "auto"})
    assert one.engine.config.dtype == picked
    expected = one.generate(PROMPTS, sampling_params(), use_tqdm=False)
    assert json.loads(out.read_text()) == [o.outputs[0].token_ids for o in expected]


@pytest.mark.multiprocess
def test_when_a_follower_dies_the_leader_fails_its_requests_and_exits(tiny_model_dir, tmp_path):
    """`jaxllm serve` over two processes; killing the follower mid-stream makes the leader's
    next step fail (its collectives lose their peer): the open stream gets an error, and the
    leader exits with status 1 instead of serving on."""
    import random

    import openai
    from tests.helpers.live_server import start_server
    from tests.helpers.tiny_model import tiny_engine_flags

    port = random.Random().randrange(20000, 40000)
    group = ["--tensor-parallel-size", "2", "--distributed-coordinator", f"127.0.0.1:{port}", "--num-processes", "2"]
    # (The follower's converted weights in tmp_path; its C++ kernels the test process's build.)
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
    follower = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jaxllm.entrypoints.cli",
            "serve",
            "--model",
            tiny_model_dir,
            *tiny_engine_flags(),
            *group,
            "--process-id",
            "1",
            "--params-cache-dir",
            str(tmp_path / "params"),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    server = None
    try:
        server = start_server(tiny_model_dir, str(tmp_path), *group, "--process-id", "0")
        stream = server.client.completions.create(
            model=server.model,
            prompt="Once upon a time",
            max_tokens=400,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        chunks = iter(stream)
        assert next(chunks).choices[0].text is not None
        follower.kill()
        with pytest.raises(openai.APIError):
            list(chunks)  # the stream ends with an error event, not [DONE]
        assert server.proc.wait(60) == 1
        assert "cannot go on" in server.log()
    finally:
        follower.kill()
        if server is not None:
            server.stop()
