"""Speculative decoding (n-gram): decode latency with and without it, on a workload where it
applies and one where it does not.

    python benchmarks/spec_decode.py                          # default model, 8 prompts per workload
    python benchmarks/spec_decode.py --num-prompts 4 --max-tokens 64   # a quick check

Workloads (`ignore_eos`, --max-tokens tokens each):
- "repeat": chat prompts asking the model to repeat a passage of the public-domain text jaxllm
  ships for perplexity (jaxllm/bench/data/public_domain.txt: fixed, unlike the README)
  (a different passage per prompt), the shape of quoting, extraction and code-editing
  requests, whose outputs copy their inputs; greedy;
- "random": prompts of random token ids (no special tokens), sampled at temperature 1 (seeded):
  outputs that do not repeat their input. (Greedy, the small model falls into loops after such
  prompts, which n-gram drafts then predict.)
- "code": beginnings of Python functions completed as they are (code completion); greedy;
- "chat": coding questions through the model's chat template; greedy.

A real draft: `--model qwen2.5-coder-1.5b --speculative-config '{"model": "qwen2.5-coder-0.5b",
"num_speculative_tokens": 3, "draft_vocab_size": 65536, "quantization": "int4"}'` (the two share a
tokenizer; the draft requantized to 4 bits: faster than its own 5-bit codes).

One engine (default model, --dtype, the given --speculative-config, no prefix caching) runs each workload with
speculation off (its scheduler's proposer removed: the same compiled steps, no drafts) and on,
alternating, --repeats times, at --batches requests at a time (1: one request alone; 4: four
submitted together), after a warm-up; each mode's median run is reported. Reported per case:
output tokens per second of wall time, mean
TPOT ((last token - first token) / (tokens - 1), per request), mean TTFT, engine steps, and
for speculation the drafts proposed and the acceptance rate (accepted / proposed); and whether
the outputs were the same both ways (greedy: they must be; sampled, only their distribution is).

With --draft-layers N the proposer is a draft model instead: the target's first N decoder
layers with its final norm and LM head (an untrained early exit; no smaller model with the
default model's vocabulary is at hand offline).

JSON to --out (default benchmarks/results/spec_decode.json).
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

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]
sys.path.insert(0, HERE)
from workload import RESULTS, ROOT, cpu_line, machine_info, now_iso, versions, vocab_info, write_result  # noqa: E402

del sys.path[0]


def truncated_draft(model: str | None, layers: int) -> str:
    """An HF directory of the model's first `layers` decoder layers (with its final norm, LM
    head and tokenizer): a draft model with the target's vocabulary, made without training
    ("early exit"), for want of a published smaller model with SmolLM2's tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engines import cache_dir, hf_directory
    from workload import default_model_path

    src = hf_directory(model or default_model_path())
    out = os.path.join(cache_dir(), f"{os.path.basename(src)}-first{layers}")
    if not os.path.exists(os.path.join(out, "config.json")):
        full = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
        full.model.layers = full.model.layers[:layers]
        full.config.num_hidden_layers = layers
        full.save_pretrained(out)
        AutoTokenizer.from_pretrained(src).save_pretrained(out)
    return out


def repeat_prompts(llm, n: int, words: int = 90) -> list[list[int]]:
    """Chat prompts asking to repeat passages of about `words` words of the shipped public-domain text."""
    with open(os.path.join(ROOT, "jaxllm", "bench", "data", "public_domain.txt")) as f:
        text = f.read()
    tokens = text.split()
    prompts = []
    for i in range(n):
        passage = " ".join(tokens[i * words : (i + 1) * words])
        messages = [{"role": "user", "content": f"Repeat the following text exactly, word for word:\n\n{passage}"}]
        prompts.append(llm.engine.apply_chat_template(messages))
    return prompts


# Beginnings of Python functions, completed as they are (no chat template): code completion.
CODE_STARTS = [
    'def quicksort(arr):\n    """Sort a list of numbers with quicksort and return a new list."""\n',
    'def is_palindrome(s: str) -> bool:\n    """Whether s reads the same backwards, ignoring case and spaces."""\n',
    'class Stack:\n    """A stack with push, pop, peek and len."""\n\n    def __init__(self):\n',
    'def read_csv_sum(path, column):\n    """Sum the column `column` of the CSV file at `path`."""\n',
    'def fibonacci(n):\n    """The first n Fibonacci numbers as a list."""\n',
    'def word_counts(text):\n    """A dict of each word of text (lowercased) to how often it occurs."""\n',
    'def binary_search(items, target):\n    """The index of target in the sorted list items, or -1."""\n',
    'def merge_intervals(intervals):\n    """Merge overlapping [start, end] intervals; return them sorted."""\n',
]
# Chat requests a coding assistant gets (the model's chat template).
CHAT_ASKS = [
    "Write a Python function that checks whether a number is prime, with a short docstring.",
    "How do I reverse a linked list in Python? Show the code.",
    "Write a SQL query that returns the ten customers with the largest total order amount.",
    "Explain the difference between a list and a tuple in Python, with examples.",
    "Write a bash script that counts the lines of every .py file in a folder.",
    "Write a JavaScript function that debounces another function.",
    "Show how to read a JSON file in Python and print one of its keys.",
    "Write a Python class for a bank account with deposit and withdraw methods.",
]


def code_prompts(llm, n: int) -> list[list[int]]:
    tok = llm.get_tokenizer()
    return [tok(CODE_STARTS[i % len(CODE_STARTS)])["input_ids"] for i in range(n)]


def chat_prompts(llm, n: int) -> list[list[int]]:
    asks = [CHAT_ASKS[i % len(CHAT_ASKS)] for i in range(n)]
    return [llm.engine.apply_chat_template([{"role": "user", "content": ask}]) for ask in asks]


def random_prompts(model: str | None, n: int, length: int, seed: int) -> list[list[int]]:
    vocab_size, special = vocab_info(model)
    allowed = np.setdiff1d(np.arange(vocab_size), np.asarray(special, dtype=np.int64))
    rng = np.random.default_rng(seed)
    return [allowed[rng.integers(0, len(allowed), length)].tolist() for _ in range(n)]


def run(llm, prompts: list[list[int]], batch: int, max_tokens: int, temperature: float) -> dict:
    from jaxllm import SamplingParams

    params = [
        SamplingParams(temperature=temperature, seed=i, max_tokens=max_tokens, ignore_eos=True)
        for i in range(len(prompts))
    ]
    stats = llm.engine.stats
    drafts0, accepted0, steps0 = stats.num_draft_tokens, stats.num_accepted_tokens, stats.num_steps
    tpot, ttft, outputs = [], [], []
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch):
        group = [{"prompt_token_ids": p} for p in prompts[i : i + batch]]
        for out in llm.generate(group, params[i : i + batch], use_tqdm=False):
            m = out.metrics
            n = len(out.outputs[0].token_ids)
            tpot.append((m["last_token_time"] - m["first_token_time"]) / max(n - 1, 1))
            ttft.append(m["first_token_time"] - m["arrival_time"])
            outputs.append(out.outputs[0].token_ids)
    wall = time.perf_counter() - t0
    num_out = sum(len(o) for o in outputs)
    drafts, accepted = stats.num_draft_tokens - drafts0, stats.num_accepted_tokens - accepted0
    return {
        "output_tokens_per_s": num_out / wall,
        "mean_tpot_ms": 1000 * statistics.fmean(tpot),
        "mean_ttft_ms": 1000 * statistics.fmean(ttft),
        "wall_s": wall,
        "output_tokens": num_out,
        "draft_tokens": drafts,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / drafts if drafts else None,
        "steps": stats.num_steps - steps0,
        "outputs": outputs,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M-Instruct")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-prompts", type=int, default=8, help="prompts per workload (default: %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=128, help="output tokens per request (default: %(default)s)")
    ap.add_argument("--random-len", type=int, default=256, help="random prompts' length (default: %(default)s)")
    ap.add_argument("--batches", default="1,4", help="requests submitted together (default: %(default)s)")
    ap.add_argument(
        "--speculative-config",
        default='{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}',
        help="(default: %(default)s)",
    )
    ap.add_argument(
        "--draft-layers",
        type=int,
        default=None,
        metavar="N",
        help="speculate with a draft model: the target's first N layers (overrides the config's method)",
    )
    ap.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="runs of each case and mode, alternating; the median is reported (default: %(default)s)",
    )
    ap.add_argument(
        "--workloads", default="repeat,random,code,chat", help="of repeat, random, code, chat (default: %(default)s)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--engine-args", default="{}", help="JSON of more LLM(...) options")
    ap.add_argument("--out", default=os.path.join(RESULTS, "spec_decode.json"))
    args = ap.parse_args()

    from jaxllm import LLM

    config = json.loads(args.speculative_config)
    if args.draft_layers:
        sys.path.insert(0, HERE)
        config = {
            "model": truncated_draft(args.model, args.draft_layers),
            "num_speculative_tokens": config.get("num_speculative_tokens", 4),
        }
    # No prefix caching: each case computes its prompts itself (the cases share them).
    llm = LLM(
        args.model,
        dtype=args.dtype,
        max_num_seqs=16,
        max_model_len=1024,
        kv_cache_memory=512 << 20,
        enable_prefix_caching=False,
        speculative_config=config,
        **json.loads(args.engine_args),
    )
    llm.engine.wait_compiled()
    proposer = llm.engine.scheduler.proposer
    makers = {
        "repeat": lambda: (repeat_prompts(llm, args.num_prompts), 0.0),
        "random": lambda: (random_prompts(args.model, args.num_prompts, args.random_len, args.seed), 1.0),
        "code": lambda: (code_prompts(llm, args.num_prompts), 0.0),
        "chat": lambda: (chat_prompts(llm, args.num_prompts), 0.0),
    }
    workloads = {name: makers[name]() for name in args.workloads.split(",")}
    machine = machine_info()
    print(f"CPU: {cpu_line(machine)}; dtype {llm.engine.config.dtype}; speculative_config {config}", flush=True)
    rows = []
    for name, (prompts, temperature) in workloads.items():
        for batch in map(int, args.batches.split(",")):
            for speculate in (False, True):  # warm-up: every bucket these cases use
                llm.engine.scheduler.proposer = proposer if speculate else None
                run(llm, prompts[:batch], batch, 16, temperature)
            runs = {False: [], True: []}
            for _ in range(args.repeats):  # alternating, so drifts in the machine's speed hit both
                for speculate in (False, True):
                    llm.engine.scheduler.proposer = proposer if speculate else None
                    runs[speculate].append(run(llm, prompts, batch, args.max_tokens, temperature))
            same = all(r["outputs"] == runs[False][0]["outputs"] for r in runs[True])
            # Each mode's median run by throughput.
            off, on = (sorted(r, key=lambda x: x["output_tokens_per_s"])[len(r) // 2] for r in runs.values())
            off.pop("outputs"), on.pop("outputs")
            off["runs_tokens_per_s"] = [r["output_tokens_per_s"] for r in runs[False]]
            on["runs_tokens_per_s"] = [r["output_tokens_per_s"] for r in runs[True]]
            row = {
                "workload": name,
                "temperature": temperature,
                "batch": batch,
                "off": off,
                "on": on,
                "same_outputs": same,
                "speedup": on["output_tokens_per_s"] / off["output_tokens_per_s"],
            }
            rows.append(row)
            print(
                f"{name:7s} batch {batch}: off {off['output_tokens_per_s']:6.1f} tok/s, TPOT "
                f"{off['mean_tpot_ms']:5.1f} ms | on {on['output_tokens_per_s']:6.1f} tok/s, TPOT "
                f"{on['mean_tpot_ms']:5.1f} ms, acceptance {on['acceptance_rate'] or 0:.0%} of "
                f"{on['draft_tokens']} drafts | {row['speedup']:.2f}x, same outputs: {same}",
                flush=True,
            )
    result = {
        "benchmark": "spec_decode",
        "command": "python " + shlex.join(sys.argv),
        "date": now_iso(),
        "machine": machine,
        "versions": versions(),
        "dtype": llm.engine.config.dtype,
        "speculative_config": config,
        "max_tokens": args.max_tokens,
        "rows": rows,
    }
    write_result(args.out, result)


if __name__ == "__main__":
    main()
