"""jaxllm/chat_template.py and jaxllm/jinja_sandbox.py: the text (and the engine's token ids)
equal transformers' `apply_chat_template` for real-world-style templates, and hostile templates
end in a ChatTemplateError instead of hanging or exhausting memory."""

from __future__ import annotations

import datetime
import itertools
import re
import threading
import tracemalloc

import pytest

from jaxllm.chat_template import ALLOWED_TEMPLATE_KWARGS, ChatTemplateError, check_template_kwargs, render_chat_template
from jaxllm.jinja_sandbox import MAX_TEMPLATE_CHARS

# Qwen3-style ChatML: a default system prompt, reasoning shown for the last assistant turn,
# `enable_thinking`, a namespace, a macro and transformers' `{% generation %}` tag.
CHATML = """\
{%- macro text(content) %}{% if content is string %}{{ content }}{% else %}{% for block in content %}\
{{ block.text }}{% endfor %}{% endif %}{% endmacro %}
{%- set ns = namespace(system='You are a helpful assistant.') %}
{%- if messages[0].role == 'system' %}{% set ns.system = text(messages[0].content) %}{% endif %}
<|im_start|>system
{{ ns.system }}<|im_end|>
{% for message in messages %}
{%- if message.role == 'system' %}{% continue %}{% endif %}
<|im_start|>{{ message.role }}
{% if message.role == 'assistant' %}{% generation %}
{%- if message.reasoning_content is defined and loop.last %}<think>
{{ message.reasoning_content | trim }}
</think>

{% endif %}{{ text(message.content) }}{% endgeneration %}
{%- else %}{{ text(message.content) }}{% endif %}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}
<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% endif %}
{%- endif %}"""

# Llama-3-style: `bos_token`, `date_string` or `strftime_now`, roles checked with `raise_exception`.
LLAMA3 = """\
{{- bos_token }}
{%- if date_string is not defined %}{% set date_string = strftime_now('%d %b %Y') %}{% endif %}
{%- set offset = 1 if messages[0]['role'] == 'system' else 0 %}
{%- for message in messages %}
    {%- if message['role'] == 'system' and not loop.first %}
        {{- raise_exception('the system message must come first') }}
    {%- elif message['role'] != 'system' and (message['role'] == 'user') != ((loop.index0 - offset) % 2 == 0) %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
    {%- if loop.first and message['role'] == 'system' %}{{ 'Today Date: ' + date_string + '\\n\\n' }}{% endif %}
    {{- message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"""

# Messages as JSON with loop controls, documents, `dict`, filters, operators, a recursive loop and an
# indented tag (lstrip_blocks).
JSON_LINES = """\
{%- for message in messages %}
{%- if loop.index0 >= 6 %}{% break %}{% endif %}
    {% if message.content is not string %}{% continue %}{% endif %}
{{ loop.index }}/{{ loop.length }} {{ message | tojson }}{{ ' (last)' if loop.last }}
{% endfor %}
{%- if documents %}<documents>{{ documents | tojson(indent=2) }}</documents>
{% for doc in documents recursive %}[{{ doc.title }}\
{% if doc.children %}: {{ loop(doc.children) }}{% endif %}]{% endfor %}
{% endif %}
{{- dict(n=messages | length, roles=messages | map(attribute='role') | unique | list) | tojson(sort_keys=True) }}
{{- ' ' ~ (9 ** 9 ** 9) ~ ' ' ~ '%05.1f|%s' % (3.14159, eos_token) ~ ' {:>6}'.format('ok') }}
{%- if add_generation_prompt %}
>>> {% endif %}"""

CONVERSATIONS = [
    [{"role": "user", "content": "Hello"}],
    [
        {"role": "system", "content": "Sé breve. 日本語で答えて"},
        {"role": "user", "content": "Qu'est-ce que «Jinja» ? 🤔"},
        {"role": "assistant", "content": "Un moteur de gabarits.", "tool_calls": None},
        {"role": "user", "content": "  Merci\n"},
    ],
    [
        {"role": "user", "content": [{"type": "text", "text": "Part one, "}, {"type": "text", "text": "part two"}]},
        {"role": "assistant", "content": "4", "reasoning": '2 + 2 = 4, "quoted" <tag>'},
    ],
]
KWARGS = [
    {},
    {"enable_thinking": False, "date_string": "01 Jan 2025"},
    {"documents": [{"title": "A", "text": "é", "children": [{"title": "A.1"}, {"title": "A.2"}]}]},
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(tiny_model_dir)


def _hf_text(tokenizer, template, conversation, **kwargs):
    return tokenizer.apply_chat_template(conversation, tokenize=False, chat_template=template, **kwargs)


def _ours(tokenizer, template, conversation, *, add_generation_prompt, **kwargs):
    return render_chat_template(
        template,
        conversation,
        add_generation_prompt=add_generation_prompt,
        special_tokens=tokenizer.special_tokens_map,
        template_kwargs=kwargs,
    )


@pytest.mark.parametrize("name", ["model", "CHATML", "LLAMA3", "JSON_LINES"])
def test_text_matches_transformers(tokenizer, name):
    template = tokenizer.chat_template if name == "model" else globals()[name]
    compared = 0
    for conversation, kwargs, add in itertools.product(CONVERSATIONS, KWARGS, (True, False)):
        if name == "model" and not isinstance(conversation[0]["content"], str):
            continue  # the model's template concatenates content as a string
        expected = _hf_text(tokenizer, template, conversation, add_generation_prompt=add, **kwargs)
        assert _ours(tokenizer, template, conversation, add_generation_prompt=add, **kwargs) == expected
        compared += 1
    assert compared >= 8


@pytest.mark.parametrize("template", ["CHATML", "model"])
def test_continue_final_message_matches_transformers(tokenizer, template):
    template = CHATML if template == "CHATML" else tokenizer.chat_template
    conversation = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "The colour is"}]
    expected = _hf_text(tokenizer, template, conversation, continue_final_message=True)
    assert expected.endswith("The colour is")
    assert (
        _ours(tokenizer, template, conversation, add_generation_prompt=False, continue_final_message=True) == expected
    )
    assert conversation[-1] == {"role": "assistant", "content": "The colour is"}  # the caller's copy is untouched
    with pytest.raises(ChatTemplateError, match="cannot both be set"):
        _ours(tokenizer, template, conversation, add_generation_prompt=True, continue_final_message=True)


def test_engine_token_ids_match_transformers(tokenizer, tiny_model_dir):
    from tests.helpers.tiny_model import offline_llm

    llm = offline_llm(tiny_model_dir)
    for conversation in CONVERSATIONS[:2]:
        expected = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
        assert llm.apply_chat_template(conversation) == list(expected["input_ids"])
        assert llm.apply_chat_template(conversation)[0] == tokenizer.bos_token_id  # the template writes BOS
    conversation = CONVERSATIONS[1]
    expected = tokenizer.apply_chat_template(
        conversation, chat_template=LLAMA3, add_generation_prompt=False, date_string="01 Jan 2025", tokenize=True
    )
    # The engine passes any template variable (date_string is not in the clients' allow-list).
    assert llm.engine.apply_chat_template(
        conversation, chat_template=LLAMA3, add_generation_prompt=False, date_string="01 Jan 2025"
    ) == list(expected["input_ids"])
    with pytest.raises(ValueError, match="rejected the conversation: the system message must come first"):
        llm.engine.apply_chat_template(conversation[1:] + conversation[:1], chat_template=LLAMA3)


def test_strftime_now():
    text = render_chat_template(
        "{{ strftime_now('%Y-%m') }}",
        [{"role": "user", "content": "x"}],
        add_generation_prompt=False,
        special_tokens={},
    )
    assert text == datetime.datetime.now().strftime("%Y-%m")


def _render_in_thread(template: str, **bounds) -> Exception | str:
    """Render `template` on a thread; fail the test (not hang it) if the render does not stop."""
    result = []

    def run():
        try:
            result.append(
                render_chat_template(
                    template,
                    CONVERSATIONS[0],
                    add_generation_prompt=True,
                    special_tokens={"bos_token": "<s>"},
                    **bounds,
                )
            )
        except Exception as e:
            result.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), "the render did not stop"
    return result[0]


# Each would exhaust the time or the memory without its bound; where a broken bound would still
# end, sizes are kept big enough to show in the test's memory peak, small enough not to hurt the machine.
HOSTILE = {
    "nested ranges, no output": (
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        "took longer than 0.3 s",
    ),
    "nested loops with no call in them": (
        "{% set r = range(100000) %}{% for i in r %}{% for j in r %}{% endfor %}{% endfor %}",
        "took longer",
    ),
    "nested loops over a string": (
        "{% set s = 'ab' * 50000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}",
        "took longer",
    ),
    "nested loops in a macro buffer": (
        "{% macro m() %}{% set r = range(100000) %}{% for i in r %}{% for j in r %}"
        "{% if not j %}x{% endif %}{% endfor %}{% endfor %}{% endmacro %}{{ m() }}",
        "took longer",
    ),
    "large values into a macro buffer": (
        "{% macro m() %}{% for i in range(300) %}{{ 'x' * 99999 }}{% endfor %}{% endmacro %}{{ m() }}",
        "built more than 1600000 characters",
    ),
    "slices into a macro buffer": (
        "{% macro m() %}{% set s = 'x' * 99999 %}{% for i in range(300) %}{{ s[i:] }}"
        "{% endfor %}{% endmacro %}{{ m() }}",
        "built more than",
    ),
    "filter blocks into a macro buffer": (
        "{% macro m() %}{% for i in range(300) %}{% filter center(99999) %}x"
        "{% endfilter %}{% endfor %}{% endmacro %}{{ m() }}",
        "built more than",
    ),
    "nested loops with output": (
        "{% for i in range(100000) %}{% for j in range(100000) %}xxxxxxxx{% endfor %}{% endfor %}",
        "produced more than 100000 characters",
    ),
    "string repetition": ('{{ "x" * 10**8 }}', "produced more than"),
    "list repetition": ("{{ ([1] * 10**6) | length }}", "produced more than"),
    "power tower": ("{{ 9 ** (9 ** 9) }}", "more than 4096 bits"),
    "repeated squaring": (
        "{% set ns = namespace(n=3) %}{% for i in range(20) %}{% set ns.n = ns.n * ns.n %}{% endfor %}",
        "more than 4096 bits",
    ),
    "doubling with ~": ("{% set a = 'x' * 1000 %}" + "{% set a = a ~ a %}" * 12, "produced more than"),
    "join of a list of references": (
        "{% set s = 'x' * 90000 %}{% set a = [" + ", ".join(["s"] * 100) + "] %}{{ a | join }}",
        "produced more than",
    ),
    "printing nested references": (
        "{% set s = 'x' * 90000 %}{% set a = [s, s, s, s, s, s, s, s, s, s] %}"
        "{% set b = [a, a, a, a, a, a, a, a, a, a] %}{{ [b, b] }}",
        "produced more than",
    ),
    "padding filter": ("{{ 'x' | center(100000000) }}", "asked for a width of 100000000; at most 100000"),
    "padding method": ("{{ 'x'.ljust(100000000) }}", "asked for a width of 100000000"),
    "% width": ("{{ '%010000000d' % 1 }}", "unsafe operation: the format spec"),
    "format width": ("{{ '{:>10000000}'.format(1) }}", "unsafe operation: the format spec"),
    "format filter width": ("{{ '%.10000000f' | format(1.5) }}", "unsafe operation: the format spec"),
    "dunder via a string": ("{{ ''.__class__.__mro__ }}", r"unsafe operation \(line 1\): access to attribute"),
    "dunder via a global": ("{{ cycler.__init__.__globals__ }}", r"unsafe operation \(line 1\): access to attribute"),
    "mutating a list": ("{% set l = [1] %}{{ l.append(2) }}", "unsafe operation"),
    "namespace underscore": ("{% set ns = namespace() %}{% set ns._x = 1 %}", "unsafe operation"),
    "recursive macro": ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recursed too deeply"),
    "raise_exception": (
        "{% if messages[0].role == 'user' %}{{ raise_exception('bad role') }}{% endif %}",
        "^the chat template rejected the conversation: bad role$",
    ),
    "syntax error": ("{% for m in messages %}\n{{ m.content }\n{% endfor %}", r"is not valid Jinja: .* \(line 2\)"),
    "unknown filter": ("{{ messages | nosuchfilter }}", "is not valid Jinja: No filter named 'nosuchfilter'"),
    "source too large": ("x" * (MAX_TEMPLATE_CHARS + 1), f"at most {MAX_TEMPLATE_CHARS}"),
    "runtime error": ("\n{{ messages[0].content + 1 }}", r"failed \(line 2\): can only concatenate str"),
}


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_template_is_refused(name):
    template, message = HOSTILE[name]
    tracemalloc.start()
    try:
        error = _render_in_thread(template, timeout_s=0.3, max_chars=100_000)
    finally:
        peak_bytes = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    # Every value stayed within the bound (peaks measured at 0.03-0.8 MB with max_chars=100_000).
    assert peak_bytes < 4 << 20
    assert isinstance(error, ChatTemplateError), error
    assert re.search(message, str(error)), str(error)
    assert "Traceback" not in str(error) and "jinja2" not in str(error)


def test_bounds_are_exact_and_per_render():
    text = "{{ 'x' * 1000 }}"
    assert len(_render_in_thread(text, max_chars=1000)) == 1000
    assert "more than 999" in str(_render_in_thread(text, max_chars=999))
    # Two renders at once keep their own deadlines (the budget is per thread, not global).
    slow = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    errors = {}
    threads = [
        threading.Thread(target=lambda t=t: errors.__setitem__(t, _render_in_thread(slow, timeout_s=t)))
        for t in (0.2, 1.0)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert "0.2 s" in str(errors[0.2]) and "1.0 s" in str(errors[1.0])
    assert _render_in_thread(CHATML).startswith("<|im_start|>system")  # nothing left over from failures


def test_check_template_kwargs():
    allowed = {
        "enable_thinking": False,
        "thinking": True,
        "reasoning_effort": "low",
        "add_generation_prompt": True,
        "continue_final_message": False,
        "documents": [{"title": "t", "text": "x"}],
    }
    assert set(allowed) == ALLOWED_TEMPLATE_KWARGS
    assert check_template_kwargs(allowed) == allowed
    assert check_template_kwargs(None) == {}
    for bad in ("tools", "return_tensors", "chat_template", "tokenize", "messages", "bos_token", "whatever"):
        with pytest.raises(ChatTemplateError, match=f"may not set '{bad}'; allowed: add_generation_prompt, "):
            check_template_kwargs({"enable_thinking": True, bad: 1})
