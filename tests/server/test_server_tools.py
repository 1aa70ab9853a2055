"""Tool calling over HTTP with the official `openai` client: a named or required choice always
gives calls whose arguments fit their function's schema, "auto" parses the model's own format
(here hermes), streamed deltas add up to the plain answer, and a call round-trips through a
tool message to an answer."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# Forces the hermes format (the tiny model's weights are random), so "auto" has a call to parse.
HERMES_CALL = (
    r'<tool_call>\n\{"name": "get_weather", "arguments": '
    r'\{"city": "[A-Z][a-z]{2,6}", "unit": "celsius"\}\}\n</tool_call>'
)


def _check(calls, *, one_of=SCHEMAS):
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), one_of[call.function.name])


def _streamed(server, **kwargs):
    """(content, {index: [id, name, arguments]}, finish_reason) of a streamed chat completion."""
    content, calls, finish = "", {}, None
    for chunk in server.client.chat.completions.create(model=server.model, stream=True, **kwargs):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            call = calls.setdefault(d.index, [None, None, ""])
            call[0] = call[0] or d.id
            call[1] = call[1] or (d.function.name if d.function else None)
            call[2] += (d.function.arguments or "") if d.function else ""
        finish = choice.finish_reason or finish
    return content, calls, finish


@pytest.mark.parametrize("choice", [{"type": "function", "function": {"name": "get_time"}}, "required"])
def test_forced_calls_parse_and_stream_the_same(server, choice):
    kwargs = dict(messages=ASK, tools=TOOLS, tool_choice=choice, seed=3, max_tokens=300)
    response = server.client.chat.completions.create(model=server.model, **kwargs)
    message = response.choices[0].message
    assert message.content is None and message.tool_calls
    _check(message.tool_calls)
    if choice == "required":
        assert response.choices[0].finish_reason == "tool_calls"
    else:
        assert response.choices[0].finish_reason == "stop" and [c.function.name for c in message.tool_calls] == [
            "get_time"
        ]
    content, calls, finish = _streamed(server, **kwargs)
    assert not content and finish == response.choices[0].finish_reason
    assert [(c[1], c[2]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in message.tool_calls
    ]


def test_parallel_tool_calls_false_gives_one_call(server):
    for seed in range(3):
        response = server.client.chat.completions.create(
            model=server.model,
            messages=ASK,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            seed=seed,
            max_tokens=300,
        )
        assert len(response.choices[0].message.tool_calls) == 1


def test_auto_parses_the_models_calls_and_leaves_plain_answers_as_content(server):
    kwargs = dict(messages=ASK, tools=TOOLS, seed=1, max_tokens=80, extra_body={"guided_regex": HERMES_CALL})
    response = server.client.chat.completions.create(model=server.model, **kwargs)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
    _check(choice.message.tool_calls)
    content, calls, finish = _streamed(server, **kwargs)
    assert (not content, finish) == (True, "tool_calls")
    assert [(c[1], c[2]) for c in calls.values()] == [("get_weather", choice.message.tool_calls[0].function.arguments)]

    plain = server.client.chat.completions.create(
        model=server.model,
        messages=ASK,
        tools=TOOLS,
        seed=1,
        max_tokens=20,
        extra_body={"guided_regex": "[a-z ]{3,30}"},
    )
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].message.content
    content, calls, finish = _streamed(
        server, messages=ASK, tools=TOOLS, seed=1, max_tokens=20, extra_body={"guided_regex": "[a-z ]{3,30}"}
    )
    assert content == plain.choices[0].message.content and not calls and finish == plain.choices[0].finish_reason


def test_a_call_round_trips_through_a_tool_message(server):
    first = server.client.chat.completions.create(
        model=server.model,
        messages=ASK,
        tools=TOOLS,
        seed=2,
        max_tokens=150,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    call = first.choices[0].message.tool_calls[0]
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21})},
    ]
    second = server.client.chat.completions.create(
        model=server.model, messages=messages, tools=TOOLS, tool_choice="none", seed=2, max_tokens=12
    )
    assert second.choices[0].message.content and second.choices[0].message.tool_calls is None
    # The tool's answer is in the prompt, rendered by the model's template as the offline engine does.
    rendered = server.offline.engine.apply_chat_template(
        [
            *ASK,
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": call.id,
                        "type": "function",
                        "function": {"name": call.function.name, "arguments": json.loads(call.function.arguments)},
                    }
                ],
            },
            {"role": "tool", "content": json.dumps({"temperature": 21}), "tool_call_id": call.id},
        ],
        tools=[WEATHER, TIME],
    )
    assert second.usage.prompt_tokens == len(rendered)
    assert '{"temperature": 21}' in server.offline.get_tokenizer().decode(rendered)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(tool_choice="required"), "needs tools"),
        (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "not among the tools"),
        (dict(tools=[WEATHER, WEATHER]), "unique"),
        (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "cannot be combined"),
        (dict(tools=[{"type": "function", "function": {"name": "bad name!"}}]), "name"),
    ],
)
def test_bad_tool_requests_are_answered_400(server, kwargs, message):
    with pytest.raises(openai.BadRequestError, match=message):
        server.client.chat.completions.create(model=server.model, messages=ASK, max_tokens=4, **kwargs)
    server.assert_healthy()
