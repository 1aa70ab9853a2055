"""Request: one sequence's host-side state, from arrival to finish."""

from __future__ import annotations

import dataclasses
import enum
import time

from jaxllm.sampling_params import SamplingParams
from jaxllm.structured_output.backend import Matcher


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # the step computing it failed (engine/core.py)

    @property
    def finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
            RequestStatus.FINISHED_ERROR,
        )


@dataclasses.dataclass(slots=True, eq=False)
class Request:
    """One sequence. With `n > 1` the engine makes n of these (`parent_id`, `index`).

    There is no prefill or decode phase: the scheduler looks at `num_computed_tokens`
    against `num_tokens` (prompt + outputs so far) and computes the difference.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    seed: int = 0  # per-request sampling seed (user's or drawn by the engine)
    parent_id: str | None = None
    index: int = 0
    prompt: str | None = None
    arrival_time: float = dataclasses.field(default_factory=time.monotonic)
    priority: int = 0  # under scheduling_policy "priority": lower runs first (core/request_queue.py)

    # False for a beam: the scheduler computes it and reports its top logprobs, and the beam
    # search appends the tokens it chooses (`append_output_token`).
    append_sampled_tokens: bool = True

    # Prompt logprobs (the first choice of a request that asks for them): per computed chunk,
    # (logprob [c], rank [c], top logprobs [c, K], top ids [c, K]) of prompt tokens 1, 2, ...;
    # None when not asked for. `num_prompt_logprobs` counts the prompt tokens covered so far.
    prompt_logprobs: list[tuple] | None = None
    num_prompt_logprobs: int = 0
    # Structured output: the matcher following this sequence's output in its grammar
    # (jaxllm/structured_output); the step masks its logits with the tokens it allows.
    grammar: Matcher | None = None
    # A pooling engine's request (its PoolingParams): it ends once its prompt is computed, with
    # `pooled` holding the merged parts of its computed chunks (models/pooling.py).
    pooling_params: object | None = None
    pooled: object | None = None
    # The LoRA adapter it runs under (lora/adapter.py LoRAAdapter), None for the base model.
    lora: object | None = None

    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    spec_token_ids: list[int] = dataclasses.field(default_factory=list)  # drafts for the next step
    cumulative_logprob: float = 0.0
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # Per KV cache group (core/kv_cache_manager.py): the page table, and how many of its
    # first pages were released (slid out of the group's window).
    page_tables: list[list[int]] = dataclasses.field(default_factory=lambda: [[]])
    num_released_pages: list[int] = dataclasses.field(default_factory=lambda: [0])
    page_hashes: list[int] = dataclasses.field(default_factory=list)
    swap_slots: list[int] = dataclasses.field(default_factory=list)  # host pages while swapped out
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    # Timestamps (time.monotonic) for metrics.
    scheduled_time: float | None = None

    @property
    def page_ids(self) -> list[int]:
        """The page table of group 0 (of every layer, for a model with one group)."""
        return self.page_tables[0]

    @page_ids.setter
    def page_ids(self, page_ids: list[int]) -> None:
        self.page_tables[0] = page_ids

    @property
    def lora_int_id(self) -> int:
        """Its adapter's id, 0 for the base model."""
        return 0 if self.lora is None else self.lora.lora_int_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + outputs without building the whole list (hot path)."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    def append_output_token(self, token_id: int, logprob: float) -> None:
        self.output_token_ids.append(token_id)
        self.cumulative_logprob += logprob

    @property
    def max_tokens(self) -> int:
        return self.sampling_params.max_tokens

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None

    def stop_status(self, max_model_len: int) -> RequestStatus | None:
        """The status this request ends with after its latest token, or None to go on.
        EOS and stop token ids count only from `min_tokens` outputs on; a complete grammar
        (structured output: nothing may follow) stops it whatever the count."""
        params = self.sampling_params
        if self.grammar is not None and self.grammar.is_stopped:
            return RequestStatus.FINISHED_STOPPED
        num_out = len(self.output_token_ids)
        token = self.output_token_ids[-1]
        if num_out >= params.min_tokens:
            if token in params.stop_token_ids:
                self.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
            if not params.ignore_eos and token in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if num_out >= params.max_tokens or self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
