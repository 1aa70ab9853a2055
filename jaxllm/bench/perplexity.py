"""Perplexity of a model on a text: `jaxllm bench perplexity`, and the quantization table's
accuracy column (benchmarks/quantization.py).

The text is cut into windows of `window` tokens; each window is one prompt whose prompt
logprobs (`SamplingParams(prompt_logprobs=0)`) give the log-probability of every token after
its first. Perplexity = exp(mean negative log-likelihood over all scored tokens). The default
text (`data/public_domain.txt`, 2,300 words: the Declaration of Independence, the Gettysburg
Address and Lincoln's second inaugural address, all public domain) ships with jaxllm.
"""

from __future__ import annotations

import math
import os

DEFAULT_TEXT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "public_domain.txt")


def text_windows(tokenizer, text: str | None = None, window: int = 512) -> list[list[int]]:
    """`text` (default: DEFAULT_TEXT) as `tokenizer`'s ids, cut into windows of `window` tokens
    (the last may be shorter; one of a single token scores nothing and is dropped)."""
    if window < 2:
        raise ValueError(f"window must be at least 2 tokens, got {window}")
    if text is None:
        with open(DEFAULT_TEXT, encoding="utf-8") as f:
            text = f.read()
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return [w for w in (ids[i : i + window] for i in range(0, len(ids), window)) if len(w) >= 2]


def perplexity(llm, text: str | None = None, window: int = 512) -> dict:
    """{"perplexity", "nll" (mean, nats), "tokens" (scored), "windows"} of `llm` (an `LLM`) on
    `text` (default: DEFAULT_TEXT)."""
    from jaxllm.sampling_params import SamplingParams

    windows = text_windows(llm.get_tokenizer(), text, window)
    outputs = llm.generate(
        [{"prompt_token_ids": w} for w in windows],
        SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0),
        use_tqdm=False,
    )
    nll, count = 0.0, 0
    for w, out in zip(windows, outputs):
        for token, entry in zip(w[1:], out.prompt_logprobs[1:]):
            nll -= entry[token].logprob
            count += 1
    return {"perplexity": math.exp(nll / count), "nll": nll / count, "tokens": count, "windows": len(windows)}
