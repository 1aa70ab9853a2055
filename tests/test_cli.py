"""The `jaxllm` command: help, flag parsing, and `generate` / `chat` output against the
offline `LLM` over the tiny model."""

from __future__ import annotations

import io
import socket
import sys

import pytest

from jaxllm import SamplingParams
from jaxllm.entrypoints import cli
from tiny_model import offline_llm, tiny_engine_flags


def test_help_names_every_command_and_flag(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for word in ("serve", "generate", "chat", "examples:", "SmolLM2"):
        assert word in text
    for command, flags in {"serve": ["--model", "--max-num-seqs", "--max-num-batched-tokens", "--max-model-len",
                                     "--block-size", "--kv-cache-memory", "--enable-prefix-caching",
                                     "--no-enable-prefix-caching", "--seed", "--served-model-name", "--api-key",
                                     "--host", "--port", "--dtype"],
                           "generate": ["--file", "--max-tokens", "--temperature", "--model"],
                           "chat": ["--system", "--max-tokens", "--model"]}.items():
        with pytest.raises(SystemExit):
            cli.main([command, "--help"])
        text = capsys.readouterr().out
        for flag in flags:
            assert flag in text, (command, flag)
    assert cli.main([]) == 2


def test_flags_become_engine_args():
    args = cli.build_parser().parse_args(
        ["serve", "--model", "m", "--dtype", "float32", "--max-model-len", "1024", "--max-num-seqs", "8",
         "--max-num-batched-tokens", "256", "--block-size", "32", "--kv-cache-memory", "1.5GiB",
         "--no-enable-prefix-caching", "--seed", "3", "--served-model-name", "mine"])
    engine_args = cli.engine_args(args)
    assert (engine_args.model, engine_args.dtype, engine_args.max_model_len, engine_args.max_num_seqs) == \
        ("m", "float32", 1024, 8)
    assert (engine_args.max_num_batched_tokens, engine_args.block_size, engine_args.seed) == (256, 32, 3)
    assert engine_args.kv_cache_memory == 3 << 29
    assert engine_args.enable_prefix_caching is False and engine_args.served_model_name == "mine"
    assert cli.engine_args(cli.build_parser().parse_args(["serve"])).enable_prefix_caching is True
    assert [cli.parse_size(s) for s in ("2GiB", "512M", "64k", "1000")] == [2 << 30, 512 << 20, 64 << 10, 1000]
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--kv-cache-memory", "lots"])


def test_serve_fails_fast_on_a_taken_port(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert cli.main(["serve", "--port", str(port), "--model", "/nonexistent"]) == 1
    assert f"127.0.0.1:{port}" in capsys.readouterr().err


def test_generate_streams_prompts_in_order(tiny_model_dir, tmp_path, monkeypatch, capsys):  # noqa: F811
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # converted weights: not in ~/.cache
    prompts = ["Hello there", "The capital of France is", "def fibonacci(n):"]
    (tmp_path / "prompts.txt").write_text("\n".join(prompts[1:]) + "\n\n")
    expected = offline_llm(tiny_model_dir).generate(prompts, SamplingParams(temperature=0, max_tokens=8),
                                                    use_tqdm=False)
    status = cli.main(["generate", "--model", tiny_model_dir, *tiny_engine_flags(), "--temperature", "0",
                       "--max-tokens", "8", prompts[0], "--file", str(tmp_path / "prompts.txt")])
    assert status == 0
    out = capsys.readouterr()
    assert out.out == "\n".join(p + o.outputs[0].text + "\n" for p, o in zip(prompts, expected))
    assert "tokens/s" in out.err
    assert cli.main(["generate"]) == 2


def test_chat_reads_stdin_and_streams_replies(tiny_model_dir, monkeypatch, capsys):  # noqa: F811
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
