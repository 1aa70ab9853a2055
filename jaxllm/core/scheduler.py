"""Scheduler: which tokens of which requests run this step, and what a step's results mean
for each request (vLLM v1 style).

There is no prefill phase and no decode phase. Each step, every running request is given
the tokens it still needs (`num_tokens - num_computed_tokens`: one for a decode, a chunk of
the prompt otherwise) under the token budget `max_num_batched_tokens`; then waiting requests
are admitted in the queue's order (`scheduling_policy`: first come, first served, or by
priority: core/request_queue.py) while sequences (`max_num_seqs`), prompt chunks
(`max_num_prefill_seqs`), pages and tokens allow. Long prompts are split across steps
(chunked prefill). When the pool runs out of pages, the newest running request (under the
priority policy: the least urgent) is preempted; there, a waiting request that outranks running
ones and lacks a sequence slot or pages preempts them too. A preempted request is paused:
by default its pages are freed and its tokens recomputed when it is admitted again
(`preemption_mode="recompute"`); with `"swap"` its pages are copied to host memory and copied
back when it resumes (falling back to recompute when the host pool is full).

Speculative decoding (with a `proposer`): when every running request is decoding, nothing
waits and at most `max_spec_seqs` run, each request gets drafts (`Request.spec_token_ids`)
and is scheduled for its newest token plus them; the step verifies them all at once.

After the step, `update_from_output` appends each request's sampled tokens (and feeds them to
its grammar, with structured output), checks its stop conditions (EOS, stop token ids,
max_tokens, min_tokens, max_model_len, a complete grammar: `Request.stop_status`), frees the
pages of finished requests, and reports all of it as `EngineCoreOutputs`. Stop *strings* need
the text: the output processor finds them and the engine ends those requests with
`finish_requests`. A pooling engine's requests sample nothing: each ends once its prompt is
computed, with its pooled state.

Everything here is host-side Python over `Request` objects and the `KVCacheManager`: the
scheduler tests run it without a model (tests/core/test_scheduler.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import numpy as np

from jaxllm.engine_config import SchedulerConfig
from jaxllm.core.kv_cache_manager import KVCacheManager
from jaxllm.core.outputs import EngineCoreOutput, EngineCoreOutputs, ModelRunnerOutput, SchedulerOutput
from jaxllm.core.request import Request, RequestStatus
from jaxllm.core.request_queue import RequestQueue, urgency
from jaxllm.core.schedule_ahead import schedule_ahead

logger = logging.getLogger("jaxllm")


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache_manager: KVCacheManager,
        proposer=None,
        max_spec_seqs: int = 0,
        pooler=None,
    ):
        """`proposer`: drafts for speculative decoding (jaxllm/spec_decode), in steps of at most
        `max_spec_seqs` sequences. `pooler`: a pooling engine's `PoolingConfig`, which merges the
        parts of its requests' prompt chunks."""
        self.config = config
        self.pooler = pooler
        self.kv = kv_cache_manager
        self.proposer = proposer
        self.max_spec_seqs = max_spec_seqs
        self.requests: dict[str, Request] = {}  # every unfinished request, by id
        self.waiting = RequestQueue(config.scheduling_policy)
        self.running: list[Request] = []
        self.num_preemptions = 0
        # Since the last schedule(): requests that left (the runner frees their rows).
        self._finished_req_ids: set[str] = set()

    # ----- requests in and out -----
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already scheduled")
        self.requests[request.request_id] = request
        self.waiting.push(request)

    def fork_request(self, parent: Request, child: Request) -> None:
        """Start `child` as a copy of the running `parent`'s computed state (a beam branching
        off): it shares every page (copy-on-write) and joins the running batch directly."""
        if parent.status is not RequestStatus.RUNNING:
            raise ValueError(f"can only fork a running request; {parent.request_id!r} is {parent.status.value}")
        if child.request_id in self.requests:
            raise ValueError(f"request_id {child.request_id!r} is already scheduled")
        self.kv.fork(parent, child)
        child.status = RequestStatus.RUNNING
        child.scheduled_time = time.monotonic()
        self.requests[child.request_id] = child
        self.running.append(child)

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> None:
        """End requests wherever they are (waiting, running, swapped) and free their pages.
        Unknown or already finished ids are ignored."""
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status is RequestStatus.RUNNING:
                self.running.remove(request)
            self._free_request(request, status)

    def _free_request(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.kv.free(request)
        self.kv.free_swap(request)
        del self.requests[request.request_id]
        self._finished_req_ids.add(request.request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.requests) - len(self.running)

    # ----- the plan -----
    def _preempt(self, request: Request, preempted: set[str], swap_out: list[tuple[int, int]]) -> None:
        self.running.remove(request)
        swapped = self.config.preemption_mode == "swap" and self.kv.can_swap_out(request)
        if swapped:
            swap_out += self.kv.swap_out(request)
        else:
            self.kv.free(request)
            request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        preempted.add(request.request_id)
        self.waiting.push_front(request)

    def _propose_drafts(self) -> bool:
        """Drafts for every running request, if this step speculates (see the module doc)."""
        if (
            self.proposer is None
            or not 0 < len(self.running) <= self.max_spec_seqs
            or len(self.requests) > len(self.running)
            or any(r.num_tokens - r.num_computed_tokens != 1 for r in self.running)
        ):
            return False
        requests, rooms = [], []
        for request in self.running:
            request.spec_token_ids = []
            if not request.append_sampled_tokens:
                continue
            # Room for the drafts and one more token, within max_tokens and the context; and
            # the pages for them (a draft model writes its KV there), if the pool has them with
            # a page to spare for every running request (drafts never cause a preemption).
            room = min(
                self.proposer.num_speculative_tokens,
                request.max_tokens - len(request.output_token_ids) - 1,
                self.config.max_model_len - request.num_tokens - 1,
            )
            if (
                room > 0
                and self.kv.num_free_pages >= len(self.running) + self.kv.pages_needed(1 + room)
                and self.kv.allocate_slots(request, 1 + room)
            ):
                requests.append(request)
                rooms.append(room)
        if requests:
            self.proposer.propose_batch(requests, rooms)
        return True

    def schedule(self) -> SchedulerOutput:
        """This step's plan: running requests first, then waiting ones (see the module doc)."""
        speculate = self._propose_drafts()
        scheduled: list[tuple[Request, int]] = []
        preempted: set[str] = set()
        swap_out: list[tuple[int, int]] = []
        swap_in: list[tuple[int, int]] = []
        if self.waiting.policy == "priority":  # the least urgent last: it gives way first
            self.running.sort(key=urgency)
            self._preempt_for_waiting(preempted, swap_out)
        made_room = len(preempted)
        budget, prefill_slots = self._schedule_running(
            speculate,
            self.config.max_num_batched_tokens,
            self.config.max_num_prefill_seqs,
            scheduled,
            preempted,
            swap_out,
        )
        if len(preempted) == made_room:  # waiting requests only while no running one gave way
            self._schedule_waiting(budget, prefill_slots, scheduled, swap_in)
        out = SchedulerOutput(
            scheduled,
            finished_req_ids=self._finished_req_ids,
            preempted_req_ids=preempted,
            page_copies=self.kv.take_pending_copies(),
            swap_out=swap_out,
            swap_in=swap_in,
        )
        self._finished_req_ids = set()
        return out

    def _schedule_running(
        self,
        speculate: bool,
        budget: int,
        prefill_slots: int,
        scheduled: list[tuple[Request, int]],
        preempted: set[str],
        swap_out: list[tuple[int, int]],
    ) -> tuple[int, int]:
        """Give running requests, oldest first, the tokens they still need (and their drafts,
        when `speculate`); the newest gives way when pages run out. Returns the token budget and
        prompt slots left."""
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            remaining = request.num_tokens - request.num_computed_tokens
            num_new = min(remaining + (len(request.spec_token_ids) if speculate else 0), budget)
            if num_new == 0 or (remaining > 1 and prefill_slots == 0):
                i += 1  # nothing to compute (a beam waiting for its token) / no prompt slot left
                continue
            if remaining > 1:
                prefill_slots -= 1
            if not self._allocate_or_preempt(request, num_new, preempted, swap_out):
                break
            scheduled.append((request, num_new))
            budget -= num_new
            i += 1
        return budget, prefill_slots

    def _preempt_for_waiting(self, preempted: set[str], swap_out: list[tuple[int, int]]) -> None:
        """Under the priority policy: while the most urgent waiting request outranks the least
        urgent running one and lacks a sequence slot or the pages of its next chunk, preempt
        that running one (it waits behind the request it gave way to)."""
        while self.waiting and self.running:
            head = self.waiting.peek()
            if head.status.finished:  # aborted while waiting
                self.waiting.pop()
                continue
            victim = self.running[-1]
            if urgency(victim) <= urgency(head):
                return
            chunk = min(head.num_tokens - head.num_computed_tokens, self.config.max_num_batched_tokens)
            if len(self.running) < self.config.max_num_seqs and self.kv.num_free_pages >= self.kv.pages_needed(chunk):
                return
            self._preempt(victim, preempted, swap_out)

    def _allocate_or_preempt(
        self, request: Request, num_new: int, preempted: set[str], swap_out: list[tuple[int, int]]
    ) -> bool:
        """Pages for `num_new` more tokens of a running request, preempting the newest running
        requests until they fit. False if `request` itself had to be preempted."""
        while not self.kv.allocate_slots(request, num_new):
            victim = self.running[-1]
            self._preempt(victim, preempted, swap_out)
            if victim is request:
                break
        return request.status is not RequestStatus.PREEMPTED

    def _schedule_waiting(
        self, budget: int, prefill_slots: int, scheduled: list[tuple[Request, int]], swap_in: list[tuple[int, int]]
    ) -> None:
        """Admit waiting requests first-come-first-served while sequences, prompt slots, pages
        and tokens allow. A request whose LoRA adapter would be one more than `max_loras` among
        the running ones is passed over (it keeps its place) for those behind it."""
        adapters = {r.lora_int_id for r in self.running} - {0} if self.config.max_loras else set()
        passed_over = []
        while self.waiting and budget > 0 and prefill_slots > 0:
            request = self.waiting.peek()
            if request.status.finished:  # aborted while waiting
                self.waiting.pop()
                continue
            if len(self.running) >= self.config.max_num_seqs:
                break
            if request.lora is not None and request.lora_int_id not in adapters:
                if len(adapters) >= self.config.max_loras:
                    passed_over.append(self.waiting.pop())
                    continue
                adapters.add(request.lora_int_id)
            if not self.config.chunked_prefill and request.num_tokens - request.num_computed_tokens > budget:
                break  # an encoder's prompt runs whole (its tokens attend to every other)
            num_new = self._admit_pages(request, budget, swap_in)
            if num_new is None:
                break
            self.waiting.pop()
            if request.status is RequestStatus.WAITING:
                request.scheduled_time = time.monotonic()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            if num_new == 0:  # swapped back in with nothing to compute (a beam awaiting its token)
                continue
            scheduled.append((request, num_new))
            budget -= num_new
            if num_new > 1:
                prefill_slots -= 1
        for request in reversed(passed_over):
            self.waiting.push_front(request)

    def _admit_pages(self, request: Request, budget: int, swap_in: list[tuple[int, int]]) -> int | None:
        """The pages of a waiting request's next tokens (up to `budget`): copied back from the
        host if it was swapped out, else its cached prefix plus new ones. Returns how many tokens
        it computes, or None where the pool lacks the pages."""
        if request.swap_slots:  # swapped out: its pages come back from the host
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            pairs = self.kv.swap_in(request, num_new)
            if pairs is None:
                return None
            swap_in += pairs
            return num_new
        # Prompt logprobs come from computing the prompt: no cached prefix for them.
        computed = [] if request.prompt_logprobs is not None else self.kv.get_computed_pages(request)
        num_cached = len(computed[0]) * self.kv.page_size if computed else 0
        num_new = min(request.num_tokens - num_cached, budget)
        if not self.kv.allocate_slots(request, num_new, computed):
            return None
        request.num_computed_tokens = num_cached
        if request.status is RequestStatus.WAITING:
            request.num_cached_tokens = num_cached
        return num_new

    def schedule_ahead(self, in_flight: SchedulerOutput) -> SchedulerOutput | None:
        """Async scheduling's next step, planned while `in_flight` runs (core/schedule_ahead.py)."""
        return schedule_ahead(self, in_flight)

    # ----- the outcome -----
    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> EngineCoreOutputs:
        """Advance every scheduled request by its computed tokens, append its sampled token,
        finish the requests that hit a stop condition, and report what each got."""
        outputs: list[EngineCoreOutput] = []
        num_prompt_tokens = num_generated = num_drafts = num_accepted = 0
        ends = np.cumsum(runner_output.num_sampled)
        for i, (request, num_new) in enumerate(scheduler_output.scheduled):
            if request.status is not RequestStatus.RUNNING:
                continue
            num_prompt_tokens += max(0, min(num_new, request.num_prompt_tokens - request.num_computed_tokens))
            drafted = self._advance_computed(request, num_new, runner_output)
            if request.pooling_params is not None:
                request.pooled = self.pooler.merge(request.pooled, runner_output.pooled[i])
                if request.num_computed_tokens == request.num_tokens:
                    outputs.append(self._finish_pooled(request))
                continue
            num_sampled = int(runner_output.num_sampled[i])
            if num_sampled == 0:  # mid-prompt: no token yet
                self.kv.cache_full_pages(request)
                continue
            rows = range(ends[i] - num_sampled, ends[i])
            num_drafts += drafted
            num_accepted += num_sampled - 1
            top = self._top_logprobs(request, runner_output, rows)
            if not request.append_sampled_tokens:
                num_generated += 1
                self.kv.cache_full_pages(request)
                outputs.append(EngineCoreOutput(request.request_id, [], top_logprobs=top))
                continue
            output = self._append_sampled(request, runner_output, rows, drafted, top)
            num_generated += len(output.new_token_ids)
            outputs.append(output)
        return EngineCoreOutputs(outputs, num_prompt_tokens, num_generated, num_drafts, num_accepted, time.monotonic())

    def _advance_computed(self, request: Request, num_new: int, runner_output: ModelRunnerOutput) -> int:
        """Count a request's `num_new` scheduled tokens as computed, except its drafts (settled
        once verified, in `_append_sampled`), drop its drafts and keep its chunk of prompt
        logprobs. Returns how many drafts it had scheduled."""
        drafted = max(0, request.num_computed_tokens + num_new - request.num_tokens)
        request.num_computed_tokens += num_new - drafted
        request.spec_token_ids = []
        chunk = runner_output.prompt_logprobs.get(request.request_id)
        if chunk is not None:
            request.prompt_logprobs.append(chunk)
            request.num_prompt_logprobs += len(chunk[0])
        return drafted

    def _finish_pooled(self, request: Request) -> EngineCoreOutput:
        """End a pooling request whose prompt is computed, with its pooled state."""
        self.running.remove(request)
        self._free_request(request, RequestStatus.FINISHED_STOPPED)
        pooled = self.pooler.finish(request.pooled, request.num_tokens)
        return EngineCoreOutput(
            request.request_id, [], finish_reason="stop", scheduled_time=request.scheduled_time, pooled=pooled
        )

    @staticmethod
    def _top_logprobs(
        request: Request, runner_output: ModelRunnerOutput, rows: range
    ) -> list[tuple[list[int], list[float]]] | None:
        """Per sampled row, the (token ids, logprobs) of the request's `logprobs` best, if asked."""
        k = request.sampling_params.logprobs
        if k is None:
            return None
        return [(runner_output.top_token_ids[r, :k].tolist(), runner_output.top_logprobs[r, :k].tolist()) for r in rows]

    def _append_sampled(
        self,
        request: Request,
        runner_output: ModelRunnerOutput,
        rows: range,
        drafted: int,
        top: list[tuple[list[int], list[float]]] | None,
    ) -> EngineCoreOutput:
        """Append a request's sampled tokens up to its first stop, settle its pages, finish it
        if it stopped, and report what it got."""
        prompt_logprobs = None
        if request.prompt_logprobs is not None and not request.output_token_ids:
            prompt_logprobs = tuple(np.concatenate(c) for c in zip(*request.prompt_logprobs))
        tokens, logprobs, status = self._append_tokens(request, runner_output, rows)
        if drafted:  # the accepted drafts' KV stays
            request.num_computed_tokens = request.num_tokens - 1
        if len(request.page_ids) > self.kv.pages_needed(request.num_tokens):
            self.kv.trim(request, request.num_tokens)  # pages held for drafts go back
        self.kv.cache_full_pages(request)
        if status is not None:
            self.running.remove(request)
            self._free_request(request, status)
        return EngineCoreOutput(
            request.request_id,
            tokens,
            logprobs,
            top[: len(tokens)] if top else None,
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
            num_cached_tokens=request.num_cached_tokens,
            scheduled_time=request.scheduled_time,
            prompt_logprobs=prompt_logprobs,
        )

    def _append_tokens(
        self, request: Request, runner_output: ModelRunnerOutput, rows: range
    ) -> tuple[list[int], list[float], RequestStatus | None]:
        """Append the tokens sampled in `rows` (feeding its grammar) until one stops the request.
        Returns the tokens appended, their logprobs and the status it ends with (None: goes on)."""
        tokens, logprobs, status = [], [], None
        for r in rows:
            tokens.append(int(runner_output.sampled_token_ids[r]))
            logprobs.append(float(runner_output.logprobs[r]))
            request.append_output_token(tokens[-1], logprobs[-1])
            if request.grammar is not None and not request.grammar.consume(tokens[-1]):
                # The step masks what the grammar forbids: this is a bug, not the client's doing.
                logger.error(
                    "request %s sampled token %d, which its grammar does not allow", request.request_id, tokens[-1]
                )
                return tokens, logprobs, RequestStatus.FINISHED_ERROR
            status = request.stop_status(self.config.max_model_len)
            if status is not None:
                break
        return tokens, logprobs, status

    def fail_step(self, scheduler_output: SchedulerOutput, cache_lost: bool) -> EngineCoreOutputs:
        """The step of `scheduler_output` failed: end its requests with FINISHED_ERROR. With
        `cache_lost` (the KV pages were reallocated) every other running request is preempted
        to be recomputed, and the prefix cache forgets its pages. Requests swapped out by this
        step are recomputed too: their copies may never have been made."""
        failed = [r for r, _ in scheduler_output.scheduled if r.status is RequestStatus.RUNNING]
        for request in failed:
            self.running.remove(request)
            self._free_request(request, RequestStatus.FINISHED_ERROR)
        for request_id in scheduler_output.preempted_req_ids:
            request = self.requests.get(request_id)
            if request is not None and request.swap_slots:
                self.kv.free_swap(request)
                request.num_computed_tokens = 0
        if cache_lost:
            for request in reversed(self.running):
                self.kv.free(request)
                request.num_computed_tokens = 0
                request.status = RequestStatus.PREEMPTED
                self._finished_req_ids.add(request.request_id)  # the runner drops its row
                self.waiting.push_front(request)
            self.running = []
            self.kv.reset_prefix_cache()
        outputs = [EngineCoreOutput(r.request_id, [], finish_reason=r.finish_reason) for r in failed]
        return EngineCoreOutputs(outputs, timestamp=time.monotonic())
