"""The dtype question on this CPU: XLA:CPU dots in float32 vs bf16 x bf16 -> f32, on the
default model's weight shapes, next to what `dtype="auto"` picks here; and jaxllm's packed
GEMMs (`kernels.gemm.matmul_packed`, the engine's path for float32 weights on one CPU device,
and for bf16 weights where the CPU has AVX512_BF16),
and the quantized weights' paths (jaxllm/quantization): `int8` and `int4` codes in the C++ GEMM
(weight-only), `int4` codes with int8 activations in the C++ GEMM (`int8_activations`),
`w8a8` in the C++ GEMM (the engine's path on one CPU device) and through XLA's int8 dot (sharded
runs' path), and on AVX512_BF16 CPUs `int4` codes x bf16 activations (weight-only `int4` under
dtype bfloat16).

    python benchmarks/dots.py                 # M = 1, 2, 8, 16, 32, 64, 128, 512 rows

On CPUs without hardware bf16 dots (no AVX512_BF16, no AMX) XLA widens the bf16 operands on
every call; this shows by how much that loses (or, for memory-bound shapes, wins) here. XLA's
f32 dot repacks the weight on every call; the packed GEMM reads weights packed once.
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

del sys.path[0]

# SmolLM2-135M's weights (K, N): fused QKV, attention output, fused gate/up, down, LM head.
SHAPES = {
    "wqkv": (576, 960),
    "wo": (576, 576),
    "w_gate_up": (576, 3072),
    "w_down": (1536, 576),
    "lm_head": (576, 49152),
}


def main(argv=None) -> int:
    from jaxllm.kernels import gemm, native
    from jaxllm.platforms import Platform

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,8,16,32,64,128,512", help="M values, comma-separated")
    ap.add_argument("--out", default=os.path.join(RESULTS, "dots.json"))
    args = ap.parse_args(argv)
    dot = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
    rng = np.random.default_rng(0)
    machine = machine_info()
    pick, why = Platform.named("cpu").default_dtype
    print(f"{cpu_line(machine)}\ndtype='auto' picks {pick}: {why}\n")
    from jaxllm.quantization import matmul as quantized_matmul
    from jaxllm.quantization.activations import with_bf16_activations, with_int8_activations
    from jaxllm.quantization.weights import make_weight

    packed_dot = jax.jit(gemm.matmul_packed) if native.available() else None
    quantized_dot = jax.jit(quantized_matmul)
    print(
        f"{'weight':10s} {'M':>4s} {'f32 GFLOP/s':>12s} {'bf16 GFLOP/s':>13s} {'bf16/f32':>9s} "
        f"{'packed f32 GFLOP/s':>19s} {'packed/f32':>11s} {'packed bf16':>12s} {'/bf16':>6s}   "
        "GFLOP/s of int8 / int4 (C++) / w8a8 (C++) / int4 x int8 (C++) / w8a8 (XLA)"
        + (" / int4 x bf16 (C++)" if native.has_bf16_dots() else "")
    )
    rows = []
    for name, (k, n) in SHAPES.items():
        w32 = jnp.asarray(rng.standard_normal((k, n), dtype=np.float32))
        w16 = w32.astype(jnp.bfloat16)
        packed = jnp.asarray(gemm.pack_weight(np.asarray(w32))) if packed_dot else None
        packed16 = (
            jnp.asarray(gemm.pack_weight(np.asarray(w32), dtype=jnp.bfloat16)) if native.has_bf16_dots() else None
        )
        quantized = {
            method: make_weight(
                np.asarray(w32),
                method,
                panels=packed_dot is not None,
                activations="int8" if method == "w8a8" else "float",
            )
            for method in ("int8", "int4", "w8a8")
        }
        quantized["int4_act8"] = with_int8_activations(quantized["int4"])
        quantized["w8a8_xla"] = make_weight(np.asarray(w32), "w8a8", panels=False, activations="int8")
        if native.has_bf16_dots():
            quantized["int4_bf16"] = with_bf16_activations(quantized["int4"])
        for m in (int(x) for x in args.rows.split(",")):
            x32 = jnp.asarray(rng.standard_normal((m, k), dtype=np.float32))
            x16 = x32.astype(jnp.bfloat16)
            reps = 10 if n > 10000 else 30
            t32 = timeit(lambda: dot(x32, w32).block_until_ready(), reps)
            t16 = timeit(lambda: dot(x16, w16).block_until_ready(), reps)
            tp = timeit(lambda: packed_dot(x32, packed).block_until_ready(), reps) if packed_dot else None
            tp16 = timeit(lambda: packed_dot(x32, packed16).block_until_ready(), reps) if packed16 is not None else None
            flops = 2 * m * k * n
            tq = {
                method: timeit(lambda w=w: quantized_dot(x32, w).block_until_ready(), reps)
                for method, w in quantized.items()
            }
            rows.append(
                {
                    "weight": name,
                    "k": k,
                    "n": n,
                    "m": m,
                    "f32_gflops": flops / t32 / 1e9,
                    "bf16_gflops": flops / t16 / 1e9,
                    "packed_f32_gflops": flops / tp / 1e9 if tp else None,
                    "packed_bf16_gflops": flops / tp16 / 1e9 if tp16 else None,
                    **{f"{method}_gflops": flops / t / 1e9 for method, t in tq.items()},
                }
            )
            packed_cols = f" {flops / tp / 1e9:19.1f} {t32 / tp:10.2f}x" if tp else ""
            packed_cols += f" {flops / tp16 / 1e9:12.1f} {t16 / tp16:5.2f}x" if tp16 else ""
            print(
                f"{name:10s} {m:4d} {flops / t32 / 1e9:12.1f} {flops / t16 / 1e9:13.1f} {t32 / t16:8.2f}x"
                + packed_cols
                + "   "
                + " / ".join(f"{flops / t / 1e9:.1f}" for t in tq.values()),
                flush=True,
            )
    result = {
        "date": now_iso(),
        "machine": machine,
        "versions": versions(),
        "auto_dtype": pick,
        "auto_reason": why,
        "rows": rows,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
