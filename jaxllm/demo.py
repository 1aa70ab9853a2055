"""`make demo`: chat with the default model through LLM.chat and report throughput.

python -m jaxllm.demo [--model PATH] [--dtype auto|bfloat16|float32] [--max-tokens 96]
"""

from __future__ import annotations

import argparse
import time

from jaxllm import LLM, EngineArgs, SamplingParams
from jaxllm.utils import DTYPE_CHOICES

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "Give me three tips for learning a new language.",
    "What is 12 times 12?",
    "Name the planets of the solar system.",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF dir, hub id or .gguf (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--dtype", default=EngineArgs.dtype, choices=DTYPE_CHOICES)
    ap.add_argument("--max-tokens", type=int, default=96)
    args = ap.parse_args()

    start = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=8, max_num_batched_tokens=256)
    print(
        f"loaded {llm.engine.model_name} ({llm.engine.config.dtype}) in {time.perf_counter() - start:.1f}s "
        f"(compiling {len(llm.engine.runner.buckets)} step shapes: {llm.engine.warmup_seconds:.1f}s)\n"
    )
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    outputs = llm.chat(conversations, SamplingParams(temperature=0, max_tokens=args.max_tokens), use_tqdm=False)
    for question, out in zip(QUESTIONS, outputs):
        print(f"> {question}\n{out.outputs[0].text.strip()}\n")
    stats = llm.last_run_stats
    print(
        f"{len(QUESTIONS)} requests, {stats['prompt_tokens']} prompt + {stats['generation_tokens']} generated tokens "
        f"in {stats['seconds']:.2f}s: {stats['generation_tokens'] / stats['seconds']:.1f} output tok/s, "
        f"{(stats['prompt_tokens'] + stats['generation_tokens']) / stats['seconds']:.1f} total tok/s"
    )


if __name__ == "__main__":
    main()
