"""Scheduler: which tokens of which requests run this step (vLLM v1 style).

There is no prefill phase and no decode phase. Each step, every running request is given
the tokens it still needs (`num_tokens - num_computed_tokens`: one for a decode, a chunk of
the prompt otherwise) under the token budget `max_num_batched_tokens`; then waiting requests
are admitted first-come-first-served while sequences (`max_num_seqs`), prompt chunks
(`max_num_prefill_seqs`), pages and tokens allow. Long prompts are split across steps
(chunked prefill). When the pool runs out of pages, the newest running request is preempted:
its pages are freed, its tokens kept, and it is recomputed when it is admitted again.
"""

from __future__ import annotations

import collections
import dataclasses
import time

from jaxllm.config import SchedulerConfig
from jaxllm.core.kv_cache_manager import KVCacheManager
from jaxllm.core.request import Request, RequestStatus


@dataclasses.dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[tuple[Request, int]]   # (request, num_new_tokens), decodes and chunks mixed
    num_preempted: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager):
        self.config = config
        self.kv = kv_cache_manager
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        prefill_slots = self.config.max_num_prefill_seqs
        scheduled: list[tuple[Request, int]] = []
        preempted = 0

        # Running requests, oldest first; the newest gives way when pages run out.
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new > 1:
                if prefill_slots == 0:
                    i += 1
                    continue
                prefill_slots -= 1
            while not self.kv.allocate_slots(request, num_new):
                victim = self.running[-1]
                self._preempt(victim)
                preempted += 1
                if victim is request:
                    break
            if request.status is RequestStatus.PREEMPTED:
                break
            scheduled.append((request, num_new))
            budget -= num_new
            i += 1

        # Waiting requests, FCFS, while nothing had to be preempted this step.
        while self.waiting and budget > 0 and not preempted and prefill_slots > 0:
            if len(self.running) >= self.config.max_num_seqs:
                break
            request = self.waiting[0]
            computed = self.kv.get_computed_blocks(request)
            num_cached = len(computed) * self.kv.block_size
            num_new = min(request.num_tokens - num_cached, budget)
            if not self.kv.allocate_slots(request, num_new, computed):
                break
            self.waiting.popleft()
            request.num_computed_tokens = num_cached
            if request.status is RequestStatus.WAITING:
                request.num_cached_tokens = num_cached
                request.scheduled_time = time.monotonic()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append((request, num_new))
            budget -= num_new
            if num_new > 1:
                prefill_slots -= 1
        return SchedulerOutput(scheduled, preempted)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Mark finished (stop/length/abort) and free its pages, wherever it is."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = status
        self.kv.free(request)
