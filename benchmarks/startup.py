"""Start-up: seconds from a fresh Python process to the first generated token (`LLM()` with the
default settings, then a one-token `generate`), cold and warm.

    python benchmarks/startup.py                 # one cold start, then --warm warm ones
    python benchmarks/startup.py --warm 5 --dtype float32
    python benchmarks/startup.py --compile-first --out benchmarks/results/startup-compile-first.json

Cold: an empty cache root (`JAXLLM_CACHE_DIR`), so the C++ kernels are built, the weights
converted and the steps compiled (by default in the background: the first token waits for
the shapes its steps need; `--compile-first`: for all of them). Warm: the same cache root again,
as every later start of the
same model and settings finds it. Each start runs in its own process; besides the total (from
just before this script starts the process to the first token), each reports its import, engine
construction (of which warm-up: compiling or loading the steps) and first-token seconds. Writes
results/startup.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]
sys.path.insert(0, HERE)
from workload import RESULTS, ROOT, cpu_line, machine_info, now_iso, versions  # noqa: E402

del sys.path[0]

CHILD = """
import json, sys, time
launched = float(sys.argv[2])          # the parent's time.time() just before it started this process
t0 = time.perf_counter()
from jaxllm import LLM, SamplingParams
t1 = time.perf_counter()
llm = LLM(**json.loads(sys.argv[1]))
t2 = time.perf_counter()
out = llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
t3 = time.perf_counter()
to_first_token = time.time() - launched
runner = llm.engine.runner
llm.engine.wait_compiled()    # (the steps compile or load in the background)
print("RESULT " + json.dumps({"to_first_token_s": to_first_token, "import_s": t1 - t0, "engine_s": t2 - t1,
                              "warmup_s": llm.engine.warmup_seconds,
                              "first_token_s": t3 - t2, "buckets": len(runner.buckets),
                              "steps_loaded": runner.steps.loaded, "dtype": llm.engine.config.dtype}))
"""


def start(cache_root: str, engine_args: dict) -> dict:
    env = {**os.environ, "JAXLLM_CACHE_DIR": cache_root}
    proc = subprocess.run(
        [sys.executable, "-P", "-c", CHILD, json.dumps(engine_args), repr(time.time())],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"start-up run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--warm", type=int, default=3, help="warm starts after the cold one")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--model", default=None, help="default: the bundled SmolLM2 GGUF")
    ap.add_argument(
        "--compile-first",
        action="store_true",
        help="background_compile=False: every step shape compiled before LLM() returns",
    )
    ap.add_argument("--out", default=os.path.join(RESULTS, "startup.json"))
    args = ap.parse_args(argv)
    engine_args = {"model": args.model, "dtype": args.dtype, "background_compile": not args.compile_first}
    machine = machine_info()
    print(cpu_line(machine), flush=True)
    runs = []
    with tempfile.TemporaryDirectory(prefix="jaxllm-startup-") as root:
        for i in range(1 + args.warm):
            kind = "cold" if i == 0 else "warm"
            row = {"kind": kind, **start(root, engine_args)}
            runs.append(row)
            print(
                f"{kind}: {row['to_first_token_s']:.1f} s to the first token (import {row['import_s']:.1f}, engine "
                f"{row['engine_s']:.1f} of which warm-up {row['warmup_s']:.1f}, first token "
                f"{row['first_token_s']:.2f}; {row['steps_loaded']}/{row['buckets']} steps loaded, "
                f"{row['dtype']})",
                flush=True,
            )
    warm = sorted(r["to_first_token_s"] for r in runs[1:])
    result = {
        "date": now_iso(),
        "machine": machine,
        "versions": versions(),
        "engine_args": engine_args,
        "command": shlex.join([os.path.relpath(sys.argv[0])] + sys.argv[1:]),
        "cold_s": runs[0]["to_first_token_s"],
        "warm_median_s": warm[len(warm) // 2] if warm else None,
        "runs": runs,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(
        f"cold {result['cold_s']:.1f} s, warm (median of {len(warm)}) "
        f"{result['warm_median_s'] or float('nan'):.1f} s -> {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
