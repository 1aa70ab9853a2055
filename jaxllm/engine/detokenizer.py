"""Incremental detokenization and stop-string matching.

Decoding one token at a time breaks multi-byte characters (a UTF-8 character split over
byte-level BPE tokens decodes to U+FFFD until its last byte arrives) and loses the spaces
that some tokenizers attach to the previous token. So text is decoded over a short sliding
window of ids (`prefix_offset:read_offset` already emitted, the rest new) and only released
once it no longer ends in U+FFFD. The window starts inside the prompt for context.
"""

from __future__ import annotations

INITIAL_CONTEXT = 5  # prompt tokens decoded as context for the first output token


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer,
        prompt_token_ids: list[int],
        *,
        skip_special_tokens: bool = True,
        stop: list[str] = (),
        include_stop_str_in_output: bool = False,
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_token_ids[-INITIAL_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self.stop = list(stop)
        self.include_stop = include_stop_str_in_output
        # Text that could still turn into a stop string is held back from streaming.
        self.holdback = max((len(s) for s in self.stop), default=1) - 1

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids, skip_special_tokens=self.skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def add_token(self, token_id: int) -> str | None:
        """Append a token; return the stop string if the text now contains one (the text is
        then cut at the stop string, or just after it with include_stop_str_in_output)."""
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return None
        delta = new_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        search_from = max(0, len(self.text) - self.holdback)
        self.text += delta
        for stop in self.stop:
            at = self.text.find(stop, search_from)
            if at != -1:
                self.text = self.text[: at + len(stop) if self.include_stop else at]
                return stop
        return None

    def streamable_len(self, finished: bool) -> int:
        """How much of `text` is safe to stream: all of it once finished, else all but a tail
        that might be the start of a stop string."""
        return len(self.text) if finished or not self.stop else max(0, len(self.text) - self.holdback)
