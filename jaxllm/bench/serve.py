"""`jaxllm bench serve`'s client (also benchmarks/serving.py's): streamed /v1/completions
requests at Poisson arrivals, or at most `max_concurrency` in flight, each timed for TTFT, TPOT,
ITL and end-to-end latency, and checked to return exactly its max_tokens tokens."""

from __future__ import annotations

import asyncio
import json
import time

import numpy as np


async def send_request(client, url: str, model: str, item: dict, api_key: str | None) -> dict:
    """One streamed completion; timings in seconds."""
    payload = {
        "model": model,
        "prompt": item["prompt_token_ids"],
        "max_tokens": item["max_tokens"],
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    out = {
        "prompt_tokens": len(item["prompt_token_ids"]),
        "max_tokens": item["max_tokens"],
        "ttft": None,
        "itl": [],
        "output_tokens": 0,
        "chunks": 0,
        "error": None,
    }
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                raise RuntimeError(f"HTTP {response.status_code}: {body[:300]}")
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("choices"):
                    now = time.perf_counter()
                    if out["ttft"] is None:
                        out["ttft"] = now - start
                    else:
                        out["itl"].append(now - last)
                    last = now
                    out["chunks"] += 1
                if chunk.get("usage"):
                    out["output_tokens"] = chunk["usage"]["completion_tokens"]
    except Exception as e:  # a failed request is counted, not fatal
        out["error"] = f"{type(e).__name__}: {e}"
    out["e2e"] = time.perf_counter() - start
    if not out["output_tokens"]:
        out["output_tokens"] = out["chunks"]  # a server without streamed usage: one token per chunk
    return out


def summarize(values: list[float]) -> dict:
    if not values:
        return {"mean_ms": None, "p50_ms": None, "p99_ms": None}
    a = np.asarray(values) * 1e3
    return {"mean_ms": float(a.mean()), "p50_ms": float(np.percentile(a, 50)), "p99_ms": float(np.percentile(a, 99))}


async def run_rate(
    base_url: str,
    model: str,
    workload: list[dict],
    rate: float,
    seed: int,
    max_concurrency: int | None,
    api_key: str | None,
) -> dict:
    import httpx

    url = base_url.rstrip("/") + "/v1/completions"
    rng = np.random.default_rng(seed)
    limits = httpx.Limits(max_connections=len(workload) + 8, max_keepalive_connections=len(workload) + 8)
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def one(client, item):
        if semaphore is None:
            return await send_request(client, url, model, item, api_key)
        async with semaphore:
            return await send_request(client, url, model, item, api_key)

    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:
        tasks = []
        start = time.perf_counter()
        for item in workload:
            tasks.append(asyncio.create_task(one(client, item)))
            if rate != float("inf"):
                await asyncio.sleep(rng.exponential(1.0 / rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return _result_row(results, rate, max_concurrency, duration)


def first_request(base_url: str, model: str, prompt_token_ids: list[int], api_key: str | None) -> dict:
    """One short request (the first 8 tokens of `prompt_token_ids`, 4 out), sent before a
    measured run as vLLM's client sends one: it checks the server answers, and no measured
    request pays for a cold path. -> `run_rate`'s row (`verified`, `errors`, `wrong_counts`)."""
    first = [{"prompt_token_ids": prompt_token_ids[:8], "max_tokens": 4}]
    return asyncio.run(run_rate(base_url, model, first, float("inf"), 0, None, api_key))


def _result_row(results: list[dict], rate: float, max_concurrency: int | None, duration: float) -> dict:
    """Counts, throughputs and latency percentiles (TTFT, TPOT, ITL, end to end) of one rate's run."""
    ok = [r for r in results if r["error"] is None]
    wrong = [i for i, r in enumerate(results) if r["error"] is None and r["output_tokens"] != r["max_tokens"]]
    out_tokens = sum(r["output_tokens"] for r in ok)
    prompt_tokens = sum(r["prompt_tokens"] for r in ok)
    row = {
        "request_rate": rate if rate != float("inf") else "inf",
        "max_concurrency": max_concurrency,
        "duration_s": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "verified": not wrong and len(ok) == len(results),
        "wrong_counts": [(i, results[i]["output_tokens"], results[i]["max_tokens"]) for i in wrong[:10]],
        "errors": sorted({r["error"] for r in results if r["error"]})[:5],
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (out_tokens + prompt_tokens) / duration,
        "output_tokens": out_tokens,
        "prompt_tokens": prompt_tokens,
        "mean_tokens_per_chunk": out_tokens / max(sum(r["chunks"] for r in ok), 1),
    }
    for name, values in (
        ("ttft", [r["ttft"] for r in ok if r["ttft"] is not None]),
        (
            "tpot",
            [
                (r["e2e"] - r["ttft"]) / (r["output_tokens"] - 1)
                for r in ok
                if r["ttft"] is not None and r["output_tokens"] > 1
            ],
        ),
        ("itl", [x for r in ok for x in r["itl"]]),
        ("e2e", [r["e2e"] for r in ok]),
    ):
        row[name] = summarize(values)
    return row


def print_row(row: dict) -> None:
    def ms(d):
        return f"{d['mean_ms']:.0f}/{d['p50_ms']:.0f}/{d['p99_ms']:.0f}" if d["mean_ms"] is not None else "-"

    status = "ok" if row["verified"] else f"{row['failed']} failed, wrong counts {row['wrong_counts']} {row['errors']}"
    bound = f" c={row['max_concurrency']}" if row.get("max_concurrency") else ""
    print(
        f"rate {str(row['request_rate']):>5s}{bound}: {row['duration_s']:7.1f} s  "
        f"{row['request_throughput']:6.2f} req/s  "
        f"{row['output_throughput']:7.1f} out tok/s  {row['total_token_throughput']:7.1f} tok/s  "
        f"TTFT {ms(row['ttft'])}  TPOT {ms(row['tpot'])}  ITL {ms(row['itl'])}  e2e {ms(row['e2e'])} ms "
        f"(mean/p50/p99)  {status}",
        flush=True,
    )
