"""`jaxllm bench throughput | latency | perplexity | serve`: jaxllm measured the way `vllm bench` measures vLLM,
with vLLM's flag names and JSON results.

- throughput: an offline batch (`LLM.generate`) over vLLM's random dataset, greedy with
  ignore_eos (every request gives exactly its max_tokens); requests/s and tokens/s.
- latency: one batch of `--batch-size` prompts of `--input-len` tokens, `--output-len` tokens
  each, timed end to end `--num-iters` times after `--num-iters-warmup`.
- perplexity: of the model on a text (a public-domain one ships with jaxllm), e.g. to see
  what `--quantization` costs (jaxllm/bench/perplexity.py).
- serve: a running OpenAI-compatible server (jaxllm's or any other) under Poisson arrivals
  (`--request-rate`) or a concurrency bound (`--max-concurrency`); TTFT, TPOT, ITL and
  end-to-end latency. The client is benchmarks/serving.py's (jaxllm/bench/serve.py).

Only argparse is imported here; each command imports what it runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

# The standard workload of benchmarks/ (128 requests, prompts 32-256, outputs 32-128).
STANDARD = {"num_prompts": 128, "input_len_range": (32, 256), "output_len_range": (32, 128)}


def parse_range(text: str) -> tuple[int, int]:
    """'LO:HI' (or 'N') -> (lo, hi), 1 <= lo <= hi."""
    lo, _, hi = text.partition(":")
    lo, hi = int(lo), int(hi or lo)
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"range must be LO:HI with 1 <= LO <= HI, got {text!r}")
    return lo, hi


def parse_rate(text: str) -> float:
    """A request rate in requests/s: > 0, or inf."""
    rate = float(text)
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"request rate must be > 0 or inf, got {text!r}")
    return rate


def _add_dataset_args(parser: argparse.ArgumentParser, seed: bool = True) -> None:
    """The dataset flags; without `seed`, the engine's --seed draws the dataset too."""
    g = parser.add_argument_group("dataset (vLLM's random dataset; the default is benchmarks/' standard workload)")
    g.add_argument("--dataset-name", default="random", choices=("random",), help="(default: %(default)s)")
    g.add_argument("--num-prompts", type=int, default=STANDARD["num_prompts"], help="(default: %(default)s)")
    g.add_argument("--random-input-len", type=int, default=None, metavar="N", help="prompt tokens (default: 32-256)")
    g.add_argument("--random-output-len", type=int, default=None, metavar="N", help="output tokens (default: 32-128)")
    g.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="lengths uniform in [N (1 - r), N (1 + r)] (default: %(default)s)",
    )
    g.add_argument(
        "--input-len-range",
        type=parse_range,
        default=None,
        metavar="LO:HI",
        help="prompt lengths, instead of --random-input-len",
    )
    g.add_argument(
        "--output-len-range",
        type=parse_range,
        default=None,
        metavar="LO:HI",
        help="output lengths, instead of --random-output-len",
    )
    if seed:
        g.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")


def add_bench_parser(commands, add_engine_args, engine_args) -> None:
    """`jaxllm bench` and its four commands, on the main parser's subparsers; `add_engine_args`
    and `engine_args` are the CLI's (its engine flags, and the EngineArgs they give)."""
    formatter = argparse.RawDescriptionHelpFormatter

    def offline(parser, run) -> None:
        """The flags every command that runs its own engine ends with, and what it runs."""
        parser.add_argument("--output-json", default=None, metavar="PATH", help="write the results as JSON")
        add_engine_args(parser)
        parser.set_defaults(run=run, engine_args=engine_args)

    bench = commands.add_parser(
        "bench",
        formatter_class=formatter,
        help="benchmark throughput, latency, perplexity or a server",
        description=__doc__.split("\n\n")[0] + "\n\n" + __doc__.split("\n\n")[1],
    )
    kinds = bench.add_subparsers(dest="bench_command", metavar="KIND", title="kinds", required=True)

    throughput = kinds.add_parser(
        "throughput",
        formatter_class=formatter,
        help="offline batch throughput",
        epilog="example:\n  jaxllm bench throughput --num-prompts 128 --output-json t.json",
    )
    _add_dataset_args(throughput, seed=False)
    offline(throughput, run_throughput)

    latency = kinds.add_parser(
        "latency",
        formatter_class=formatter,
        help="latency of one batch",
        epilog="example:\n  jaxllm bench latency --batch-size 8 --input-len 32 --output-len 128",
    )
    latency.add_argument("--input-len", type=int, default=32, help="(default: %(default)s)")
    latency.add_argument("--output-len", type=int, default=128, help="(default: %(default)s)")
    latency.add_argument("--batch-size", type=int, default=8, help="(default: %(default)s)")
    latency.add_argument("--num-iters-warmup", type=int, default=2, help="(default: %(default)s)")
    latency.add_argument("--num-iters", type=int, default=5, help="(default: %(default)s)")
    offline(latency, run_latency)

    ppl = kinds.add_parser(
        "perplexity",
        formatter_class=formatter,
        help="perplexity on a text",
        epilog="example:\n  jaxllm bench perplexity --quantization int8",
    )
    ppl.add_argument(
        "--text-file",
        default=None,
        metavar="PATH",
        help="UTF-8 text to score (default: the public-domain text that ships with jaxllm)",
    )
    ppl.add_argument("--window", type=int, default=512, help="tokens per scored window (default: %(default)s)")
    offline(ppl, run_perplexity)

    _add_serve_parser(kinds)


def _add_serve_parser(kinds) -> None:
    """`jaxllm bench serve`: load on a running server (vLLM's `vllm bench serve` flags)."""
    serve = kinds.add_parser(
        "serve",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        help="a running server under load",
        epilog="example:\n  jaxllm serve &\n  jaxllm bench serve --request-rate 4 --num-prompts 64",
    )
    serve.add_argument(
        "--base-url", default=None, help="server root, e.g. http://127.0.0.1:8000 (default: --host/--port)"
    )
    serve.add_argument("--host", default="127.0.0.1", help="(default: %(default)s)")
    serve.add_argument("--port", type=int, default=8000, help="(default: %(default)s)")
    serve.add_argument("--model", default=None, help="the served model's name (default: the server's first model)")
    serve.add_argument(
        "--tokenizer",
        default=None,
        metavar="MODEL",
        help="model files whose vocabulary the prompts are drawn from (default: the bundled SmolLM2)",
    )
    serve.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="(default: $OPENAI_API_KEY)")
    serve.add_argument(
        "--request-rate", type=parse_rate, default=float("inf"), help="requests/s, or inf (default: inf)"
    )
    serve.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight (default: no bound)")
    _add_dataset_args(serve)
    serve.add_argument("--save-result", action="store_true", help="write the results as JSON")
    serve.add_argument("--result-dir", default=".", help="(default: the current folder)")
    serve.add_argument("--result-filename", default=None, help="(default: jaxllm-<rate>qps-<date>.json)")
    serve.set_defaults(run=run_serve)


def workload(args, model: str | None) -> list[dict]:
    """The requests the dataset flags describe, from `model`'s vocabulary."""
    from jaxllm.bench.datasets import length_range, random_workload, vocab_info

    def lengths(explicit, length, standard):
        if explicit is not None:
            return explicit
        return standard if length is None else length_range(length, args.random_range_ratio)

    vocab_size, special = vocab_info(model)
    return random_workload(
        args.num_prompts,
        lengths(args.input_len_range, args.random_input_len, STANDARD["input_len_range"]),
        lengths(args.output_len_range, args.random_output_len, STANDARD["output_len_range"]),
        args.seed,
        vocab_size,
        special,
    )


def provenance() -> dict:
    """The machine (CPU model, family, SIMD flags) and versions, for the JSON results."""
    import importlib.metadata

    from jaxllm.bench import machine_info

    return {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine_info(),
        "versions": {name: importlib.metadata.version(name) for name in ("jaxllm", "jax", "jaxlib")},
        "command": " ".join(["jaxllm", *sys.argv[1:]]),
    }


def _write(path: str | None, result: dict) -> None:
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {path}")


def _load(args):
    from jaxllm.engine.llm import LLM

    fields = vars(args.engine_args(args))
    llm = LLM(fields.pop("model"), **fields)
    llm.engine.wait_compiled()  # (timed runs start once every step shape is compiled)
    return llm


def _greedy(max_tokens: int):
    from jaxllm.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens)


def _generate(llm, requests: list[dict]) -> int:
    """Run `requests` as one batch; returns the output tokens, checking each gave its max_tokens."""
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in requests]
    outputs = llm.generate(prompts, [_greedy(r["max_tokens"]) for r in requests], use_tqdm=False)
    for out, r in zip(outputs, requests):
        if len(out.outputs[0].token_ids) != r["max_tokens"]:
            raise RuntimeError(
                f"request {out.request_id} gave {len(out.outputs[0].token_ids)} tokens, not {r['max_tokens']}"
            )
    return sum(r["max_tokens"] for r in requests)


def run_throughput(args) -> int:
    llm = _load(args)
    requests = workload(args, args.model)
    _generate(llm, [{"prompt_token_ids": requests[0]["prompt_token_ids"][:8], "max_tokens": 4}])  # warm
    start = time.perf_counter()
    output_tokens = _generate(llm, requests)
    elapsed = time.perf_counter() - start
    prompt_tokens = sum(len(r["prompt_token_ids"]) for r in requests)
    result = {
        "elapsed_time": elapsed,
        "num_requests": len(requests),
        "total_num_tokens": prompt_tokens + output_tokens,
        "total_output_tokens": output_tokens,
        "requests_per_second": len(requests) / elapsed,
        "tokens_per_second": (prompt_tokens + output_tokens) / elapsed,
        "output_tokens_per_second": output_tokens / elapsed,
        **provenance(),
    }
    print(
        f"Throughput: {result['requests_per_second']:.2f} requests/s, {result['tokens_per_second']:.2f} total "
        f"tokens/s, {result['output_tokens_per_second']:.2f} output tokens/s"
    )
    _write(args.output_json, result)
    return 0


def run_latency(args) -> int:
    import numpy as np

    llm = _load(args)
    args.num_prompts, args.input_len_range, args.output_len_range = args.batch_size, None, None
    args.random_input_len, args.random_output_len, args.random_range_ratio = args.input_len, args.output_len, 0.0
    batch = workload(args, args.model)
    for _ in range(args.num_iters_warmup):
        _generate(llm, batch)
    latencies = []
    for _ in range(args.num_iters):
        start = time.perf_counter()
        _generate(llm, batch)
        latencies.append(time.perf_counter() - start)
    percentiles = {str(p): float(np.percentile(latencies, p)) for p in (10, 25, 50, 75, 90, 99)}
    result = {
        "avg_latency": float(np.mean(latencies)),
        "latencies": latencies,
        "percentiles": percentiles,
        "batch_size": args.batch_size,
        "input_len": args.input_len,
        "output_len": args.output_len,
        **provenance(),
    }
    print(f"Avg latency: {result['avg_latency']:.3f} seconds")
    for p, value in percentiles.items():
        print(f"{p}% percentile latency: {value:.3f} seconds")
    _write(args.output_json, result)
    return 0


def run_perplexity(args) -> int:
    from jaxllm.bench.perplexity import perplexity

    text = None
    if args.text_file is not None:
        with open(args.text_file, encoding="utf-8") as f:
            text = f.read()
    result = {
        **perplexity(_load(args), text, args.window),
        "window": args.window,
        "quantization": args.quantization,
        **provenance(),
    }
    print(f"Perplexity: {result['perplexity']:.4f} over {result['tokens']} tokens ({result['windows']} windows)")
    _write(args.output_json, result)
    return 0


def _served_model(base_url: str, headers: dict) -> str | None:
    """The first model the server lists (None, said on stderr, when no server answers)."""
    import httpx

    try:
        response = httpx.get(base_url + "/v1/models", headers=headers, timeout=30)
        response.raise_for_status()
    except httpx.HTTPError as e:
        print(f"jaxllm bench serve: error: no server answers at {base_url}: {e}", file=sys.stderr)
        return None
    return response.json()["data"][0]["id"]


def _print_serving_result(row: dict) -> None:
    """The result table, laid out as vLLM's `vllm bench serve` prints it."""
    print(f"{' Serving Benchmark Result ':=^60}")
    lines = [
        ("Successful requests:", row["completed"]),
        ("Failed requests:", row["failed"]),
        ("Benchmark duration (s):", f"{row['duration_s']:.2f}"),
        ("Total input tokens:", row["prompt_tokens"]),
        ("Total generated tokens:", row["output_tokens"]),
        ("Request throughput (req/s):", f"{row['request_throughput']:.2f}"),
        ("Output token throughput (tok/s):", f"{row['output_throughput']:.2f}"),
        ("Total Token throughput (tok/s):", f"{row['total_token_throughput']:.2f}"),
    ]
    for name, title in (
        ("ttft", "Time to First Token"),
        ("tpot", "Time per Output Token (excl. 1st token)"),
        ("itl", "Inter-token Latency"),
        ("e2e", "End-to-end Latency"),
    ):
        lines.append((f"{title:-^60}", None))
        short = name.upper()
        for stat, key in (("Mean", "mean_ms"), ("Median", "p50_ms"), ("P99", "p99_ms")):
            value = row[name][key]
            lines.append((f"{stat} {short} (ms):", "-" if value is None else f"{value:.2f}"))
    for label, value in lines:
        print(label if value is None else f"{label:<40}{value:<10}")
    print("=" * 60)


def run_serve(args) -> int:
    import asyncio

    from jaxllm.bench.serve import run_rate, first_request

    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model = args.model or _served_model(base_url, headers)
    if model is None:
        return 1
    requests = workload(args, args.tokenizer)
    test = first_request(base_url, model, requests[0]["prompt_token_ids"], args.api_key)
    if not test["verified"]:
        print(f"jaxllm bench serve: the test request failed: {test['errors'] or test['wrong_counts']}", file=sys.stderr)
        return 1
    row = asyncio.run(
        run_rate(base_url, model, requests, args.request_rate, args.seed, args.max_concurrency, args.api_key)
    )
    _print_serving_result(row)
    if not row["verified"]:
        print(f"not every request gave its max_tokens tokens: {row['errors'] or row['wrong_counts']}", file=sys.stderr)
    if args.save_result:
        rate = "inf" if args.request_rate == float("inf") else f"{args.request_rate:g}"
        name = args.result_filename or f"jaxllm-{rate}qps-{time.strftime('%Y%m%d-%H%M%S')}.json"
        _write(
            os.path.join(args.result_dir, name),
            {**row, "base_url": base_url, "model": model, "num_prompts": len(requests), **provenance()},
        )
    return 0 if row["verified"] else 1
