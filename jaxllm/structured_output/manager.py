"""StructuredOutputManager: constraints -> compiled matchers (cached), for one engine."""

from __future__ import annotations

import collections
import threading

from jaxllm.sampling_params import StructuredOutputsParams
from jaxllm.structured_output.backend import GrammarBackend, Matcher


def mask_words(vocab_size: int) -> int:
    """int32 words in one row of a packed token bitmask."""
    return (vocab_size + 31) // 32


class StructuredOutputManager:
    """Compiles each distinct constraint once (least recently used of `cache_size` dropped) and
    hands every request a copy of the compiled matcher. Thread-safe: a server compiles off its
    event loop while the engine thread takes copies."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids, cache_size: int = 256):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos_token_ids = tuple(eos_token_ids)
        self._backend: GrammarBackend | None = None
        self._compiled: collections.OrderedDict[tuple[str, str], Matcher] = collections.OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    @property
    def backend(self) -> GrammarBackend:
        with self._lock:
            if self._backend is None:
                if self._tokenizer is None:
                    raise ValueError("structured outputs need the model's tokenizer; this model has none")
                from jaxllm.structured_output.llguidance_backend import LLGuidanceBackend

                self._backend = LLGuidanceBackend(self._tokenizer, self.vocab_size, self._eos_token_ids)
            return self._backend

    def compile(self, params: StructuredOutputsParams) -> Matcher:
        """The compiled (never advanced) matcher of `params`; raises ValueError if invalid."""
        key = params.key
        with self._lock:
            matcher = self._compiled.get(key)
            if matcher is not None:
                self._compiled.move_to_end(key)
                return matcher
        matcher = self.backend.compile(*key)  # (outside the lock: a large grammar takes a while)
        with self._lock:
            self._compiled[key] = matcher
            while len(self._compiled) > self._cache_size:
                self._compiled.popitem(last=False)
        return matcher

    def matcher(self, params: StructuredOutputsParams) -> Matcher:
        """A new request's own matcher for `params`."""
        return self.compile(params).copy()
