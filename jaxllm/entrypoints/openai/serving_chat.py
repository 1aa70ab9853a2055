"""/v1/chat/completions: messages through the model's chat template, `n` choices, with the chat
API's logprobs and tool calls (serving_tools.py), plain or streamed (a first chunk with the
assistant role, then content and tool-call deltas)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import Request

from jaxllm.entrypoints.openai.middleware import request_id_of
from jaxllm.entrypoints.openai.protocol import (
    AssistantMessage, ChatCompletionChoice, ChatCompletionRequest, ChatCompletionResponse, ChatCompletionStreamChoice,
    ChatCompletionStreamResponse, DeltaFunctionCall, DeltaMessage, DeltaToolCall, FunctionCall, ToolCallOut, UsageInfo)
from jaxllm.entrypoints.openai.serving_engine import ChoiceState, MergedOutputs, OpenAIServing
from jaxllm.entrypoints.openai.serving_tools import ToolCalling, ToolDelta
from jaxllm.entrypoints.openai.serving_utils import APIError, chat_logprobs, finish_reason, sse
from jaxllm.entrypoints.openai.tool_parsers import get_tool_parser


def _tool_deltas(deltas: list[ToolDelta]) -> list[DeltaToolCall] | None:
    return [DeltaToolCall(index=d.index, id=d.id, type="function" if d.id else None,
                          function=DeltaFunctionCall(name=d.name, arguments=d.arguments)) for d in deltas] or None


class OpenAIServingChat(OpenAIServing):
    """The /v1/chat/completions handler."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.tool_parser = (get_tool_parser(self.args.tool_call_parser)
                            if self.args.enable_auto_tool_choice and self.args.tool_call_parser else None)

    async def create_chat_completion(self, request: ChatCompletionRequest, raw: Request):
        self.check_request(request)
        if request.top_logprobs and not request.logprobs:
            raise APIError("top_logprobs needs logprobs set to true", param="top_logprobs")
        tools = ToolCalling(request, self.tool_parser)
        # max_completion_tokens replaces max_tokens; neither: as much as the context leaves.
        max_tokens = request.max_tokens if request.max_completion_tokens is None else request.max_completion_tokens
        params = self.sampling_params(request, max_tokens, request.num_logprobs)
        constraint = tools.constraint()
        if constraint is not None:
            if params.structured_outputs is not None:
                raise APIError(f"tool_choice {tools.mode!r} constrains the output itself; it cannot be combined with "
                               "response_format or structured outputs", param="tool_choice")
            params.structured_outputs = constraint
        eos_text = ""
        if tools.mode == "auto" and tools.parser.needs_special_tokens:
            params.skip_special_tokens = False      # its tool-call marker is a special token; EOS's text is cut
            eos_text = getattr(self.tokenizer, "eos_token", None) or ""
        prompt_ids = await self.chat_prompt(request.messages, request.add_generation_prompt,
                                            request.chat_template_kwargs, request.chat_template,
                                            tools=tools.template_tools)
        self.check_length(len(prompt_ids), max_tokens, "messages")
        request_id = f"chatcmpl-{request_id_of(raw.scope)}"
        created, n = int(time.time()), params.n
        choices = [ChoiceState() for _ in range(n)]

        def usage() -> UsageInfo:
            completion_tokens = sum(len(c.token_ids) for c in choices)
            return UsageInfo(prompt_tokens=len(prompt_ids), completion_tokens=completion_tokens,
                             total_tokens=len(prompt_ids) + completion_tokens)

        def chunk(choice_list: list[ChatCompletionStreamChoice], usage_info: UsageInfo | None = None) -> str:
            response = ChatCompletionStreamResponse(id=request_id, created=created, model=self.model_name,
                                                    choices=choice_list)
            if usage_info is not None:
                response.usage = usage_info
            return sse(response)

        def message(c: ChoiceState) -> tuple[AssistantMessage, str | None]:
            content, calls = tools.extract(c.text.removesuffix(eos_text) if eos_text else c.text)
            out = [ToolCallOut(id=t.id, function=FunctionCall(name=t.name, arguments=t.arguments)) for t in calls]
            return (AssistantMessage(content=content, tool_calls=out or None),
                    tools.finish_reason(len(calls), finish_reason(c.finish_reason)))

        async def collect(outputs: MergedOutputs) -> ChatCompletionResponse:
            async for _, out in outputs:
                for delta in out.outputs:
                    choices[delta.index].add(delta)
            result = [ChatCompletionChoice(
                index=i, message=msg, logprobs=chat_logprobs(c.token_ids, c.logprobs) if request.logprobs else None,
                finish_reason=reason, stop_reason=c.stop_reason)
                for i, c in enumerate(choices) for msg, reason in [message(c)]]
            return ChatCompletionResponse(id=request_id, created=created, model=self.model_name, choices=result,
                                          usage=usage())

        async def stream(outputs: MergedOutputs) -> AsyncIterator[str]:
            yield chunk([ChatCompletionStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""),
                                                    logprobs=None, finish_reason=None) for i in range(n)])
            parsers = [tools.stream() for _ in range(n)]
            async for _, out in outputs:
                for delta in out.outputs:
                    choices[delta.index].add(delta)
                    parser = parsers[delta.index]
                    text = delta.text
                    if eos_text and delta.finish_reason is not None:
                        text = text.removesuffix(eos_text)
                    content, calls = parser.feed(text)
                    if delta.finish_reason is not None:
                        more, more_calls = parser.finish()
                        content, calls = content + more, calls + more_calls
                    elif tools.mode != "none" and not content and not calls and not request.logprobs:
                        continue        # (text held back by the tool parser)
                    choice = ChatCompletionStreamChoice(
                        index=delta.index, delta=DeltaMessage(content=content if content or not calls else None,
                                                              tool_calls=_tool_deltas(calls)),
                        logprobs=chat_logprobs(delta.token_ids, delta.logprobs or []) if request.logprobs else None,
                        finish_reason=tools.finish_reason(parser.num_calls, finish_reason(delta.finish_reason)))
                    if delta.finish_reason is not None:
                        choice.stop_reason = delta.stop_reason
                    yield chunk([choice])
            if request.include_usage:
                yield chunk([], usage())

        return await self.respond(raw, self.start([(None, prompt_ids)], params, request_id), request, collect, stream)
