"""Does a request's answer depend on what was cached, how its prompt was chunked, what shared its
steps? With and without `batch_invariant=True`, on a real model.

    python benchmarks/batch_invariance.py                 # the default model, dtype auto
    python benchmarks/batch_invariance.py --dtype float32

48 prompts share a ~700-token prefix (a system prompt) and differ in a short question each; every
request is greedy with its logprobs. Each mode runs them four ways: all at once with prefix
caching off, with it on (the prefix computed once, then hit), with prompt chunks of 64 tokens,
and one request at a time. Reported per mode: how many of the 48 outputs differ from the first
way in their tokens and in their logprobs (bit for bit), and each way's wall time (the mode's
cost). JSON to --out (default benchmarks/results/batch_invariance.json).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]
sys.path.insert(0, HERE)
from workload import RESULTS, write_run  # noqa: E402

del sys.path[0]

SYSTEM = (
    "You are a careful assistant for a hardware store. Answer in one short sentence, name the aisle "
    "when you can, and never invent a product. The store sells tools, paint, garden supplies, "
    "plumbing parts, electrical parts, lumber, fasteners and cleaning products. "
)
QUESTIONS = [
    f"Question {i}: where would I find {item} for {use}?"
    for i, (item, use) in enumerate(
        (item, use)
        for item in ("a hammer", "blue paint", "garden hose", "copper pipe", "a light switch", "wood screws")
        for use in ("my kitchen", "a fence", "the garage", "a bathroom", "the porch", "a shed", "a boat", "a desk")
    )
]


def outputs(llm, prompts, params, one_at_a_time: bool) -> list[tuple]:
    if one_at_a_time:
        outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    else:
        outs = llm.generate(prompts, params, use_tqdm=False)
    return [
        (
            tuple(o.outputs[0].token_ids),
            tuple(e[t].logprob for e, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)),
        )
        for o in outs
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--out", default=os.path.join(RESULTS, "batch_invariance.json"))
    args = ap.parse_args()
    from jaxllm import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, logprobs=0)
    results = {}
    for mode in (False, True):
        common = dict(dtype=args.dtype, batch_invariant=mode)
        first = LLM(args.model, **common, enable_prefix_caching=False)
        tokenizer = first.get_tokenizer()
        system = tokenizer.encode(SYSTEM * 6)[:700]
        prompts = [{"prompt_token_ids": system + tokenizer.encode(q)} for q in QUESTIONS]
        ways, times = {}, {}
        for name, llm, alone in [
            ("no_cache", first, False),
            ("cache", LLM(args.model, **common), False),
            ("chunks_64", LLM(args.model, **common, max_num_batched_tokens=64, enable_prefix_caching=False), False),
            ("one_at_a_time", first, True),
        ]:
            llm.engine.wait_compiled()
            start = time.perf_counter()
            ways[name] = outputs(llm, prompts, params, alone)
            times[name] = time.perf_counter() - start
        base = ways["no_cache"]
        results["on" if mode else "off"] = {
            name: {
                "tokens_differ": sum(a[0] != b[0] for a, b in zip(base, got)),
                "logprobs_differ": sum(a[1] != b[1] for a, b in zip(base, got)),
                "seconds": round(times[name], 2),
            }
            for name, got in ways.items()
        }
        print(f"batch_invariant={mode}: {results['on' if mode else 'off']}")
    out = dict(results=results, prompts=len(QUESTIONS), prefix_tokens=700, dtype=args.dtype, model=args.model)
    write_run(args.out, out)


if __name__ == "__main__":
    main()
