"""The llguidance grammar backend (https://github.com/guidance-ai/llguidance): an Earley parser
over a lexer, with no per-grammar precomputation, so a new schema costs milliseconds; it has
no dependencies beyond itself."""

from __future__ import annotations

import os

import numpy as np

from jaxllm.structured_output.backend import GrammarBackend, Matcher

# JSON is generated compact but readable (`{"a": 1, "b": [2, 3]}`): no free whitespace, which
# a small model at temperature 1 can otherwise spin on until max_tokens. A schema's own
# "x-guidance" options override these.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class LLGuidanceMatcher(Matcher):
    __slots__ = ("matcher", "backend")

    def __init__(self, matcher, backend: LLGuidanceBackend):
        self.matcher = matcher
        self.backend = backend

    def consume(self, token: int) -> bool:
        return self.matcher.consume_token(token)

    @property
    def is_stopped(self) -> bool:
        return self.matcher.is_stopped()

    def copy(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self.matcher.deep_copy(), self.backend)


class LLGuidanceBackend(GrammarBackend):
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids):
        """`tokenizer`: a transformers fast tokenizer; building llguidance's view of it takes
        about 0.4 s (49k tokens), so the manager does it on the first constrained request."""
        import llguidance
        import llguidance.hf

        self._ll = llguidance
        self.vocab_size = vocab_size
        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=list(eos_token_ids))
        self._executor = llguidance.LLExecutor(num_threads=len(os.sched_getaffinity(0)))

    def compile(self, kind: str, text: str) -> Matcher:
        ll = self._ll
        try:
            if kind == "json":
                grammar = ll.LLMatcher.grammar_from_json_schema(text, defaults=JSON_OPTIONS)
            elif kind == "regex":  # \d and \w match ASCII, as in JSON Schema patterns and xgrammar
                grammar = ll.LLMatcher.grammar_from_lark(f"start: /{ll.regex_to_lark(text, 'dw')}/")
            else:
                grammar = ll.grammar_from(kind, text)
        except ValueError as e:
            raise ValueError(f"invalid {_WHAT[kind]}: {e}") from None
        matcher = ll.LLMatcher(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"invalid {_WHAT[kind]}: {matcher.get_error().strip()}")
        return LLGuidanceMatcher(matcher, self)

    def fill_masks(self, items: list[tuple[Matcher, int, list[int]]], bitmask: np.ndarray) -> None:
        assert bitmask.dtype == np.int32 and bitmask.flags["C_CONTIGUOUS"] and bitmask.ndim == 2
        where = (bitmask.ctypes.data, bitmask.shape[1] * 4, bitmask.shape[0])
        plain = [(m.matcher, row) for m, row, drafts in items if not drafts]
        drafted = [(m.matcher, row, drafts) for m, row, drafts in items if drafts]
        if plain:
            self._executor.unsafe_compute_mask_ptr(plain, *where)
        if drafted:
            self._executor.unsafe_compute_mask_ptr_with_draft_token(drafted, *where)


_WHAT = {"json": "JSON schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}
