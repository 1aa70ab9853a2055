"""Anthropic's Messages API (`/v1/messages`) with the official `anthropic` client: answers equal
the offline engine's greedy output for the same conversation, streamed = whole, stop sequences
and forced tool calls as Anthropic reports them, a tool result rendered back into the prompt,
count_tokens, and errors in Anthropic's shape (with its client's exception classes)."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from jaxllm import SamplingParams
from tests.helpers.live_server import API_KEY
from tests.server.test_server_tools import SCHEMAS, TOOLS

anthropic = pytest.importorskip("anthropic")

SYSTEM = "You answer in one word."
ASK = [{"role": "user", "content": "Name a colour."}]
ANTHROPIC_TOOLS = [
    {
        "name": t["function"]["name"],
        "description": t["function"].get("description", ""),
        "input_schema": t["function"]["parameters"],
    }
    for t in TOOLS
]


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=120)


def _offline(server, messages, max_tokens, tools=None, stop=None):
    """(text, prompt tokens, output tokens) of the offline engine's greedy answer."""
    llm = server.offline
    ids = llm.engine.apply_chat_template(messages, tools=tools)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, stop=stop)
    out = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].outputs[0]
    return out.text, len(ids), len(out.token_ids)


def test_an_answer_equals_the_offline_engines_whole_and_streamed(server, client):
    text, n_prompt, n_out = _offline(server, [{"role": "system", "content": SYSTEM}, *ASK], 12)
    kwargs = dict(model=server.model, system=SYSTEM, messages=ASK, max_tokens=12, extra_body={"temperature": 0})
    message = client.messages.create(**kwargs)
    assert [b.type for b in message.content] == ["text"] and message.content[0].text == text
    assert message.role == "assistant" and message.model == server.model and message.id.startswith("msg-")
    assert (message.stop_reason, message.stop_sequence) == ("max_tokens", None)
    assert (message.usage.input_tokens, message.usage.output_tokens) == (n_prompt, n_out)
    with client.messages.stream(**kwargs) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_message()
    assert final.content[0].text == text and final.stop_reason == "max_tokens"
    assert (final.usage.input_tokens, final.usage.output_tokens) == (n_prompt, n_out)
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert events.count("content_block_start") == events.count("content_block_stop") == 1


def test_a_stop_sequence_ends_the_answer(server, client):
    text, *_ = _offline(server, ASK, 24)
    stop = text.strip()[3:6]
    assert stop
    want, *_ = _offline(server, ASK, 24, stop=[stop])
    kwargs = dict(model=server.model, messages=ASK, max_tokens=24, extra_body={"temperature": 0}, stop_sequences=[stop])
    message = client.messages.create(**kwargs)
    assert (message.content[0].text, message.stop_reason, message.stop_sequence) == (want, "stop_sequence", stop)
    with client.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert (final.content[0].text, final.stop_reason, final.stop_sequence) == (want, "stop_sequence", stop)


@pytest.mark.parametrize("choice", [{"type": "tool", "name": "get_weather"}, {"type": "any"}])
def test_forced_tool_use_whole_and_streamed(server, client, choice):
    kwargs = dict(
        model=server.model,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=ANTHROPIC_TOOLS,
        tool_choice=choice,
        max_tokens=300,
        extra_body={"temperature": 0},
    )
    message = client.messages.create(**kwargs)
    uses = [b for b in message.content if b.type == "tool_use"]
    assert uses and message.stop_reason == "tool_use"
    for use in uses:
        jsonschema.validate(use.input, SCHEMAS[use.name])
    if choice["type"] == "tool":
        assert [u.name for u in uses] == ["get_weather"]
    with client.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [(u.name, u.input) for u in uses]
    assert final.stop_reason == "tool_use"


def test_a_tool_result_goes_back_into_the_prompt(server, client):
    """A tool_use / tool_result exchange renders as the chat template renders the same calls and
    results in OpenAI's shape (count_tokens against the offline render)."""
    call = {"id": "toolu_1", "name": "get_weather", "input": {"city": "Paris", "unit": "celsius"}}
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Let me look."}, {"type": "tool_use", **call}]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": '{"temperature": 21}'},
                {"type": "text", "text": "Thanks."},
            ],
        },
    ]
    openai_shape = [
        {"role": "system", "content": SYSTEM},
        messages[0],
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps(call["input"])},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": '{"temperature": 21}'},
        {"role": "user", "content": "Thanks."},
    ]
    rendered = server.offline.engine.apply_chat_template(openai_shape, tools=TOOLS)
    counted = client.messages.count_tokens(model=server.model, system=SYSTEM, messages=messages, tools=ANTHROPIC_TOOLS)
    assert counted.input_tokens == len(rendered)
    assert '{"temperature": 21}' in server.offline.get_tokenizer().decode(rendered)
    message = client.messages.create(
        model=server.model,
        system=SYSTEM,
        messages=messages,
        tools=ANTHROPIC_TOOLS,
        max_tokens=4,
        extra_body={"temperature": 0},
    )
    assert message.usage.input_tokens == len(rendered)


def test_errors_have_anthropics_shape(server, client):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=server.model, messages=[{"role": "user", "content": "hi"}], max_tokens=0)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    with pytest.raises(anthropic.BadRequestError, match="image"):
        client.messages.create(model=server.model, messages=[{"role": "user", "content": [image]}], max_tokens=4)
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="claude-nope", messages=ASK, max_tokens=4)
    assert e.value.body["error"]["type"] == "not_found_error"
    wrong = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        wrong.messages.create(model=server.model, messages=ASK, max_tokens=4)
    # The OpenAI routes keep OpenAI's shape; the server answers on.
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": []}, headers={"x-api-key": API_KEY})
    assert r.status_code == 400 and "error" in r.json() and "type" not in r.json()
    assert client.messages.create(model=server.model, messages=ASK, max_tokens=2).content
