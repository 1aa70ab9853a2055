"""Async scheduling (EngineCore.step, Scheduler.schedule_ahead): the next decode step is
dispatched before the last one's tokens reach the host, its tokens read on the device. It must
give exactly the synchronous engine's outputs, free every page, survive aborts of requests in
flight, and step synchronously where a batch needs the host's view of every token."""

import pytest

from jaxllm import LLM, SamplingParams

from tests.helpers.tiny_model import TINY_ENGINE_ARGS

PROMPTS = ["Hello, my name is", "The capital of France is", "def fibonacci(n):" * 3, "Q: two plus two? A:"]


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    """(async, sync) LLMs on the tiny model; the async one counts the steps it dispatched ahead."""
    fast = LLM(tiny_model_dir, **TINY_ENGINE_ARGS)
    slow = LLM(tiny_model_dir, **{**TINY_ENGINE_ARGS, "async_scheduling": False})
    runner = fast.engine.runner
    real_dispatch = runner.dispatch
    runner.ahead_steps = 0

    def dispatch(scheduler_output, ahead=None, prev=None):
        runner.ahead_steps += ahead is not None
        return real_dispatch(scheduler_output, ahead, prev)

    runner.dispatch = dispatch
    assert fast.engine.engine_core.async_scheduling and not slow.engine.engine_core.async_scheduling
    return fast, slow


def outputs(llm, params, prompts=PROMPTS):
    return [
        (o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].logprobs)
        for o in llm.generate(prompts, params, use_tqdm=False)
    ]


def test_the_same_outputs_as_stepping_synchronously(engines):
    fast, slow = engines
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    ref = slow.generate(PROMPTS[2], greedy, use_tqdm=False)[0].outputs[0].token_ids
    first = next(i for i in range(1, 6) if ref[i] not in ref[:i])  # its first time there
    stop_at = ref[first]
    params = [
        SamplingParams(temperature=0, max_tokens=9, ignore_eos=True, logprobs=3),
        SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=17, ignore_eos=True),
        # Ends on a token the host learns a step late (the step ahead wastes its row). With
        # min_tokens at that token's index the ban has just lifted there, one more and it holds:
        # its count must include the token in flight.
        SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_at]),
        SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_at], min_tokens=first),
        SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_at], min_tokens=first + 1),
    ]
    prompts = PROMPTS[:2] + PROMPTS[2:3] * 3
    before = fast.engine.runner.ahead_steps
    got, want = outputs(fast, params, prompts), outputs(slow, params, prompts)
    assert got == want
    assert [w[1] for w in want[:4]] == ["length", "length", "stop", "stop"]
    assert len(want[2][0]) == len(want[3][0]) == first + 1 and want[4][0][first] != stop_at
    assert fast.engine.runner.ahead_steps - before >= 5
    assert fast.engine.kv_cache_manager.num_used_pages == 0


def test_an_abort_while_its_step_is_in_flight(engines):
    fast, slow = engines
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = slow.generate(PROMPTS[1], params, use_tqdm=False)[0].outputs[0].token_ids
    engine = fast.engine
    engine.add_request("kept", PROMPTS[1], params)
    engine.add_request("dropped", PROMPTS[2], params)
    for _ in range(3):
        engine.step()
    assert engine.engine_core._ahead is not None  # the next step is in flight
    engine.abort_request("dropped")
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    assert finished == {"kept": want}
    assert engine.kv_cache_manager.num_used_pages == 0


def test_penalties_step_synchronously(engines):
    """Penalties count every token on the host: a batch with them never runs ahead."""
    fast, slow = engines
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, repetition_penalty=1.3)
    before = fast.engine.runner.ahead_steps
    assert outputs(fast, params) == outputs(slow, params)
    assert fast.engine.runner.ahead_steps == before
