"""The layer GEMMs as a decode step streams them: a model's four layer matrices (fused QKV,
attention output, gate/up with the SwiGLU epilogue, down; `--model`: the default model's 30
layers, Qwen2.5-Coder-0.5B's 24 or 1.5B's 28) for each of its layers,
each layer's weights distinct (80 MB of bf16 or more: past the caches, as in the engine), chained
in one jitted call, through jaxllm's C++ GEMMs: bf16 panels (the float default on AVX512_BF16
CPUs), 4-bit and 8-bit codes x bf16 activations (`matmul_quantized_bf16`: weight-only codes
under dtype bfloat16, a GGUF's blocks by default; 4-bit ones also with the scales factored out of
the sums, `factored=True`, and codes in [-32, 31] so as 8-bit codes, "q6 factored", and as 6-bit
ones, "q6 six-bit"), 4-bit and 8-bit (Q6_K-like, in [-32, 31]) codes through the f32
weight-only kernel (`matmul_quantized`, dequantizing each weight or, "factored", with the
group scales factored out of the sums: the float32 engine's decodes on AVX2, whose code path
the kernel takes on AVX-512 CPUs too), 4-bit codes x int8 rows ("q4 x int8", `act8=True`:
llama.cpp's scheme, the codes in `quads`; from more rows on AMX's int8 tiles and on bf16 dots
where the CPU has them, `native.int8_tile_rows`, `native.act8_bf16_rows`; "q4 x int8 vnni" the
VNNI kernels at every row count; "q4 x int8 avx2" its AVX2 kernel; "q4k x int8" the same codes
with Q4_K's two-level scales (int8 sub-scales and offsets per 32 rows under f16 per 256, as a
GGUF's Q4_K is kept); "q6 x int8" the
Q6_K-like codes so, from 6 bits: `gemm.six_bit_quads`; "q6k six-bit" and "q6k x int8" the same
codes with Q6_K's two-level scales, int8 per 16 rows under f16 per 256), f32 panels (the
float32 dtype's GEMM, `csrc/gemm.cc`) and W8A8 (8-bit codes x int8 activations,
`quantization="int8"`: the engine's weights, x scaled per block of up to 256 columns, and the
same with a scale per row). Best of `--repeat` calls per row count; each path's GFLOP/s and its
time against the first path's; at one row, the GB/s each path streams (its weights' bytes,
scales included, over the time).

    python benchmarks/weight_stream.py --rows 1,4,16,64,512 --out /tmp/stream.json
    python benchmarks/weight_stream.py --model qwen2.5-coder-1.5b --rows 1,4 --paths "q4 x bf16,q4 f32 kernel"

The bf16 paths need AVX512_BF16 (under `benchmarks/as_avx2.sh`, list others only); random
weights and codes (timing only).
"""

from __future__ import annotations

import argparse
import contextlib
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

# layers, then (K, N, SwiGLU epilogue) of the fused QKV, output, gate/up, down.
MODELS = {
    "smollm2": (30, [(576, 960, False), (576, 576, False), (576, 3072, True), (1536, 576, False)]),
    "qwen2.5-coder-0.5b": (24, [(896, 1152, False), (896, 896, False), (896, 9728, True), (4864, 896, False)]),
    "qwen2.5-coder-1.5b": (28, [(1536, 2048, False), (1536, 1536, False), (1536, 17920, True), (8960, 1536, False)]),
}
PATHS = (
    "bf16",
    "q4 x bf16",
    "q4 factored",
    "q4 x int8",
    "q4 x int8 vnni",
    "q4 x int8 avx2",
    "q4k x int8",
    "q4k x int8 vnni",
    "q6 x int8",
    "q6 x int8 vnni",
    "q8 x bf16",
    "q6 factored",
    "q6 six-bit",
    "q6k six-bit",
    "q6k x int8",
    "q6k x int8 vnni",
    "q4 f32 kernel",
    "q4 f32 factored",
    "q8 f32 kernel",
    "q8 f32 factored",
    "f32",
    "w8a8",
    "w8a8 per row",
)
VNNI = " vnni"  # (a path's suffix: the int8 rows' VNNI kernels at every row count: `vnni_only`)
BF16_PATHS = ("bf16", "q4 x bf16", "q4 factored", "q8 x bf16", "q6 factored", "q6 six-bit", "q6k six-bit")


@contextlib.contextmanager
def vnni_only():
    """Int8 rows' calls neither on AMX's int8 tiles nor, from `native.act8_bf16_rows` rows, on bf16 dots."""
    from jaxllm.kernels import native

    with native.int8_tile_rows_set(0), native.act8_bf16_rows_set(4, 0), native.act8_bf16_rows_set(6, 0):
        yield


def chain(matmul, layers: int, shapes: list):
    """A jitted call of `matmul(h, weight, swiglu)` over every layer's matrices in order, each
    input the previous output widened or cut to its K (the values do not matter)."""
    swiglus = [sw for _ in range(layers) for _, _, sw in shapes]

    def run(x, weights):
        h = x
        for w, (k, _, _), sw in zip(weights, shapes * layers, swiglus):
            y = matmul(jnp.tile(h, (1, -(-k // h.shape[1])))[:, :k], w, sw)
            h = y
        return h

    return jax.jit(run)


def main(argv=None) -> int:
    import dataclasses

    from jaxllm.kernels import gemm, native
    from jaxllm.quantization import weights as quant

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="smollm2")
    ap.add_argument("--paths", default=",".join(PATHS), help="comma-separated, of " + ", ".join(PATHS))
    ap.add_argument("--rows", default="1,4,16,64,512")
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    machine = machine_info()
    print(cpu_line(machine), flush=True)
    layers, shapes = MODELS[args.model]
    paths = args.paths.split(",")
    if not set(paths) <= set(PATHS):
        raise SystemExit(f"--paths: any of {', '.join(PATHS)}")
    if any(p in BF16_PATHS for p in paths) and not native.has_bf16_dots():
        raise SystemExit(f"this CPU has no AVX512_BF16 dots (or no C++ kernels): no {', '.join(BF16_PATHS)}")
    base = paths[0]
    rng = np.random.default_rng(0)
    weights = {name: [] for name in paths}
    kernels = {name.removesuffix(VNNI) for name in paths}  # (a " vnni" path's weights are its kernel's)

    def add(name, make):
        for each in (name, name + VNNI):
            if each in weights:
                weights[each].append(make())

    for _ in range(layers):
        for k, n, _ in shapes:
            w = (rng.standard_normal((k, n)) * 0.02).astype(np.float32)
            c4, c8 = rng.integers(0, 16, (k, n)), rng.integers(-127, 128, (k, n))
            s = jnp.asarray(gemm.pack_scales((rng.random((k // 32, n)) * 0.01).astype(np.float16)))
            o = jnp.asarray(gemm.pack_scales((-rng.random((k // 32, n)) * 0.1).astype(np.float16)))
            add("bf16", lambda: jnp.asarray(gemm.pack_weight(w, dtype=jnp.bfloat16)))
            add("q4 x bf16", lambda: (jnp.asarray(gemm.pack_codes(c4, 4, pairs=True)), s, o))
            add("q4 factored", lambda: (jnp.asarray(gemm.pack_codes(c4, 4, pairs=True)), s, o))
            add("q8 x bf16", lambda: (jnp.asarray(gemm.pack_codes(c8, 8)), s, None))
            add("q6 factored", lambda: (jnp.asarray(gemm.pack_codes(c8 // 4, 8)), s, None))
            add("q6 six-bit", lambda: (jnp.asarray(gemm.pack_codes(c8 // 4, 6)), s, None))
            add("q4 f32 kernel", lambda: (jnp.asarray(gemm.pack_codes(c4, 4)), s, o))
            add("q4 f32 factored", lambda: (jnp.asarray(gemm.pack_codes(c4, 4)), s, o))
            add("q8 f32 kernel", lambda: (jnp.asarray(gemm.pack_codes(c8 // 4, 8)), s, None))
            add("q8 f32 factored", lambda: (jnp.asarray(gemm.pack_codes(c8 // 4, 8)), s, None))
            add("q4 x int8", lambda: (jnp.asarray(gemm.pack_codes(c4, 4, quads=True)), s, o))
            add("q4 x int8 avx2", lambda: (jnp.asarray(gemm.pack_codes(c4, 4, quads=True)), s, o))
            add("q6 x int8", lambda: (jnp.asarray(gemm.pack_codes(c8 // 4, 6, quads=True)), s, None))
            if "q4k x int8" in kernels:  # Q4_K's scales: int8 sub-scales and offsets per 32 rows, f16 per 256
                sub = jnp.asarray(gemm.pack_scales(rng.integers(0, 64, (k // 32, n)).astype(np.int8)))
                sub_o = jnp.asarray(gemm.pack_scales(rng.integers(0, 64, (k // 32, n)).astype(np.int8)))
                sup = jnp.asarray(gemm.pack_scales((rng.random((k // 256, n)) * 1e-3).astype(np.float16)))
                sup_o = jnp.asarray(gemm.pack_scales((-rng.random((k // 256, n)) * 1e-3).astype(np.float16)))
                add("q4k x int8", lambda: (jnp.asarray(gemm.pack_codes(c4, 4, quads=True)), sub, sub_o, sup, sup_o))
            if {"q6k six-bit", "q6k x int8"} & kernels:  # Q6_K's scales: int8 per 16 rows, f16 per 256
                sub = jnp.asarray(gemm.pack_scales(rng.integers(-128, 128, (k // 16, n)).astype(np.int8)))
                sup = jnp.asarray(gemm.pack_scales((rng.random((k // 256, n)) * 1e-4).astype(np.float16)))
                add("q6k six-bit", lambda: (jnp.asarray(gemm.pack_codes(c8 // 4, 6)), sub, None, sup))
                add("q6k x int8", lambda: (jnp.asarray(gemm.pack_codes(c8 // 4, 6, quads=True)), sub, None, sup))
            add("f32", lambda: jnp.asarray(gemm.pack_weight(w)))
            if {"w8a8", "w8a8 per row"} & kernels:
                q = quant.make_weight(w, "w8a8", panels=True, activations="int8")
                add("w8a8", lambda: q)
                row_bias = jnp.asarray(quant._w8a8_bias(quant._unpacked_codes(q, np), 0))
                add("w8a8 per row", lambda: dataclasses.replace(q, act_group=0, bias=row_bias))
    matmuls = {
        "bf16": lambda h, w, sw: gemm.matmul_packed(h, w, swiglu=sw),
        "q4 x bf16": lambda h, w, sw: gemm.matmul_quantized_bf16(h, *w, 4, swiglu=sw),
        "q4 factored": lambda h, w, sw: gemm.matmul_quantized_bf16(h, *w, 4, swiglu=sw, factored=True),
        "q8 x bf16": lambda h, w, sw: gemm.matmul_quantized_bf16(h, *w, 8, swiglu=sw),
        "q6 factored": lambda h, w, sw: gemm.matmul_quantized_bf16(h, *w, 8, swiglu=sw, factored=True),
        "q6 six-bit": lambda h, w, sw: gemm.matmul_quantized_bf16(h, *w, 6, swiglu=sw, factored=True),
        "q4 f32 kernel": lambda h, w, sw: gemm.matmul_quantized(h, *w, 4, swiglu=sw),
        "q4 f32 factored": lambda h, w, sw: gemm.matmul_quantized(h, *w, 4, swiglu=sw, factored=True),
        "q8 f32 kernel": lambda h, w, sw: gemm.matmul_quantized(h, *w, 8, swiglu=sw),
        "q8 f32 factored": lambda h, w, sw: gemm.matmul_quantized(h, *w, 8, swiglu=sw, factored=True),
        "q4 x int8": lambda h, w, sw: gemm.matmul_quantized(h, *w, 4, swiglu=sw, act8=True),
        "q4 x int8 avx2": lambda h, w, sw: gemm.matmul_quantized(h, *w, 4, swiglu=sw, act8=True, path="avx2"),
        "q4k x int8": lambda h, w, sw: gemm.matmul_quantized(
            h, *w[:3], 4, swiglu=sw, act8=True, super_scale=w[3], super_offset=w[4]
        ),
        "q6 x int8": lambda h, w, sw: gemm.matmul_quantized(h, *w, 6, swiglu=sw, act8=True),
        "q6k six-bit": lambda h, w, sw: gemm.matmul_quantized_bf16(
            h, *w[:3], 6, swiglu=sw, super_scale=w[3], factored=True
        ),
        "q6k x int8": lambda h, w, sw: gemm.matmul_quantized(h, *w[:3], 6, swiglu=sw, act8=True, super_scale=w[3]),
        "f32": lambda h, w, sw: gemm.matmul_packed(h, w, swiglu=sw),
        "w8a8": lambda h, w, sw: quant.matmul(h, w, swiglu=sw),
        "w8a8 per row": lambda h, w, sw: quant.matmul(h, w, swiglu=sw),
    }
    calls = {name: chain(matmuls[name.removesuffix(VNNI)], layers, shapes) for name in paths}
    nbytes = {name: sum(a.nbytes for a in jax.tree_util.tree_leaves(weights[name])) for name in paths}
    flops_per_row = 2 * layers * sum(k * n for k, n, _ in shapes)
    rows = []
    print("| rows | " + " | ".join(f"{name} ms (GFLOP/s)" for name in calls) + f" | vs {base} |", flush=True)
    for m in (int(r) for r in args.rows.split(",")):
        x = jnp.asarray(rng.standard_normal((m, shapes[0][0])).astype(np.float32))
        best = {}
        for name, call in calls.items():
            with vnni_only() if name.endswith(VNNI) else contextlib.nullcontext():
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
            **{f"{name} GB/s": nbytes[name] / t / 1e9 for name, t in best.items()},
        }
        rows.append(row)
        print(
            f"| {m} | "
            + " | ".join(f"{1e3 * t:.2f} ({m * flops_per_row / t / 1e9:.0f})" for t in best.values())
            + " | "
            + " / ".join(f"{best[base] / t:.2f}x" for name, t in best.items() if name != base)
            + " |",
            flush=True,
        )
        if m == 1:
            print("  weights streamed: " + ", ".join(f"{n} {nbytes[n] / t / 1e9:.1f} GB/s" for n, t in best.items()))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "date": now_iso(),
                    "machine": machine,
                    "versions": versions(),
                    "model": args.model,
                    "layers": layers,
                    "shapes": shapes,
                    "weight_bytes": nbytes,
                    "rows": rows,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
