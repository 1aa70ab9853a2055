"""`jaxllm bench throughput | latency | serve` on the tiny model: vLLM's flags, JSON results, and
token counts checked against the dataset drawn independently and the server's own counters."""

from __future__ import annotations

import json

import pytest

from jaxllm.bench.datasets import random_workload, vocab_info
from jaxllm.entrypoints import cli
from live_server import API_KEY
from tiny_model import tiny_engine_flags


@pytest.mark.parametrize("kind, flags", [
    ("throughput", ["--num-prompts", "--random-input-len", "--random-output-len", "--random-range-ratio",
                    "--dataset-name", "--output-json", "--max-num-seqs"]),
    ("latency", ["--input-len", "--output-len", "--batch-size", "--num-iters-warmup", "--num-iters", "--output-json"]),
    ("perplexity", ["--text-file", "--window", "--output-json", "--quantization"]),
    ("serve", ["--base-url", "--host", "--port", "--model", "--request-rate", "--max-concurrency", "--num-prompts",
               "--random-input-len", "--save-result", "--result-dir", "--result-filename"]),
])
def test_bench_commands_take_vllm_s_flags(kind, flags, capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", kind, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flag in flags:
        assert f"{flag} " in text, (kind, flag)
    assert "default: None" not in text


def test_bench_throughput_and_latency(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "throughput.json"
    assert cli.main(["bench", "throughput", "--model", tiny_model_dir, *tiny_engine_flags(), "--num-prompts", "6",
                     "--input-len-range", "8:40", "--output-len-range", "4:12", "--output-json", str(out)]) == 0
    assert capsys.readouterr().out.startswith("Throughput: ")
    result = json.loads(out.read_text())
    requests = random_workload(6, (8, 40), (4, 12), 0, *vocab_info(tiny_model_dir))
    prompt_tokens = sum(len(r["prompt_token_ids"]) for r in requests)
    output_tokens = sum(r["max_tokens"] for r in requests)
    assert (result["num_requests"], result["total_output_tokens"]) == (6, output_tokens)
    assert result["total_num_tokens"] == prompt_tokens + output_tokens
    assert result["output_tokens_per_second"] == pytest.approx(output_tokens / result["elapsed_time"])
    assert result["machine"]["cpu"] and result["versions"]["jax"]

    out = tmp_path / "latency.json"
    assert cli.main(["bench", "latency", "--model", tiny_model_dir, *tiny_engine_flags(), "--batch-size", "2",
                     "--input-len", "16", "--output-len", "8", "--num-iters-warmup", "1", "--num-iters", "3",
                     "--output-json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert len(result["latencies"]) == 3 and result["avg_latency"] == pytest.approx(sum(result["latencies"]) / 3)
    assert f"Avg latency: {result['avg_latency']:.3f} seconds" in capsys.readouterr().out


def test_bench_serve_counts_what_the_server_generated(server, tiny_model_dir, tmp_path, capsys):
    before = server.metrics()[("jaxllm:generation_tokens_total", ())]
    assert cli.main(["bench", "serve", "--base-url", server.url, "--api-key", API_KEY, "--tokenizer", tiny_model_dir,
                     "--num-prompts", "8", "--input-len-range", "8:32", "--output-len-range", "4:10",
                     "--max-concurrency", "4", "--save-result", "--result-dir", str(tmp_path),
                     "--result-filename", "serve.json"]) == 0
    printed = capsys.readouterr().out
    result = json.loads((tmp_path / "serve.json").read_text())
    requests = random_workload(8, (8, 32), (4, 10), 0, *vocab_info(tiny_model_dir))
    expected = sum(r["max_tokens"] for r in requests)
    assert result["completed"] == 8 and result["verified"] and result["output_tokens"] == expected
    # The server also generated the 4 tokens of the short test request sent first.
    assert server.metrics()[("jaxllm:generation_tokens_total", ())] - before == expected + 4
    assert result["prompt_tokens"] == sum(len(r["prompt_token_ids"]) for r in requests)
    assert f"{'Total generated tokens:':<40}{expected}" in printed and "Mean TTFT (ms):" in printed
    assert result["ttft"]["p50_ms"] > 0 and result["model"] == server.model
