"""The scheduler on the host alone: no model, no JAX step. A fake runner output stands in for
the model (a token for every request whose scheduled tokens reach its end)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxllm.core.outputs import ModelRunnerOutput
from jaxllm.core.request import RequestStatus
from jaxllm.core.scheduler import Scheduler
from jaxllm.sampling_params import MAX_LOGPROBS
from jaxllm.spec_decode.proposer import Proposer

from tests.helpers.scheduler_steps import EOS, make_request, make_scheduler, step


def scheduled(out) -> dict[str, int]:
    return {r.request_id: n for r, n in out.scheduled}


def run_to_end(scheduler, max_steps=500):
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return
        step(scheduler)
    raise AssertionError("requests did not finish")


# ----- admission, budgets, chunked prefill -----


def test_admission_fills_the_token_budget_fcfs_and_chunks_the_rest():
    s = make_scheduler(budget=16)
    for i in range(3):
        s.add_request(make_request(f"r{i}", 10, first_token=100 * i))
    out, _ = step(s)
    assert scheduled(out) == {"r0": 10, "r1": 6}  # r1's prompt is chunked, r2 waits
    assert out.num_scheduled_tokens == 16
    out, _ = step(s)
    # r0 decodes (1), r1 finishes its prompt (4), r2's whole prompt fits in the 11 left
    assert scheduled(out) == {"r0": 1, "r1": 4, "r2": 10}
    assert [r.request_id for r in s.running] == ["r0", "r1", "r2"]


def test_chunked_prefill_samples_only_after_the_last_chunk():
    s = make_scheduler(budget=16)
    s.add_request(make_request("long", 40, max_tokens=3))
    chunks, tokens = [], []
    while s.has_unfinished_requests():
        out, core = step(s)
        chunks.append(scheduled(out)["long"])
        tokens.append([o.new_token_ids for o in core.outputs])
    assert chunks == [16, 16, 8, 1, 1]
    assert tokens == [
        [],
        [],
        [[next_token_at("long", 40)]],
        [[next_token_at("long", 41)]],
        [[next_token_at("long", 42)]],
    ]


def next_token_at(request_id: str, num_tokens: int) -> int:
    return 10 + (sum(map(ord, request_id)) * 7 + num_tokens * 13) % 50


def test_max_num_seqs_and_prompt_slots_bound_a_step():
    s = make_scheduler(budget=100, max_num_seqs=3, max_prefill=2)
    for i in range(5):
        s.add_request(make_request(f"r{i}", 5, first_token=100 * i))
    out, _ = step(s)
    assert list(scheduled(out)) == ["r0", "r1"]  # two prompt slots
    out, _ = step(s)
    assert scheduled(out) == {"r0": 1, "r1": 1, "r2": 5}  # three sequences at most
    assert s.num_running == 3 and s.num_waiting == 2


# ----- stop conditions -----


@pytest.mark.parametrize(
    "params, forced, reason, stop_reason, num_out",
    [
        (dict(ignore_eos=False), {1: EOS}, "stop", None, 2),  # EOS ends it
        (dict(ignore_eos=True), {1: EOS}, "length", None, 4),  # unless ignored
        (dict(stop_token_ids=[77]), {2: 77}, "stop", 77, 3),  # a stop token id
        (dict(ignore_eos=False, min_tokens=3), {0: EOS, 1: EOS}, "length", None, 4),  # EOS held back by min_tokens
        (dict(ignore_eos=False, min_tokens=2), {0: EOS, 1: EOS}, "stop", None, 2),  # ... until min_tokens
        (dict(), {}, "length", None, 4),  # max_tokens
    ],
)
def test_stop_conditions(params, forced, reason, stop_reason, num_out):
    s = make_scheduler()
    s.add_request(make_request("r", 5, max_tokens=4, **params))
    outputs = []
    while s.has_unfinished_requests():
        n = len(outputs)
        _, core = step(s, {"r": forced.get(n)})
        outputs += core.outputs
    assert len(outputs) == num_out
    assert [o.finish_reason for o in outputs] == [None] * (num_out - 1) + [reason]
    assert outputs[-1].stop_reason == stop_reason
    assert s.kv.num_used_pages == 0


def test_max_model_len_ends_a_request():
    s = make_scheduler(max_model_len=12)
    s.add_request(make_request("r", 9, max_tokens=100))
    outputs = []
    while s.has_unfinished_requests():
        outputs += step(s)[1].outputs
    assert len(outputs) == 3 and outputs[-1].finish_reason == "length"  # 9 + 3 = max_model_len


# ----- preemption -----


def test_preemption_takes_the_newest_and_resumes_it_by_recompute():
    # 8 pages of 4 tokens: two requests of 12 prompt tokens (3 pages each) growing by 8.
    s = make_scheduler(num_pages=8, page_size=4, budget=64, prefix_caching=False)
    s.add_request(make_request("old", 12, max_tokens=8, first_token=100))
    s.add_request(make_request("new", 12, max_tokens=8, first_token=300))
    step(s)
    preempted_at = None
    for i in range(40):
        out, _ = step(s)
        if out.preempted_req_ids:
            assert out.preempted_req_ids == {"new"}
            preempted_at = i
            new = next(r for r in s.waiting if r.request_id == "new")
            assert new.status is RequestStatus.PREEMPTED and new.num_computed_tokens == 0 and not new.page_ids
            assert s.waiting.peek() is new  # resumes first
            break
    assert preempted_at is not None
    run_to_end(s)
    assert s.kv.num_used_pages == 0 and s.num_preemptions >= 1


def test_preempted_request_gets_the_same_tokens_as_an_unpreempted_run():
    def tokens_of(num_pages):
        s = make_scheduler(num_pages=num_pages, page_size=4, budget=64)
        requests = [make_request(f"r{i}", 10 + 3 * i, max_tokens=10, first_token=100 * i) for i in range(3)]
        for r in requests:
            s.add_request(r)
        run_to_end(s)
        return [r.output_token_ids for r in requests], s.num_preemptions

    roomy, n0 = tokens_of(64)
    tight, n1 = tokens_of(12)
    assert n0 == 0 and n1 > 0
    assert tight == roomy


def test_swap_preemption_saves_pages_and_restores_them_in_place_of_recompute():
    s = make_scheduler(num_pages=8, page_size=4, budget=64, swap_pages=16, prefix_caching=False)
    s.add_request(make_request("old", 12, max_tokens=8, first_token=100))
    s.add_request(make_request("new", 12, max_tokens=8, first_token=300))
    step(s)
    new = s.requests["new"]
    for _ in range(40):
        pages_before = list(new.page_ids)
        computed_before = new.num_computed_tokens
        out, _ = step(s)
        if out.preempted_req_ids:
            break
    assert out.preempted_req_ids == {"new"}
    assert out.swap_out == list(zip(pages_before, new.swap_slots))
    assert new.num_computed_tokens == computed_before and not new.page_ids  # kept: nothing to recompute
    slots = list(new.swap_slots)
    while True:
        out, _ = step(s)
        if out.swap_in:
            break
    assert [slot for slot, _ in out.swap_in] == slots
    assert [page for _, page in out.swap_in] == new.page_ids[: len(slots)]
    assert scheduled(out)["new"] == 1  # resumes with a decode, not a recompute
    run_to_end(s)
    assert s.kv.num_used_pages == 0 and len(s.kv.free_swap_slots) == 16


# ----- prefix cache, aborts, fairness -----


def test_prefix_cache_hit_skips_the_cached_pages():
    s = make_scheduler(page_size=4)
    s.add_request(make_request("a", 14))
    run_to_end(s)
    s.add_request(make_request("b", 14))
    out, _ = step(s)
    assert scheduled(out) == {"b": 2}  # 3 full pages cached; the last prompt tokens recomputed
    assert s.requests["b"].num_cached_tokens == 12


@pytest.mark.parametrize("state", ["waiting", "running", "mid_prompt", "preempted", "swapped"])
def test_abort_in_every_state_frees_everything(state):
    swap = state == "swapped"
    s = make_scheduler(
        num_pages=8,
        page_size=4,
        budget=16 if state == "mid_prompt" else 64,
        max_num_seqs=2,
        swap_pages=16 if swap else 0,
        prefix_caching=False,
    )
    s.add_request(make_request("a", 12, max_tokens=8, first_token=100))
    s.add_request(make_request("b", 12, max_tokens=8, first_token=300))
    target = "b"
    if state == "waiting":
        s.add_request(make_request("c", 4, first_token=500))
        step(s)
        target = "c"
        assert s.requests["c"].status is RequestStatus.WAITING
    elif state in ("running", "mid_prompt"):
        step(s)
        assert s.requests["b"].status is RequestStatus.RUNNING
        if state == "mid_prompt":
            assert 0 < s.requests["b"].num_computed_tokens < 12
    else:
        for _ in range(40):
            out, _ = step(s)
            if out.preempted_req_ids:
                break
        assert s.requests["b"].status is RequestStatus.PREEMPTED
        assert bool(s.requests["b"].swap_slots) == swap
    s.finish_requests(target, RequestStatus.FINISHED_ABORTED)
    assert target not in s.requests
    out, _ = step(s)
    assert target in out.finished_req_ids and target not in scheduled(out)
    run_to_end(s)
    assert s.kv.num_used_pages == 0 and len(s.kv.free_swap_slots) == s.kv.num_swap_pages


def test_admission_is_first_come_first_served():
    s = make_scheduler(budget=8, max_prefill=1)
    order = [f"r{i}" for i in range(6)]
    for i, rid in enumerate(order):
        s.add_request(make_request(rid, 6, max_tokens=2, first_token=100 * i))
    admitted = []
    while s.has_unfinished_requests():
        out, _ = step(s)
        admitted += [r.request_id for r, n in out.scheduled if r.request_id not in admitted]
    assert admitted == order


@settings(max_examples=50, deadline=None)
@given(priorities=st.lists(st.integers(-3, 3), min_size=1, max_size=12))
def test_priority_admits_the_lowest_priority_first_then_arrival(priorities):
    s = make_scheduler(budget=8, max_prefill=1, policy="priority")
    for i, priority in enumerate(priorities):
        request = make_request(f"r{i}", 6, max_tokens=2, first_token=100 * i)
        request.priority, request.arrival_time = priority, float(i)
        s.add_request(request)
    admitted = []
    while s.has_unfinished_requests():
        out, _ = step(s)
        admitted += [r.request_id for r, n in out.scheduled if r.request_id not in admitted]
    assert admitted == [f"r{i}" for i in sorted(range(len(priorities)), key=lambda i: (priorities[i], i))]


def test_an_urgent_waiting_request_preempts_the_least_urgent_running_one():
    """Two running requests fill max_num_seqs; a more urgent one arrives: the least urgent gives
    way at once (its pages freed), the urgent one runs in that very step, and the preempted one
    resumes after it and still gets all its tokens."""
    s = make_scheduler(max_num_seqs=2, policy="priority")
    for rid, priority, when in [("low", 5, 0.0), ("mid", 3, 1.0)]:
        request = make_request(rid, 6, max_tokens=6, first_token=100 + int(when) * 50)
        request.priority, request.arrival_time = priority, when
        s.add_request(request)
    step(s)
    step(s)
    urgent = make_request("urgent", 6, max_tokens=3, first_token=400)
    urgent.priority, urgent.arrival_time = 0, 2.0
    s.add_request(urgent)
    out, _ = step(s)
    assert out.preempted_req_ids == {"low"}
    assert {r.request_id for r, _ in out.scheduled} == {"mid", "urgent"}
    assert not s.requests["low"].page_ids and s.requests["low"].status is RequestStatus.PREEMPTED
    low, finished = s.requests["low"], set()
    while s.has_unfinished_requests():
        _, core = step(s)
        finished |= {o.request_id for o in core.outputs if o.finish_reason}
    assert finished == {"low", "mid", "urgent"} and kv_empty(s)
    assert len(low.output_token_ids) == 6 and low.finish_reason == "length"
    # Under FCFS the newcomer waits: nothing is preempted for it.
    fcfs = make_scheduler(max_num_seqs=2)
    for rid in ("a", "b"):
        fcfs.add_request(make_request(rid, 6, max_tokens=6))
    step(fcfs)
    fcfs.add_request(make_request("c", 6, max_tokens=3))
    out, _ = step(fcfs)
    assert not out.preempted_req_ids and "c" not in {r.request_id for r, _ in out.scheduled}


# ----- invariants under random traffic -----

OPS = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 40), st.integers(1, 24), st.booleans(), st.integers(0, 3)),
        st.tuples(st.just("abort"), st.integers(0, 30)),
        st.tuples(st.just("step"), st.integers(1, 3)),
    ),
    min_size=1,
    max_size=40,
)


def check_invariants(s: Scheduler, out=None):
    kv = s.kv
    live = list(s.requests.values())
    holders: dict[int, int] = {}
    for r in live:
        for b in r.page_ids:
            holders[b] = holders.get(b, 0) + 1
    for page in kv.groups[0].pages:  # no page leaked or double-freed
        assert page.ref_cnt == holders.get(page.page_id, 0)
        assert (page.page_id in kv.groups[0].free_pages) == (page.ref_cnt == 0)
    swapped = [slot for r in live for slot in r.swap_slots]
    assert len(swapped) == len(set(swapped)) and not set(swapped) & set(kv.free_swap_slots)
    assert len(swapped) + len(kv.free_swap_slots) == kv.num_swap_pages
    assert all(r.status is RequestStatus.RUNNING for r in s.running)
    if out is not None:  # budgets
        assert out.num_scheduled_tokens <= s.config.max_num_batched_tokens
        assert len(out.scheduled) <= s.config.max_num_seqs
        assert sum(n > 1 for _, n in out.scheduled) <= s.config.max_num_prefill_seqs
        assert len({r.request_id for r, _ in out.scheduled}) == len(out.scheduled)


@settings(max_examples=100, deadline=None)
@given(ops=OPS, swap=st.booleans(), prefix_caching=st.booleans(), policy=st.sampled_from(["fcfs", "priority"]))
def test_random_traffic_keeps_the_invariants(ops, swap, prefix_caching, policy):
    """Under either policy (random priorities under "priority"): no page leaked or shared
    wrongly, the budgets held, and every request finishes (none starves)."""
    # 16 pages hold any one request (at most 40 + 24 tokens = 16 pages), not many at once.
    s = make_scheduler(
        num_pages=16,
        page_size=4,
        budget=24,
        max_num_seqs=6,
        max_prefill=3,
        max_model_len=64,
        swap_pages=12 if swap else 0,
        prefix_caching=prefix_caching,
        policy=policy,
    )
    added, finished = [], {}
    for op in ops:
        if op[0] == "add":
            _, prompt_len, max_tokens, shared, priority = op
            rid = f"r{len(added)}"
            # Half the prompts share a prefix, so the prefix cache and its ref counts get exercised.
            request = make_request(
                rid, prompt_len, max_tokens=max_tokens, first_token=100 if shared else 1000 + 64 * len(added)
            )
            request.priority = priority if policy == "priority" else 0
            s.add_request(request)
            added.append(rid)
        elif op[0] == "abort" and added:
            rid = added[op[1] % len(added)]
            if rid in s.requests:
                s.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
                finished[rid] = "abort"
        else:
            for _ in range(op[1]):
                out, core = step(s)
                check_invariants(s, out)
                finished.update({o.request_id: o.finish_reason for o in core.outputs if o.finish_reason})
        check_invariants(s)
    for _ in range(1000):  # every request finishes or was aborted
        if not s.has_unfinished_requests():
            break
        out, core = step(s)
        check_invariants(s, out)
        finished.update({o.request_id: o.finish_reason for o in core.outputs if o.finish_reason})
    assert not s.has_unfinished_requests()
    assert set(finished) == set(added)
    assert kv_empty(s)


def kv_empty(s: Scheduler) -> bool:
    return s.kv.num_used_pages == 0 and len(s.kv.free_swap_slots) == s.kv.num_swap_pages


def test_beam_like_request_swapped_back_in_is_not_scheduled_without_tokens():
    """A request whose tokens are all computed (a beam waiting for the token its search picks)
    comes back from the host but is not scheduled with 0 tokens."""
    s = make_scheduler(num_pages=8, page_size=4, budget=64, swap_pages=16, prefix_caching=False)
    beam = make_request("beam", 12)
    beam.append_sampled_tokens = False
    s.add_request(beam)
    step(s)
    assert beam.num_computed_tokens == beam.num_tokens == 12
    swap_out = []
    s._preempt(beam, set(), swap_out)  # as if a newer request had needed its pages
    assert len(swap_out) == len(beam.swap_slots) == 3
    out = s.schedule()
    assert out.swap_in and not out.scheduled and beam.status is RequestStatus.RUNNING
    beam.append_output_token(42, -0.1)  # the search appends its choice: now it has work
    out = s.schedule()
    assert scheduled(out) == {"beam": 1}


# ----- speculative decoding -----


class FixedDrafts(Proposer):
    num_speculative_tokens = 3

    def propose(self, tokens, room):
        return [7, 8, 9][:room]


def runner_output(tokens: list[list[int]]) -> ModelRunnerOutput:
    flat = [t for ts in tokens for t in ts]
    n = len(flat)
    return ModelRunnerOutput(
        np.asarray(flat, np.int32),
        np.full(n, -0.5, np.float32),
        np.zeros((n, MAX_LOGPROBS), np.float32),
        np.zeros((n, MAX_LOGPROBS), np.int32),
        np.asarray([len(ts) for ts in tokens]),
    )


def test_speculation_schedules_drafts_and_gives_back_rejected_pages():
    s = make_scheduler(page_size=4)
    s.proposer, s.max_spec_seqs = FixedDrafts(), 8
    r = make_request("a", 6, max_tokens=20)
    s.add_request(r)
    out = s.schedule()
    assert scheduled(out) == {"a": 6} and r.spec_token_ids == []  # no drafts for a prompt
    s.update_from_output(out, runner_output([[4]]))
    out = s.schedule()  # decoding: newest token + 3 drafts
    assert scheduled(out) == {"a": 4} and r.spec_token_ids == [7, 8, 9] and len(r.page_ids) == 3
    core = s.update_from_output(out, runner_output([[5]]))  # every draft rejected
    assert core.outputs[0].new_token_ids == [5] and (core.num_draft_tokens, core.num_accepted_tokens) == (3, 0)
    assert r.output_token_ids == [4, 5] and r.num_computed_tokens == r.num_tokens - 1 == 7
    assert len(r.page_ids) == 2 and s.kv.num_used_pages == 2  # the drafts' third page is back
    out = s.schedule()
    core = s.update_from_output(out, runner_output([[7, 8, 1]]))  # two accepted, then a correction
    assert core.outputs[0].new_token_ids == [7, 8, 1] and core.num_accepted_tokens == 2
    assert r.num_computed_tokens == r.num_tokens - 1 == 10
    # A waiting request: no drafts while it waits to be admitted.
    s.add_request(make_request("b", 3))
    assert scheduled(s.schedule())["a"] == 1


def test_speculation_stops_at_max_tokens_and_stop_tokens():
    s = make_scheduler(page_size=4)
    s.proposer, s.max_spec_seqs = FixedDrafts(), 8
    r = make_request("a", 5, max_tokens=3, stop_token_ids=[8])
    s.add_request(r)
    s.update_from_output(s.schedule(), runner_output([[6]]))
    out = s.schedule()
    assert scheduled(out) == {"a": 2}  # room for one draft: max_tokens 3, one out, one more to come
    core = s.update_from_output(out, runner_output([[7, 9]]))
    assert r.output_token_ids == [6, 7, 9] and core.outputs[0].finish_reason == "length"
    r2 = make_request("b", 5, max_tokens=10, stop_token_ids=[8])
    s.add_request(r2)
    s.update_from_output(s.schedule(), runner_output([[6]]))
    core = s.update_from_output(s.schedule(), runner_output([[7, 8, 9, 3]]))
    assert r2.output_token_ids == [6, 7, 8] and core.outputs[0].finish_reason == "stop"
    assert s.kv.num_used_pages == 0
