"""N-gram (prompt lookup) proposer: when the last n tokens of a sequence occurred earlier in it
(its prompt or its output), propose the tokens that followed them there.

It needs no model and costs microseconds per request, and it pays off when the output repeats
its input: summaries and extractions quoting the prompt, code edits, reformatting. The longest
n in [prompt_lookup_min, prompt_lookup_max] with a match wins, and of its matches the most
recent (the nearest context is the likeliest to continue the same way).
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from jaxllm.spec_decode.proposer import Proposer


def propose_ngram(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """Up to `k` draft tokens continuing `tokens` [L] int, or none (an empty array)."""
    L = len(tokens)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        suffix = tokens[L - n :]
        # Windows starting at 0 .. L - 1 - n: every earlier occurrence, not the suffix itself.
        hits = np.flatnonzero((sliding_window_view(tokens[: L - 1], n) == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start : start + k]
    return tokens[:0]


class NgramProposer(Proposer):
    """Drafts for running requests from their own tokens (`Request.spec_token_ids`)."""

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int):
        self.k = self.num_speculative_tokens = num_speculative_tokens
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max

    def propose(self, tokens: np.ndarray, room: int) -> list[int]:
        """Drafts continuing `tokens`: at most num_speculative_tokens, and at most `room`."""
        return propose_ngram(tokens, self.min_n, self.max_n, min(self.k, room)).tolist()
