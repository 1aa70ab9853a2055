"""A high-priority request's time to first token under a full queue of low-priority ones, FCFS
against `scheduling_policy="priority"`, in one run on the default model.

    python benchmarks/priority.py
    python benchmarks/priority.py --background 96 --max-num-seqs 16

`--background` low-priority requests (prompts of ~`--prompt-tokens` tokens, `--max-tokens` out,
EOS ignored) are queued at once; once the engine is busy (`--after` steps), one urgent request
arrives. Reported for each policy: the urgent request's TTFT and end-to-end time, and the
background's output tokens per second. Each policy runs `--repeat` times, alternating; medians.
JSON to --out (default benchmarks/results/priority.json).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]
sys.path.insert(0, HERE)
from workload import RESULTS, write_run  # noqa: E402

del sys.path[0]


def run(engine, args, policy: str, prompts: list[list[int]], urgent: list[int]) -> dict:
    from jaxllm import SamplingParams

    background = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, detokenize=False)
    start = time.perf_counter()
    for i, ids in enumerate(prompts):
        engine.add_request(
            f"bg-{i}", prompt_token_ids=ids, params=background, priority=1 if policy == "priority" else 0
        )
    for _ in range(args.after):
        engine.step()
    arrival = time.perf_counter()
    engine.add_request(
        "urgent", prompt_token_ids=urgent, params=SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    )
    first = done = None
    tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == "urgent":
                if first is None and out.outputs[0].token_ids:
                    first = time.perf_counter() - arrival
                if out.finished:
                    done = time.perf_counter() - arrival
            elif out.finished:
                tokens += len(out.outputs[0].token_ids)
    return dict(ttft_s=first, e2e_s=done, background_tok_s=tokens / (time.perf_counter() - start))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--background", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--after", type=int, default=8, help="engine steps before the urgent request arrives")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(RESULTS, "priority.json"))
    args = ap.parse_args()
    from jaxllm import LLM

    engines = {
        policy: LLM(args.model, max_num_seqs=args.max_num_seqs, scheduling_policy=policy).engine
        for policy in ("fcfs", "priority")
    }
    for engine in engines.values():
        engine.wait_compiled()
    rng = np.random.default_rng(0)
    vocab = engines["fcfs"].cfg.vocab_size
    prompts = [rng.integers(100, vocab - 100, args.prompt_tokens).tolist() for _ in range(args.background)]
    urgent = rng.integers(100, vocab - 100, args.prompt_tokens).tolist()
    runs = {policy: [] for policy in engines}
    for _ in range(args.repeat):
        for policy, engine in engines.items():
            runs[policy].append(run(engine, args, policy, prompts, urgent))
            print(policy, runs[policy][-1])
    results = {
        policy: {key: round(float(np.median([r[key] for r in rs])), 3) for key in rs[0]} for policy, rs in runs.items()
    }
    print(results)
    write_run(args.out, dict(results=results, runs=runs, args=vars(args)))


if __name__ == "__main__":
    main()
