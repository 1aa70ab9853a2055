"""/v1/chat/completions: messages through the model's chat template, `n` choices, with the chat
API's logprobs, reasoning (reasoning_parsers.py) and tool calls (serving_tools.py), plain or
streamed (a first chunk with the assistant role, then reasoning, content and tool-call deltas)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import Request

from jaxllm.entrypoints.openai.middleware import request_id_of
from jaxllm.entrypoints.openai.protocol import (
    AssistantMessage,
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCallOut,
    UsageInfo,
)
from jaxllm.entrypoints.openai.reasoning_parsers import ReasoningParser, get_reasoning_parser
from jaxllm.entrypoints.openai.serving_engine import ChoiceState, MergedOutputs, OpenAIServing, weight_versions
from jaxllm.entrypoints.openai.serving_tools import ToolCalling, ToolDelta
from jaxllm.entrypoints.openai.serving_utils import APIError, chat_logprobs, finish_reason, sse
from jaxllm.entrypoints.openai.tool_parsers import get_tool_parser


class _ChatCompletion:
    """One chat completion's answer, whole (`collect`) or as server-sent events (`stream`): its
    choices' text turned into messages, tool calls and finish reasons as the request asks.
    `eos_text`: the EOS token's text, cut from the end (a tool parser that reads special tokens
    keeps them in the text). `reasoning`: the server's reasoning parser, and whether the prompt
    opened the thoughts (the output's text before the tool parser sees it)."""

    def __init__(
        self,
        request: ChatCompletionRequest,
        tools: ToolCalling,
        model_name: str,
        prompt_ids: list[int],
        request_id: str,
        n: int,
        eos_text: str,
        reasoning: tuple[ReasoningParser, bool] | None = None,
    ):
        self.request, self.tools, self.model_name, self.prompt_ids = request, tools, model_name, prompt_ids
        self.request_id, self.n, self.eos_text, self.reasoning = request_id, n, eos_text, reasoning
        self.created = int(time.time())
        self.choices = [ChoiceState() for _ in range(n)]

    def usage(self) -> UsageInfo:
        completion_tokens = sum(len(c.token_ids) for c in self.choices)
        return UsageInfo(
            prompt_tokens=len(self.prompt_ids),
            completion_tokens=completion_tokens,
            total_tokens=len(self.prompt_ids) + completion_tokens,
        )

    def chunk(self, choice_list: list[ChatCompletionStreamChoice], usage_info: UsageInfo | None = None) -> str:
        response = ChatCompletionStreamResponse(
            id=self.request_id, created=self.created, model=self.model_name, choices=choice_list
        )
        if usage_info is not None:
            response.usage = usage_info
        return sse(response)

    def message(self, c: ChoiceState) -> tuple[AssistantMessage, str | None]:
        text, thoughts = c.text.removesuffix(self.eos_text) if self.eos_text else c.text, None
        if self.reasoning is not None:
            parser, opened = self.reasoning
            thoughts, text = parser.extract(text, opened)
            text = text or ""
        content, calls = self.tools.extract(text)
        out = [ToolCallOut(id=t.id, function=FunctionCall(name=t.name, arguments=t.arguments)) for t in calls]
        return (
            AssistantMessage(
                content=content or (None if thoughts or calls else content),
                reasoning_content=thoughts if self.request.include_reasoning else None,
                tool_calls=out or None,
            ),
            self.tools.finish_reason(len(calls), finish_reason(c.finish_reason)),
        )

    async def collect(self, outputs: MergedOutputs) -> ChatCompletionResponse:
        async for _, out in outputs:
            for delta in out.outputs:
                self.choices[delta.index].add(delta)
        logprobs = self.request.logprobs
        result = [
            ChatCompletionChoice(
                index=i,
                message=msg,
                logprobs=chat_logprobs(c.token_ids, c.logprobs) if logprobs else None,
                finish_reason=reason,
                stop_reason=c.stop_reason,
            )
            for i, c in enumerate(self.choices)
            for msg, reason in [self.message(c)]
        ]
        return ChatCompletionResponse(
            id=self.request_id,
            created=self.created,
            model=self.model_name,
            choices=result,
            usage=self.usage(),
            weight_versions=weight_versions(self.choices),
        )

    async def stream(self, outputs: MergedOutputs) -> AsyncIterator[str]:
        yield self.chunk(
            [
                ChatCompletionStreamChoice(
                    index=i, delta=DeltaMessage(role="assistant", content=""), logprobs=None, finish_reason=None
                )
                for i in range(self.n)
            ]
        )
        async for choice in self.stream_choices(outputs):
            yield self.chunk([choice])
        if self.request.include_usage:
            yield self.chunk([], self.usage())

    async def stream_choices(self, outputs: MergedOutputs) -> AsyncIterator[ChatCompletionStreamChoice]:
        """Each choice's deltas as they come: reasoning, content and tool calls parsed."""
        parsers = [self.tools.stream() for _ in range(self.n)]
        thinking = [self.reasoning[0].stream(self.reasoning[1]) if self.reasoning else None for _ in range(self.n)]
        async for _, out in outputs:
            for delta in out.outputs:
                self.choices[delta.index].add(delta)
                choice = self._stream_choice(delta, parsers[delta.index], thinking[delta.index])
                if choice is not None:
                    yield choice

    def _stream_choice(self, delta, parser, thinking) -> ChatCompletionStreamChoice | None:
        """One choice's new text as a stream chunk's choice, or None while a parser holds it."""
        text, thoughts = delta.text, ""
        finished = delta.finish_reason is not None
        if self.eos_text and finished:
            text = text.removesuffix(self.eos_text)
        if thinking is not None:  # the reasoning first; the tool parser sees the content only
            thoughts, text = thinking.feed(text)
            if finished:
                more_thoughts, more = thinking.finish()
                thoughts, text = thoughts + more_thoughts, text + more
        content, calls = parser.feed(text)
        if finished:
            more, more_calls = parser.finish()
            content, calls = content + more, calls + more_calls
        elif (self.tools.mode != "none" or thinking is not None) and not (
            content or calls or thoughts or self.request.logprobs
        ):
            return None  # (text held back by a parser)
        if not self.request.include_reasoning:
            thoughts = ""
        choice = ChatCompletionStreamChoice(
            index=delta.index,
            delta=DeltaMessage(
                content=content if content or not (calls or thoughts) else None,
                reasoning_content=thoughts or None,
                tool_calls=_tool_deltas(calls),
            ),
            logprobs=chat_logprobs(delta.token_ids, delta.logprobs or []) if self.request.logprobs else None,
            finish_reason=self.tools.finish_reason(parser.num_calls, finish_reason(delta.finish_reason)),
        )
        if delta.finish_reason is not None:
            choice.stop_reason = delta.stop_reason
        return choice


def _tool_deltas(deltas: list[ToolDelta]) -> list[DeltaToolCall] | None:
    return [
        DeltaToolCall(
            index=d.index,
            id=d.id,
            type="function" if d.id else None,
            function=DeltaFunctionCall(name=d.name, arguments=d.arguments),
        )
        for d in deltas
    ] or None


class OpenAIServingChat(OpenAIServing):
    """The /v1/chat/completions handler."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.tool_parser = (
            get_tool_parser(self.args.tool_call_parser)
            if self.args.enable_auto_tool_choice and self.args.tool_call_parser
            else None
        )
        self.reasoning_parser = get_reasoning_parser(self.args.reasoning_parser) if self.args.reasoning_parser else None

    async def create_chat_completion(self, request: ChatCompletionRequest, raw: Request):
        chat, outputs = await self.start_chat(request, raw, "chatcmpl")
        return await self.respond(raw, outputs, request, chat.collect, chat.stream)

    async def start_chat(
        self, request: ChatCompletionRequest, raw: Request, id_prefix: str, max_tool_calls: int | None = None
    ):
        """The request checked, rendered and queued: (its `_ChatCompletion`, its outputs).
        `max_tool_calls`: at most this many tool calls (the Responses API's bound)."""
        lora = self.check_request(request)
        if request.top_logprobs and not request.logprobs:
            raise APIError("top_logprobs needs logprobs set to true", param="top_logprobs")
        tools = ToolCalling(request, self.tool_parser, max_tool_calls)
        # max_completion_tokens replaces max_tokens; neither: as much as the context leaves.
        max_tokens = request.max_tokens if request.max_completion_tokens is None else request.max_completion_tokens
        params = self.sampling_params(request, max_tokens, request.num_logprobs)
        constraint = tools.constraint()
        if constraint is not None:
            if params.structured_outputs is not None:
                raise APIError(
                    f"tool_choice {tools.mode!r} constrains the output itself; it cannot be combined with "
                    "response_format or structured outputs",
                    param="tool_choice",
                )
            params.structured_outputs = constraint
        eos_text = ""
        if tools.mode == "auto" and tools.parser.needs_special_tokens:
            params.skip_special_tokens = False  # its tool-call marker is a special token; EOS's text is cut
            eos_text = getattr(self.tokenizer, "eos_token", None) or ""
        prompt_ids = await self.chat_prompt(
            request.messages,
            request.add_generation_prompt,
            request.chat_template_kwargs,
            request.chat_template,
            tools=tools.template_tools,
        )
        self.check_length(len(prompt_ids), max_tokens, "messages")
        reasoning = None
        if self.reasoning_parser is not None:
            opened = self.reasoning_parser.opened_by(self.tokenizer.decode(prompt_ids[-16:]))
            reasoning = self.reasoning_parser, opened
            if params.structured_outputs is not None and not self.args.structured_outputs_in_reasoning:
                # (the grammar starts where the thoughts end)
                params.structured_outputs = self.reasoning_parser.constrain(params.structured_outputs, opened)
        chat = _ChatCompletion(
            request,
            tools,
            self.model_name if lora is None else lora.lora_name,
            prompt_ids,
            f"{id_prefix}-{request_id_of(raw.scope)}",
            params.n,
            eos_text,
            reasoning,
        )
        return chat, self.start([(None, prompt_ids)], params, chat.request_id, request.priority, lora)
