"""Reasoning output over HTTP with the official `openai` client (--reasoning-parser).

The tiny model's weights are random, so a grammar makes it write think tags: on a server that
constrains the whole output (--structured-outputs-in-reasoning), `reasoning_content` and
`content` are the parts of the text the offline engine writes under the same grammar, streamed
deltas add up to them, and a hermes tool call after the thoughts is parsed from the content. On
a server that constrains the content only (the default), the grammar waits for the thoughts to
end: greedy thoughts are what the unconstrained model writes, and a forced tool call (the thoughts
closed by a logit_bias) is parsed from what follows them. `enable_thinking` in
chat_template_kwargs decides, through the template, whether the output is thoughts or answer."""

from __future__ import annotations

import pytest

from jaxllm import SamplingParams
from jaxllm.sampling_params import StructuredOutputsParams
from tests.helpers.live_server import start_server
from tests.server.test_server_tools import HERMES_CALL, SCHEMAS, TOOLS, _check

ASK = [{"role": "user", "content": "How many legs has a cat?"}]
THINK_THEN_ANSWER = r"<think>[a-z ]{3,20}</think>[a-z ]{3,20}"


@pytest.fixture(scope="module")
def whole_server(tiny_model_dir, tmp_path_factory):
    """qwen3's parser, the grammar over the whole output, hermes tool calls."""
    live = start_server(
        tiny_model_dir,
        str(tmp_path_factory.mktemp("reasoning-whole")),
        *("--reasoning-parser", "qwen3", "--structured-outputs-in-reasoning"),
        *("--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--trust-request-chat-template"),
    )
    yield live
    live.stop()


@pytest.fixture(scope="module")
def r1_server(tiny_model_dir, tmp_path_factory):
    """deepseek_r1's parser (the output starts in the thoughts), the grammar after them."""
    live = start_server(
        tiny_model_dir, str(tmp_path_factory.mktemp("reasoning-r1")), "--reasoning-parser", "deepseek_r1"
    )
    yield live
    live.stop()


def _offline_text(
    server, messages, regex: str | None, max_tokens: int, chat_template: str | None = None, **template_kwargs
) -> str:
    """The reference: what the offline engine writes for the chat, greedy, under `regex`."""
    llm = server.offline
    prompt = llm.engine.apply_chat_template(
        messages, add_generation_prompt=True, chat_template=chat_template, **template_kwargs
    )
    params = SamplingParams(
        temperature=0,
        max_tokens=max_tokens,
        structured_outputs=StructuredOutputsParams(regex=regex) if regex else None,
    )
    return llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0].text


def _streamed(live, **kwargs) -> tuple[str, str, list]:
    """(reasoning, content, deltas) of a streamed chat completion."""
    reasoning, content, deltas = "", "", []
    for chunk in live.client.chat.completions.create(model=live.model, stream=True, **kwargs):
        for choice in chunk.choices:
            delta = choice.delta
            deltas.append(delta)
            reasoning += getattr(delta, "reasoning_content", None) or ""
            content += delta.content or ""
    return reasoning, content, deltas


def test_thoughts_and_answer_split_whole_and_streamed(whole_server, server):
    want = _offline_text(server, ASK, THINK_THEN_ANSWER, 64)
    thoughts, _, answer = want.removeprefix("<think>").partition("</think>")
    kwargs = dict(messages=ASK, temperature=0, max_tokens=64, extra_body={"guided_regex": THINK_THEN_ANSWER})
    message = whole_server.client.chat.completions.create(model=whole_server.model, **kwargs).choices[0].message
    assert (message.reasoning_content, message.content) == (thoughts, answer)
    reasoning, content, deltas = _streamed(whole_server, **kwargs)
    assert (reasoning, content) == (thoughts, answer)
    assert not any("think>" in (d.content or "") + (getattr(d, "reasoning_content", None) or "") for d in deltas)
    # include_reasoning false: the answer alone.
    kwargs["extra_body"] = {**kwargs["extra_body"], "include_reasoning": False}
    message = whole_server.client.chat.completions.create(model=whole_server.model, **kwargs).choices[0].message
    assert message.content == answer and getattr(message, "reasoning_content", None) is None
    reasoning, content, _ = _streamed(whole_server, **kwargs)
    assert (reasoning, content) == ("", answer)


def test_a_tool_call_after_the_thoughts_is_parsed_from_the_content(whole_server):
    regex = r"<think>[a-z ]{3,9}</think>" + HERMES_CALL
    kwargs = dict(messages=ASK, tools=TOOLS, temperature=0, max_tokens=100, extra_body={"guided_regex": regex})
    choice = whole_server.client.chat.completions.create(model=whole_server.model, **kwargs).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.reasoning_content and "think>" not in choice.message.reasoning_content
    _check(choice.message.tool_calls)
    reasoning, content, deltas = _streamed(whole_server, **kwargs)
    assert reasoning == choice.message.reasoning_content and not content
    calls = [c for d in deltas for c in d.tool_calls or []]
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        (c.function.name, c.function.arguments) for c in choice.message.tool_calls
    ]


# A template that opens the thoughts in the prompt, as Qwen3-2507's thinking models do.
OPENING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)


def test_thoughts_opened_by_the_template(whole_server, server):
    regex = r"[a-z ]{3,20}</think>[a-z ]{3,20}"
    want = _offline_text(server, ASK, regex, 64, chat_template=OPENING_TEMPLATE)
    thoughts, _, answer = want.partition("</think>")
    kwargs = dict(
        messages=ASK,
        temperature=0,
        max_tokens=64,
        extra_body={"guided_regex": regex, "chat_template": OPENING_TEMPLATE},
    )
    message = whole_server.client.chat.completions.create(model=whole_server.model, **kwargs).choices[0].message
    assert (message.reasoning_content, message.content) == (thoughts, answer)
    assert _streamed(whole_server, **kwargs)[:2] == (thoughts, answer)


# Qwen3's switch: the thoughts opened by the prompt while thinking is on (the default, as the
# thinking models of Qwen3-2507 do), closed in it by `enable_thinking: false` (as Qwen3's template).
SWITCH_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
    "<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}{% endif %}"
)


@pytest.mark.parametrize("enable_thinking", [None, True, False])
def test_enable_thinking_decides_the_split(whole_server, server, enable_thinking):
    """chat_template_kwargs' enable_thinking through the template: on (or unset) the thoughts are
    open when the output starts, and 8 greedy tokens (the model's free text, no </think> in it) are
    all reasoning; off the prompt closed them, and the free text after them is all content."""
    template_kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    free = _offline_text(server, ASK, None, 8, chat_template=SWITCH_TEMPLATE, **template_kwargs)
    assert free.strip() and "think>" not in free
    want = (None, free) if enable_thinking is False else (free, None)
    extra_body = {"chat_template": SWITCH_TEMPLATE}
    if template_kwargs:
        extra_body["chat_template_kwargs"] = template_kwargs
    kwargs = dict(messages=ASK, temperature=0, max_tokens=8, extra_body=extra_body)
    message = whole_server.client.chat.completions.create(model=whole_server.model, **kwargs).choices[0].message
    assert (getattr(message, "reasoning_content", None), message.content) == want
    reasoning, content, _ = _streamed(whole_server, **kwargs)
    assert (reasoning or None, content or None) == want


def test_a_forced_tool_call_is_parsed_after_the_thoughts(r1_server, server):
    """tool_choice naming a function on a server whose grammars wait for the thoughts to end:
    deepseek_r1's output starts in them, and a logit_bias toward the pieces of `</think>` ('</',
    'think', '>') makes the random model close them after a few tokens; the call's arguments
    (get_time's schema) are parsed from what follows. The offline engine under the same grammar
    and bias is the reference, whole and streamed."""
    import json

    import jsonschema

    from jaxllm.entrypoints.openai.reasoning_parsers import PARSERS

    llm = server.offline
    bias = {t: 20.0 for t in llm.get_tokenizer().encode("</think>", add_special_tokens=False)}
    grammar = PARSERS["deepseek_r1"].constrain(StructuredOutputsParams(json=SCHEMAS["get_time"]), True)
    params = SamplingParams(temperature=0, max_tokens=60, structured_outputs=grammar, logit_bias=bias)
    prompt = llm.engine.apply_chat_template(ASK, tools=TOOLS)
    want = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0].text
    thoughts, _, arguments = want.partition("</think>")
    assert thoughts and arguments
    kwargs = dict(
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        temperature=0,
        max_tokens=60,
        logit_bias={str(t): b for t, b in bias.items()},
    )
    choice = r1_server.client.chat.completions.create(model=r1_server.model, **kwargs).choices[0]
    assert choice.finish_reason == "stop" and choice.message.content is None
    assert choice.message.reasoning_content == thoughts
    (call,) = choice.message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_time", arguments)
    jsonschema.validate(json.loads(arguments), SCHEMAS["get_time"])
    reasoning, content, deltas = _streamed(r1_server, **kwargs)
    assert (reasoning, content) == (thoughts, "")
    calls = [c for d in deltas for c in d.tool_calls or []]
    assert [c.function.name for c in calls if c.id] == ["get_time"]
    assert "".join(c.function.arguments or "" for c in calls) == arguments


def test_a_plain_answer_has_no_reasoning(whole_server, server):
    want = _offline_text(server, ASK, "[a-z ]{3,20}", 32)
    kwargs = dict(messages=ASK, temperature=0, max_tokens=32, extra_body={"guided_regex": "[a-z ]{3,20}"})
    message = whole_server.client.chat.completions.create(model=whole_server.model, **kwargs).choices[0].message
    assert message.content == want and getattr(message, "reasoning_content", None) is None


def test_the_grammar_waits_for_the_thoughts_to_end(r1_server, server):
    """deepseek_r1 starts in the thoughts: under response_format json_object the greedy output
    is the model's own free text (it never writes </think> in 8 tokens), where the server without
    a reasoning parser starts the JSON at once."""
    free = _offline_text(server, ASK, None, 8)
    assert "</think>" not in free
    kwargs = dict(messages=ASK, temperature=0, max_tokens=8, response_format={"type": "json_object"})
    message = r1_server.client.chat.completions.create(model=r1_server.model, **kwargs).choices[0].message
    assert (message.reasoning_content, message.content) == (free, None)
    reasoning, content, _ = _streamed(r1_server, **kwargs)
    assert (reasoning, content) == (free, "")
    plain = server.client.chat.completions.create(model=server.model, **kwargs).choices[0].message
    assert plain.content.startswith("{")


@pytest.mark.slow
def test_the_default_model_thinks_under_a_template_that_asks(tmp_path):
    """SmolLM2 with a template that asks for thoughts and opens them: the greedy thoughts are the
    model's own free text (the offline engine's, unconstrained, up to the first </think>), and
    whatever follows them is the JSON that response_format asks for."""
    import json
    import os

    from jaxllm import LLM
    from jaxllm.models.loader import default_model_path

    template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>system\nThink inside <think></think>, then answer in JSON."
        "<|im_end|>\n<|im_start|>assistant\n<think>\n{% endif %}"
    )
    path = default_model_path()
    flags = ("--kv-cache-memory", "128MiB", "--max-model-len", "384", "--served-model-name", os.path.basename(path))
    live = start_server(path, str(tmp_path), *flags, "--reasoning-parser", "qwen3", "--trust-request-chat-template")
    try:
        messages = [{"role": "user", "content": "Is 7 a prime number?"}]
        llm = LLM(path, kv_cache_memory=128 << 20, max_model_len=384)
        ids = llm.engine.apply_chat_template(messages, chat_template=template)
        free = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=48), use_tqdm=False)
        thoughts = free[0].outputs[0].text.partition("</think>")[0]
        choice = live.client.chat.completions.create(
            model=live.model,
            messages=messages,
            temperature=0,
            max_tokens=48,
            response_format={"type": "json_object"},
            extra_body={"chat_template": template},
        ).choices[0]
        message = choice.message
        assert message.reasoning_content == thoughts and thoughts.strip()
        if choice.finish_reason == "stop":  # (the model closed its thoughts, then the JSON is whole)
            assert isinstance(json.loads(message.content), dict)
    finally:
        live.stop()


def test_responses_and_messages_carry_the_thoughts(r1_server, server):
    """The same split through the Responses API (a reasoning item, reasoning_text deltas) and
    Anthropic's (a thinking block, thinking_delta events): deepseek_r1's output starts in the
    thoughts, so 8 greedy tokens are all thoughts, the offline engine's free text."""
    import anthropic

    from tests.helpers.live_server import API_KEY

    free = _offline_text(server, ASK, None, 8)
    response = r1_server.client.responses.create(
        model=r1_server.model, input=ASK[0]["content"], max_output_tokens=8, temperature=0
    )
    assert [item.type for item in response.output] == ["reasoning"]
    assert response.output[0].content[0].text == free
    events = list(
        r1_server.client.responses.create(
            model=r1_server.model, input=ASK[0]["content"], max_output_tokens=8, temperature=0, stream=True
        )
    )
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == free
    client = anthropic.Anthropic(base_url=r1_server.url, api_key=API_KEY, max_retries=0)
    kwargs = dict(model=r1_server.model, messages=ASK, max_tokens=8, extra_body={"temperature": 0})
    message = client.messages.create(**kwargs)
    assert [(b.type, b.thinking) for b in message.content] == [("thinking", free)]
    with client.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert [(b.type, b.thinking) for b in final.content] == [("thinking", free)]
