"""A soak run against a live server: many mixed requests, some abandoned mid-way, some invalid.

    python -m tests.helpers.soak [--requests 2000] [--concurrency 64]   # starts a tiny-model server itself
    python -m tests.helpers.soak --url http://127.0.0.1:8000 --api-key KEY --model NAME

Each request is drawn at random: completions or chat, streamed or not, n 1-2, 1-48 tokens. About
10% are abandoned by their client (a stream dropped after a few chunks, or a plain request timed
out), 5% are invalid on purpose (they must get a 4xx), and the rest must succeed with exactly the
tokens asked for (ignore_eos). Reported: counts, errors (any other outcome), latency
percentiles of the completed requests, and the server's RSS, threads and KV-cache usage before
and after (`soak_figures`). `tests/server/test_soak.py` runs it in CI and asserts on the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time

import httpx

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
INVALID = [{"temperature": -1}, {"max_tokens": 0}, {"n": 10**6}, {"top_p": 2}, {"model": "no-such-model"}]


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
                stats["error_samples"].append((response.status_code, (await response.aread())[:200].decode()))
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
        stats["error_samples"].append(repr(e)[:200])


async def run_soak(
    url: str, api_key: str, model: str, *, requests: int = 2000, concurrency: int = 64, seed: int = 0
) -> dict:
    rng = random.Random(seed)
    stats = {"ok": 0, "abandoned": 0, "rejected": 0, "errors": 0, "latencies": [], "error_samples": []}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {api_key}"}, limits=limits) as client:
        queue = [random.Random(rng.getrandbits(64)) for _ in range(requests)]

        async def worker():
            while queue:
                await one_request(client, queue.pop(), model, stats)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        stats["seconds"] = time.perf_counter() - start
    return stats


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


def soak_figures(url: str, api_key: str, model: str, pid: int | None, **kwargs) -> dict:
    before = server_state(url, pid)
    stats = asyncio.run(run_soak(url, api_key, model, **kwargs))
    after = server_state(url, pid)
    latencies = sorted(stats.pop("latencies"))

    def pct(q):
        return latencies[min(len(latencies) - 1, int(q * len(latencies)))] if latencies else float("nan")

    return {**stats, "p50_s": pct(0.50), "p99_s": pct(0.99), "before": before, "after": after}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a running server (default: start a tiny-model server)")
    parser.add_argument("--api-key", default="")
    parser.add_argument("--model")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    sizes = dict(requests=args.requests, concurrency=args.concurrency, seed=args.seed)
    if args.url:
        figures = soak_figures(args.url, args.api_key, args.model, None, **sizes)
    else:
        import tempfile

        from tests.helpers.live_server import API_KEY, start_server
        from tests.helpers.tiny_model import build_tiny_model

        with tempfile.TemporaryDirectory() as work:
            server = start_server(build_tiny_model(f"{work}/tiny-llama"), work)
            try:
                figures = soak_figures(server.url, API_KEY, server.model, server.proc.pid, **sizes)
            finally:
                server.stop()
    print(json.dumps(figures, indent=2))
    return 0 if figures["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
