"""OpenAI's Responses API (`/v1/responses`) with the official `openai` client: output text equal to
the offline engine's greedy answer for the same conversation, streamed events adding up to the
whole response, a forced function call and its output chained by previous_response_id,
text.format's JSON schema, and bad requests answered 4xx."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from jaxllm import SamplingParams
from tests.server.test_server_tools import SCHEMAS, TOOLS

FLAT_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]


def _offline(server, messages, max_tokens, tools=None) -> tuple[str, int, int]:
    """(text, prompt tokens, output tokens) of the offline engine's greedy chat answer."""
    llm = server.offline
    ids = llm.engine.apply_chat_template(messages, tools=tools)
    out = llm.generate(
        {"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False
    )
    return out[0].outputs[0].text, len(ids), len(out[0].outputs[0].token_ids)


def test_text_answer_whole_and_streamed(server):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    text, n_prompt, n_out = _offline(server, messages, 10)
    kwargs = dict(
        model=server.model, instructions="Be brief.", input="Name a colour.", max_output_tokens=10, temperature=0
    )
    response = server.client.responses.create(**kwargs)
    assert response.output_text == text and response.id.startswith("resp-")
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert (response.usage.input_tokens, response.usage.output_tokens) == (n_prompt, n_out)
    assert [item.type for item in response.output] == ["message"]
    events = list(server.client.responses.create(stream=True, **kwargs))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == text
    assert events[-1].response.output_text == text
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == 1


def test_message_items_and_a_json_schema_format(server):
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}},
        "required": ["n"],
        "additionalProperties": False,
    }
    response = server.client.responses.create(
        model=server.model,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "A number, as JSON."}]}],
        text={"format": {"type": "json_schema", "name": "number", "schema": schema, "strict": True}},
        max_output_tokens=40,
        temperature=0,
    )
    jsonschema.validate(json.loads(response.output_text), schema)
    assert response.status == "completed" and response.text.format.type == "json_schema"


def test_a_function_call_and_its_output_chain_by_previous_response_id(server):
    forced = dict(
        model=server.model,
        input="Weather in Paris?",
        tools=FLAT_TOOLS,
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=200,
        temperature=0,
    )
    first = server.client.responses.create(**forced)
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), SCHEMAS["get_weather"])
    output = [{"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature": 21}'}]
    second = server.client.responses.create(
        model=server.model,
        previous_response_id=first.id,
        input=output,
        tools=FLAT_TOOLS,
        tool_choice="none",
        max_output_tokens=6,
        temperature=0,
    )
    conversation = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": '{"temperature": 21}'},
    ]
    text, n_prompt, _ = _offline(server, conversation, 6, tools=TOOLS)
    assert second.output_text == text and second.usage.input_tokens == n_prompt
    assert second.previous_response_id == first.id
    # Streamed, the call comes as a function_call item with its argument deltas.
    events = list(server.client.responses.create(stream=True, **forced))
    streamed = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert streamed == call.arguments
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done.arguments == call.arguments


def test_store_false_and_unknown_ids(server):
    unstored = server.client.responses.create(model=server.model, input="Hi", max_output_tokens=2, store=False)
    for previous in (unstored.id, "resp-nope"):
        with pytest.raises(openai.NotFoundError) as e:
            server.client.responses.create(
                model=server.model, input="Hi", max_output_tokens=2, previous_response_id=previous
            )
        assert e.value.body["param"] == "previous_response_id"


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]), "input"),
        (dict(input="Hi", background=True), "background"),
        (dict(input="Hi", max_output_tokens=0), "max_output_tokens"),
        (dict(input="Hi", text={"format": {"type": "json_schema", "name": "x"}}), "text"),
    ],
)
def test_bad_requests_are_answered_400(server, kwargs, param):
    with pytest.raises(openai.BadRequestError) as e:
        server.client.responses.create(model=server.model, **kwargs)
    assert e.value.body["param"] == param


def test_the_store_drops_the_least_recently_used():
    from jaxllm.entrypoints.openai.serving_responses import ResponseStore

    store = ResponseStore(2, max_chars=200)
    conversation = [{"role": "user", "content": "x" * 40}]
    for i in range(3):
        store.put(f"r{i}", conversation)
        assert store.get("r0") is not None or i == 2  # (r0 used: r1 goes first)
    assert store.get("r1") is None and store.get("r0") == conversation and store.get("r2") == conversation
    store.put("big", [{"role": "user", "content": "y" * 300}])  # (past the character budget: not kept)
    assert store.get("big") is None and store.chars <= 200
    store.put("r3", [{"role": "user", "content": "z" * 90}])  # (two of ~100 characters fill the budget)
    assert store.get("r3") is not None and store.chars <= 200
