"""`allowed_token_ids` and `bad_words` (vLLM's built-in logits processors) as token masks.

Both say which tokens a request may sample next, as a grammar does, so they ride on the
grammar's path: a `FilteredMatcher` wraps the request's grammar matcher (or none), follows its
output tokens, and narrows the row's packed bitmask after the grammar has filled it
(`fill_masks`). The step masks the logits there as for any grammar: nothing recompiles.

bad_words as vLLM reads them: each word is tokenized as it is and with a leading space (a new
word), without special tokens; a one-token word is never sampled, a longer one's last token is
masked wherever the output so far ends with its other tokens.
"""

from __future__ import annotations

import numpy as np

from jaxllm.sampling_params import SamplingParams
from jaxllm.structured_output.backend import Matcher


def bad_word_token_ids(words: list[str], tokenizer) -> list[tuple[int, ...]]:
    """Each bad word's token sequences (as written, and as a new word after a space), distinct."""
    out: list[tuple[int, ...]] = []
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tuple(tokenizer.encode(text, add_special_tokens=False))
            if ids and ids not in out:
                out.append(ids)
    return out


class FilteredMatcher(Matcher):
    """A request's grammar matcher (or None) narrowed by a fixed set of allowed tokens (a packed
    bitmask row) and bad words (token sequences)."""

    def __init__(self, inner: Matcher | None, allowed: np.ndarray | None, bad_words: list[tuple[int, ...]]):
        self.inner, self.allowed, self.bad_words = inner, allowed, bad_words
        self.backend = inner.backend if inner is not None else None
        self.output: list[int] = []  # the tokens so far (bad words look back over them)

    def consume(self, token: int) -> bool:
        self.output.append(token)
        return self.inner.consume(token) if self.inner is not None else True

    @property
    def is_stopped(self) -> bool:
        return self.inner is not None and self.inner.is_stopped

    @property
    def ends_output(self) -> bool:
        return self.inner is not None and self.inner.ends_output

    def copy(self) -> FilteredMatcher:
        out = FilteredMatcher(self.inner.copy() if self.inner is not None else None, self.allowed, self.bad_words)
        out.output = list(self.output)
        return out

    def narrow(self, bitmask: np.ndarray, row: int, drafts: list[int]) -> None:
        """Narrow rows row .. row + len(drafts) (the next token, then after each draft)."""
        for i in range(len(drafts) + 1):
            words = bitmask[row + i].view(np.uint32)  # (a view: narrowed in place)
            if self.allowed is not None:
                words &= self.allowed
            history = self.output + list(drafts[:i])
            for seq in self.bad_words:
                *prefix, last = seq
                if last < 32 * len(words) and (not prefix or history[-len(prefix) :] == prefix):
                    words[last // 32] &= np.uint32(0xFFFFFFFF ^ (1 << (last % 32)))


def wrap(grammar: Matcher | None, params: SamplingParams, vocab_size: int, tokenizer) -> Matcher | None:
    """The request's matcher with its allowed_token_ids and bad_words applied (`grammar` itself
    when it has neither). Raises ValueError for ids past the vocabulary or bad words without a
    tokenizer."""
    if not params.allowed_token_ids and not params.bad_words:
        return grammar
    allowed = None
    if params.allowed_token_ids:
        ids = np.asarray(params.allowed_token_ids, np.int64)
        if ids.max() >= vocab_size:
            raise ValueError(f"allowed_token_ids has {int(ids.max())}, past the vocabulary ({vocab_size} tokens)")
        bits = np.zeros(32 * ((vocab_size + 31) // 32), np.uint8)
        bits[ids] = 1
        allowed = np.packbits(bits, bitorder="little").view(np.uint32)
    bad = []
    if params.bad_words:
        if tokenizer is None:
            raise ValueError("bad_words need the model's tokenizer; this model has none")
        bad = bad_word_token_ids(params.bad_words, tokenizer)
    return FilteredMatcher(grammar, allowed, bad)


def fill_masks(items: list[tuple[Matcher, int, list[int]]], bitmask: np.ndarray) -> None:
    """The step's rows of `bitmask` for (matcher, row, drafts): each grammar's mask (its
    backend's `fill_masks`; rows without one stay all ones), then each filter's narrowing."""
    grammars = []
    for matcher, row, drafts in items:
        inner = matcher.inner if isinstance(matcher, FilteredMatcher) else matcher
        if inner is not None:
            grammars.append((inner, row, drafts))
    if grammars:
        grammars[0][0].backend.fill_masks(grammars, bitmask)
    for matcher, row, drafts in items:
        if isinstance(matcher, FilteredMatcher):
            matcher.narrow(bitmask, row, drafts)
