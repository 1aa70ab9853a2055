"""GPU benchmark of the quantized matmul (`jaxllm/kernels/quant_matmul.py`, the GPU path of
weight-only `int8` / `int4`) against a bf16 `jnp.dot` of the same weight, on Llama-3-8B's
matrices, x in bf16 as the engine's GPU dtype has it.

    python benchmarks/gpu_quant.py                     # the kernel's own tiles, every matrix
    python benchmarks/gpu_quant.py --sweep up,down     # and a search over tiles on those two
    python benchmarks/gpu_quant.py --smoke             # tiny shapes, anywhere (interpreted on CPU)

Timing: one jitted call multiplies x by `copies` separate copies of the weight (at least 512 MiB
of codes together, so no copy is served from the L2 cache, and the launch cost is shared), the
median of `--repeat` calls over the copies, after 0.3 s of calls to warm the GPU up. Each row
reports both times, the codes' and scales' bytes over the kernel's time (GB/s), and the first
row count of each matrix checks the numbers against the float64 product with the dequantized
weight. `--sweep` times each candidate tiling
(`candidates`) at `--sweep-rows`, each search within an equal share of `--sweep-s` seconds, and
reports the fastest against `choose_tiles`' pick.

Needs only jax and numpy besides jaxllm; `gpu.py` runs it as its quantized-matmul part.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

MATRICES = {
    "qkv": (4096, 6144),
    "o": (4096, 4096),
    "gate_up": (4096, 28672),
    "up": (4096, 14336),
    "down": (14336, 4096),
    "lm_head": (4096, 128256),
}
SMOKE_MATRICES = {"up": (128, 256)}
METHODS = {"int8": (8, None), "int4": (4, 32)}  # bits, rows per scale group (None: one group)


def random_weight(k: int, n: int, method: str, seed: int):
    """A QuantizedWeight of random codes and f16 scales (offsets for int4), as `make_weight`
    lays out the method's plain weights; made on the device (no host quantization to wait for)."""
    from jaxllm.quantization import QuantizedWeight

    bits, group = METHODS[method]
    groups = 1 if group is None else k // group
    key = jax.random.key(seed)
    if bits == 8:
        codes = jax.random.randint(key, (k, n), -127, 128, jnp.int32).astype(jnp.int8)
    else:
        codes = jax.random.randint(key, (k, n // 2), 0, 256, jnp.int32).astype(jnp.uint8)
    scale = (jax.random.uniform(jax.random.fold_in(key, 1), (groups, n), jnp.float32, 0.5, 1.5) / 2000).astype(
        jnp.float16
    )
    offset = None if bits == 8 else (-8 * scale.astype(jnp.float32)).astype(jnp.float16)
    return QuantizedWeight(codes, scale, offset, bits, "plain", "float")


WARM_S = 0.3  # seconds of warm-up calls before timing (0 for --smoke: nothing to warm up)


def median_seconds(fn, *args, repeat: int) -> float:
    """Median seconds of `repeat` calls, after calls for `WARM_S` seconds: the GPU idles at a low
    clock between the host's work, and the first calls after it ran up to 2.5x slower."""
    jax.block_until_ready(fn(*args))
    until = time.perf_counter() + WARM_S
    while time.perf_counter() < until:
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def candidates(m: int, k: int, n: int, groups: int, bits: int, sms: int) -> list:
    """`choose_tiles`' pick first, then tilings around it: other warps, pipeline stages, split
    factors and row blocks, then other column and K blocks (K split by the same rule)."""
    from jaxllm.kernels.quant_matmul import choose_tiles, fits, split_for

    base = choose_tiles(m, k, n, groups, bits, sms)
    out = [base]

    def add(tiles):
        if fits(tiles, k, n, groups, bits) and tiles not in out:
            out.append(tiles)

    for change in (
        dict(num_warps=8),
        dict(num_warps=2),
        dict(num_stages=2),
        dict(num_stages=5),
        dict(split_k=2 * base.split_k),
        dict(split_k=max(1, base.split_k // 2)),
    ):
        add(dataclasses.replace(base, **change))
    if m >= 64:
        add(dataclasses.replace(base, block_m=128, num_warps=8))
        add(dataclasses.replace(base, block_m=32, num_warps=4))
    for bn in (64, 128, 256):
        for bk in (32, 64, 128, 256):
            t = dataclasses.replace(base, block_n=bn, block_k=bk, split_k=1)
            add(split_for(t, m, k, n, groups, bits, sms))
    return out


def run(args) -> list[dict]:
    from jaxllm.kernels.quant_matmul import choose_tiles, quantized_matmul
    from jaxllm.quantization import dequantize

    interpret = jax.devices()[0].platform != "gpu"
    sms = getattr(jax.devices()[0], "core_count", None) or 132
    matrices = SMOKE_MATRICES if args.smoke else {name: MATRICES[name] for name in args.matrices}
    rows = []
    searches = len([m for m in matrices if m in args.sweep]) * len(args.methods) * len(args.sweep_rows)
    for name, (k, n) in matrices.items():
        for method in args.methods:
            weight = random_weight(k, n, method, seed=k + n)
            parts = [a for a in (weight.codes, weight.scale, weight.offset) if a is not None]
            weight_bytes = sum(a.nbytes for a in parts)
            copies = 1 if args.smoke else max(2, min(16, (512 << 20) // weight_bytes))
            stack = [[jnp.array(a, copy=True) for a in parts] for _ in range(copies)]
            dense = dequantize(weight).astype(jnp.bfloat16)
            denses = [jnp.array(dense, copy=True) for _ in range(copies)]
            groups = weight.scale.shape[0]
            plain = jax.jit(lambda x, ds: [jnp.dot(x, d, preferred_element_type=jnp.float32) for d in ds])

            def kernel(tiles):
                def f(x, ws):
                    return [
                        quantized_matmul(
                            x,
                            w[0],
                            w[1],
                            w[2] if len(w) == 3 else None,
                            bits=weight.bits,
                            tiles=tiles,
                            interpret=interpret,
                        )
                        for w in ws
                    ]

                return jax.jit(f)

            for i, m in enumerate(args.rows):
                x = jax.random.normal(jax.random.key(m), (m, k), jnp.float32).astype(jnp.bfloat16)
                tiles = choose_tiles(m, k, n, groups, weight.bits, sms)
                row = {
                    "matrix": name,
                    "method": method,
                    "rows": m,
                    "k": k,
                    "n": n,
                    "weight_bytes": weight_bytes,
                    "copies": copies,
                    "tiles": dataclasses.asdict(tiles),
                }
                try:
                    if i == 0:
                        ref = np.asarray(x, np.float64) @ np.asarray(dequantize(weight), np.float64)
                        got = np.asarray(kernel(tiles)(x, stack[:1])[0])
                        row["max_rel_err"] = float(np.abs(got - ref).max() / np.abs(ref).max())
                    row["ms"] = 1e3 * median_seconds(kernel(tiles), x, stack, repeat=args.repeat) / copies
                    row["bf16_ms"] = 1e3 * median_seconds(plain, x, denses, repeat=args.repeat) / copies
                    row["gb_s"] = weight_bytes / row["ms"] * 1e-6
                    if name in args.sweep and m in args.sweep_rows:  # an equal share of the time each
                        row["sweep"] = sweep(
                            kernel,
                            x,
                            stack,
                            candidates(m, k, n, groups, weight.bits, sms),
                            copies,
                            args.repeat,
                            time.perf_counter() + args.sweep_s / searches,
                        )
                except Exception as e:  # report and go on: the other rows still say something
                    row["error"] = f"{type(e).__name__}: {e}"[:500]
                rows.append(row)
                print(format_row(row), flush=True)
            del stack, denses, dense
    return rows


def sweep(kernel, x, stack, tilings, copies: int, repeat: int, until: float) -> list[dict]:
    """Each tiling's ms (or its error) until the clock passes `until`, fastest first."""
    out = []
    for tiles in tilings:
        if time.perf_counter() > until:
            break
        entry = {"tiles": dataclasses.asdict(tiles)}
        try:
            entry["ms"] = 1e3 * median_seconds(kernel(tiles), x, stack, repeat=repeat) / copies
        except Exception as e:
            entry["error"] = f"{type(e).__name__}: {e}"[:200]
        out.append(entry)
    return sorted(out, key=lambda e: e.get("ms", float("inf")))


def format_row(row: dict) -> str:
    head = f"| {row['matrix']} [{row['k']}, {row['n']}] | {row['method']} | {row['rows']} |"
    if "error" in row:
        return f"{head} failed: {row['error'][:160]} | | | |"
    text = f"{head} {row['ms']:.4f} | {row['bf16_ms']:.4f} | {row['bf16_ms'] / row['ms']:.2f}x | {row['gb_s']:.0f} |"
    if row.get("sweep"):
        best = row["sweep"][0]
        t = best["tiles"]
        text += (
            f" best of {len(row['sweep'])}: {best.get('ms', float('nan')):.4f} ms with m{t['block_m']} "
            f"n{t['block_n']} k{t['block_k']} s{t['split_k']} w{t['num_warps']} st{t['num_stages']}"
        )
    return text


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--matrices", default="qkv,o,gate_up,down,lm_head", type=lambda s: s.split(","))
    ap.add_argument("--methods", default="int8,int4", type=lambda s: s.split(","))
    ap.add_argument("--rows", default="1,16,128,1024", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument(
        "--sweep", default="", type=lambda s: [x for x in s.split(",") if x], help="matrices to search tilings on"
    )
    ap.add_argument(
        "--sweep-rows",
        default="16,128,1024",
        type=lambda s: [int(x) for x in s.split(",")],
        help="row counts to search tilings at",
    )
    ap.add_argument("--sweep-s", type=float, default=240.0, help="time for the whole search")
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, 1 repeat (interpreted on CPU)")
    ap.add_argument("--out", default=None, help="JSON of the rows")
    args = ap.parse_args(argv)
    if args.smoke:
        global WARM_S
        args.rows, args.repeat, args.sweep, args.sweep_rows, WARM_S = [3], 1, [], [], 0.0
    return args


HEADER = (
    "| matrix | codes | rows | quantized ms | bf16 dot ms | speed-up | weight GB/s |\n"
    "|---|---|---:|---:|---:|---:|---:|"
)


def main(argv=None):
    args = parse_args(argv)
    print(f"# {jax.devices()[0].device_kind}; jax {jax.__version__}\n{HEADER}", flush=True)
    rows = run(args)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": rows}, fh, indent=1)
    return rows


if __name__ == "__main__":
    main()
