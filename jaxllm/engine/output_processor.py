"""OutputProcessor: EngineCoreOutputs (token ids) -> RequestOutputs (text, logprobs, choices).

It owns everything about a request that only matters to the caller: the incremental
detokenizer and stop strings (with the streaming hold-back), logprobs as `Logprob` dicts
(built once per new token), the `n` choices of one request, and the output kind
("cumulative": everything so far, "delta": only what is new, "final": one output at the
end). A stop string needs the text, so it is found here: the request id goes back to the
engine in `reqs_to_abort`, which ends it in the scheduler. A pooling request (PoolingParams)
has one output, once it ends: its embedding, cut and normalized as it asked.
"""

from __future__ import annotations

import dataclasses

from jaxllm.core.outputs import EngineCoreOutputs
from jaxllm.engine.detokenizer import IncrementalDetokenizer
from jaxllm.models import pooling
from jaxllm.outputs import CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, Logprob, RequestOutput
from jaxllm.pooling_params import PoolingParams
from jaxllm.sampling_params import SamplingParams

OUTPUT_KINDS = ("cumulative", "delta", "final")


@dataclasses.dataclass(slots=True, eq=False)
class SequenceState:
    """One choice of a request."""

    index: int
    detok: IncrementalDetokenizer | None
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    weight_versions: list = dataclasses.field(default_factory=list)  # per token
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    sent_tokens: int = 0  # delta outputs: tokens and text already returned
    sent_text: int = 0
    final_sent: bool = False


@dataclasses.dataclass(slots=True, eq=False)
class RequestState:
    """A user's request: its `n` choices, keyed by the engine-core request id of each."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams | PoolingParams
    output_kind: str
    arrival_time: float
    seqs: dict[str, SequenceState]
    num_cached_tokens: int = 0
    scheduled_time: float | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    prompt_logprobs_sent: bool = False
    weight_version: int | str = 0
    pooled: object | None = None  # a pooling request's pooled state, once computed

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.seqs.values())


@dataclasses.dataclass(slots=True)
class OutputProcessorOutput:
    request_outputs: list[RequestOutput]
    reqs_to_abort: list[str]  # engine-core ids a stop string ended
    finished: list[RequestState]


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}
        self._seq_of: dict[str, tuple[RequestState, SequenceState]] = {}  # engine-core id -> its choice

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams | PoolingParams,
        output_kind: str,
        arrival_time: float,
        core_ids: list[str],
    ) -> None:
        """Track a request whose choices run in the engine core as `core_ids` (one per choice)."""
        seqs = {core_id: self._sequence(index, params, prompt_token_ids) for index, core_id in enumerate(core_ids)}
        state = RequestState(request_id, prompt, prompt_token_ids, params, output_kind, arrival_time, seqs)
        self.requests[request_id] = state
        for core_id, seq in seqs.items():
            self._seq_of[core_id] = (state, seq)

    def _sequence(self, index: int, params, prompt_token_ids: list[int]) -> SequenceState:
        """A choice's state: a pooling request's holds no text; a generation request's, its
        detokenizer (unless it asks for token ids only) and its logprobs if asked for."""
        if isinstance(params, PoolingParams):
            return SequenceState(index, None)
        detok = None
        if params.detokenize:
            detok = IncrementalDetokenizer(
                self.tokenizer,
                prompt_token_ids,
                skip_special_tokens=params.skip_special_tokens,
                stop=params.stop,
                include_stop_str_in_output=params.include_stop_str_in_output,
            )
        return SequenceState(index, detok, logprobs=[] if params.logprobs is not None else None)

    def remove_request(self, request_id: str) -> RequestState | None:
        state = self.requests.pop(request_id, None)
        if state is not None:
            for core_id in state.seqs:
                self._seq_of.pop(core_id, None)
        return state

    def is_tracked(self, core_id: str) -> bool:
        return core_id in self._seq_of

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def process_outputs(self, core_outputs: EngineCoreOutputs) -> OutputProcessorOutput:
        touched: dict[str, RequestState] = {}
        reqs_to_abort: list[str] = []
        now = core_outputs.timestamp
        for out in core_outputs.outputs:
            entry = self._seq_of.get(out.request_id)
            if entry is None:  # not ours (a beam of beam search)
                continue
            state, seq = entry
            if seq.index == 0:
                state.num_cached_tokens, state.scheduled_time = out.num_cached_tokens, out.scheduled_time
            state.weight_version = core_outputs.weight_version
            if out.pooled is not None:
                state.pooled, seq.last_token_time = out.pooled, now
            if out.prompt_logprobs is not None:
                state.prompt_logprobs = self._prompt_logprobs_entries(
                    state.prompt_token_ids, out.prompt_logprobs, state.params.prompt_logprobs
                )
            for j, (token, logprob) in enumerate(zip(out.new_token_ids, out.new_logprobs)):
                seq.token_ids.append(token)
                seq.weight_versions.append(core_outputs.weight_version)
                seq.cumulative_logprob += logprob
                seq.first_token_time = seq.first_token_time or now
                seq.last_token_time = now
                if seq.logprobs is not None:
                    seq.logprobs.append(self._logprobs_entry(token, logprob, out.top_logprobs and out.top_logprobs[j]))
                stop = seq.detok.add_token(token) if seq.detok is not None else None
                if stop is not None and len(seq.token_ids) >= state.params.min_tokens:
                    seq.finish_reason, seq.stop_reason = "stop", stop
                    if out.finish_reason is None:
                        reqs_to_abort.append(out.request_id)
                    break  # tokens after it (a step's accepted drafts) are not the request's
            if seq.finish_reason is None and out.finish_reason is not None:
                seq.finish_reason, seq.stop_reason = out.finish_reason, out.stop_reason
            touched[state.request_id] = state
        request_outputs, finished = [], []
        for state in touched.values():
            output = self._make_output(state)
            if output is not None:
                request_outputs.append(output)
            if state.finished:
                finished.append(self.remove_request(state.request_id))
        return OutputProcessorOutput(request_outputs, reqs_to_abort, finished)

    def abort_all(self) -> list[RequestOutput]:
        """End every request now with finish reason "abort": each one's last output (the
        engine ends them in the scheduler)."""
        outputs = []
        for state in list(self.requests.values()):
            for seq in state.seqs.values():
                if seq.finish_reason is None:
                    seq.finish_reason = "abort"
            output = self._make_output(state)
            if output is not None:
                outputs.append(output)
            self.remove_request(state.request_id)
        return outputs

    def _logprobs_entry(self, token: int, logprob: float, top) -> dict[int, Logprob]:
        ids, logprobs = top if top is not None else ((), ())
        entry = {tid: Logprob(lp, rank + 1, self._token_text(tid)) for rank, (tid, lp) in enumerate(zip(ids, logprobs))}
        if token not in entry:
            entry[token] = Logprob(logprob, None, self._token_text(token))
        return entry

    def _prompt_logprobs_entries(self, prompt_token_ids: list[int], arrays, k: int) -> list[dict[int, Logprob] | None]:
        """[None, then per prompt token its Logprob (with rank) and the top ones]."""
        entries: list[dict[int, Logprob] | None] = [None]
        if not arrays:  # a one-token prompt
            return entries
        for token, lp, rank, top_lp, top_ids in zip(prompt_token_ids[1:], *(a.tolist() for a in arrays)):
            entry = {
                tid: Logprob(v, r + 1, self._token_text(tid)) for r, (tid, v) in enumerate(zip(top_ids[:k], top_lp))
            }
            entry[token] = Logprob(lp, rank, self._token_text(token))
            entries.append(entry)
        return entries

    def _token_text(self, token_id: int) -> str | None:
        """The token's text, or None for a model without a tokenizer (token ids only)."""
        return None if self.tokenizer is None else self.tokenizer.decode([token_id])

    def _make_output(self, state: RequestState) -> RequestOutput | EmbeddingRequestOutput | None:
        finished = state.finished
        if isinstance(state.params, PoolingParams):
            return self._embedding_output(state) if finished else None
        delta = state.output_kind == "delta"
        if state.output_kind == "final" and not finished:
            return None
        completions = []
        for seq in state.seqs.values():
            done = seq.finish_reason is not None
            text = ""
            if seq.detok is not None:
                end = seq.detok.streamable_len(done)
                text = seq.detok.text[seq.sent_text : end] if delta else seq.detok.text[:end]
            token_ids, logprobs, versions = seq.token_ids, seq.logprobs, seq.weight_versions
            if delta:
                if seq.final_sent or (len(token_ids) == seq.sent_tokens and not text and not done):
                    continue
                token_ids, versions = token_ids[seq.sent_tokens :], versions[seq.sent_tokens :]
                if logprobs is not None:
                    logprobs = logprobs[seq.sent_tokens :]
                seq.sent_tokens = len(seq.token_ids)
                if seq.detok is not None:
                    seq.sent_text = seq.detok.streamable_len(done)
                seq.final_sent = done
            completions.append(
                CompletionOutput(
                    index=seq.index,
                    text=text,
                    token_ids=list(token_ids),
                    cumulative_logprob=seq.cumulative_logprob,
                    logprobs=list(logprobs) if logprobs is not None else None,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                    weight_versions=list(versions),
                )
            )
        if not completions:
            return None
        prompt_logprobs = state.prompt_logprobs
        if delta and state.prompt_logprobs_sent:  # a stream carries them once
            prompt_logprobs = None
        elif delta and prompt_logprobs is not None:
            state.prompt_logprobs_sent = True
        first = next(iter(state.seqs.values()))
        last_token_time = max((s.last_token_time or 0) for s in state.seqs.values())
        return RequestOutput(
            state.request_id,
            state.prompt,
            state.prompt_token_ids,
            completions,
            finished,
            num_cached_tokens=state.num_cached_tokens,
            prompt_logprobs=prompt_logprobs,
            weight_version=state.weight_version,
            metrics={
                "arrival_time": state.arrival_time,
                "first_token_time": first.first_token_time,
                "scheduled_time": state.scheduled_time,
                "last_token_time": last_token_time,
                "num_generation_tokens": sum(len(s.token_ids) for s in state.seqs.values()),
            },
        )

    @staticmethod
    def _embedding_output(state: RequestState) -> EmbeddingRequestOutput:
        """A finished pooling request's output (an empty embedding if it failed or was aborted)."""
        seq = next(iter(state.seqs.values()))
        params = state.params
        embedding = (
            []
            if state.pooled is None
            else pooling.embedding(state.pooled, params.normalize, params.dimensions).tolist()
        )
        return EmbeddingRequestOutput(
            state.request_id,
            state.prompt,
            state.prompt_token_ids,
            EmbeddingOutput(embedding),
            finish_reason=seq.finish_reason,
            metrics={
                "arrival_time": state.arrival_time,
                "scheduled_time": state.scheduled_time,
                "last_token_time": seq.last_token_time,
            },
        )
