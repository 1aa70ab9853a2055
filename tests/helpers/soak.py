"""A soak run against a live server: many mixed requests, some abandoned mid-way, some invalid.

    python -m tests.helpers.soak [--requests 2000] [--concurrency 64]   # starts a tiny-model server itself
    python -m tests.helpers.soak --url http://127.0.0.1:8000 --api-key KEY --model NAME
    python -m tests.helpers.soak --duration 3600 --server-model PATH --out soak.json   # the hour-long soak

Each request is drawn at random: completions or chat, streamed or not, n 1-2, 1-48 tokens. About
10% are abandoned by their client (a stream dropped after a few chunks, or a plain request timed
out), 5% are invalid on purpose (they must get a 4xx), and the rest must succeed with exactly the
tokens asked for (ignore_eos); with `--structured`, 10% ask for a JSON schema and must answer
JSON that fits it. Reported: counts, errors (any other outcome), latency percentiles of the
completed requests, and the server's RSS, threads and KV-cache usage before and after
(`soak_figures`). `tests/server/test_soak.py` runs it in CI and asserts on the figures.

With `--duration` the load runs for that many seconds instead of a number of requests, and the
server's RSS, open files and threads are sampled every `--sample-every` seconds: reported as
their timeline and the RSS growth from the first sample past a sixth of the run to the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time

import httpx

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
INVALID = [{"temperature": -1}, {"max_tokens": 0}, {"n": 10**6}, {"top_p": 2}, {"model": "no-such-model"}]
SCHEMA = {
    "type": "object",
    "properties": {"word": {"enum": WORDS}, "count": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["word", "count"],
    "additionalProperties": False,
}


def _sample(stats: dict, error) -> None:
    """Keep the first 20 errors as samples (they are all counted in stats["errors"])."""
    if len(stats["error_samples"]) < 20:
        stats["error_samples"].append(error)


async def structured_request(client: httpx.AsyncClient, rng: random.Random, model: str, stats: dict) -> None:
    """A chat request under a JSON schema: its answer must be JSON that fits it."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": " ".join(rng.choices(WORDS, k=8))}],
        "max_tokens": 64,
        "temperature": rng.choice([0, 0.8]),
        "response_format": {"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA}},
    }
    start = time.perf_counter()
    try:
        response = await client.post("/v1/chat/completions", json=body, timeout=120)
        if response.status_code != 200:
            raise RuntimeError(f"status {response.status_code}: {response.text[:200]}")
        value = json.loads(response.json()["choices"][0]["message"]["content"])
        if set(value) != {"word", "count"} or value["word"] not in WORDS or not 0 <= value["count"] <= 99:
            raise RuntimeError(f"does not fit the schema: {value}")
        stats["structured"] += 1
        stats["ok"] += 1
        stats["latencies"].append(time.perf_counter() - start)
    except Exception as e:  # noqa: BLE001 - every unexpected outcome is counted, with a sample
        stats["errors"] += 1
        _sample(stats, repr(e)[:200])


async def one_request(client: httpx.AsyncClient, rng: random.Random, model: str, stats: dict) -> None:
    chat, stream = rng.random() < 0.5, rng.random() < 0.5
    max_tokens, n = rng.randint(1, 48), rng.choice([1, 1, 1, 2])
    text = " ".join(rng.choices(WORDS, k=rng.randint(1, 40)))
    body = {
        "model": model,
        "max_tokens": max_tokens,
        "n": n,
        "temperature": rng.choice([0, 0.8]),
        "ignore_eos": True,
        "stream": stream,
    }
    body.update({"messages": [{"role": "user", "content": text}]} if chat else {"prompt": text})
    path = "/v1/chat/completions" if chat else "/v1/completions"
    kind = rng.choices(["ok", "abandon", "invalid"], [0.85, 0.10, 0.05])[0]
    if kind == "invalid":
        body.update(rng.choice(INVALID))
    start = time.perf_counter()
    try:
        if kind == "abandon" and not stream:
            try:
                response = await client.post(path, json=body, timeout=httpx.Timeout(30, read=rng.uniform(0.01, 0.2)))
            except httpx.ReadTimeout:  # gave up waiting: the server must abort the request
                stats["abandoned"] += 1
                return
            if response.status_code != 200:  # answered before the client gave up: it must be a success
                raise RuntimeError(f"status {response.status_code}: {response.text[:200]}")
            stats["ok"] += 1
            stats["latencies"].append(time.perf_counter() - start)
            return
        async with client.stream("POST", path, json=body, timeout=120) as response:
            if kind == "invalid":
                await response.aread()
                stats["rejected" if 400 <= response.status_code < 500 else "errors"] += 1
                return
            if response.status_code != 200:
                stats["errors"] += 1
                _sample(stats, (response.status_code, (await response.aread())[:200].decode()))
                return
            tokens, finished, drop_after = 0, 0, rng.randint(1, 4) if kind == "abandon" else None
            if stream:
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        raise RuntimeError(f"error event: {event['error']}")
                    for choice in event["choices"]:
                        tokens += 1 if (choice.get("text") or choice.get("delta", {}).get("content")) else 0
                        finished += choice.get("finish_reason") is not None
                    if drop_after is not None and tokens >= drop_after:
                        stats["abandoned"] += 1
                        return  # leaving the block closes the connection mid-stream
            else:
                result = json.loads(await response.aread())
                finished = sum(c["finish_reason"] is not None for c in result["choices"])
                tokens = result["usage"]["completion_tokens"]
                if tokens != n * max_tokens:
                    raise RuntimeError(f"asked for {n} x {max_tokens} tokens, got {tokens}")
            if finished != n:
                raise RuntimeError(f"{finished} of {n} choices finished")
        stats["ok"] += 1
        stats["latencies"].append(time.perf_counter() - start)
    except Exception as e:  # noqa: BLE001 - every unexpected outcome is counted, with a sample
        stats["errors"] += 1
        _sample(stats, repr(e)[:200])


async def run_soak(
    url: str,
    api_key: str,
    model: str,
    *,
    requests: int = 2000,
    concurrency: int = 64,
    seed: int = 0,
    duration: float | None = None,
    structured: bool = False,
) -> dict:
    """`requests` requests (or, with `duration`, as many as fit in that many seconds) from
    `concurrency` clients at once."""
    rng = random.Random(seed)
    stats = {"ok": 0, "abandoned": 0, "rejected": 0, "errors": 0, "structured": 0, "latencies": [], "error_samples": []}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {api_key}"}, limits=limits) as client:
        start = time.perf_counter()
        left = [requests]

        def more() -> bool:
            if duration is not None:
                return time.perf_counter() - start < duration
            left[0] -= 1
            return left[0] >= 0

        async def worker():
            while more():
                request_rng = random.Random(rng.getrandbits(64))
                if structured and request_rng.random() < 0.1:
                    await structured_request(client, request_rng, model, stats)
                else:
                    await one_request(client, request_rng, model, stats)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        stats["seconds"] = time.perf_counter() - start
    stats["requests"] = stats["ok"] + stats["abandoned"] + stats["rejected"] + stats["errors"]
    return stats


def sample_process(pid: int, every: float, timeline: list, stop) -> None:
    """Append (seconds, RSS MiB, open files, threads) of process `pid` every `every` s until `stop` is set."""
    import psutil

    process, start = psutil.Process(pid), time.perf_counter()
    while not stop.wait(every if timeline else 0):
        timeline.append(
            (
                round(time.perf_counter() - start, 1),
                round(process.memory_info().rss / 2**20, 1),
                process.num_fds(),
                process.num_threads(),
            )
        )


def server_state(url: str, pid: int | None) -> dict:
    """RSS, threads, KV usage and running requests of the server, once it is idle."""
    import psutil
    from prometheus_client.parser import text_string_to_metric_families

    deadline = time.monotonic() + 30
    while True:
        text = httpx.get(url + "/metrics", timeout=30).text
        values = {
            s.name: s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
            if not s.labels or set(s.labels) == {"model_name"}
        }
        idle = values["jaxllm:num_requests_running"] == 0 and values["jaxllm:num_requests_waiting"] == 0
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    state = {
        "kv_cache_usage": values["jaxllm:kv_cache_usage_perc"],
        "running": values["jaxllm:num_requests_running"],
        "waiting": values["jaxllm:num_requests_waiting"],
    }
    if pid is not None:
        process = psutil.Process(pid)
        state.update(rss_mib=process.memory_info().rss / 2**20, threads=process.num_threads())
    return state


def soak_figures(url: str, api_key: str, model: str, pid: int | None, sample_every: float = 30.0, **kwargs) -> dict:
    import threading

    before = server_state(url, pid)
    timeline, stop = [], threading.Event()
    sampler = None
    if pid is not None and kwargs.get("duration"):
        sampler = threading.Thread(target=sample_process, args=(pid, sample_every, timeline, stop), daemon=True)
        sampler.start()
    stats = asyncio.run(run_soak(url, api_key, model, **kwargs))
    stop.set()
    if sampler is not None:
        sampler.join()
    after = server_state(url, pid)
    latencies = sorted(stats.pop("latencies"))

    def pct(q):
        return latencies[min(len(latencies) - 1, int(q * len(latencies)))] if latencies else float("nan")

    figures = {**stats, "p50_s": pct(0.50), "p99_s": pct(0.99), "before": before, "after": after}
    if timeline:
        settled = next((row for row in timeline if row[0] >= kwargs["duration"] / 6), timeline[0])
        figures["timeline"] = timeline  # (seconds, RSS MiB, open files, threads)
        figures["rss_growth_after_first_sixth"] = (timeline[-1][1] - settled[1]) / settled[1]
        figures["fds_min_max"] = (min(r[2] for r in timeline), max(r[2] for r in timeline))
        figures["threads_min_max"] = (min(r[3] for r in timeline), max(r[3] for r in timeline))
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a running server (default: start a tiny-model server)")
    parser.add_argument("--api-key", default="")
    parser.add_argument("--model")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--duration", type=float, help="seconds of load (instead of --requests)")
    parser.add_argument("--sample-every", type=float, default=30.0, help="seconds between samples of the server")
    parser.add_argument("--structured", action="store_true", help="10%% of requests under a JSON schema")
    parser.add_argument("--server-model", help="the model of the server this starts (default: a tiny random one)")
    parser.add_argument("--server-flags", default="", help="more `jaxllm serve` flags for it, one string")
    parser.add_argument("--out", help="write the figures (JSON) here too")
    args = parser.parse_args()
    sizes = dict(
        requests=args.requests,
        concurrency=args.concurrency,
        seed=args.seed,
        duration=args.duration,
        structured=args.structured,
    )
    if args.url:
        figures = soak_figures(args.url, args.api_key, args.model, None, **sizes)
    else:
        import tempfile

        from tests.helpers.live_server import API_KEY, start_server
        from tests.helpers.tiny_model import build_tiny_model

        with tempfile.TemporaryDirectory() as work:
            model = args.server_model or build_tiny_model(f"{work}/tiny-llama")
            named = ["--served-model-name", os.path.basename(model)]  # (the name the client asks for)
            server = start_server(model, work, *named, *args.server_flags.split())
            try:
                figures = soak_figures(
                    server.url, API_KEY, server.model, server.proc.pid, sample_every=args.sample_every, **sizes
                )
            finally:
                server.stop()
    text = json.dumps(figures, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0 if figures["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
