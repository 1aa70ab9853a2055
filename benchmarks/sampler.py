"""The sampler's draw for sampled rows: XLA (`runner.sampler.draw_xla`) against the C++ kernel
(`kernels.native.sample_rows`, the CPU default), in one run.

    python benchmarks/sampler.py [--rows 128] [--vocab 49152]

For each: the compile time of the whole sampler (`sampler.sample`, what every step shape
compiles; median of --compiles fresh compiles) and the draw's run time on [rows, vocab] random
logits, plain (temperature 1) and with top-k 50 + top-p 0.9 (median of --repeat calls). JSON
to --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]
sys.path.insert(0, HERE)
from workload import RESULTS, cpu_line, machine_info, now_iso, versions, write_result  # noqa: E402

del sys.path[0]

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxllm.kernels import native  # noqa: E402
from jaxllm.runner import sampler  # noqa: E402
from jaxllm.runner.input_batch import FLAG_TOP_K_TOP_P, SamplingMetadata  # noqa: E402


def native_draw(logits, s, u, u_draft):
    return native.sample_rows(logits, s.temperature, s.min_p, s.top_k, s.top_p, s.draft_tokens, u, u_draft)


DRAWS = {"xla": sampler.draw_xla, "native": native_draw}


def metadata(rows: int, vocab: int, top_k: int = 0, top_p: float = 1.0) -> SamplingMetadata:
    s = SamplingMetadata.zeros(rows)
    s = dataclasses.replace(
        s,
        temperature=np.ones(rows, np.float32),
        top_k=np.full(rows, top_k, np.int32),
        top_p=np.full(rows, top_p, np.float32),
        seeds=np.arange(rows, dtype=np.uint32),
        penalty_tokens=np.full((rows, 8), -1, np.int32),
        token_mask=np.full((rows, -(-vocab // 32)), -1, np.int32),
    )
    s.flags[FLAG_TOP_K_TOP_P] = top_k > 0 or top_p < 1
    return s


def compile_seconds(draw, rows: int, vocab: int, times: int) -> float:
    logits, s = np.zeros((rows, vocab), np.float32), metadata(rows, vocab)
    out = []
    for _ in range(times):
        fn = jax.jit(lambda x, m: sampler.sample(x, m, draw=draw))  # a new function: no cache hit
        start = time.perf_counter()
        fn.lower(logits, s).compile()
        out.append(time.perf_counter() - start)
    return statistics.median(out)


def draw_ms(draw, logits, s, repeat: int) -> float:
    u, u_draft = jax.jit(sampler.uniforms)(s)
    fn = jax.jit(draw)
    fn(logits, s, u, u_draft).block_until_ready()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn(logits, s, u, u_draft).block_until_ready()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--compile-rows", type=int, default=32, help="rows of the compiled sampler")
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--compiles", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--out", default=os.path.join(RESULTS, "sampler.json"))
    args = ap.parse_args(argv)
    jax.config.update("jax_enable_compilation_cache", False)
    machine = machine_info()
    print(cpu_line(machine))
    logits = (np.random.default_rng(0).standard_normal((args.rows, args.vocab)) * 3).astype(np.float32)
    rows = []
    for name, draw in DRAWS.items():
        row = {
            "draw": name,
            "compile_s": compile_seconds(draw, args.compile_rows, args.vocab, args.compiles),
            "plain_ms": draw_ms(draw, logits, metadata(args.rows, args.vocab), args.repeat),
            "top_k_top_p_ms": draw_ms(draw, logits, metadata(args.rows, args.vocab, 50, 0.9), args.repeat),
        }
        print(
            f"{name:>6}: sampler compile {row['compile_s']:.2f} s; draw [{args.rows}, {args.vocab}]: plain "
            f"{row['plain_ms']:.1f} ms, top-k 50 + top-p 0.9 {row['top_k_top_p_ms']:.1f} ms",
            flush=True,
        )
        rows.append(row)
    write_result(
        args.out,
        {
            "rows": rows,
            "args": vars(args),
            "date": now_iso(),
            "machine": machine,
            "versions": versions(),
            "command": shlex.join(["python", *sys.argv]),
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
