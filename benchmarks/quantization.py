"""Quantization table: perplexity, standard-workload throughput and weight memory of each
`quantization=` method beside the float dtypes, one engine per subprocess, in one run.

    python benchmarks/quantization.py        # every method (the list: --configs' default)
    python benchmarks/quantization.py --configs int8,int4 --num-prompts 32

A config is METHOD[:DTYPE[:KV[:ACT]]] (METHOD as `LLM(quantization=...)`: `none` dequantizes a GGUF
to the dtype, `gguf` keeps its blocks; DTYPE as `LLM(dtype=...)`, default auto; KV as
`LLM(kv_cache_dtype=...)`, default auto; ACT `int8` for `LLM(int8_activations=True)`, e.g.
`gguf:auto:auto:int8`). Each runs in a fresh process: perplexity on the shipped public-domain text
(jaxllm/bench/perplexity.py, windows of 512 tokens), then the standard workload (128 requests,
prompts 32-256, outputs 32-128 tokens, greedy, ignore_eos) timed after a short warm-up request,
the bytes of the engine's weights (`quantization.weight_bytes`: codes, scales, offsets, and
the float arrays), and greedy agreement: 16 prompts cut from the same text, 64 greedy tokens
each; the share of tokens equal to the baseline's (bf16 if it ran, else the first config) up to
each output's first difference, and the share of outputs equal whole. JSON to --out (default
benchmarks/results/quantization.json) and a markdown table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]
sys.path.insert(0, HERE)
from workload import RESULTS, add_workload_args, cpu_line, machine_info, make_workload, now_iso, versions  # noqa: E402

del sys.path[0]

BITS = {
    "none": None,
    "int8_weight_only": "8",
    "int4": "4 (LM head 8)",
    "w8a8": "8 / 8",
    "int8": "8 / 8",
    "gguf": "the file's blocks",
}


def worker(job: dict) -> dict:
    from jaxllm import LLM, SamplingParams
    from jaxllm.bench.perplexity import perplexity
    from jaxllm.quantization import weight_bytes

    t0 = time.perf_counter()
    llm = LLM(
        job["model"],
        dtype=job["dtype"],
        quantization=job["method"],
        kv_cache_dtype=job["kv"],
        int8_activations=job["act"] == "int8",
    )
    llm.engine.wait_compiled()
    start_s = time.perf_counter() - t0
    ppl = perplexity(llm)
    agreement = llm.generate(
        job["agreement_prompts"], SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True), use_tqdm=False
    )
    requests = job["workload"]
    greedy = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=r["max_tokens"]) for r in requests]
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in requests]
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=4), use_tqdm=False)
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, greedy, use_tqdm=False)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert tokens == sum(r["max_tokens"] for r in requests), "an engine gave the wrong number of tokens"
    return {
        "method": job["method"],
        "dtype": llm.engine.config.dtype,
        "kv_cache_dtype": llm.engine.config.cache.dtype,
        "int8_activations": llm.engine.config.int8_activations,
        "perplexity": ppl["perplexity"],
        "ppl_tokens": ppl["tokens"],
        "output_tokens": tokens,
        "wall_s": wall,
        "output_tok_s": tokens / wall,
        "weight_bytes": weight_bytes(llm.engine.runner.params, llm.engine.runner.small_params),
        "start_s": start_s,
        "greedy_tokens": [o.outputs[0].token_ids for o in agreement],
    }


def agreement_prompts(n: int = 16) -> list[str]:
    """n prompts: the first 12 words of every other paragraph of the perplexity text."""
    from jaxllm.bench.perplexity import DEFAULT_TEXT

    with open(DEFAULT_TEXT, encoding="utf-8") as f:
        paragraphs = [p for p in f.read().split("\n\n") if len(p.split()) >= 12]
    return [" ".join(p.split()[:12]) for p in paragraphs[::2]][:n]


def agreement(a: list[list[int]], b: list[list[int]]) -> tuple[float, float]:
    """(share of tokens before each pair's first difference, share of pairs equal whole)."""
    prefix = 0
    for x, y in zip(a, b):
        prefix += next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))
    return prefix / sum(len(y) for y in b), sum(x == y for x, y in zip(a, b)) / len(b)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--configs",
        default="none:auto,none:bfloat16,gguf,gguf:auto:auto:int8,int8_weight_only,int4,"
        "int4:auto:auto:int8,w8a8,gguf:auto:int8,gguf:auto:fp8_e4m3",
        help="METHOD[:DTYPE[:KV[:ACT]]],...",
    )
    ap.add_argument("--out", default=os.path.join(RESULTS, "quantization.json"))
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    add_workload_args(ap)
    args = ap.parse_args(argv)
    if args.worker:
        with open(args.worker) as f:
            job = json.load(f)
        print("RESULT " + json.dumps(worker(job)), flush=True)
        return 0
    workload, desc = make_workload(args)
    machine = machine_info()
    print(cpu_line(machine), flush=True)
    rows = []
    prompts = agreement_prompts()
    for config in args.configs.split(","):
        method, dtype, kv, act = (config.split(":") + ["auto", "auto", "float"])[:4]
        spec_path = os.path.join(RESULTS, f".quantization-{os.getpid()}.json")
        with open(spec_path, "w") as f:
            json.dump(
                {
                    "method": method,
                    "dtype": dtype or "auto",
                    "kv": kv or "auto",
                    "act": act,
                    "model": args.model,
                    "workload": workload,
                    "agreement_prompts": prompts,
                },
                f,
            )
        try:
            proc = subprocess.run(
                [sys.executable, os.path.abspath(__file__), "--worker", spec_path],
                capture_output=True,
                text=True,
                env={**os.environ, "OPENBLAS_NUM_THREADS": "1"},
            )
        finally:
            os.unlink(spec_path)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            print(f"{config}: failed\n{proc.stderr[-3000:]}", file=sys.stderr)
            return 1
        row = json.loads(lines[-1][len("RESULT ") :])
        rows.append(row)
        print(
            f"{config}: ppl {row['perplexity']:.3f}, {row['output_tok_s']:.1f} output tok/s, "
            f"weights {row['weight_bytes'] / 2**20:.1f} MiB",
            flush=True,
        )
    base = next(
        (r for r in rows if r["method"] == "none" and r["dtype"] == "bfloat16" and r["kv_cache_dtype"] == "bfloat16"),
        rows[0],
    )
    for r in rows:
        r["greedy_token_agreement"], r["greedy_output_agreement"] = agreement(r["greedy_tokens"], base["greedy_tokens"])
    vs = f"vs {base['dtype']}"
    print(
        f"\n| method | dtype | KV cache | bits (weights / activations) | perplexity | {vs} | output tok/s | {vs} | "
        f"weights MiB | {vs} | greedy agreement (tokens / outputs) |"
    )
    print("|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        act = " (int8 activations)" if r.get("int8_activations") else ""
        print(
            f"| {r['method']}{act} | {r['dtype']} | {r['kv_cache_dtype']} | {BITS.get(r['method']) or r['dtype']} | "
            f"{r['perplexity']:.3f} | {r['perplexity'] / base['perplexity']:.3f}x | {r['output_tok_s']:.1f} | "
            f"{r['output_tok_s'] / base['output_tok_s']:.2f}x | {r['weight_bytes'] / 2**20:.1f} | "
            f"{r['weight_bytes'] / base['weight_bytes']:.2f}x | "
            f"{r['greedy_token_agreement']:.0%} / {r['greedy_output_agreement']:.0%} |"
        )
    result = {
        "date": now_iso(),
        "machine": machine,
        "versions": versions(),
        "workload": desc,
        "command": " ".join(["python", "benchmarks/quantization.py", *(argv or sys.argv[1:])]),
        "rows": rows,
    }
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
