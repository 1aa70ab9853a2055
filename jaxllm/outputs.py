"""What the engine returns (vLLM's shapes): RequestOutput with one CompletionOutput per choice; a
pooling engine's EmbeddingRequestOutput, and LLM.score's ScoringRequestOutput."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclasses.dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or token id that ended it
    # The weight version (LLMEngine.update_weights) that computed each of token_ids.
    weight_versions: list[int | str] = dataclasses.field(default_factory=list)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: dict | None = None
    # With SamplingParams.prompt_logprobs: one entry per prompt token (None for the first),
    # each the prompt token's Logprob plus the top ones, as for generated tokens.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # The weight version of the latest step that computed any of this request's tokens.
    weight_version: int | str = 0

    @property
    def finish_reasons(self) -> list[str | None]:
        return [c.finish_reason for c in self.outputs]


@dataclasses.dataclass(slots=True)
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclasses.dataclass(slots=True)
class EmbeddingRequestOutput:
    """A pooling engine's answer to one prompt (`LLM.embed`, `/v1/embeddings`)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True
    finish_reason: str = "stop"  # "stop" with an embedding; "abort" or "error" (empty) without
    metrics: dict | None = None
    num_cached_tokens: int = 0  # (a pooling engine computes every prompt token)

    @property
    def finish_reasons(self) -> list[str]:
        return [self.finish_reason]


@dataclasses.dataclass(slots=True)
class ScoringOutput:
    score: float


@dataclasses.dataclass(slots=True)
class ScoringRequestOutput:
    """`LLM.score`'s answer for one pair: the cosine similarity of their embeddings."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ScoringOutput
    finished: bool = True
