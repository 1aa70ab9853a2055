"""The `jaxllm` command: help, flag parsing, and `generate` / `chat` output against the
offline `LLM` over the tiny model."""

from __future__ import annotations

import dataclasses
import io
import socket
import sys

import pytest

from jaxllm import EngineArgs, SamplingParams
from jaxllm.entrypoints import cli
from jaxllm.entrypoints.openai.server_args import ServerArgs

from tests.helpers.tiny_model import offline_llm, tiny_engine_flags


def test_help_names_every_command_and_flag(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for word in ("serve", "generate", "chat", "examples:", "SmolLM2"):
        assert word in text
    for command, flags in {
        "serve": [
            "--model",
            "--max-num-seqs",
            "--max-num-batched-tokens",
            "--max-model-len",
            "--block-size",
            "--kv-cache-memory",
            "--enable-prefix-caching",
            "--no-enable-prefix-caching",
            "--seed",
            "--served-model-name",
            "--api-key",
            "--host",
            "--port",
            "--dtype",
        ],
        "generate": ["--file", "--max-tokens", "--temperature", "--model"],
        "chat": ["--system", "--max-tokens", "--model"],
    }.items():
        with pytest.raises(SystemExit):
            cli.main([command, "--help"])
        text = capsys.readouterr().out
        for flag in flags:
            assert flag in text, (command, flag)
    assert cli.main([]) == 2


def test_every_engine_args_field_has_a_flag(capsys):
    # `mesh` (a jax.sharding.Mesh) is for Python callers only.
    fields = [field.name for field in dataclasses.fields(EngineArgs) if field.metadata.get("cli", True)]
    assert [f.name for f in dataclasses.fields(EngineArgs) if f.name not in fields] == ["mesh"]
    for command in ("serve", "generate", "chat"):
        args = vars(cli.build_parser().parse_args([command]))
        expected = [f for f in fields if command == "serve" or f not in cli.SERVE_ONLY_FIELDS]
        assert [f for f in fields if f in args] == expected, command
        with pytest.raises(SystemExit):
            cli.main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())  # argparse wraps help lines
        for field in expected:
            assert f"--{field.replace('_', '-')} " in text, (command, field)
        for shown in (
            "most sequences in one batch (default: 128)",
            "--no-enable-prefix-caching",
            "shared prompt prefixes (default: on)",
            "{recompute,swap}",
        ):
            assert shown in text, (command, shown)
        assert "default: None" not in text, command


def test_flags_round_trip_to_engine_args():
    defaults = EngineArgs()
    for command in ("generate", "chat", "serve"):
        assert cli.engine_args(cli.build_parser().parse_args([command])) == defaults
    # Every field off its default (kv_cache_memory with gpu_memory_utilization would fail verify(),
    # which parsing does not run).
    expected = EngineArgs(
        model="m",
        dtype="float32",
        quantization="int4",
        kv_cache_dtype="int8",
        max_model_len=1024,
        max_num_seqs=8,
        max_num_batched_tokens=256,
        max_num_prefill_seqs=4,
        block_size=32,
        kv_cache_memory=64 << 20,
        gpu_memory_utilization=0.5,
        num_gpu_blocks_override=100,
        swap_space=1.5,
        preemption_mode="swap",
        enable_prefix_caching=False,
        scheduling_policy="priority",
        async_scheduling=False,
        seed=3,
        max_logprobs=5,
        logprobs_mode="processed_logprobs",
        logits_processors=["a.b:C", "d:E"],
        batch_invariant=True,
        runner="pooling",
        pooler_config={"pooling_type": "MEAN", "normalize": False},
        tensor_parallel_size=2,
        pipeline_parallel_size=2,
        data_parallel_size=3,
        distributed_coordinator="10.0.0.1:1234",
        num_processes=2,
        process_id=1,
        served_model_name="mine",
        compilation_cache_dir="",
        params_cache_dir="/params",
        attention_backend="reference",
        warmup=False,
        background_compile=False,
        int8_activations=True,
        packed_weights=False,
        small_step_codes=False,
        small_step_factored=True,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3},
        enable_lora=True,
        max_loras=4,
        max_lora_rank=64,
        max_cpu_loras=8,
    )
    assert all(
        getattr(expected, f.name) != getattr(defaults, f.name)
        for f in dataclasses.fields(EngineArgs)
        if f.name != "mesh"
    )
    flags = [
        "--model",
        "m",
        "--dtype",
        "float32",
        "--quantization",
        "int4",
        "--kv-cache-dtype",
        "int8",
        "--max-model-len",
        "1024",
        "--max-num-seqs",
        "8",
        "--max-num-batched-tokens",
        "256",
        "--max-num-prefill-seqs",
        "4",
        "--block-size",
        "32",
        "--kv-cache-memory",
        "64MiB",
        "--gpu-memory-utilization",
        "0.5",
        "--num-gpu-blocks-override",
        "100",
        "--swap-space",
        "1.5",
        "--preemption-mode",
        "swap",
        "--no-enable-prefix-caching",
        "--scheduling-policy",
        "priority",
        "--no-async-scheduling",
        "--seed",
        "3",
        "--max-logprobs",
        "5",
        "--logprobs-mode",
        "processed_logprobs",
        "--logits-processors",
        "a.b:C",
        "d:E",
        "--batch-invariant",
        "--runner",
        "pooling",
        "--pooler-config",
        '{"pooling_type": "MEAN", "normalize": false}',
        "--tensor-parallel-size",
        "2",
        "--pipeline-parallel-size",
        "2",
        "--data-parallel-size",
        "3",
        "--distributed-coordinator",
        "10.0.0.1:1234",
        "--num-processes",
        "2",
        "--process-id",
        "1",
        "--compilation-cache-dir",
        "",
        "--params-cache-dir",
        "/params",
        "--attention-backend",
        "reference",
        "--no-warmup",
        "--no-background-compile",
        "--int8-activations",
        "--no-packed-weights",
        "--no-small-step-codes",
        "--small-step-factored",
        "--speculative-config",
        '{"method": "ngram", "num_speculative_tokens": 3}',
        "--enable-lora",
        "--max-loras",
        "4",
        "--max-lora-rank",
        "64",
        "--max-cpu-loras",
        "8",
    ]
    parse = cli.build_parser().parse_args
    assert cli.engine_args(parse(["serve", *flags, "--served-model-name", "mine"])) == expected
    assert cli.engine_args(parse(["generate", *flags, "a prompt"])) == dataclasses.replace(
        expected, served_model_name=None
    )
    assert cli.engine_args(parse(["serve", "--kv-cache-memory", "1.5GiB"])).kv_cache_memory == 3 << 29
    # "int8" is W8A8's other name; the weight-only 8-bit method has its own.
    assert cli.engine_args(parse(["serve", "--quantization", "int8"])).quantization == "w8a8"
    assert cli.engine_args(parse(["serve", "--quantization", "int8_weight_only"])).quantization == "int8_weight_only"
    assert [cli.parse_size(s) for s in ("2GiB", "512M", "64k", "1000")] == [2 << 30, 512 << 20, 64 << 10, 1000]


def test_server_flags_round_trip_to_server_args(monkeypatch):
    monkeypatch.delenv("JAXLLM_API_KEY", raising=False)
    parse = cli.build_parser().parse_args
    assert cli.from_flags(ServerArgs, parse(["serve"])) == ServerArgs()
    expected = ServerArgs(
        host="0.0.0.0",
        port=9,
        api_key="k",
        trust_request_chat_template=True,
        max_request_body_bytes=1 << 20,
        max_prompts_per_request=3,
        max_embedding_inputs=5,
        max_stop_strings=2,
        max_stream_backlog=9,
        max_waiting_requests=7,
        limit_concurrency=11,
        timeout_keep_alive=2,
        request_read_timeout=4.5,
        max_header_bytes=8 << 10,
        shutdown_timeout=1.5,
        uvicorn_log_level="error",
        enable_auto_tool_choice=True,
        tool_call_parser="mistral",
        reasoning_parser="qwen3",
        structured_outputs_in_reasoning=True,
        disable_playground=True,
        enable_weight_updates=True,
        responses_store_size=3,
        otlp_traces_endpoint="http://collector:4318/v1/traces",
        disable_log_requests=True,
        disable_log_stats=True,
        log_stats_interval=2.5,
        lora_modules=["a=/x", '{"name": "b", "path": "/y"}'],
    )
    assert all(getattr(expected, f.name) != getattr(ServerArgs(), f.name) for f in dataclasses.fields(ServerArgs))
    flags = [
        "--host",
        "0.0.0.0",
        "--port",
        "9",
        "--api-key",
        "k",
        "--trust-request-chat-template",
        "--max-request-body-bytes",
        "1MiB",
        "--max-prompts-per-request",
        "3",
        "--max-embedding-inputs",
        "5",
        "--max-stop-strings",
        "2",
        "--max-stream-backlog",
        "9",
        "--max-waiting-requests",
        "7",
        "--limit-concurrency",
        "11",
        "--timeout-keep-alive",
        "2",
        "--request-read-timeout",
        "4.5",
        "--max-header-bytes",
        "8KiB",
        "--shutdown-timeout",
        "1.5",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "mistral",
        "--reasoning-parser",
        "qwen3",
        "--structured-outputs-in-reasoning",
        "--disable-playground",
        "--enable-weight-updates",
        "--responses-store-size",
        "3",
        "--otlp-traces-endpoint",
        "http://collector:4318/v1/traces",
        "--disable-log-requests",
        "--disable-log-stats",
        "--log-stats-interval",
        "2.5",
        "--uvicorn-log-level",
        "error",
        "--lora-modules",
        "a=/x",
        '{"name": "b", "path": "/y"}',
    ]
    assert cli.from_flags(ServerArgs, parse(["serve", *flags])) == expected
    monkeypatch.setenv("JAXLLM_API_KEY", "from-env")
    assert cli.from_flags(ServerArgs, cli.build_parser().parse_args(["serve"])).api_key == "from-env"
    with pytest.raises(ValueError, match="shutdown_timeout"):
        ServerArgs(shutdown_timeout=0).verify()


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--preemption-mode", "sometimes", "invalid choice: 'sometimes'"),
        ("--attention-backend", "cuda", "invalid choice: 'cuda'"),
        ("--dtype", "float16", "invalid choice: 'float16'"),
        ("--kv-cache-memory", "lots", "not a size: 'lots'"),
        ("--max-num-seqs", "many", "invalid int value: 'many'"),
    ],
)
def test_bad_engine_flag_is_an_argparse_error(flag, value, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.build_parser().parse_args(["serve", flag, value])
    assert exit_info.value.code == 2
    assert f"argument {flag}: {message}" in capsys.readouterr().err


def test_serve_fails_fast_on_a_taken_port(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert cli.main(["serve", "--port", str(port), "--model", "/nonexistent"]) == 1
    assert f"127.0.0.1:{port}" in capsys.readouterr().err


def test_generate_streams_prompts_in_order(tiny_model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # converted weights: not in ~/.cache
    prompts = ["Hello there", "The capital of France is", "def fibonacci(n):"]
    (tmp_path / "prompts.txt").write_text("\n".join(prompts[1:]) + "\n\n")
    expected = offline_llm(tiny_model_dir).generate(
        prompts, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False
    )
    status = cli.main(
        [
            "generate",
            "--model",
            tiny_model_dir,
            *tiny_engine_flags(),
            "--temperature",
            "0",
            "--max-tokens",
            "8",
            prompts[0],
            "--file",
            str(tmp_path / "prompts.txt"),
        ]
    )
    assert status == 0
    out = capsys.readouterr()
    assert out.out == "\n".join(p + o.outputs[0].text + "\n" for p, o in zip(prompts, expected))
    assert "tokens/s" in out.err
    assert cli.main(["generate"]) == 2


def test_chat_reads_stdin_and_streams_replies(tiny_model_dir, monkeypatch, capsys):
    llm = offline_llm(tiny_model_dir)
    loaded = []
    monkeypatch.setattr(cli, "_load", lambda args: loaded.append(args) or llm)  # the engine is tested above
    system = {"role": "system", "content": "You are terse."}
    params = SamplingParams(temperature=0, max_tokens=12)
    first = llm.chat([system, {"role": "user", "content": "Name a colour."}], params, use_tqdm=False)[0]
    second = llm.chat([system, {"role": "user", "content": "Hello"}], params, use_tqdm=False)[0]
    monkeypatch.setattr(sys, "stdin", io.StringIO("Name a colour.\n\n/reset\nHello\n/exit\nnot read\n"))
    assert cli.main(["chat", "--system", "You are terse.", "--temperature", "0", "--max-tokens", "12"]) == 0
    assert capsys.readouterr().out == first.outputs[0].text + "\n" + second.outputs[0].text + "\n"
    assert loaded[0].model is None and loaded[0].max_tokens == 12
