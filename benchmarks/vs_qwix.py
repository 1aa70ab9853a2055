"""jaxllm's quantized matmuls against qwix's (Google's JAX quantization library), on the default
model's weight shapes: the evaluation the quantization issue asked for before adopting qwix.

    pip install --no-deps qwix         # (it needs flax >= 0.12, which jaxllm declares)
    python benchmarks/vs_qwix.py       # M = 2, 32, 128, 512 rows

Per weight and row count, microseconds per call (jitted, weights quantized once outside):
- weight-only int8, a scale per output channel: jaxllm's C++ GEMM on its packed codes (the
  engine's path on one CPU device) and qwix's `dot_general` of f32 x by a `QArray`;
- W8A8 (x quantized per row inside the call): jaxllm's `quantization.matmul` (XLA's int8 dot)
  and qwix's `quantize` + `dot_general` of two `QArray`s;
and the largest error of each against the exact product of the float operands (relative to
that product's largest value), and whether both quantize the weight to the same values.
JSON to --out (default benchmarks/results/vs_qwix.json).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]
sys.path.insert(0, HERE)
from workload import RESULTS, cpu_line, machine_info, now_iso, timeit, versions  # noqa: E402
from dots import SHAPES  # noqa: E402  (dots.py takes HERE off sys.path again)

sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]


def main(argv=None) -> int:
    try:
        import qwix
    except ImportError as e:
        print(f"qwix is not installed ({e}): pip install --no-deps qwix")
        return 1
    from jaxllm.kernels import native
    from jaxllm.quantization import dequantize, matmul
    from jaxllm.quantization.weights import make_weight

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="2,32,128,512", help="M values, comma-separated")
    ap.add_argument("--out", default=os.path.join(RESULTS, "vs_qwix.json"))
    args = ap.parse_args(argv)
    machine = machine_info()
    print(f"{cpu_line(machine)}\nqwix {getattr(qwix, '__version__', '?')}, jax {jax.__version__}\n")
    dims = (((1,), (0,)), ((), ()))
    ours = jax.jit(matmul)
    qwix_weight_only = jax.jit(lambda x, w: qwix.dot_general(x, w, dims, preferred_element_type=jnp.float32))
    qwix_w8a8 = jax.jit(
        lambda x, w: qwix.dot_general(
            qwix.quantize(x, jnp.int8, channelwise_axes=(0,)), w, dims, preferred_element_type=jnp.float32
        )
    )
    rng = np.random.default_rng(0)
    rows = []
    print(
        f"{'weight':10s} {'M':>4s} {'int8 jaxllm us':>15s} {'int8 qwix us':>13s} {'w8a8 jaxllm us':>15s} "
        f"{'w8a8 qwix us':>13s}   max error: int8 jaxllm / qwix, w8a8 jaxllm / qwix"
    )
    for name, (k, n) in SHAPES.items():
        w = rng.standard_normal((k, n), dtype=np.float32) * 0.05
        ours_int8 = make_weight(w, "int8", panels=native.available(), activations="float")
        ours_w8a8 = make_weight(w, "w8a8", panels=False, activations="int8")
        theirs = qwix.quantize(jnp.asarray(w), jnp.int8, channelwise_axes=(1,))
        same = bool(
            np.allclose(np.asarray(qwix.dequantize(theirs)), np.asarray(dequantize(ours_w8a8)), rtol=1e-6, atol=1e-7)
        )
        for m in (int(v) for v in args.rows.split(",")):
            x = rng.standard_normal((m, k), dtype=np.float32)
            x[:, 5] *= 20  # an outlier channel, as real activations have
            exact = x.astype(np.float64) @ w.astype(np.float64)
            calls = {
                "int8_jaxllm": lambda: ours(x, ours_int8),
                "int8_qwix": lambda: qwix_weight_only(x, theirs),
                "w8a8_jaxllm": lambda: ours(x, ours_w8a8),
                "w8a8_qwix": lambda: qwix_w8a8(x, theirs),
            }
            reps = 10 if n > 10000 else 30
            row = {"weight": name, "k": k, "n": n, "m": m, "same_weight_values": same}
            for key, call in calls.items():
                row[f"{key}_us"] = timeit(lambda c=call: c().block_until_ready(), reps) * 1e6
                row[f"{key}_error"] = float(np.abs(np.asarray(call()) - exact).max() / np.abs(exact).max())
            rows.append(row)
            print(
                f"{name:10s} {m:4d} {row['int8_jaxllm_us']:15.0f} {row['int8_qwix_us']:13.0f} "
                f"{row['w8a8_jaxllm_us']:15.0f} {row['w8a8_qwix_us']:13.0f}   "
                f"{row['int8_jaxllm_error']:.1e} / {row['int8_qwix_error']:.1e}, "
                f"{row['w8a8_jaxllm_error']:.1e} / {row['w8a8_qwix_error']:.1e}"
            )
    for key in ("int8", "w8a8"):
        ratios = [r[f"{key}_qwix_us"] / r[f"{key}_jaxllm_us"] for r in rows]
        print(
            f"{key}: qwix time / jaxllm time, median {np.median(ratios):.2f}x (range {min(ratios):.2f}-"
            f"{max(ratios):.2f}x)"
        )
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(
            {"when": now_iso(), "machine": machine, "versions": {**versions(), "qwix": qwix.__version__}, "rows": rows},
            f,
            indent=1,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
