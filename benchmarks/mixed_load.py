"""Chat and embeddings served at once on one machine: does either starve the other?

    python benchmarks/mixed_load.py                      # 30 s a phase
    python benchmarks/mixed_load.py --seconds 60 --chat-clients 4 --embed-clients 4

An engine either generates or embeds (as in vLLM), so a deployment that serves both runs two
`jaxllm serve` processes: here the default chat model and all-MiniLM-L6-v2, started side by side
with their defaults. Three phases of `--seconds` each: chat alone, embeddings alone, both at
once. Chat clients loop over chat completions (`--max-tokens` tokens, greedy, EOS ignored);
embedding clients loop over requests of `--batch` sentences of the shipped text. Reported per
phase: chat output tokens per second and request latency (p50, p99), embedded sentences per
second and request latency, and what each keeps of its alone rate when both run. JSON to --out
(default benchmarks/results/mixed_load.json).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]
sys.path.insert(0, HERE)
from embeddings import corpus, minilm_path  # noqa: E402
from workload import RESULTS, write_run  # noqa: E402

del sys.path[0]

QUESTIONS = [
    "Explain what a hash map is.",
    "Write a haiku about the sea.",
    "Give three tips for learning a language.",
    "What causes the seasons on Earth?",
]


def serve(model: str | None, log_path: str) -> tuple[subprocess.Popen, str]:
    """`jaxllm serve` on a free port; returns (process, base URL) once it is ready."""
    cmd = [sys.executable, "-m", "jaxllm.entrypoints.cli", "serve", "--port", "0", "--disable-log-requests"]
    cmd += ["--model", model] if model else []
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=open(log_path, "w"), text=True)
    found = {}

    def watch():
        for line in proc.stdout:
            if line.startswith("jaxllm: ready at "):
                found["url"] = line.split()[3]

    threading.Thread(target=watch, daemon=True).start()
    while "url" not in found:
        if proc.poll() is not None:
            raise SystemExit(f"jaxllm serve {model} exited; see {log_path}")
        time.sleep(0.2)
    return proc, found["url"]


async def chat_client(client, stop: float, tokens: list, latencies: list, max_tokens: int, i: int) -> None:
    n = i
    model = (await client.models.list()).data[0].id
    while time.perf_counter() < stop:
        start = time.perf_counter()
        out = await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": QUESTIONS[n % len(QUESTIONS)]}],
            max_tokens=max_tokens,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        if time.perf_counter() <= stop:
            tokens.append(out.usage.completion_tokens)
            latencies.append(time.perf_counter() - start)
        n += 1


async def embed_client(client, stop: float, counts: list, latencies: list, batches: list, i: int) -> None:
    n = i
    model = (await client.models.list()).data[0].id
    while time.perf_counter() < stop:
        start = time.perf_counter()
        out = await client.embeddings.create(model=model, input=batches[n % len(batches)])
        if time.perf_counter() <= stop:
            counts.append(len(out.data))
            latencies.append(time.perf_counter() - start)
        n += 1


async def phase(args, chat_url: str | None, embed_url: str | None, batches: list) -> dict:
    import openai

    stop = time.perf_counter() + args.seconds
    chat_tokens, chat_lat, embedded, embed_lat, tasks, clients = [], [], [], [], [], []
    if chat_url:
        clients.append(openai.AsyncOpenAI(base_url=chat_url, api_key="-", max_retries=0, timeout=600))
        tasks += [
            chat_client(clients[-1], stop, chat_tokens, chat_lat, args.max_tokens, i) for i in range(args.chat_clients)
        ]
    if embed_url:
        clients.append(openai.AsyncOpenAI(base_url=embed_url, api_key="-", max_retries=0, timeout=600))
        tasks += [embed_client(clients[-1], stop, embedded, embed_lat, batches, i) for i in range(args.embed_clients)]
    await asyncio.gather(*tasks)
    for client in clients:
        await client.close()

    def summary(rate: str, done: list, latencies: list) -> dict:
        percentile = lambda q: round(float(np.percentile(latencies, q)), 3) if latencies else None  # noqa: E731
        return {
            rate: round(sum(done) / args.seconds, 1),
            "requests": len(latencies),
            "latency_p50_s": percentile(50),
            "latency_p99_s": percentile(99),
        }

    out = {}
    if chat_url:
        out["chat"] = summary("output_tok_s", chat_tokens, chat_lat)
    if embed_url:
        out["embeddings"] = summary("sentences_s", embedded, embed_lat)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--chat-model", default=None, help="default: the bundled SmolLM2-135M-Instruct")
    ap.add_argument("--embed-model", default=None, help="default: all-MiniLM-L6-v2")
    ap.add_argument("--chat-clients", type=int, default=4)
    ap.add_argument("--embed-clients", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--out", default=os.path.join(RESULTS, "mixed_load.json"))
    args = ap.parse_args()
    sentences = corpus(32 * args.batch)
    batches = [sentences[i : i + args.batch] for i in range(0, len(sentences), args.batch)]
    logs = tempfile.mkdtemp(prefix="jaxllm-mixed-load-")  # the servers' logs
    chat, chat_url = serve(args.chat_model, os.path.join(logs, "mixed_load-chat.log"))
    embed, embed_url = serve(args.embed_model or minilm_path(), os.path.join(logs, "mixed_load-embed.log"))
    try:
        asyncio.run(phase(argparse.Namespace(**{**vars(args), "seconds": 5.0}), chat_url, embed_url, batches))  # warm
        results = {
            "chat_alone": asyncio.run(phase(args, chat_url, None, batches)),
            "embeddings_alone": asyncio.run(phase(args, None, embed_url, batches)),
            "both": asyncio.run(phase(args, chat_url, embed_url, batches)),
        }
    finally:
        for proc in (chat, embed):
            proc.terminate()
            proc.wait(timeout=60)
    both = results["both"]
    kept = {
        "chat": round(both["chat"]["output_tok_s"] / results["chat_alone"]["chat"]["output_tok_s"], 3),
        "embeddings": round(
            both["embeddings"]["sentences_s"] / results["embeddings_alone"]["embeddings"]["sentences_s"], 3
        ),
    }
    for name, value in results.items():
        print(f"{name}: {value}")
    print(f"kept when both run: {kept}")
    write_run(args.out, dict(results=results, kept_when_both=kept, args=vars(args)))


if __name__ == "__main__":
    main()
