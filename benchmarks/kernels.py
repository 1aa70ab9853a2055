"""CPU paged attention, one layer: the three implementations the engine can run.

    python benchmarks/kernels.py [--batches 1,8,32,128] [--context 512] [--spread 128] [--prefill 512]

"dense": `kernels.ragged_paged_attention_reference` (for every query token, gather its
sequence's whole page table and attend densely). "rows": the jnp row path
(`attention_backend="cpu"`: `kernels.paged_attention_rows` on rows built by
`kernels.ragged_to_rows`, including the gather of q into rows and the scatter back).
"native": the C++ kernel (`attention_backend="native"`, the CPU default). Cases: decode steps of
each batch size at --context tokens of cache per sequence, a decode batch of --spread
sequences with contexts uniform in 32..--context (like the standard workload's), and one
--prefill-token prompt chunk. Head shapes default to the bundled model's (9 query heads, 3 KV
heads, head_dim 64, the engine's CPU page size, 64); a bf16 cache is stored as uint16 as in the engine. Times are
medians per call (one layer); the host-side `ragged_to_rows` is timed apart (once per step,
not per layer). JSON to --out.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shlex
import statistics
import sys
import time
import types

# benchmarks/ must not be on sys.path: kernels.py here would shadow HF's `kernels` package, which
# transformers imports when it probes for it. workload.py itself imports only stdlib + numpy.
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]
sys.path.insert(0, HERE)
from workload import RESULTS, machine_info, now_iso, versions  # noqa: E402

del sys.path[0]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxllm import kernels  # noqa: E402
from jaxllm.kernels.kv_write import cache_dtype, row_width, storage_dtype, to_storage  # noqa: E402
from jaxllm.attention import BACKENDS  # noqa: E402
from jaxllm.platforms import Platform  # noqa: E402


def median_time(fn, min_repeat: int, min_seconds: float) -> float:
    jax.block_until_ready(fn())  # compile + warm
    times = []
    start = time.perf_counter()
    while len(times) < min_repeat or time.perf_counter() - start < min_seconds:
        t = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t)
        if len(times) >= 200:
            break
    return statistics.median(times)


def make_case(rng, q_lens, kv_lens, args):
    """Random q, cache and page tables for sequences with `q_lens` new tokens and `kv_lens`
    cached tokens (this step's included)."""
    page = args.page_size
    pages_per_seq = max(args.table_pages or 0, -(-max(kv_lens) // page))
    num_seqs = len(q_lens)
    num_pages = 1 + num_seqs * pages_per_seq  # page 0 is the engine's scratch page
    store = storage_dtype(cache_dtype(args.dtype))
    shape = (args.num_kv_heads, num_pages, page, args.head_dim)
    k_pages = to_storage(jnp.asarray(rng.standard_normal(shape, np.float32)), store)
    v_pages = to_storage(jnp.asarray(rng.standard_normal(shape, np.float32)), store)
    page_tables = (1 + rng.permutation(num_seqs * pages_per_seq)).reshape(num_seqs, pages_per_seq).astype(np.int32)
    num_tokens = int(sum(q_lens))
    q = jnp.asarray(rng.standard_normal((num_tokens, args.num_q_heads, args.head_dim), np.float32))
    return q, k_pages, v_pages, np.asarray(kv_lens, np.int32), page_tables


def rows_batch(q_lens, kv_lens, page_tables, num_tokens, group, row_tokens):
    idx, bt, kl, ql = kernels.ragged_to_rows(
        q_lens,
        kv_lens,
        page_tables,
        num_tokens=num_tokens,
        num_rows=int(sum(-(-n // row_tokens) for n in q_lens)),
        row_tokens=row_tokens,
    )
    return {f"{group}_token_idx": idx, f"{group}_page_tables": bt, f"{group}_kv_lens": kl, f"{group}_q_lens": ql}


IMPLS = ("dense", "rows", "native")


def measure(kind: str, q_lens: list[int], kv_lens: list[int], args, rng) -> dict:
    q, k_pages, v_pages, kv, page_tables = make_case(rng, q_lens, kv_lens, args)
    num_tokens = q.shape[0]
    group, row_tokens = ("decode", 1) if kind == "decode" else ("prefill", args.prefill_row_tokens)

    host_s = median_time(lambda: rows_batch(q_lens, kv, page_tables, num_tokens, group, row_tokens), 20, 0.2)
    # The step inputs a backend reads (the ragged contract; the `cpu` backend adds its rows).
    inputs = {
        "seq_lens": jnp.asarray(kv),
        "page_tables": jnp.asarray(page_tables),
        "query_start_loc": jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)),
        "num_seqs": jnp.int32(len(q_lens)),
        "attn_metadata": {
            k: jnp.asarray(v) for k, v in rows_batch(q_lens, kv, page_tables, num_tokens, group, row_tokens).items()
        },
    }

    def call(backend_name):
        backend = BACKENDS[backend_name]()
        fn = jax.jit(lambda q, k, v, inputs: backend.forward(q, k, v, types.SimpleNamespace(**inputs)))
        return functools.partial(fn, q, k_pages, v_pages, inputs)

    calls = {"dense": call("reference"), "rows": call("cpu"), "native": call("native")}
    want = calls["dense"]().astype(jnp.float32)
    row = {
        "case": kind,
        "batch": len(q_lens),
        "context": int(max(kv_lens)),
        "mean_context": float(np.mean(kv_lens)),
        "tokens": num_tokens,
        "table_pages": int(page_tables.shape[1]),
        "host_rows_ms": host_s * 1e3,
    }
    for name, fn in calls.items():
        row[f"{name}_ms"] = median_time(fn, args.repeat, args.min_seconds) * 1e3
        row[f"{name}_max_abs_diff"] = float(jnp.max(jnp.abs(fn().astype(jnp.float32) - want)))
    # KV bytes each query token's sequence reads once (K and V), over the measured time.
    store = storage_dtype(cache_dtype(args.dtype))
    kv_bytes = sum(kv_lens) * 2 * args.num_kv_heads * row_width(args.head_dim, store) * store.itemsize
    row["native_gb_s"] = kv_bytes / row["native_ms"] / 1e6
    print(
        f"{kind:8s} batch {row['batch']:4d} tokens {num_tokens:4d} "
        f"ctx {row['mean_context']:5.0f}/{row['context']:5d}: "
        + "  ".join(f"{n} {row[f'{n}_ms']:8.3f} ms" for n in IMPLS)
        + f"  (native {row['native_gb_s']:.1f} GB/s of KV; host rows {host_s * 1e3:.3f} ms)",
        flush=True,
    )
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument(
        "--spread", type=int, default=128, help="decode batch with contexts uniform in 32..--context (0: skip)"
    )
    ap.add_argument("--prefill", type=int, default=512, help="prompt chunk length (0: skip)")
    ap.add_argument("--prefill-row-tokens", type=int, default=16, help="query tokens per prefill row")
    ap.add_argument("--num-q-heads", type=int, default=9)
    ap.add_argument("--num-kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=Platform("cpu").default_page_size)
    ap.add_argument("--table-pages", type=int, default=None, help="page-table width (default: the context's pages)")
    ap.add_argument(
        "--dtype",
        default="bfloat16",
        choices=("float32", "bfloat16", "int8", "fp8_e4m3"),
        help="KV cache dtype (int8, fp8_e4m3: codes and a scale per row, as the engine stores them)",
    )
    ap.add_argument("--repeat", type=int, default=10, help="least timed calls per case")
    ap.add_argument("--min-seconds", type=float, default=1.0, help="least time per case")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(RESULTS, "kernels.json"))
    args = ap.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    rows = []
    for b in map(int, args.batches.split(",")):
        rows.append(measure("decode", [1] * b, [args.context] * b, args, rng))
    if args.spread:
        # The standard workload's decode steps: contexts spread between 32 and --context.
        b = args.spread
        rows.append(measure("decode", [1] * b, sorted(rng.integers(32, args.context + 1, b).tolist()), args, rng))
    if args.prefill:
        rows.append(measure("prefill", [args.prefill], [args.prefill], args, rng))
    result = {
        "rows": rows,
        "dtype": args.dtype,
        "shapes": {
            "num_q_heads": args.num_q_heads,
            "num_kv_heads": args.num_kv_heads,
            "head_dim": args.head_dim,
            "page_size": args.page_size,
            "prefill_row_tokens": args.prefill_row_tokens,
        },
        "date": now_iso(),
        "machine": machine_info(),
        "versions": versions(),
        "command": shlex.join([os.path.relpath(sys.argv[0])] + sys.argv[1:]),
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")
    bad = [r for r in rows for n in IMPLS if not r[f"{n}_max_abs_diff"] < 5e-2]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
