"""/v1/completions: one or more prompts (text or token ids), `n` choices each, optionally echoed,
with the completions API's logprobs (text offsets; an echoed prompt's too, as evaluation tools
score text), plain or streamed."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator

from fastapi import Request

from jaxllm.entrypoints.openai.middleware import request_id_of
from jaxllm.entrypoints.openai.protocol import CompletionChoice, CompletionRequest, CompletionResponse, UsageInfo
from jaxllm.entrypoints.openai.serving_engine import ChoiceState, MergedOutputs, OpenAIServing
from jaxllm.entrypoints.openai.serving_utils import (
    APIError,
    completion_logprobs,
    echo_logprobs,
    finish_reason,
    joined_logprobs,
    sse,
)


class OpenAIServingCompletion(OpenAIServing):
    """The /v1/completions handler."""

    async def completion_prompts(self, prompt) -> list[tuple[str | None, list[int]]]:
        if isinstance(prompt, str):
            prompt = [prompt]
        elif prompt and isinstance(prompt[0], int):
            prompt = [prompt]
        if not prompt:
            raise APIError("prompt must not be empty", param="prompt")
        if len(prompt) > self.args.max_prompts_per_request:
            raise APIError(f"at most {self.args.max_prompts_per_request} prompts are allowed per request (the "
                           f"server's --max-prompts-per-request), got {len(prompt)}", param="prompt")
        out = []
        for p in prompt:
            if isinstance(p, str):
                out.append((p, await self.encode(p)))
            else:
                out.append((None, list(p)))
        return out

    async def create_completion(self, request: CompletionRequest, raw: Request):
        self.check_request(request)
        params = self.sampling_params(request, request.max_tokens, request.logprobs)
        prompts = await self.completion_prompts(request.prompt)
        for _, ids in prompts:
            self.check_length(len(ids), request.max_tokens)
        request_id = f"cmpl-{request_id_of(raw.scope)}"
        created, n = int(time.time()), params.n
        choices = [ChoiceState() for _ in range(len(prompts) * n)]
        echo = [""] * len(prompts)
        if request.echo:
            echo = [text if text is not None else await self.in_worker(self.tokenizer.decode, ids)
                    for text, ids in prompts]
        # Echo with logprobs: the prompt's logprobs lead each choice's (per prompt, once known).
        prompt_lp: list = [None] * len(prompts)
        if request.echo and request.logprobs is not None:
            params = dataclasses.replace(params, prompt_logprobs=request.logprobs)

        def note_prompt_logprobs(i: int, out) -> None:
            if out.prompt_logprobs is not None and prompt_lp[i] is None:
                ids = prompts[i][1]
                prompt_lp[i] = echo_logprobs(ids, out.prompt_logprobs, self.tokenizer.decode(ids[:1]))

        def usage() -> UsageInfo:
            prompt_tokens = sum(len(ids) for _, ids in prompts)
            completion_tokens = sum(len(c.token_ids) for c in choices)
            return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                             total_tokens=prompt_tokens + completion_tokens)

        async def collect(outputs: MergedOutputs) -> CompletionResponse:
            async for i, out in outputs:
                note_prompt_logprobs(i, out)
                for delta in out.outputs:
                    choices[i * n + delta.index].add(delta)
            result = []
            for index, c in enumerate(choices):
                prefix = echo[index // n]
                logprobs = None
                if request.logprobs is not None:
                    logprobs = joined_logprobs(prompt_lp[index // n],
                                               completion_logprobs(c.token_ids, c.logprobs, len(prefix)))
                result.append(CompletionChoice(index=index, text=prefix + c.text, logprobs=logprobs,
                                               finish_reason=finish_reason(c.finish_reason),
                                               stop_reason=c.stop_reason))
            return CompletionResponse(id=request_id, created=created, model=self.model_name, choices=result,
                                      usage=usage())

        async def stream(outputs: MergedOutputs) -> AsyncIterator[str]:
            async for i, out in outputs:
                note_prompt_logprobs(i, out)
                for delta in out.outputs:
                    index = i * n + delta.index
                    c = choices[index]
                    first = not c.token_ids and not c.text and c.text_offset == 0
                    text = (echo[i] if first else "") + delta.text
                    logprobs = None
                    if request.logprobs is not None:
                        start = c.text_offset if not first else len(echo[i])
                        logprobs = completion_logprobs(delta.token_ids, delta.logprobs or [], start)
                        c.text_offset = start + sum(len(t) for t in logprobs.tokens)
                        if first:
                            logprobs = joined_logprobs(prompt_lp[i], logprobs)
                    c.add(delta)
                    choice = CompletionChoice(index=index, text=text, logprobs=logprobs,
                                              finish_reason=finish_reason(delta.finish_reason),
                                              stop_reason=delta.stop_reason)
                    yield sse(CompletionResponse(id=request_id, created=created, model=self.model_name,
                                                 choices=[choice]))
            if request.include_usage:
                yield sse(CompletionResponse(id=request_id, created=created, model=self.model_name, choices=[],
                                             usage=usage()))

        return await self.respond(raw, self.start(prompts, params, request_id), request, collect, stream)
