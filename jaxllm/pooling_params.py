"""PoolingParams: what one embedding request asks for (vLLM's names)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(slots=True)
class PoolingParams:
    """dimensions: keep the embedding's first N entries (models trained for it: Matryoshka);
    normalize: scale it to unit length (None: as the model's pooling says);
    truncate_prompt_tokens: a prompt longer than this many tokens keeps that many (on the
    tokenizer's truncation side, its special tokens kept) instead of being refused; -1: the
    model's context (max_model_len)."""

    dimensions: int | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None

    def verify(self) -> None:
        """Raise ValueError, naming the field, for a value no request can have."""
        if self.dimensions is not None and (
            isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int) or self.dimensions < 1
        ):
            raise ValueError(f"dimensions must be a positive integer, got {self.dimensions!r}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be true or false, got {self.normalize!r}")
        k = self.truncate_prompt_tokens
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or (k < 1 and k != -1)):
            raise ValueError(f"truncate_prompt_tokens must be -1 or a positive integer, got {k!r}")
