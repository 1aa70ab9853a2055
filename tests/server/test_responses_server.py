"""OpenAI's Responses API (`/v1/responses`) with the official `openai` client: output text equal to
the offline engine's greedy answer for the same conversation, streamed events adding up to the
whole response, a forced function call and its output chained by previous_response_id,
text.format's JSON schema, max_tool_calls, the output's logprobs (include, top_logprobs),
reasoning.effort through a template that reads it, and bad requests (the API's fields this server
cannot honour among them) answered 4xx, naming the field."""

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
        # Fields of the API this server cannot honour: refused by name, never silently ignored.
        (dict(input="Hi", conversation="conv_123"), "conversation"),
        (dict(input="Hi", prompt={"id": "pmpt_123"}), "prompt"),
        (dict(input="Hi", truncation="auto"), "truncation"),
        (dict(input="Hi", include=["reasoning.encrypted_content"]), "include"),
        (dict(input="Hi", top_logprobs=2), "top_logprobs"),  # (without include: nowhere to put them)
        (dict(input="Hi", reasoning={"summary": "auto"}), "reasoning"),
        (dict(input="Hi", reasoning={"effort": "low"}), "reasoning"),  # (the template never reads it)
        (dict(input="Hi", extra_body={"priority": 1}), "priority"),  # (an fcfs server)
        (dict(input="Hi", tools=FLAT_TOOLS, tool_choice="required", max_tool_calls=0), "max_tool_calls"),
        (dict(input="Hi", tools=FLAT_TOOLS, include=["message.output_text.logprobs"]), "include"),
        (dict(input="Hi", include=["message.output_text.logprobs"], top_logprobs=11), "top_logprobs"),
    ],
)
def test_bad_requests_are_answered_400(server, kwargs, param):
    with pytest.raises(openai.BadRequestError) as e:
        server.client.responses.create(model=server.model, **kwargs)
    assert e.value.body["param"] == param
    assert param in e.value.body["message"] or param in ("input", "text", "max_output_tokens")
    assert server.client.responses.create(model=server.model, input="Hi", max_output_tokens=2).status == "incomplete"


def test_truncation_disabled_and_max_tool_calls(server):
    """truncation "disabled" is what the server does (an input past the context is refused, not
    cut); max_tool_calls bounds a required choice's calls as parallel_tool_calls false does."""
    response = server.client.responses.create(
        model=server.model, input="Hi", max_output_tokens=2, truncation="disabled"
    )
    assert response.truncation == "disabled" and response.status == "incomplete"
    with pytest.raises(openai.BadRequestError):
        server.client.responses.create(model=server.model, input="Hi " * 600, truncation="disabled")
    forced = dict(model=server.model, input="Weather and time in Paris?", tools=FLAT_TOOLS, tool_choice="required")
    many = server.client.responses.create(**forced, max_output_tokens=200, temperature=0)
    one = server.client.responses.create(**forced, max_output_tokens=200, temperature=0, max_tool_calls=1)
    assert [item.type for item in many.output] == ["function_call", "function_call"]
    calls = [item for item in one.output if item.type == "function_call"]
    assert len(calls) == 1 and one.max_tool_calls == 1
    jsonschema.validate(json.loads(calls[0].arguments), SCHEMAS[calls[0].name])


def test_output_logprobs_with_top_logprobs(server):
    """include message.output_text.logprobs with top_logprobs: each output token's logprob and its
    3 best alternatives, the offline engine's; streamed, the deltas' logprobs add up to them."""
    llm = server.offline
    ids = llm.engine.apply_chat_template([{"role": "user", "content": "Name a colour."}])
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=3)
    out = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].outputs[0]
    kwargs = dict(
        model=server.model,
        input="Name a colour.",
        max_output_tokens=6,
        temperature=0,
        include=["message.output_text.logprobs"],
        top_logprobs=3,
    )
    response = server.client.responses.create(**kwargs)
    assert response.output_text == out.text and response.top_logprobs == 3
    logprobs = response.output[0].content[0].logprobs
    assert "".join(lp.token for lp in logprobs) == out.text and len(logprobs) == len(out.token_ids)
    for lp, token, entry in zip(logprobs, out.token_ids, out.logprobs):
        assert lp.logprob == pytest.approx(entry[token].logprob, abs=1e-4)
        best = sorted((e.logprob for e in entry.values()), reverse=True)[:3]
        assert [t.logprob for t in lp.top_logprobs] == pytest.approx(best, abs=1e-4)
    events = list(server.client.responses.create(stream=True, **kwargs))
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    assert [lp.model_dump() for lp in streamed] == [lp.model_dump() for lp in done.logprobs]
    assert [lp.model_dump() for lp in done.logprobs] == [lp.model_dump() for lp in logprobs]


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


# gpt-oss's variable, in a template of the tiny model's chat format.
EFFORT_TEMPLATE = (
    "{% if reasoning_effort is defined %}<|im_start|>system\nReasoning: {{ reasoning_effort }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_reasoning_effort_reaches_a_template_that_reads_it(llm, monkeypatch):
    """reasoning.effort becomes the chat template's reasoning_effort: on an app over a model whose
    template reads it, the prompt is the one rendered with it (its length the usage's) and the
    answer the offline engine's for that prompt."""
    import asyncio

    import httpx

    from jaxllm.engine.async_llm import AsyncLLM
    from jaxllm.entrypoints.openai.api_server import build_app
    from jaxllm.entrypoints.openai.server_args import ServerArgs

    monkeypatch.setattr(llm.engine.tokenizer, "chat_template", EFFORT_TEMPLATE)
    messages = [{"role": "user", "content": "Name a colour."}]
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    want = {}
    for effort in ("low", "high"):
        ids = llm.engine.apply_chat_template(messages, reasoning_effort=effort)
        want[effort] = len(ids), llm.generate({"prompt_token_ids": ids}, greedy, use_tqdm=False)[0].outputs[0].text
    plain = llm.engine.apply_chat_template(messages)

    async def ask(app, effort: str):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app/v1") as http:
            client = openai.AsyncOpenAI(api_key="none", base_url="http://app/v1", http_client=http, max_retries=0)
            return await client.responses.create(
                model=llm.engine.model_name,
                input=messages[0]["content"],
                max_output_tokens=6,
                temperature=0,
                reasoning={"effort": effort},
            )

    async_llm = AsyncLLM(engine=llm.engine)
    try:
        app = build_app(async_llm, ServerArgs(disable_log_stats=True))
        for effort, (num_prompt_tokens, text) in want.items():
            response = asyncio.run(ask(app, effort))
            assert (response.usage.input_tokens, response.output_text) == (num_prompt_tokens, text)
            assert response.reasoning.effort == effort and num_prompt_tokens > len(plain)
    finally:
        async_llm.shutdown()
