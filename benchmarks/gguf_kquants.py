"""GGUF K-quants (Q4_K, Q5_K, Q6_K) kept with their two-level scales against the same codes
with the scales multiplied out to f32 (how jaxllm held them before): weight bits and the C++
GEMM's speed, in one run.

    python benchmarks/gguf_kquants.py                    # Llama-3-8B's q and down shapes
    python benchmarks/gguf_kquants.py --rows 1,16,128

Per block type, shape and row count: microseconds per `quantization.matmul` (jitted, the
weight packed for the C++ GEMM once outside; the two layouts timed in turn three times, each
time the median of 5 calls, the best of the three kept), bits a weight (codes, scales, offsets),
and whether the two outputs are equal
(they must be: the same f32 scales). The blocks are random (a small f16 d per super-block).
JSON to --out (default benchmarks/results/gguf_kquants.json; a Zen 3 run in results/zen3/).
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

# (name, K inputs, N outputs): Llama-3-8B's attention q (and output) and MLP down matrices.
SHAPES = [("q", 4096, 4096), ("down", 14336, 4096)]


def random_pages(rng, ggml_type: int, out: int, k: int) -> np.ndarray:
    """Raw GGUF rows [out, bytes] of random K-quant blocks with a small f16 d (and dmin)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T

    elems, size = GGML_QUANT_SIZES[ggml_type]
    blocks = rng.integers(0, 256, (out, k // elems, size), dtype=np.uint8)
    for at in {T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}[ggml_type]:
        d = rng.uniform(2e-4, 1e-3, blocks.shape[:2]).astype(np.float16)
        blocks[..., at : at + 2] = d[..., None].view(np.uint8)
    return blocks.reshape(out, -1)


def main(argv=None) -> int:
    from gguf.constants import GGMLQuantizationType as T

    from jaxllm.quantization import matmul, weight_bytes
    from jaxllm.quantization.gguf_blocks import gguf_rows
    from jaxllm.quantization.weights import flat_scales, relayout

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,4,32,128", help="M values, comma-separated")
    ap.add_argument("--types", default="Q4_K,Q5_K,Q6_K")
    ap.add_argument("--out", default=os.path.join(RESULTS, "gguf_kquants.json"))
    args = ap.parse_args(argv)
    machine = machine_info()
    print(cpu_line(machine))
    rng = np.random.default_rng(0)
    mm = jax.jit(matmul)
    results = []
    for type_name in args.types.split(","):
        t = T[type_name]
        for shape_name, k, n in SHAPES:
            rows = gguf_rows(random_pages(rng, t, n, k), t, (n, k))
            two = relayout(rows.to_weight(), panels=True)
            flat = relayout(flat_scales(rows.to_weight()), panels=True)
            bits = {name: weight_bytes(w) * 8 / (k * n) for name, w in (("two_level", two), ("flat", flat))}
            for m in (int(r) for r in args.rows.split(",")):
                x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
                equal = bool(np.array_equal(mm(x, two), mm(x, flat)))
                us = {"two_level": [], "flat": []}
                for _ in range(3):  # interleaved, so a slow spell of the machine hits both
                    for name, w in (("two_level", two), ("flat", flat)):
                        us[name].append(timeit(lambda w=w: mm(x, w).block_until_ready()) * 1e6)
                row = dict(
                    type=type_name,
                    shape=shape_name,
                    K=k,
                    N=n,
                    M=m,
                    equal=equal,
                    **{f"{name}_us": round(min(v), 1) for name, v in us.items()},
                    **{f"{name}_bits": round(b, 3) for name, b in bits.items()},
                )
                row["speed_ratio"] = round(row["flat_us"] / row["two_level_us"], 3)
                results.append(row)
                print(json.dumps(row), flush=True)
    print("\n| type | shape [K, N] | bits a weight: two-level / flat | M | two-level us | flat us | flat / two-level |")
    print("|---|---|---|---:|---:|---:|---:|")
    for r in results:
        print(
            f"| {r['type']} | {r['shape']} [{r['K']}, {r['N']}] | {r['two_level_bits']} / {r['flat_bits']} | "
            f"{r['M']} | {r['two_level_us']} | {r['flat_us']} | {r['speed_ratio']}x |"
        )
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(machine=machine, versions=versions(), date=now_iso(), results=results), f, indent=1)
    return 0 if all(r["equal"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
