"""What the parts of one engine step hand each other (vLLM v1's contracts).

Scheduler.schedule()                        -> SchedulerOutput
ModelRunner.execute(SchedulerOutput)        -> ModelRunnerOutput
Scheduler.update_from_output(both)          -> EngineCoreOutputs
OutputProcessor.process_outputs(that)       -> RequestOutputs (+ requests a stop string ended)
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxllm.core.request import Request


@dataclasses.dataclass(slots=True)
class SchedulerOutput:
    """One step's plan.

    scheduled: (request, num_new_tokens) pairs; a decode has 1 new token, a prompt chunk more.
    finished_req_ids / preempted_req_ids: requests that left the batch since the last step
        (the runner drops their rows).
    page_copies: per KV cache group, (src, dst) pages to copy before the step (copy-on-write).
    swap_out: (device page, host slot) pairs to save before the step (preemption by swapping);
    swap_in: (host slot, device page) pairs to restore before the step.
    """

    scheduled: list[tuple[Request, int]]
    finished_req_ids: set[str] = dataclasses.field(default_factory=set)
    preempted_req_ids: set[str] = dataclasses.field(default_factory=set)
    page_copies: list[tuple[list[int], list[int]]] = dataclasses.field(default_factory=list)
    swap_out: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    swap_in: list[tuple[int, int]] = dataclasses.field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def num_preempted(self) -> int:
        return len(self.preempted_req_ids)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclasses.dataclass(slots=True)
class ModelRunnerOutput:
    """The step's results: the tokens each of `SchedulerOutput.scheduled` got, request i's
    `num_sampled[i]` of them after request i - 1's (none mid-prompt; one; with speculative
    decoding its accepted drafts and one more).

    sampled_token_ids: [N] int32; logprobs: [N] f32, each token's logprob.
    top_logprobs, top_token_ids: [N, MAX_LOGPROBS], filled when a request asked for logprobs.
    num_sampled: [n] int.
    prompt_logprobs: request id -> (logprob [c], rank [c], top logprobs [c, K], top ids [c, K])
        of the prompt tokens this step covered, for requests that asked for them.
    """

    sampled_token_ids: np.ndarray
    logprobs: np.ndarray
    top_logprobs: np.ndarray
    top_token_ids: np.ndarray
    num_sampled: np.ndarray
    prompt_logprobs: dict[str, tuple] = dataclasses.field(default_factory=dict)
    timings: dict[str, float] = dataclasses.field(default_factory=dict)
    pooled: np.ndarray | None = None  # a pooling step's: [n, hidden], request i's chunk part


@dataclasses.dataclass(slots=True)
class EngineCoreOutput:
    """What one request got from a step: new tokens (none mid-prompt, several with speculative
    decoding) and, once it ends, why.

    new_logprobs: each new token's logprob.
    top_logprobs: per new token, (token ids, logprobs) of the request's `logprobs` best, or None.
    prompt_logprobs: with the first token of a request that asked for them, its prompt
        tokens' (logprob [P-1], rank [P-1], top logprobs [P-1, K], top ids [P-1, K]).
    finish_reason: "stop" | "length" | "abort" | None; stop_reason: the stop token id.
    """

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[float] = dataclasses.field(default_factory=list)
    top_logprobs: list[tuple[list[int], list[float]]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    scheduled_time: float | None = None
    prompt_logprobs: tuple | None = None
    pooled: np.ndarray | None = None  # a pooling request's pooled state [hidden], once it ends


@dataclasses.dataclass(slots=True)
class EngineCoreOutputs:
    outputs: list[EngineCoreOutput]
    num_prompt_tokens: int = 0  # prompt tokens computed this step
    num_generated_tokens: int = 0
    num_draft_tokens: int = 0  # speculative decoding: drafts verified this step
    num_accepted_tokens: int = 0  # and accepted
    timestamp: float = 0.0  # time.monotonic() when the step's tokens arrived
    weight_version: int | str = 0  # the weights that computed them (LLMEngine.update_weights)
