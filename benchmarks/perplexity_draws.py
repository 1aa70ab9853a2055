"""Perplexity of a quantization as a spread, not one figure: int8 activations turn a change in the
last bit of any input into other codes a few layers on, so one run of `jaxllm bench perplexity`
is one draw of that rounding (on the default model W8A8 with a scale per row moved by up to 1%
from draw to draw). Each draw scales the input of every matmul with int8 activations by 1 + eps
(the product changes by eps, the rounding by more) and measures the perplexity on the shipped
public-domain text, each in a fresh process with its own compile cache.

    python benchmarks/perplexity_draws.py                                # int8 (W8A8), four draws
    python benchmarks/perplexity_draws.py --configs int8,int8:act_group=0 --eps=0,1e-6,-1e-6,3e-6

A config is METHOD[:act_group=B] (METHOD as `LLM(quantization=...)`; act_group B: W8A8's
activation blocks of up to B columns, `quantization.weights.W8A8_ACT_GROUP`, 0 for a scale per
row). Prints each draw and each config's mean and range; JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]
sys.path.insert(0, HERE)
from workload import cpu_line, machine_info, now_iso, versions  # noqa: E402

del sys.path[0]


def worker(config: str, eps: float) -> float:
    """One draw: the perplexity of `config` with its int8-activation inputs times 1 + eps."""
    from jaxllm.quantization import weights

    method, *options = config.split(":")
    for option in options:
        key, value = option.split("=")
        if key != "act_group":
            raise SystemExit(f"unknown option {key!r} in {config!r}")
        weights.W8A8_ACT_GROUP = int(value)
    matmul = weights.matmul

    def perturbed(x, w, *args, **kwargs):
        if w.activations == "int8" and eps:
            x = x * (1 + eps)
        return matmul(x, w, *args, **kwargs)

    weights.matmul = perturbed  # QuantizedWeight.apply calls it through the module
    from jaxllm import LLM
    from jaxllm.bench.perplexity import perplexity

    return perplexity(LLM(quantization=None if method == "none" else method))["perplexity"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="int8", help="METHOD[:act_group=B],...")
    ap.add_argument("--eps", default="0,1e-6,-1e-6,3e-6", help="one draw per value")
    ap.add_argument("--out", default=None)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # CONFIG@EPS
    args = ap.parse_args(argv)
    if args.worker:
        config, eps = args.worker.rsplit("@", 1)
        print("RESULT " + json.dumps(worker(config, float(eps))), flush=True)
        return 0
    machine = machine_info()
    print(cpu_line(machine), flush=True)
    results = {}
    for config in args.configs.split(","):
        draws = []
        for eps in args.eps.split(","):
            with tempfile.TemporaryDirectory() as cache:  # no compiled step or executable of another draw
                env = {**os.environ, "JAXLLM_CACHE_DIR": cache}
                proc = subprocess.run(
                    [sys.executable, os.path.abspath(__file__), f"--worker={config}@{eps}"],
                    env=env,
                    capture_output=True,
                    text=True,
                )
            lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
            if proc.returncode or not lines:
                raise SystemExit(f"{config} eps {eps} failed:\n{proc.stderr[-3000:]}")
            draws.append(json.loads(lines[-1][len("RESULT ") :]))
            print(f"{config} eps {eps}: perplexity {draws[-1]:.3f}", flush=True)
        results[config] = {"eps": args.eps.split(","), "perplexity": draws, "mean": sum(draws) / len(draws)}
        print(
            f"{config}: mean {results[config]['mean']:.3f}, {min(draws):.3f}-{max(draws):.3f} over {len(draws)} draws",
            flush=True,
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"date": now_iso(), "machine": machine, "versions": versions(), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
