"""/v1/chat/completions: messages through the model's chat template, `n` choices, with the chat
API's logprobs, plain or streamed (a first chunk with the assistant role, then content deltas)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import Request

from jaxllm.entrypoints.openai.middleware import request_id_of
from jaxllm.entrypoints.openai.protocol import (
    AssistantMessage, ChatCompletionChoice, ChatCompletionRequest, ChatCompletionResponse, ChatCompletionStreamChoice,
    ChatCompletionStreamResponse, DeltaMessage, UsageInfo)
from jaxllm.entrypoints.openai.serving_engine import ChoiceState, MergedOutputs, OpenAIServing
from jaxllm.entrypoints.openai.serving_utils import APIError, chat_logprobs, finish_reason, sse


class OpenAIServingChat(OpenAIServing):
    """The /v1/chat/completions handler."""

    async def create_chat_completion(self, request: ChatCompletionRequest, raw: Request):
        self.check_request(request)
        if request.top_logprobs and not request.logprobs:
            raise APIError("top_logprobs needs logprobs set to true", param="top_logprobs")
        # max_completion_tokens replaces max_tokens; neither: as much as the context leaves.
        max_tokens = request.max_tokens if request.max_completion_tokens is None else request.max_completion_tokens
        params = self.sampling_params(request, max_tokens, request.num_logprobs)
        prompt_ids = await self.chat_prompt(request.messages, request.add_generation_prompt,
                                            request.chat_template_kwargs, request.chat_template)
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

        async def collect(outputs: MergedOutputs) -> ChatCompletionResponse:
            async for _, out in outputs:
                for delta in out.outputs:
                    choices[delta.index].add(delta)
            result = [ChatCompletionChoice(
                index=i, message=AssistantMessage(content=c.text),
                logprobs=chat_logprobs(c.token_ids, c.logprobs) if request.logprobs else None,
                finish_reason=finish_reason(c.finish_reason), stop_reason=c.stop_reason)
                for i, c in enumerate(choices)]
            return ChatCompletionResponse(id=request_id, created=created, model=self.model_name, choices=result,
                                          usage=usage())

        async def stream(outputs: MergedOutputs) -> AsyncIterator[str]:
            yield chunk([ChatCompletionStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""),
                                                    logprobs=None, finish_reason=None) for i in range(n)])
            async for _, out in outputs:
                for delta in out.outputs:
                    choices[delta.index].add(delta)
                    choice = ChatCompletionStreamChoice(
                        index=delta.index, delta=DeltaMessage(content=delta.text),
                        logprobs=chat_logprobs(delta.token_ids, delta.logprobs or []) if request.logprobs else None,
                        finish_reason=finish_reason(delta.finish_reason))
                    if delta.finish_reason is not None:
                        choice.stop_reason = delta.stop_reason
                    yield chunk([choice])
            if request.include_usage:
                yield chunk([], usage())

        return await self.respond(raw, self.start([(None, prompt_ids)], params, request_id), request, collect, stream)
