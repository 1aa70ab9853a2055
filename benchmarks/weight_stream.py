"""The layer GEMMs as a decode step streams them: the default model's four layer matrices
(fused QKV, attention output, gate/up with the SwiGLU epilogue, down) for each of its 30 layers,
each layer's weights distinct (80 MB of bf16 or more: past the caches, as in the engine), chained
in one jitted call, through jaxllm's C++ GEMMs: bf16 panels (the float default on AVX512_BF16
CPUs), 4-bit and 8-bit codes x bf16 activations (`matmul_quantized_bf16`: weight-only codes
under dtype bfloat16, a GGUF's blocks by default), 4-bit codes through the f32 weight-only
kernel (`matmul_quantized`), f32 panels (the float32 dtype's GEMM, `csrc/gemm.cc`) and W8A8
(8-bit codes x int8 activations, `quantization="int8"`: the engine's weights, x scaled per block
of up to 256 columns, and the same with a scale per row). Best of `--repeat` calls per row count;
each path's GFLOP/s and its time against bf16's.

    python benchmarks/weight_stream.py --rows 1,4,16,64,512 --out /tmp/stream.json

Needs AVX512_BF16 (the bf16 paths); random weights and codes (timing only).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]
sys.path.insert(0, HERE)
from workload import cpu_line, machine_info, now_iso, versions  # noqa: E402

del sys.path[0]

LAYERS = 30
# (K, N, SwiGLU epilogue): SmolLM2-135M's fused QKV, output, gate/up, down.
SHAPES = [(576, 960, False), (576, 576, False), (576, 3072, True), (1536, 576, False)]


def chain(matmul):
    """A jitted call of `matmul(h, weight, swiglu)` over every layer's matrices in order, each
    input the previous output widened or cut to its K (the values do not matter)."""
    swiglus = [sw for _ in range(LAYERS) for _, _, sw in SHAPES]

    def run(x, weights):
        h = x
        for w, (k, _, _), sw in zip(weights, SHAPES * LAYERS, swiglus):
            y = matmul(jnp.tile(h, (1, -(-k // h.shape[1])))[:, :k], w, sw)
            h = y
        return h

    return jax.jit(run)


def main(argv=None) -> int:
    import dataclasses

    from jaxllm.kernels import gemm, native
    from jaxllm.quantization import weights as quant

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,4,16,64,512")
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not native.has_bf16_dots():
        raise SystemExit("this CPU has no AVX512_BF16 dots (or no C++ kernels): nothing to compare")
    machine = machine_info()
    print(cpu_line(machine), flush=True)
    rng = np.random.default_rng(0)
    weights = {name: [] for name in ("bf16", "q4 x bf16", "q8 x bf16", "q4 f32 kernel", "f32", "w8a8", "w8a8 per row")}
    for _ in range(LAYERS):
        for k, n, _ in SHAPES:
            w = (rng.standard_normal((k, n)) * 0.02).astype(np.float32)
            weights["bf16"].append(jnp.asarray(gemm.pack_weight(w, dtype=jnp.bfloat16)))
            c4, c8 = rng.integers(0, 16, (k, n)), rng.integers(-127, 128, (k, n))
            s = jnp.asarray((rng.random((k // 32, n)) * 0.01).astype(np.float16))
            o = jnp.asarray((-rng.random((k // 32, n)) * 0.1).astype(np.float16))
            weights["q4 x bf16"].append((jnp.asarray(gemm.pack_codes(c4, 4, pairs=True)), s, o))
            weights["q8 x bf16"].append((jnp.asarray(gemm.pack_codes(c8, 8)), s, None))
            weights["q4 f32 kernel"].append((jnp.asarray(gemm.pack_codes(c4, 4)), s, o))
            weights["f32"].append(jnp.asarray(gemm.pack_weight(w)))
            q = quant.make_weight(w, "w8a8", panels=True, activations="int8")
            weights["w8a8"].append(q)
            row_bias = jnp.asarray(quant._w8a8_bias(quant._unpacked_codes(q, np), 0))
            weights["w8a8 per row"].append(dataclasses.replace(q, act_group=0, bias=row_bias))
    calls = {
        "bf16": chain(lambda h, w, sw: gemm.matmul_packed(h, w, swiglu=sw)),
        "q4 x bf16": chain(lambda h, w, sw: gemm.matmul_quantized_bf16(h, *w, 4, swiglu=sw)),
        "q8 x bf16": chain(lambda h, w, sw: gemm.matmul_quantized_bf16(h, *w, 8, swiglu=sw)),
        "q4 f32 kernel": chain(lambda h, w, sw: gemm.matmul_quantized(h, *w, 4, swiglu=sw)),
        "f32": chain(lambda h, w, sw: gemm.matmul_packed(h, w, swiglu=sw)),
        "w8a8": chain(lambda h, w, sw: quant.matmul(h, w, swiglu=sw)),
        "w8a8 per row": chain(lambda h, w, sw: quant.matmul(h, w, swiglu=sw)),
    }
    flops_per_row = 2 * LAYERS * sum(k * n for k, n, _ in SHAPES)
    rows = []
    print("| rows | " + " | ".join(f"{name} ms (GFLOP/s)" for name in calls) + " | vs bf16 |", flush=True)
    for m in (int(r) for r in args.rows.split(",")):
        x = jnp.asarray(rng.standard_normal((m, 576)).astype(np.float32))
        best = {}
        for name, call in calls.items():
            jax.block_until_ready(call(x, weights[name]))
            times = []
            for _ in range(args.repeat):
                t = time.perf_counter()
                jax.block_until_ready(call(x, weights[name]))
                times.append(time.perf_counter() - t)
            best[name] = min(times)
        row = {
            "rows": m,
            **{f"{name} ms": 1e3 * t for name, t in best.items()},
            **{f"{name} GFLOP/s": m * flops_per_row / t / 1e9 for name, t in best.items()},
        }
        rows.append(row)
        print(
            f"| {m} | "
            + " | ".join(f"{1e3 * t:.2f} ({m * flops_per_row / t / 1e9:.0f})" for t in best.values())
            + " | "
            + " / ".join(f"{best['bf16'] / t:.2f}x" for name, t in best.items() if name != "bf16")
            + " |",
            flush=True,
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "date": now_iso(),
                    "machine": machine,
                    "versions": versions(),
                    "layers": LAYERS,
                    "shapes": SHAPES,
                    "rows": rows,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
