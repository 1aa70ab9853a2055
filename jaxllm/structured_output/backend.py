"""The interface a grammar engine implements for jaxllm (llguidance_backend.py is the one shipped)."""

from __future__ import annotations

import abc

import numpy as np


class Matcher(abc.ABC):
    """One request's position in its grammar; `backend` fills its masks."""

    backend: GrammarBackend

    @abc.abstractmethod
    def consume(self, token: int) -> bool:
        """Advance past `token`; False if the grammar does not allow it."""

    @property
    @abc.abstractmethod
    def is_stopped(self) -> bool:
        """The grammar is complete and nothing may follow (the request is done)."""

    @property
    def ends_output(self) -> bool:
        """Whether the matcher decides where the output ends (a grammar does; a mere filter of
        tokens, token_filters.py, does not)."""
        return True

    @abc.abstractmethod
    def copy(self) -> Matcher:
        """An independent matcher in the same state."""


class GrammarBackend(abc.ABC):
    """Compiles constraints for one tokenizer and fills token bitmasks.

    A bitmask row is `mask_words(vocab_size)` int32 words; bit `t % 32` of word `t // 32` set
    means token t is allowed."""

    name: str

    @abc.abstractmethod
    def compile(self, kind: str, text: str) -> Matcher:
        """A fresh matcher for a constraint: kind "json" (a JSON schema's text), "regex",
        "choice" (a JSON list of strings) or "grammar" (Lark or GBNF). Raises ValueError with
        the engine's message for an invalid one. May take long for a large grammar (it runs
        off the event loop)."""

    @abc.abstractmethod
    def fill_masks(self, items: list[tuple[Matcher, int, list[int]]], bitmask: np.ndarray) -> None:
        """For each (matcher, row, drafts): the tokens allowed next into `bitmask[row]`, and
        with drafts (speculative decoding) those allowed after each draft into the rows that
        follow, as far as the drafts are allowed (the matcher's state is left as it was)."""
