"""The scheduler's waiting queue under its policy (vLLM's `--scheduling-policy`).

    fcfs      first come, first served; a preempted request goes back to the front
    priority  the lowest `Request.priority` first, then the earliest arrival (a preempted request
              keeps its place by that order)

A request aborted while it waits stays in the queue, finished, until it reaches the front (an
abort is O(1), not a search of the queue).
"""

from __future__ import annotations

import collections
import heapq
import itertools

from jaxllm.core.request import Request

SCHEDULING_POLICIES = ("fcfs", "priority")


def urgency(request: Request) -> tuple[int, float]:
    """The priority policy's order: lower first."""
    return request.priority, request.arrival_time


class RequestQueue:
    def __init__(self, policy: str = "fcfs"):
        if policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {policy!r}")
        self.policy = policy
        self._fifo: collections.deque[Request] = collections.deque()
        self._heap: list[tuple[int, float, int, Request]] = []
        self._ties = itertools.count()  # equal (priority, arrival): the order they came in

    def push(self, request: Request) -> None:
        """A new request: at the back (fcfs), or in its place by (priority, arrival)."""
        if self.policy == "fcfs":
            self._fifo.append(request)
        else:
            heapq.heappush(self._heap, (*urgency(request), next(self._ties), request))

    def push_front(self, request: Request) -> None:
        """A preempted request, to resume first (fcfs) or in its place (priority)."""
        if self.policy == "fcfs":
            self._fifo.appendleft(request)
        else:
            self.push(request)

    def peek(self) -> Request:
        return self._fifo[0] if self.policy == "fcfs" else self._heap[0][-1]

    def pop(self) -> Request:
        return self._fifo.popleft() if self.policy == "fcfs" else heapq.heappop(self._heap)[-1]

    def __iter__(self):
        """The requests in the order they would run."""
        return iter(self._fifo) if self.policy == "fcfs" else (entry[-1] for entry in sorted(self._heap))

    def __len__(self) -> int:
        return len(self._fifo) if self.policy == "fcfs" else len(self._heap)
