"""Tool-call parsers on hand-written outputs of each family's format, and streamed in any
chunking the same as whole."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxllm.entrypoints.openai.tool_parsers import get_tool_parser

WEATHER = {"city": "Paris", "unit": "celsius"}
TIME = {"zone": "UTC"}

CASES = [
    # (parser, output, expected content, expected [(name, arguments)])
    (
        "hermes",
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
        '"unit": "celsius"}}\n</tool_call>',
        "Let me check.",
        [("get_weather", WEATHER)],
    ),
    (
        "hermes",
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}</tool_call>\n'
        '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>',
        None,
        [("get_weather", WEATHER), ("get_time", TIME)],
    ),
    ("hermes", '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}', None, [("get_time", TIME)]),  # unclosed
    ("hermes", "No tools needed: 2 + 2 = 4.", "No tools needed: 2 + 2 = 4.", []),
    (
        "hermes",
        '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>\n<tool_call>oops</tool_call>',
        "<tool_call>oops</tool_call>",
        [("get_time", TIME)],
    ),  # a block that does not parse stays content
    ("hermes", "<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),  # kept as content
    (
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
        None,
        [("get_weather", WEATHER)],
    ),
    (
        "llama3_json",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
        '{"name": "get_time", "parameters": {"zone": "UTC"}}',
        None,
        [("get_weather", WEATHER), ("get_time", TIME)],
    ),
    ("llama3_json", 'The answer is {"a": 1}.', 'The answer is {"a": 1}.', []),
    ("llama3_json", '{"a": 1}', '{"a": 1}', []),  # JSON, but not a call
    (
        "mistral",
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
        '{"name": "get_time", "arguments": {"zone": "UTC"}}]',
        None,
        [("get_weather", WEATHER), ("get_time", TIME)],
    ),
    ("mistral", 'Sure. [TOOL_CALLS]get_time[ARGS]{"zone": "UTC"}', "Sure.", [("get_time", TIME)]),
    (
        "mistral",
        '[TOOL_CALLS]get_time[ARGS] {"zone": "UTC"}[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}',
        None,
        [("get_time", TIME), ("get_weather", WEATHER)],
    ),
    ("mistral", "Plain answer.", "Plain answer.", []),
]


def _calls(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("parser, text, content, calls", CASES)
def test_extract(parser, text, content, calls):
    got_content, got_calls = get_tool_parser(parser).extract(text)
    assert got_content == content and _calls(got_calls) == calls
    assert len({c.id for c in got_calls}) == len(got_calls) and all(c.id.startswith("call_") for c in got_calls)


@settings(max_examples=40, deadline=None)
@given(case=st.sampled_from(CASES), cuts=st.lists(st.integers(0, 400), max_size=12))
def test_streamed_in_any_chunking_equals_whole(case, cuts):
    parser, text, content, calls = case
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    stream = get_tool_parser(parser).stream()
    streamed, got = "", []
    for a, b in zip(bounds, bounds[1:]):
        delta, new = stream.feed(text[a:b])
        streamed, got = streamed + delta, got + new
    delta, new = stream.finish()
    streamed, got = streamed + delta, got + new
    assert _calls(got) == calls
    if calls:
        assert streamed.strip() == (content or "")
    else:
        assert streamed == text


def test_unknown_parser_is_refused():
    with pytest.raises(ValueError, match="known: hermes, llama3_json, mistral"):
        get_tool_parser("pythonic")
