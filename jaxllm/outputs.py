"""What the engine returns: RequestOutput with one CompletionOutput per choice (vLLM's shape)."""

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
