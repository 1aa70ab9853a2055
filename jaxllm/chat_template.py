"""Chat templates: a conversation -> prompt text, as transformers' `apply_chat_template(...,
tokenize=False)` renders it, but in a bounded sandbox (jaxllm/jinja_sandbox.py).

A chat template is code. The model's own template is trusted like its weights, but a server
renders client data through it (`chat_template_kwargs`, checked by `check_template_kwargs`) and,
when the operator opts in, a client's whole template: `render_chat_template` bounds the time and
the size of every render, and every failure is a ChatTemplateError (a ValueError, an HTTP 400).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np

from jaxllm.jinja_sandbox import ChatTemplateError, compile_template, render

__all__ = [
    "ALLOWED_TEMPLATE_KWARGS",
    "DEFAULT_TIMEOUT_S",
    "MAX_OUTPUT_CHARS",
    "ChatTemplateError",
    "check_template_kwargs",
    "render_chat_template",
]

# Template variables a client may set: data the template reads, never code. (`tools` comes from
# the request's own field, checked by its model.)
ALLOWED_TEMPLATE_KWARGS = frozenset(
    {
        "add_generation_prompt",  # end with the assistant's header (bool)
        "continue_final_message",  # leave the last message open for the model to continue (bool)
        "enable_thinking",  # Qwen3, SmolLM3, GLM-4.5: reason before answering (bool)
        "thinking",  # DeepSeek-V3.1, Granite 3.x: the same switch (bool)
        "reasoning_effort",  # gpt-oss: "low" | "medium" | "high"
        "documents",  # RAG templates (Command-R, Granite): [{"title": ..., "text": ...}]
    }
)
DEFAULT_TIMEOUT_S = 2.0
MAX_OUTPUT_CHARS = 1_000_000
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # first: the name templates read
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def check_template_kwargs(kwargs: Mapping | None) -> dict:
    """A client's `chat_template_kwargs`, as a dict, if every name is in ALLOWED_TEMPLATE_KWARGS."""
    for name in kwargs or {}:
        if name not in ALLOWED_TEMPLATE_KWARGS:
            raise ChatTemplateError(
                f"chat_template_kwargs may not set {name!r}; allowed: {', '.join(sorted(ALLOWED_TEMPLATE_KWARGS))}"
            )
    return dict(kwargs or {})


def render_chat_template(
    template: str,
    messages: list[dict],
    *,
    add_generation_prompt: bool,
    special_tokens: Mapping[str, str],
    template_kwargs: Mapping | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    max_chars: int = MAX_OUTPUT_CHARS,
) -> str:
    """The prompt text of `messages` rendered by `template`.

    special_tokens: the tokenizer's `special_tokens_map` (`bos_token`, `eos_token`, ...).
    template_kwargs: more template variables; they win over the special tokens and over
        `add_generation_prompt`. `continue_final_message` (True, or the message field to
        continue) ends the text inside the final message, as transformers does.
    Raises ChatTemplateError for any failure, including `timeout_s` seconds passing or the text
    (or a value built on the way) exceeding `max_chars` characters.
    """
    compiled = compile_template(template)
    variables = _plain({**special_tokens, **(template_kwargs or {})})
    continue_final = variables.pop("continue_final_message", False)
    add_generation_prompt = variables.pop("add_generation_prompt", add_generation_prompt)
    if continue_final and add_generation_prompt:
        raise ChatTemplateError("continue_final_message and add_generation_prompt cannot both be set")
    documents = variables.get("documents")
    if documents is not None and not (isinstance(documents, list) and all(isinstance(d, dict) for d in documents)):
        raise ChatTemplateError("documents must be a list of objects")
    messages = _conversation(messages)
    final = _tag_final_message(messages, continue_final, template) if continue_final else None
    variables = {
        "tools": None,
        "documents": None,
        **variables,
        "messages": messages,
        "add_generation_prompt": add_generation_prompt,
    }
    text = render(compiled, variables, timeout_s=timeout_s, max_chars=max_chars)
    return text if final is None else _cut_at_tag(text, final)


def _plain(value):
    """`value` rebuilt from JSON types, as transformers does, so that the template sees no object
    with methods of its own (numpy scalars, enums, pydantic models: their methods may do anything)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    for base in (str, int, float):  # a subclass (an enum...) carries methods of its own
        if isinstance(value, base):
            return str.__str__(value) if base is str else base(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return (tuple if isinstance(value, tuple) else list)(_plain(v) for v in value)
    if isinstance(value, np.generic):
        return _plain(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _conversation(messages: list[dict]) -> list[dict]:
    """Plain copies of the messages, without keys whose value is None, and with the reasoning
    under `reasoning_content` and `thinking` too (the names templates read), as in transformers."""
    if not messages:
        raise ChatTemplateError("the conversation is empty")
    conversation = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"each message must be an object, got {type(message).__name__}")
        message = _plain({k: v for k, v in message.items() if v is not None})
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        conversation.append(message)
    return conversation


def _tag_final_message(messages: list[dict], continue_final: bool | str, template: str) -> str:
    """Mark the end of the final message's text (its field `continue_final`, or `content`) so that
    `_cut_at_tag` can end the rendered text there; return that text."""
    field = continue_final if isinstance(continue_final, str) else "content"
    last = messages[-1]
    final = last.get(field)
    if final is None:
        raise ChatTemplateError(f"continue_final_message is set but the final message has no {field!r}")
    fields = [f for f in _REASONING_FIELDS if last.get(f) == final] if field in _REASONING_FIELDS else [field]
    if not any(f in template for f in fields):
        raise ChatTemplateError(f"continue_final_message is set to {field!r} but the chat template never reads it")
    if isinstance(final, (list, tuple)):  # content blocks: continue the last text block
        block = next((b for b in reversed(final) if isinstance(b, dict) and "text" in b), None)
        if block is None:
            raise ChatTemplateError("continue_final_message is set but the final message has no text")
        final, block["text"] = block["text"], block["text"] + _CONTINUE_TAG
    elif isinstance(final, str):
        last.update((f, final + _CONTINUE_TAG) for f in fields)
    else:
        raise ChatTemplateError(f"continue_final_message is set but the final message's {field!r} is not text")
    return final


def _cut_at_tag(text: str, final: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in text or tag not in text:
        raise ChatTemplateError("continue_final_message is set but the chat template drops (part of) the final message")
    cut = text.rindex(tag)
    return text[:cut] if text.startswith(_CONTINUE_TAG, cut) else text[:cut].rstrip()
