"""`POST /v1/messages` and `/v1/messages/count_tokens`: Anthropic's Messages API over the chat
completion machinery (serving_chat.py), as vLLM and llama.cpp's server serve it.

A request becomes a chat completion request: `system` a system message, text blocks the
message's text, `tool_use` blocks an assistant's tool calls, `tool_result` blocks tool messages,
`tools` OpenAI function tools, `tool_choice` auto / any (required) / tool (named) / none,
`stop_sequences` stop strings, `priority` (vLLM's extra, as on the OpenAI routes) the engine
request's. The answer's content is a thinking block (with --reasoning-parser), text, then
tool_use blocks; `stop_reason` end_turn, max_tokens, stop_sequence (with `stop_sequence`) or
tool_use. Streamed, the events are Anthropic's: message_start, then per block
content_block_start / _delta (text_delta, thinking_delta, input_json_delta) / _stop, then
message_delta (stop reason, output tokens) and message_stop.
Errors have Anthropic's shape (`{"type": "error", "error": {"type", "message"}}`).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from fastapi import Request
from pydantic import ValidationError

from jaxllm.entrypoints.anthropic.protocol import (
    CountTokensRequest,
    CountTokensResponse,
    MessageResponse,
    MessagesRequest,
    TextBlock,
    TextOut,
    ThinkingBlock,
    ThinkingOut,
    ToolResultBlock,
    ToolUseBlock,
    ToolUseOut,
    Usage,
    error_body,
)
from jaxllm.entrypoints.openai.protocol import ChatCompletionRequest
from jaxllm.entrypoints.openai.serving_chat import OpenAIServingChat
from jaxllm.entrypoints.openai.serving_utils import APIError


def _text(content: str | list[TextBlock]) -> str:
    return content if isinstance(content, str) else "".join(b.text for b in content)


def chat_messages(request: CountTokensRequest) -> list[dict]:
    """The conversation as chat completion messages (OpenAI's shape). Raises APIError (400) for
    blocks this server cannot read."""
    out = [{"role": "system", "content": _text(request.system)}] if request.system else []
    for i, m in enumerate(request.messages):
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        texts, calls, results = [], [], 0
        for block in m.content:
            if isinstance(block, TextBlock):
                texts.append(block.text)
            elif isinstance(block, ToolUseBlock) and m.role == "assistant":
                arguments = json.dumps(block.input, ensure_ascii=False)
                calls.append(
                    {"id": block.id, "type": "function", "function": {"name": block.name, "arguments": arguments}}
                )
            elif isinstance(block, ToolResultBlock) and m.role == "user":
                out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": _text(block.content)})
                results += 1
            elif isinstance(block, ThinkingBlock):
                continue  # (an earlier answer's thinking is not shown to the model again)
            else:
                raise APIError(
                    f"messages.{i}: {m.role} content blocks of type {block.type!r} are not supported here",
                    param="messages",
                )
        if texts or calls or not results:
            out.append({"role": m.role, "content": "".join(texts), **({"tool_calls": calls} if calls else {})})
    return out


def _tools(request: CountTokensRequest) -> list[dict] | None:
    if not request.tools:
        return None
    return [
        {"type": "function", "function": {"name": t.name, "description": t.description, "parameters": t.input_schema}}
        for t in request.tools
    ]


def chat_request(request: MessagesRequest) -> ChatCompletionRequest:
    """The Messages request as a chat completion request."""
    fields = dict(
        model=request.model,
        messages=chat_messages(request),
        max_tokens=request.max_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=request.top_k,
        stop=request.stop_sequences,
        stream=request.stream,
        tools=_tools(request),
        priority=request.priority,
    )
    choice = request.tool_choice
    if choice is not None:
        if choice.type == "tool" and not choice.name:
            raise APIError('tool_choice of type "tool" needs the tool\'s name', param="tool_choice")
        fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type) or {
            "type": "function",
            "function": {"name": choice.name},
        }
        fields["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as e:
        err = e.errors()[0]
        raise APIError(f"{'.'.join(str(x) for x in err['loc'])}: {err['msg']}", param="messages") from None


def stop_reason(finish_reason: str | None, stop: int | str | None, called: bool) -> tuple[str | None, str | None]:
    """(Anthropic's stop_reason, stop_sequence) of a chat choice's finish; `called`: it made tool
    calls (a forced call ends with "stop" in the chat API, with "tool_use" here)."""
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason == "tool_calls" or (finish_reason == "stop" and called):
        return "tool_use", None
    if finish_reason == "stop" and isinstance(stop, str):
        return "stop_sequence", stop
    return ("end_turn" if finish_reason else None), None


def _tool_use(call_id: str, name: str, arguments: str) -> ToolUseOut | TextOut:
    """A parsed call as a tool_use block; arguments that are not a JSON object stay text."""
    try:
        value = json.loads(arguments)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        return TextOut(text=arguments)
    return ToolUseOut(id=call_id, name=name, input=value)


def _event(kind: str, **payload) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **payload}, ensure_ascii=False)}\n\n"


class AnthropicServingMessages:
    """The /v1/messages handlers, over the chat completion handler."""

    def __init__(self, chat: OpenAIServingChat):
        self.chat = chat

    async def count_tokens(self, request: CountTokensRequest) -> CountTokensResponse:
        self.chat.check_model(request.model)
        ids = await self.chat.chat_prompt(
            [m for m in ChatCompletionRequest.model_validate({"messages": chat_messages(request)}).messages],
            True,
            tools=_tools(request),
        )
        return CountTokensResponse(input_tokens=len(ids))

    async def create_message(self, request: MessagesRequest, raw: Request):
        chat_req = chat_request(request)
        chat, outputs = await self.chat.start_chat(chat_req, raw, "msg")

        async def collect(outputs) -> MessageResponse:
            answer = await chat.collect(outputs)
            choice = answer.choices[0]
            message = choice.message
            content = [ThinkingOut(thinking=message.reasoning_content)] if message.reasoning_content else []
            content += [TextOut(text=message.content)] if message.content else []
            content += [_tool_use(c.id, c.function.name, c.function.arguments) for c in message.tool_calls or []]
            reason, sequence = stop_reason(choice.finish_reason, choice.stop_reason, bool(message.tool_calls))
            usage = Usage(input_tokens=answer.usage.prompt_tokens, output_tokens=answer.usage.completion_tokens)
            return MessageResponse(
                id=chat.request_id,
                model=chat.model_name,
                content=content,
                stop_reason=reason,
                stop_sequence=sequence,
                usage=usage,
            )

        async def stream(outputs) -> AsyncIterator[str]:
            start = MessageResponse(
                id=chat.request_id,
                model=chat.model_name,
                content=[],
                usage=Usage(input_tokens=len(chat.prompt_ids), output_tokens=0),
            )
            yield _event("message_start", message=start.model_dump())
            blocks = _Blocks()
            async for choice in chat.stream_choices(outputs):
                delta = choice.delta
                if delta.reasoning_content:
                    yield blocks.add("thinking", "thinking_delta", thinking=delta.reasoning_content)
                if delta.content:
                    yield blocks.add("text", "text_delta", text=delta.content)
                for call in delta.tool_calls or []:
                    arguments = call.function.arguments if call.function else ""
                    if call.id:  # a new call: its own block
                        yield blocks.open("tool_use", id=call.id, name=call.function.name, input={})
                    if arguments:
                        yield blocks.add("tool_use", "input_json_delta", partial_json=arguments)
                if choice.finish_reason is not None:
                    reason, sequence = stop_reason(choice.finish_reason, choice.stop_reason, blocks.called)
                    yield blocks.close()
                    usage = {"output_tokens": chat.usage().completion_tokens}
                    yield _event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence}, usage=usage)
            yield _event("message_stop")

        return await self.chat.respond(
            raw, outputs, chat_req, collect, stream, stream_end="", stream_error=lambda m, s, _: _error_event(m, s)
        )


def _error_event(message: str, status: int) -> str:
    return _event("error", error=error_body(message, status)["error"])


class _Blocks:
    """The stream's content blocks: which one is open, and the events that open, feed and close them."""

    def __init__(self):
        self.index, self.kind, self.called = -1, None, False

    def open(self, kind: str, **block) -> str:
        events = self.close()
        self.index, self.kind = self.index + 1, kind
        self.called |= kind == "tool_use"
        empty = {"text": {"text": ""}, "thinking": {"thinking": "", "signature": ""}}.get(kind, {})
        return events + _event("content_block_start", index=self.index, content_block={"type": kind, **empty, **block})

    def add(self, kind: str, delta_type: str, **delta) -> str:
        events = self.open(kind) if self.kind != kind else ""
        return events + _event("content_block_delta", index=self.index, delta={"type": delta_type, **delta})

    def close(self) -> str:
        if self.kind is None:
            return ""
        self.kind = None
        return _event("content_block_stop", index=self.index)
