"""The server app in-process (httpx's ASGI transport, no sockets) over the tiny model's engine:
what a bug inside a route, a drain, a chunked oversize body and a dead engine look like to a
client, and what the server logs."""

from __future__ import annotations

import asyncio
import logging
import re

import httpx
import pytest

from jaxllm.engine.async_llm import AsyncLLM
from jaxllm.entrypoints.metrics import StatLogger
from jaxllm.entrypoints.openai import serving_tokenization
from jaxllm.entrypoints.openai.api_server import build_app
from jaxllm.entrypoints.openai.http_server import Shutdown
from jaxllm.entrypoints.openai.server_args import ServerArgs


@pytest.fixture
def app_over(llm):
    """(app, async_llm, shutdown) over the module's tiny engine; the AsyncLLM is shut down after."""
    made = []

    def make(**server_args):
        async_llm, shutdown = AsyncLLM(engine=llm.engine), Shutdown()
        made.append(async_llm)
        return build_app(async_llm, ServerArgs(**server_args), shutdown), async_llm, shutdown

    yield make
    for async_llm in made:
        async_llm.shutdown()


async def call(app, method: str, path: str, **kwargs) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app") as client:
        return await client.request(method, path, **kwargs)


def test_bug_in_a_route_is_a_500_with_the_request_id_only_logged_once(app_over, monkeypatch, caplog):
    def broken(self, request):
        raise RuntimeError("secret internals")

    monkeypatch.setattr(serving_tokenization.OpenAIServingTokenization, "tokenize", broken)
    app, _, _ = app_over()
    with caplog.at_level(logging.ERROR, logger="jaxllm.server"):
        response = asyncio.run(call(app, "POST", "/tokenize", json={"prompt": "hi"}))
    assert response.status_code == 500
    request_id = response.headers["x-request-id"]
    assert request_id in response.json()["error"]["message"]
    assert "secret" not in response.text
    records = [r for r in caplog.records if r.exc_info]
    assert len(records) == 1 and request_id in records[0].getMessage()
    assert "secret internals" in str(records[0].exc_info[1])


def test_draining_server_refuses_new_work_but_answers_probes(app_over):
    app, _, shutdown = app_over()
    shutdown.draining = True
    response = asyncio.run(call(app, "POST", "/v1/completions", json={"prompt": "hi"}))
    assert response.status_code == 503 and response.headers["retry-after"]
    assert asyncio.run(call(app, "GET", "/health")).status_code == 503
    assert asyncio.run(call(app, "GET", "/metrics")).status_code == 200


def test_chunked_body_past_the_limit_is_refused(app_over):
    app, _, _ = app_over(max_request_body_bytes=1000)

    async def chunks():
        for _ in range(10):
            yield b'{"prompt": "' + b"a" * 200

    response = asyncio.run(
        call(app, "POST", "/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
    )
    assert response.status_code == 413 and "1000 bytes" in response.json()["error"]["message"]


def test_dead_engine_fails_every_request_at_once(app_over, monkeypatch):
    app, async_llm, _ = app_over()
    died = []
    async_llm.on_dead = died.append

    def step():
        raise RuntimeError("the device is gone")

    monkeypatch.setattr(async_llm.engine, "step", step)
    body = {"prompt": "hi", "max_tokens": 4}

    async def scenario():
        first = await call(app, "POST", "/v1/completions", json=body)  # its step kills the engine
        streamed = await call(app, "POST", "/v1/completions", json={**body, "stream": True})
        return first, streamed, await call(app, "GET", "/health")

    first, streamed, health = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert first.status_code == 503 and "engine has stopped" in first.json()["error"]["message"]
    assert streamed.status_code == 503
    assert health.status_code == 503
    assert len(died) == 1 and "device is gone" in str(died[0])


def test_auto_tool_choice_needs_a_tool_call_parser(app_over):
    app, _, _ = app_over()  # no --enable-auto-tool-choice
    tool = {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {
                "type": "object",
                "properties": {"x": {"type": "boolean"}},
                "required": ["x"],
                "additionalProperties": False,
            },
        },
    }
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [tool], "max_tokens": 40}
    response = asyncio.run(call(app, "POST", "/v1/chat/completions", json=body))
    assert response.status_code == 400 and "--enable-auto-tool-choice" in response.json()["error"]["message"]
    # One call with one boolean: the grammar ends the answer within max_tokens whatever is sampled.
    forced = asyncio.run(
        call(
            app, "POST", "/v1/chat/completions", json={**body, "tool_choice": "required", "parallel_tool_calls": False}
        )
    )
    assert forced.status_code == 200 and forced.json()["choices"][0]["message"]["tool_calls"]
    with pytest.raises(ValueError, match="needs --tool-call-parser"):
        ServerArgs(enable_auto_tool_choice=True).verify()


def test_playground_page_is_served_without_the_key_unless_disabled(app_over):
    app, _, _ = app_over(api_key="k")
    page = asyncio.run(call(app, "GET", "/"))
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "/v1/chat/completions" in page.text and "<script" in page.text  # self-contained: no external URL
    assert "http://" not in page.text and "https://" not in page.text
    assert asyncio.run(call(app, "GET", "/v1/models")).status_code == 401  # the API still needs the key
    app, _, _ = app_over(disable_playground=True)
    assert asyncio.run(call(app, "GET", "/")).status_code == 404


def test_each_finished_request_is_one_log_line_and_stats_are_logged(app_over, caplog):
    app, async_llm, _ = app_over()
    stats = StatLogger(async_llm.engine, 10.0)
    with caplog.at_level(logging.INFO, logger="jaxllm.server"):
        stats.log()  # nothing happened yet: no line
        response = asyncio.run(
            call(app, "POST", "/v1/completions", json={"prompt": "Hello there", "max_tokens": 7, "ignore_eos": True})
        )
        stats.log()
    assert response.status_code == 200, response.text
    usage, request_id = response.json()["usage"], response.headers["x-request-id"]
    lines = [r.getMessage() for r in caplog.records]
    mine = [line for line in lines if line.startswith(f"request cmpl-{request_id}-0:")]
    assert len(mine) == 1, lines
    match = re.fullmatch(
        r"request \S+: (\d+) prompt tokens \((\d+) cached\), (\d+) output tokens, "
        r"TTFT ([\d.]+) s, e2e ([\d.]+) s, finish length",
        mine[0],
    )
    assert match, mine[0]
    prompt, _, output, ttft, e2e = (float(x) for x in match.groups())
    assert usage["completion_tokens"] == 7 and (prompt, output) == (usage["prompt_tokens"], 7)
    assert 0 < ttft <= e2e
    engine_lines = [line for line in lines if line.startswith("engine: ")]
    assert len(engine_lines) == 1, lines
    assert re.fullmatch(
        r"engine: prompt [\d.]+ tok/s, generation [\d.]+ tok/s, running 0, waiting 0, "
        r"KV cache 0\.0%, prefix cache hit rate [\d.]+%",
        engine_lines[0],
    ), engine_lines[0]
    assert float(engine_lines[0].split("generation ")[1].split()[0]) > 0
