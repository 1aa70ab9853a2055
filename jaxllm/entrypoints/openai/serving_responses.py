"""`POST /v1/responses`: OpenAI's Responses API over the chat completion machinery
(serving_chat.py), as vLLM serves it.

The request becomes a chat completion request: `instructions` a system message, `input` (text,
or message / function_call / function_call_output items) the conversation, after the stored one
of `previous_response_id`; flat function `tools` and `tool_choice` the chat API's; `text.format`
(json_schema, json_object) the response format; `max_output_tokens` max_tokens; `max_tool_calls`
a bound on the function calls; `reasoning.effort` the chat template's `reasoning_effort` (where
the template reads it); `include` of the output's logprobs (with `top_logprobs`) the chat API's
logprobs; `priority` the engine request's. The answer's `output` is a reasoning item (with
--reasoning-parser), a message with `output_text`, then function_call items; `status`
"incomplete" (`max_output_tokens`) when it ran out of tokens. Streamed, the events are the API's
typed ones, each with its `sequence_number`.

With `store` (the default) the conversation and its answer are kept for `previous_response_id`
in a bounded in-memory store (`--responses-store-size` responses, 256 Mi characters in all; the
least recently used dropped).
"""

from __future__ import annotations

import collections
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from pydantic import ValidationError

from jaxllm.entrypoints.openai.protocol import ChatCompletionRequest
from jaxllm.entrypoints.openai.responses_protocol import (
    OUTPUT_LOGPROBS,
    FunctionCallItem,
    FunctionCallOutputItem,
    MessageItem,
    ReasoningItem,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    TextPart,
)
from jaxllm.entrypoints.openai.serving_chat import OpenAIServingChat
from jaxllm.entrypoints.openai.serving_utils import APIError


class ResponseStore:
    """Conversations of stored responses (chat messages, the answer included), by response id;
    at most `size` of them and `max_chars` characters of them in all, the least recently used
    dropped first. Thread-safe."""

    def __init__(self, size: int, max_chars: int = 256 << 20):
        self.size, self.max_chars, self.chars = size, max_chars, 0
        self._items: collections.OrderedDict[str, tuple[list[dict], int]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def put(self, response_id: str, messages: list[dict]) -> None:
        chars = len(json.dumps(messages, ensure_ascii=False))
        if self.size <= 0 or chars > self.max_chars:
            return
        with self._lock:
            self._items[response_id] = messages, chars
            self.chars += chars
            while len(self._items) > self.size or self.chars > self.max_chars:
                _, (_, dropped) = self._items.popitem(last=False)
                self.chars -= dropped

    def get(self, response_id: str) -> list[dict] | None:
        with self._lock:
            item = self._items.get(response_id)
            if item is None:
                return None
            self._items.move_to_end(response_id)
            return item[0]


def _text(content) -> str:
    if isinstance(content, str):
        return content
    for part in content:
        if not isinstance(part, TextPart):
            raise APIError(f"input content parts of type {part.type!r} are not supported here", param="input")
    return "".join(p.text for p in content)


def conversation(request: ResponsesRequest, history: list[dict]) -> list[dict]:
    """The chat messages of `history` (a stored conversation) and the request's `input`."""
    items = [MessageItem(role="user", content=request.input)] if isinstance(request.input, str) else request.input
    out = list(history)
    for item in items:
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            out.append({"role": role, "content": _text(item.content)})
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            if out and out[-1]["role"] == "assistant":  # (the calls of one answer, in one message)
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
        elif not isinstance(item, ReasoningItem):
            raise APIError(f"input items of type {item.type!r} are not supported here", param="input")
    return out


def chat_request(request: ResponsesRequest, messages: list[dict]) -> ChatCompletionRequest:
    fields = dict(
        model=request.model,
        messages=([{"role": "system", "content": request.instructions}] if request.instructions else []) + messages,
        max_tokens=request.max_output_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        stream=request.stream,
        parallel_tool_calls=request.parallel_tool_calls,
        priority=request.priority,
        logprobs=request.logprobs,
        top_logprobs=request.top_logprobs if request.logprobs else None,
    )
    effort = request.reasoning.effort if request.reasoning else None
    if effort is not None:
        fields["chat_template_kwargs"] = {"reasoning_effort": effort}
    if request.tools:
        fields["tools"] = [
            {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)} for t in request.tools
        ]
    choice = request.tool_choice
    if choice is not None:
        fields["tool_choice"] = (
            choice if isinstance(choice, str) else {"type": "function", "function": {"name": choice.name}}
        )
    fmt = request.text.format if request.text else None
    if fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise APIError("text.format of type json_schema needs its schema", param="text")
        fields["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": fmt.name, "schema": fmt.json_schema},
        }
    elif fmt is not None and fmt.type == "json_object":
        fields["response_format"] = {"type": "json_object"}
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as e:
        err = e.errors()[0]
        raise APIError(f"{'.'.join(str(x) for x in err['loc'])}: {err['msg']}", param="input") from None


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _message_item(item_id: str, text: str, status: str = "completed", logprobs: list | None = None) -> dict:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}
    content = [part] if status == "completed" else []
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def _reasoning_item(item_id: str, text: str | None) -> dict:
    return {
        "type": "reasoning",
        "id": item_id,
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}] if text else [],
    }


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


class OpenAIServingResponses:
    """The /v1/responses handler, over the chat completion handler."""

    def __init__(self, chat: OpenAIServingChat, store_size: int):
        self.chat = chat
        self.store = ResponseStore(store_size)

    def check(self, request: ResponsesRequest) -> None:
        """400s for what this server cannot honour, naming the field."""
        refused = request.unsupported()
        if refused:
            field, why = refused
            raise APIError(why, param=field)
        effort = request.reasoning.effort if request.reasoning else None
        if effort is not None and "reasoning_effort" not in (self.chat.llm.engine.chat_template or ""):
            raise APIError(
                "reasoning.effort goes to the chat template as reasoning_effort, which this model's template "
                "never reads",
                param="reasoning",
            )
        parsed = self.chat.reasoning_parser is not None or (bool(request.tools) and request.tool_choice != "none")
        if request.logprobs and parsed:
            raise APIError(
                f"include {OUTPUT_LOGPROBS!r}: logprobs are given where the message is the whole output, not "
                "beside tools or a --reasoning-parser",
                param="include",
            )

    async def create_response(self, request: ResponsesRequest, raw: Request):
        self.check(request)
        history = []
        if request.previous_response_id is not None:
            history = self.store.get(request.previous_response_id)
            if history is None:
                raise APIError(
                    f"no stored response {request.previous_response_id!r} (not stored, or dropped from the "
                    f"server's store of {self.store.size})",
                    404,
                    param="previous_response_id",
                )
        messages = conversation(request, history)
        chat_req = chat_request(request, messages)
        chat, outputs = await self.chat.start_chat(chat_req, raw, "resp", max_tool_calls=request.max_tool_calls)
        created = int(time.time())

        def response(status: str, output: list[dict], finish: str | None = None) -> ResponseObject:
            incomplete = finish == "length"
            usage = chat.usage()
            return ResponseObject(
                id=chat.request_id,
                created_at=created,
                status="incomplete" if incomplete and status == "completed" else status,
                incomplete_details={"reason": "max_output_tokens"} if incomplete else None,
                model=chat.model_name,
                output=output,
                instructions=request.instructions,
                tools=[t.model_dump(exclude_none=True) for t in request.tools or []],
                tool_choice=request.tool_choice or "auto",
                parallel_tool_calls=request.parallel_tool_calls is not False,
                text={"format": request.text.format.model_dump(by_alias=True, exclude_none=True)}
                if request.text and request.text.format
                else {"format": {"type": "text"}},
                temperature=request.temperature,
                top_p=request.top_p,
                max_output_tokens=request.max_output_tokens,
                max_tool_calls=request.max_tool_calls,
                top_logprobs=request.top_logprobs,
                reasoning=request.reasoning.model_dump(exclude_none=True) if request.reasoning else None,
                previous_response_id=request.previous_response_id,
                store=request.store is not False,
                usage=ResponseUsage(
                    input_tokens=usage.prompt_tokens,
                    output_tokens=usage.completion_tokens,
                    total_tokens=usage.total_tokens,
                )
                if status != "in_progress"
                else None,
            )

        def remember(content: str | None, calls: list[dict]) -> None:
            if request.store is not False:
                answer = {"role": "assistant", "content": content or "", **({"tool_calls": calls} if calls else {})}
                self.store.put(chat.request_id, [*messages, answer])

        async def collect(outputs) -> ResponseObject:
            answer = await chat.collect(outputs)
            choice = answer.choices[0]
            message = choice.message
            output = [_reasoning_item(_id("rs"), message.reasoning_content)] if message.reasoning_content else []
            logprobs = [lp.model_dump() for lp in choice.logprobs.content or []] if choice.logprobs else None
            output += [_message_item(_id("msg"), message.content, logprobs=logprobs)] if message.content else []
            calls = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": c.function.arguments},
                }
                for c in message.tool_calls or []
            ]
            output += [_call_item(_id("fc"), c["id"], c["function"]["name"], c["function"]["arguments"]) for c in calls]
            remember(message.content, calls)
            return response("completed", output, choice.finish_reason)

        async def stream(outputs) -> AsyncIterator[str]:
            events = _Events()
            yield events.emit("response.created", response=response("in_progress", []).model_dump())
            yield events.emit("response.in_progress", response=response("in_progress", []).model_dump())
            finish = None
            async for choice in chat.stream_choices(outputs):
                delta = choice.delta
                if delta.reasoning_content:
                    yield events.reasoning(delta.reasoning_content)
                logprobs = [lp.model_dump() for lp in choice.logprobs.content or []] if choice.logprobs else []
                if delta.content or logprobs:
                    yield events.text(delta.content or "", logprobs)
                for call in delta.tool_calls or []:
                    if call.id:
                        yield events.open_call(call.id, call.function.name)
                    if call.function and call.function.arguments:
                        yield events.arguments(call.function.arguments)
                finish = choice.finish_reason or finish
            yield events.close()
            message = next((i for i in events.items if i["type"] == "message"), None)
            calls = [
                {"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
                for i in events.items
                if i["type"] == "function_call"
            ]
            remember(message["content"][0]["text"] if message else None, calls)
            final = response("completed", events.items, finish)
            kind = "response.completed" if final.status == "completed" else "response.incomplete"
            yield events.emit(kind, response=final.model_dump())

        return await self.chat.respond(
            raw, outputs, chat_req, collect, stream, stream_end="", stream_error=_error_event
        )


def _error_event(message: str, status: int, param: str | None) -> str:
    body = {"type": "error", "code": str(status), "message": message, "param": param, "sequence_number": 0}
    return f"event: error\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"


class _Events:
    """The stream's output items: which one is open, and the events that open, feed and close them."""

    def __init__(self):
        self.sequence, self.items, self.open_kind, self.buffer = 0, [], None, ""
        self.logprobs: list[dict] = []  # the open message's

    def emit(self, kind: str, **payload) -> str:
        body = {"type": kind, "sequence_number": self.sequence, **payload}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

    def _start(self, kind: str, item: dict) -> str:
        events = self.close()
        self.open_kind, self.buffer, self.logprobs = kind, "", []
        self.items.append(item)
        events += self.emit("response.output_item.added", output_index=len(self.items) - 1, item=item)
        if kind == "message":
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            events += self.emit("response.content_part.added", **self._where(), content_index=0, part=part)
        return events

    def _where(self) -> dict:
        return {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1}

    def reasoning(self, text: str) -> str:
        events = self._start("reasoning", _reasoning_item(_id("rs"), None)) if self.open_kind != "reasoning" else ""
        self.buffer += text
        return events + self.emit("response.reasoning_text.delta", **self._where(), content_index=0, delta=text)

    def text(self, text: str, logprobs: list[dict]) -> str:
        events = (
            self._start("message", _message_item(_id("msg"), "", "in_progress")) if self.open_kind != "message" else ""
        )
        self.buffer += text
        self.logprobs += logprobs
        return events + self.emit(
            "response.output_text.delta", **self._where(), content_index=0, delta=text, logprobs=logprobs
        )

    def open_call(self, call_id: str, name: str) -> str:
        return self._start("function_call", _call_item(_id("fc"), call_id, name, "", "in_progress"))

    def arguments(self, text: str) -> str:
        self.buffer += text
        return self.emit("response.function_call_arguments.delta", **self._where(), delta=text)

    def close(self) -> str:
        kind, text = self.open_kind, self.buffer
        if kind is None:
            return ""
        self.open_kind = None
        where, item = self._where(), self.items[-1]
        if kind == "reasoning":
            item.update(_reasoning_item(item["id"], text))
            events = self.emit("response.reasoning_text.done", **where, content_index=0, text=text)
        elif kind == "message":
            item.update(_message_item(item["id"], text, logprobs=self.logprobs))
            part = item["content"][0]
            events = self.emit("response.output_text.done", **where, content_index=0, text=text, logprobs=self.logprobs)
            events += self.emit("response.content_part.done", **where, content_index=0, part=part)
        else:
            item.update(arguments=text, status="completed")
            events = self.emit("response.function_call_arguments.done", **where, arguments=text)
        return events + self.emit("response.output_item.done", output_index=where["output_index"], item=item)
