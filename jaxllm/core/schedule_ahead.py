"""Async scheduling's plan (`Scheduler.schedule_ahead`): the next step, made while the step in
flight runs, before its tokens are known (engine/core.py dispatches it behind that step)."""

from __future__ import annotations

from jaxllm.core.outputs import SchedulerOutput
from jaxllm.core.request import RequestStatus


def schedule_ahead(scheduler, in_flight: SchedulerOutput) -> SchedulerOutput | None:
    """Async scheduling: the next step, planned while `in_flight` runs and before its results
    are known, or None where that is not simple. Each of its requests that samples a token
    there decodes that token next (the device reads it from the step in flight); a request
    its length stops there is left out, and one stopped by its token (EOS) wastes its row.
    Only when nothing waits, every running request is in `in_flight` and samples there, none
    needs a grammar, penalties, custom logits processors (`extra_args`), prompt logprobs or beams,
    and the pool has pages to spare."""
    if scheduler.proposer is not None or len(scheduler.requests) > len(scheduler.running):
        return None
    ids = {r.request_id for r, _ in in_flight.scheduled}
    if any(r.request_id not in ids for r in scheduler.running):
        return None
    ahead = []
    for request, num_new in in_flight.scheduled:
        if request.status is not RequestStatus.RUNNING:
            continue
        params = request.sampling_params
        if (
            request.num_computed_tokens + num_new != request.num_tokens
            or request.grammar is not None
            or params.uses_penalties
            or params.extra_args  # (custom logits processors update their state from each token)
            or request.prompt_logprobs is not None
            or not request.append_sampled_tokens
        ):
            return None
        if (
            len(request.output_token_ids) + 1 < params.max_tokens
            and request.num_tokens + 1 < scheduler.config.max_model_len
        ):
            ahead.append(request)
    if not ahead or scheduler.kv.num_free_pages < 2 * len(ahead):
        return None
    for request in ahead:  # one more token past the one in flight
        num_new = request.num_tokens - request.num_computed_tokens
        if not scheduler.kv.allocate_slots(request, num_new + 1):
            return None
    return SchedulerOutput(
        [(r, 1) for r in ahead],
        finished_req_ids=set(),
        preempted_req_ids=set(),
        page_copies=scheduler.kv.take_pending_copies(),
        swap_out=[],
        swap_in=[],
    )
