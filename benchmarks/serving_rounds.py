"""Servers raced in rounds, their order reversed each round, and the first one's ratios per round.

    python benchmarks/serving_rounds.py --servers jaxllm,llama --rounds 3 --out-prefix \\
        benchmarks/results/zen5/race16 -- --tokenizer qwen2.5-coder-1.5b --concurrencies 16 \\
        --prompts-per-client 4

Each round runs `benchmarks/serving.py --launch <server>` once per server with the arguments
after `--`: jaxllm, llama, then llama, jaxllm, ... On a host whose speed drifts within minutes (a
shared virtual machine's often does), one run of each server a few minutes apart can land in
different phases of that drift; rounds in alternating order put each pair close in time, and
the median of the per-round ratios is the figure to quote. Each run's JSON goes to
`<prefix>-<server>-r<round>.json`; the summary (output tok/s per level, server and round, the
first server's ratio to each other per round, their medians) to `<prefix>-rounds.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def level_name(run: dict) -> str:
    """A run row's level: 'c16' for 16 in flight, 'rate inf' for requests at a rate."""
    if run.get("max_concurrency"):
        return f"c{run['max_concurrency']}"
    return f"rate {run['request_rate']}"


def summarize(servers: list[str], results: dict) -> dict:
    """Output tok/s per level -> server -> [round's], and the first server's ratios to each other
    per round and their median. `results[server]` holds one serving.py result a round."""
    tps = {}
    for server in servers:
        for result in results[server]:
            for run in result["runs"]:
                tps.setdefault(level_name(run), {}).setdefault(server, []).append(run["output_throughput"])
    first, ratios = servers[0], {}
    for level, by_server in tps.items():
        for other in servers[1:]:
            pairs = [a / b for a, b in zip(by_server.get(first, []), by_server.get(other, [])) if b]
            if pairs:
                ratios.setdefault(level, {})[f"{first}/{other}"] = {
                    "per_round": pairs,
                    "median": statistics.median(pairs),
                }
    return {"output_tok_s": tps, "ratios": ratios}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    passed = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", default="jaxllm,llama", help="comma-separated --launch values, the first compared")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out-prefix", default=os.path.join(HERE, "results", "serving"))
    args = ap.parse_args(own)
    servers = args.servers.split(",")
    if len(servers) < 2 or len(set(servers)) != len(servers):
        ap.error("--servers: two or more different servers")
    if "--launch" in passed or "--out" in passed:
        ap.error("--launch and --out are this script's to set")
    results: dict = {s: [] for s in servers}
    timeline = []
    for r in range(1, args.rounds + 1):
        for server in servers if r % 2 else servers[::-1]:
            out = f"{args.out_prefix}-{server}-r{r}.json"
            cmd = [sys.executable, os.path.join(HERE, "serving.py"), "--launch", server, *passed, "--out", out]
            print(f"round {r}: {server} ({time.strftime('%H:%M:%S')})", flush=True)
            if subprocess.run(cmd).returncode != 0:
                print(f"round {r}: {server} failed: {shlex.join(cmd)}", file=sys.stderr)
                return 1
            with open(out) as f:
                results[server].append(json.load(f))
            timeline.append({"round": r, "server": server, "date": results[server][-1]["date"], "file": out})
    summary = {
        "servers": servers,
        "rounds": args.rounds,
        "serving_args": passed,
        "runs": timeline,
        **summarize(servers, results),
        "machine": results[servers[0]][0]["machine"],
    }
    with open(f"{args.out_prefix}-rounds.json", "w") as f:
        json.dump(summary, f, indent=1)
    for level, pairs in summary["ratios"].items():
        for name, ratio in pairs.items():
            rounds = ", ".join(f"{x:.2f}" for x in ratio["per_round"])
            print(f"{level}: {name} {ratio['median']:.2f}x (median of rounds: {rounds})")
    print(f"wrote {args.out_prefix}-rounds.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
