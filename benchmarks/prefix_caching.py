"""Shared KV pages: prefix caching on a shared-prefix workload, and the pages beam search and
parallel sampling hold against the pages they would need without sharing.

    python benchmarks/prefix_caching.py                          # 64 requests, the full workload
    python benchmarks/prefix_caching.py --num-requests 8 --sharing-prompts 2   # a quick check

Workload: --num-requests requests sharing one --system-len-token system prompt, each followed
by its own --question-len-token question (token ids drawn uniformly from the vocabulary without
its special tokens), --output-len greedy tokens each (`ignore_eos`), all submitted at once.
One engine (default model, --dtype) runs it twice in the same process, prefix caching off then
on (the cache emptied before each), after a warm-up: throughput (output and total tokens per
second of wall time) and mean time to first token (arrival to first token, queueing included).

Sharing: on the first --sharing-prompts of those prompts, beam search (--beam-width) and
parallel sampling (n = --n) with --output-len tokens, each with prefix caching on and off.
After every engine step it records the pages in use (`num_used_pages`, distinct pages) and the
pages the same page tables would need if no page were shared (the sum of the running
requests' table lengths); the peaks of both are reported. With the cache on, pages are also
shared across prompts (the system prompt); with it off, beams still share through forks,
while the n samples each compute and hold the whole prompt.

JSON to --out (default benchmarks/results/prefix_caching.json).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time

import numpy as np

# benchmarks/ must not be on sys.path: kernels.py here would shadow HF's `kernels` package, which
# transformers imports when it probes for it. workload.py itself imports only stdlib + numpy.
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]
sys.path.insert(0, HERE)
from workload import RESULTS, machine_info, now_iso, versions, vocab_info  # noqa: E402

del sys.path[0]


def make_prompts(args) -> list[list[int]]:
    vocab_size, special = vocab_info(args.model)
    allowed = np.setdiff1d(np.arange(vocab_size), np.asarray(special, dtype=np.int64))
    rng = np.random.default_rng(args.seed)
    system = allowed[rng.integers(0, len(allowed), args.system_len)].tolist()
    return [
        system + allowed[rng.integers(0, len(allowed), args.question_len)].tolist() for _ in range(args.num_requests)
    ]


def set_prefix_caching(llm, on: bool) -> None:
    kv = llm.engine.kv_cache_manager
    kv.enable_prefix_caching = on
    kv.reset_prefix_cache()


def timed_generate(llm, prompts: list[list[int]], output_len: int, caching: bool) -> tuple[dict, list]:
    from jaxllm import SamplingParams

    set_prefix_caching(llm, caching)
    engine, kv = llm.engine, llm.engine.kv_cache_manager
    queries, hits, computed = kv.prefix_queries, kv.prefix_hits, engine.stats.prompt_tokens
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    ttft = [o.metrics["first_token_time"] - o.metrics["arrival_time"] for o in outs]
    tokens = [o.outputs[0].token_ids for o in outs]
    num_out = sum(len(t) for t in tokens)
    num_prompt = sum(len(p) for p in prompts)
    return {
        "wall_s": wall,
        "output_tokens_per_s": num_out / wall,
        "total_tokens_per_s": (num_out + num_prompt) / wall,
        "mean_ttft_s": statistics.fmean(ttft),
        "median_ttft_s": statistics.median(ttft),
        "prompt_tokens_computed": engine.stats.prompt_tokens - computed,
        "prefix_cache_queries": kv.prefix_queries - queries,
        "prefix_cache_hits": kv.prefix_hits - hits,
        "verified": all(len(t) == output_len for t in tokens),
    }, tokens


def page_trace(llm, run, caching: bool) -> dict:
    """Run `run()` and record, after every step, the pages in use and the pages the running
    requests' page tables would need unshared."""
    set_prefix_caching(llm, caching)
    engine, kv = llm.engine, llm.engine.kv_cache_manager
    peak = {"used": 0, "unshared": 0}

    core, core_step = engine.engine_core, engine.engine_core.step

    def step():
        outputs = core_step()
        peak["used"] = max(peak["used"], kv.num_used_pages)
        peak["unshared"] = max(peak["unshared"], sum(len(r.page_ids) for r in engine.scheduler.running))
        return outputs

    copies = kv.num_copies
    core.step = step  # an instance attribute shadows the method while this runs
    t0 = time.perf_counter()
    try:
        run()
    finally:
        del core.step
    return {
        "prefix_caching": caching,
        "peak_pages_used": peak["used"],
        "peak_pages_unshared": peak["unshared"],
        "pages_saved_fraction": 1.0 - peak["used"] / max(peak["unshared"], 1),
        "copy_on_write_pages": kv.num_copies - copies,
        "wall_s": time.perf_counter() - t0,
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the bundled SmolLM2 GGUF")
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--system-len", type=int, default=1024)
    ap.add_argument("--question-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--max-model-len", type=int, default=None, help="default: the model's")
    ap.add_argument("--sharing-prompts", type=int, default=8, help="prompts for the beam search / n > 1 page counts")
    ap.add_argument("--beam-width", type=int, default=4)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--out", default=os.path.join(RESULTS, "prefix_caching.json"))
    args = ap.parse_args(argv)

    from jaxllm import LLM, BeamSearchParams, SamplingParams

    prompts = make_prompts(args)
    llm = LLM(
        args.model,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
    )
    llm.engine.wait_compiled()
    llm.generate(
        [{"prompt_token_ids": p} for p in prompts[:2]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False
    )  # warm-up beyond compilation: first transfers, allocator

    off, tokens_off = timed_generate(llm, prompts, args.output_len, caching=False)
    on, tokens_on = timed_generate(llm, prompts, args.output_len, caching=True)
    prefix = {
        "off": off,
        "on": on,
        "throughput_ratio_on_vs_off": on["output_tokens_per_s"] / off["output_tokens_per_s"],
        "mean_ttft_ratio_on_vs_off": on["mean_ttft_s"] / off["mean_ttft_s"],
        # bf16 KV computed in other batch shapes may flip a near-tie greedy token
        "identical_outputs_fraction": statistics.fmean(a == b for a, b in zip(tokens_on, tokens_off)),
    }

    share = [{"prompt_token_ids": p} for p in prompts[: args.sharing_prompts]]
    beam = BeamSearchParams(beam_width=args.beam_width, max_tokens=args.output_len, ignore_eos=True)
    sample = SamplingParams(n=args.n, temperature=1.0, seed=args.seed, max_tokens=args.output_len, ignore_eos=True)
    sharing = {}
    for caching in (True, False):
        tag = "" if caching else "_no_prefix_cache"
        sharing[f"beam_search{tag}"] = page_trace(llm, lambda: llm.beam_search(share, beam), caching)
        sharing[f"n_sampling{tag}"] = page_trace(llm, lambda: llm.generate(share, sample, use_tqdm=False), caching)
    set_prefix_caching(llm, True)

    result = {
        "model": llm.engine.model_name,
        "dtype": args.dtype,
        "block_size": llm.engine.kv_cache_manager.page_size,
        "num_blocks": llm.engine.kv_cache_manager.num_pages,
        "workload": {
            "num_requests": args.num_requests,
            "system_len": args.system_len,
            "question_len": args.question_len,
            "output_len": args.output_len,
            "seed": args.seed,
        },
        "prefix_caching": prefix,
        "sharing": {"num_prompts": len(share), "beam_width": args.beam_width, "n": args.n, **sharing},
        "date": now_iso(),
        "machine": machine_info(),
        "versions": versions(),
        "command": shlex.join([os.path.relpath(sys.argv[0])] + sys.argv[1:]),
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)

    print(
        f"{args.num_requests} requests: {args.system_len}-token shared prefix + {args.question_len}-token "
        f"question, {args.output_len} output tokens ({args.dtype})"
    )
    for name, r in (("off", off), ("on", on)):
        print(
            f"  prefix caching {name:3s}: {r['output_tokens_per_s']:8.1f} out tok/s  "
            f"{r['total_tokens_per_s']:8.1f} total tok/s  mean TTFT {r['mean_ttft_s']:7.3f} s  "
            f"prompt tokens computed {r['prompt_tokens_computed']}"
        )
    print(
        f"  on/off: throughput x{prefix['throughput_ratio_on_vs_off']:.2f}, "
        f"mean TTFT x{prefix['mean_ttft_ratio_on_vs_off']:.2f}, "
        f"identical outputs {100 * prefix['identical_outputs_fraction']:.0f}%"
    )
    print(f"pages on {len(share)} of those prompts, {args.output_len} tokens (peak used / peak needed unshared):")
    for name, r in sharing.items():
        print(
            f"  {name:28s} {r['peak_pages_used']:6d} / {r['peak_pages_unshared']:6d}  "
            f"({100 * r['pages_saved_fraction']:.0f}% saved, {r['copy_on_write_pages']} copied on write)"
        )
    ok = off["verified"] and on["verified"]
    print(f"wrote {args.out}" + ("" if ok else "  (WRONG TOKEN COUNTS)"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
