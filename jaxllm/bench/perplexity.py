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


def perplexity(llm, text: str | None = None, window: int = 512) -> dict:
    """{"perplexity", "nll" (mean, nats), "tokens" (scored), "windows"} of `llm` (an `LLM`) on
    `text` (default: DEFAULT_TEXT)."""
    from jaxllm.sampling_params import SamplingParams

    if window < 2:
        raise ValueError(f"window must be at least 2 tokens, got {window}")
    if text is None:
        with open(DEFAULT_TEXT, encoding="utf-8") as f:
            text = f.read()
    ids = llm.get_tokenizer()(text, add_special_tokens=False)["input_ids"]
    windows = [ids[i : i + window] for i in range(0, len(ids), window)]
    windows = [w for w in windows if len(w) >= 2]
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
