"""KV-cache memory: jaxllm's pages vs a contiguous per-request reservation, on a mixed workload.

    python benchmarks/memory.py                       # the standard random workload
    python benchmarks/memory.py --kv-budget 256MiB    # also run the engine inside that budget
    python benchmarks/memory.py --kv-budget 256MiB --preemption-modes recompute,swap
    python benchmarks/memory.py --kv-budget 64MiB --kv-cache-dtypes auto,int8   # int8 pages: ~2x the sequences

Runs the workload through jaxllm's engine and, after every step, records the pages in use
(`kv_cache_manager.num_used_pages`) and the tokens actually stored in them (each running
request's `num_computed_tokens`). Against the same trace it sets the pre-PagedAttention way:
every running request holding a contiguous slab of `max_model_len` tokens (and, kinder, a slab
of its own prompt + max_tokens, which needs the output length known up front).

Reports the waste fraction (reserved slots holding no token, summed over all steps) each way,
and how many sequences fit a fixed KV budget (--budget, default 2 GiB) each way: contiguous =
budget // max_model_len; paged = budget / the mean pages a running request held. With
--kv-budget the engine also runs with a pool of that size, and the peak number of sequences it
actually held at once is reported, once per `--preemption-modes` entry (recompute: preempted
requests are recomputed; swap: their pages go to host memory and back) and `--kv-cache-dtypes`
entry (auto: pages in --dtype; int8: int8 codes with a scale per token and head), with the
wall time of each. JSON to --out (default benchmarks/results/memory.json).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time

import numpy as np

# benchmarks/ must not be on sys.path: kernels.py here would shadow HF's `kernels` package, which
# transformers imports when it probes for it. workload.py itself imports only stdlib + numpy.
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]
sys.path.insert(0, HERE)
from workload import RESULTS, add_workload_args, machine_info, make_workload, now_iso, versions  # noqa: E402

del sys.path[0]


def parse_size(text: str) -> int:
    from jaxllm.entrypoints.cli import parse_size as parse

    return parse(text)


def run_trace(llm, workload: list[dict]) -> dict:
    """Step the engine to completion; per step: pages used, tokens stored, running requests,
    and the slots a contiguous reservation would hold (max_model_len, own prompt + max_tokens)."""
    from jaxllm import SamplingParams

    engine = llm.engine
    kv, scheduler = engine.kv_cache_manager, engine.scheduler
    page_size, max_len = kv.page_size, engine.config.scheduler.max_model_len
    for i, w in enumerate(workload):
        engine.add_request(
            f"m{i}",
            params=SamplingParams(temperature=0, ignore_eos=True, max_tokens=w["max_tokens"]),
            prompt_token_ids=w["prompt_token_ids"],
            output_kind="final",
        )
    steps = []
    generated = {}
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                generated[out.request_id] = len(out.outputs[0].token_ids)
        running = scheduler.running
        stored = sum(r.num_computed_tokens for r in running)
        steps.append(
            (
                kv.num_used_pages,
                stored,
                len(running),
                sum(len(r.prompt_token_ids) + r.sampling_params.max_tokens for r in running),
            )
        )
        assert len(running) * max_len >= stored
    wall = time.perf_counter() - t0
    wrong = [i for i, w in enumerate(workload) if generated.get(f"m{i}") != w["max_tokens"]]
    used, stored, running, own = (np.asarray(c, dtype=np.int64) for c in zip(*steps))
    return {
        "block_size": page_size,
        "max_model_len": max_len,
        "num_blocks": kv.num_pages,
        "wall_s": wall,
        "verified": not wrong,
        "num_preemptions": engine.stats.num_preemptions,
        "used_blocks": used,
        "stored_tokens": stored,
        "running": running,
        "own_slots": own,
    }


def analyse(trace: dict, budget_bytes: int, bytes_per_token: int) -> dict:
    bs, max_len = trace["block_size"], trace["max_model_len"]
    used, stored, running, own = trace["used_blocks"], trace["stored_tokens"], trace["running"], trace["own_slots"]
    busy = running > 0
    paged_slots = used * bs
    contiguous_slots = running * max_len
    total_stored = int(stored.sum())

    def waste(slots):
        return 1.0 - total_stored / max(int(slots.sum()), 1)

    budget_tokens = budget_bytes // bytes_per_token
    mean_pages_per_seq = float(used[busy].sum() / running[busy].sum())
    mean_own_per_seq = float(own[busy].sum() / running[busy].sum())
    peak = int(np.argmax(paged_slots))
    return {
        "steps": int(len(used)),
        "mean_running": float(running[busy].mean()),
        "peak_running": int(running.max()),
        "stored_token_steps": total_stored,
        "paged": {
            "slot_steps": int(paged_slots.sum()),
            "waste_fraction": waste(paged_slots),
            "peak_bytes": int(paged_slots.max()) * bytes_per_token,
            "mean_tokens_per_seq": mean_pages_per_seq * bs,
            "seqs_in_budget": budget_tokens / (mean_pages_per_seq * bs),
        },
        "contiguous_max_model_len": {
            "slot_steps": int(contiguous_slots.sum()),
            "waste_fraction": waste(contiguous_slots),
            "peak_bytes": int(contiguous_slots.max()) * bytes_per_token,
            "seqs_in_budget": budget_tokens // max_len,
        },
        "contiguous_own_max": {
            "slot_steps": int(own.sum()),
            "waste_fraction": waste(own),
            "peak_bytes": int(own.max()) * bytes_per_token,
            "seqs_in_budget": budget_tokens / mean_own_per_seq,
        },
        "budget_bytes": budget_bytes,
        "budget_tokens": int(budget_tokens),
        "memory_saved_vs_max_model_len": 1.0 - int(paged_slots.sum()) / max(int(contiguous_slots.sum()), 1),
        "at_peak": {
            "step": peak,
            "running": int(running[peak]),
            "stored_tokens": int(stored[peak]),
            "paged_slots": int(paged_slots[peak]),
        },
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(ap)
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--max-model-len", type=int, default=None, help="default: the model's")
    ap.add_argument("--budget", type=parse_size, default=2 << 30, help="KV budget for 'sequences that fit' (bytes)")
    ap.add_argument(
        "--kv-budget",
        type=parse_size,
        default=None,
        help="also run the engine with a KV pool of this many bytes and report the sequences it held",
    )
    ap.add_argument(
        "--preemption-modes",
        default="recompute",
        help="comma-separated preemption modes to run the --kv-budget engine with (recompute, swap)",
    )
    ap.add_argument("--swap-space", type=float, default=4.0, help="GiB of host pages for --preemption-modes swap")
    ap.add_argument(
        "--kv-cache-dtypes",
        default="auto",
        help="comma-separated KV cache dtypes to run the --kv-budget engine with (auto, int8)",
    )
    ap.add_argument("--out", default=os.path.join(RESULTS, "memory.json"))
    args = ap.parse_args(argv)

    from jaxllm import LLM
    from jaxllm.engine_config import kv_bytes_per_token

    workload, desc = make_workload(args)
    common = dict(
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        enable_prefix_caching=False,
    )
    llm = LLM(args.model, **common)
    llm.engine.wait_compiled()
    bytes_per_token = kv_bytes_per_token(llm.engine.cfg, args.dtype)
    trace = run_trace(llm, workload)
    result = analyse(trace, args.budget, bytes_per_token)
    result.update(
        dtype=args.dtype,
        kv_bytes_per_token=bytes_per_token,
        block_size=trace["block_size"],
        max_model_len=trace["max_model_len"],
        verified=trace["verified"],
        num_preemptions=trace["num_preemptions"],
    )
    if args.kv_budget:
        model_config = llm.engine.cfg
        del llm
        runs = [(m, d) for m in args.preemption_modes.split(",") for d in args.kv_cache_dtypes.split(",")]
        for mode, kv_dtype in runs:
            small = LLM(
                args.model,
                kv_cache_memory=args.kv_budget,
                preemption_mode=mode,
                swap_space=args.swap_space,
                kv_cache_dtype=kv_dtype,
                **common,
            )
            small.engine.wait_compiled()
            t = run_trace(small, workload)
            run_bytes = kv_bytes_per_token(model_config, small.engine.config.cache.dtype)
            result.setdefault("engine_in_budget", {})[mode if kv_dtype == "auto" else f"{mode}, kv {kv_dtype}"] = {
                "kv_cache_dtype": small.engine.config.cache.dtype,
                "kv_bytes_per_token": run_bytes,
                "kv_budget_bytes": args.kv_budget,
                "num_blocks": t["num_blocks"],
                "peak_running": int(t["running"].max()),
                "mean_running": float(t["running"][t["running"] > 0].mean()),
                "num_preemptions": t["num_preemptions"],
                "wall_s": t["wall_s"],
                "pages_swapped_out": small.engine.kv_cache_manager.num_swapped_out,
                "peak_usage": float(t["used_blocks"].max() / t["num_blocks"]),
                "verified": t["verified"],
                "contiguous_max_model_len_fits": args.kv_budget // run_bytes // t["max_model_len"],
            }
            del small
    result.update(
        workload=desc,
        date=now_iso(),
        machine=machine_info(),
        versions=versions(),
        command=shlex.join([os.path.relpath(sys.argv[0])] + sys.argv[1:]),
    )
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)

    gib = 2**30
    print(
        f"{desc['num_requests']} requests, {result['steps']} steps, mean {result['mean_running']:.1f} / peak "
        f"{result['peak_running']} running, block {trace['block_size']}, max_model_len {trace['max_model_len']}, "
        f"{bytes_per_token} B/token ({args.dtype})"
    )
    for key, label in (
        ("paged", "paged (jaxllm)"),
        ("contiguous_own_max", "contiguous, prompt+max_tokens"),
        ("contiguous_max_model_len", "contiguous, max_model_len"),
    ):
        r = result[key]
        print(
            f"  {label:32s} waste {100 * r['waste_fraction']:5.1f}%  peak {r['peak_bytes'] / gib:7.3f} GiB  "
            f"sequences in {args.budget / gib:g} GiB: {r['seqs_in_budget']:.0f}"
        )
    for mode, e in result.get("engine_in_budget", {}).items():
        print(
            f"  engine in {args.kv_budget / 2**20:g} MiB ({e['num_blocks']} pages of {e['kv_cache_dtype']}, "
            f"{e['kv_bytes_per_token']} B/token), preemption by {mode}: peak "
            f"{e['peak_running']} running, {e['num_preemptions']} preemptions, {e['pages_swapped_out']} pages "
            f"swapped out, {e['wall_s']:.1f} s (contiguous max_model_len fits {e['contiguous_max_model_len_fits']})"
        )
    ok = result["verified"] and all(e["verified"] for e in result.get("engine_in_budget", {}).values())
    print(f"wrote {args.out}" + ("" if ok else "  (WRONG TOKEN COUNTS)"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
