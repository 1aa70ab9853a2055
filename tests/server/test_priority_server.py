"""Priority over HTTP with the official clients: on a server started with --scheduling-policy
priority that runs one sequence at a time (steps slowed by tests/helpers/fault_server.py), the
`priority` of a request from each route (chat and completions through `extra_body`, the
Responses API, Anthropic's Messages through the `anthropic` client's `extra_body`) reaches the
scheduler: of two requests waiting behind a running one, the one with the lower value runs
first although it arrived second, and answers as the offline engine does."""

from __future__ import annotations

import concurrent.futures
import time

import pytest

from jaxllm import SamplingParams
from tests.helpers.live_server import API_KEY, start_server

ASK = [{"role": "user", "content": "Name a colour."}]
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def priority_server(tiny_model_dir, tmp_path_factory):
    live = start_server(
        tiny_model_dir,
        str(tmp_path_factory.mktemp("priority")),
        *("--scheduling-policy", "priority", "--max-num-seqs", "1"),
        faults=["--step-delay", "0.05"],
    )
    yield live
    live.stop()


def _chat(live, priority: int) -> str:
    kwargs = dict(messages=ASK, max_tokens=3, temperature=0, extra_body={"priority": priority})
    return live.client.chat.completions.create(model=live.model, **kwargs).choices[0].message.content


def _completion(live, priority: int) -> str:
    kwargs = dict(prompt=PROMPT, max_tokens=3, temperature=0, extra_body={"priority": priority})
    return live.client.completions.create(model=live.model, **kwargs).choices[0].text


def _response(live, priority: int) -> str:
    kwargs = dict(input=ASK[0]["content"], max_output_tokens=3, temperature=0, extra_body={"priority": priority})
    return live.client.responses.create(model=live.model, **kwargs).output_text


def _message(live, priority: int) -> str:
    import anthropic

    client = anthropic.Anthropic(base_url=live.url, api_key=API_KEY, max_retries=0)
    kwargs = dict(messages=ASK, max_tokens=3, extra_body={"priority": priority, "temperature": 0})
    return client.messages.create(model=live.model, **kwargs).content[0].text


@pytest.mark.parametrize("send", [_chat, _completion, _response, _message], ids=lambda f: f.__name__[1:])
def test_the_lower_priority_value_runs_first(priority_server, server, send):
    """A streamed completion holds the one slot; `send`'s request with priority 10 queues behind
    it, then a completion with priority 5: when the slot frees, the completion runs first (had
    `send` dropped its priority, its 0 would have gone first, as it arrived first)."""
    live = priority_server
    blocker = live.client.completions.create(
        model=live.model, prompt=PROMPT, max_tokens=40, stream=True, extra_body={"ignore_eos": True}
    )
    finished = []

    def run(name: str, fn, priority: int) -> str:
        text = fn(live, priority)
        finished.append(name)
        return text

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        next(iter(blocker))  # (running)
        later = pool.submit(run, "sent", send, 10)
        time.sleep(0.3)  # (queued first)
        sooner = pool.submit(run, "completion", _completion, 5)
        assert sum(1 for _ in blocker) > 0
        assert later.result(timeout=120) and finished == ["completion", "sent"]
    want = server.offline.generate(PROMPT, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert sooner.result() == want[0].outputs[0].text
