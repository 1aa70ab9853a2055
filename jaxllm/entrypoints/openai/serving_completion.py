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
from jaxllm.entrypoints.openai.serving_engine import ChoiceState, MergedOutputs, OpenAIServing, weight_versions
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
            raise APIError(
                f"at most {self.args.max_prompts_per_request} prompts are allowed per request (the "
                f"server's --max-prompts-per-request), got {len(prompt)}",
                param="prompt",
            )
        out = []
        for p in prompt:
            if isinstance(p, str):
                out.append((p, await self.encode(p)))
            else:
                out.append((None, list(p)))
        return out

    async def create_completion(self, request: CompletionRequest, raw: Request):
        lora = self.check_request(request)
        params = self.sampling_params(request, request.max_tokens, request.logprobs)
        prompts = await self.completion_prompts(request.prompt)
        for _, ids in prompts:
            self.check_length(len(ids), request.max_tokens)
        echo = [""] * len(prompts)
        if request.echo:
            echo = [
                text if text is not None else await self.in_worker(self.tokenizer.decode, ids) for text, ids in prompts
            ]
        if request.echo and request.logprobs is not None:
            params = dataclasses.replace(params, prompt_logprobs=request.logprobs)
        model = self.model_name if lora is None else lora.lora_name
        completion = _Completion(
            request, model, prompts, echo, f"cmpl-{request_id_of(raw.scope)}", params.n, self.tokenizer
        )
        return await self.respond(
            raw,
            self.start(prompts, params, completion.request_id, request.priority, lora),
            request,
            completion.collect,
            completion.stream,
        )


class _Completion:
    """One completion request's answer, whole (`collect`) or as server-sent events (`stream`):
    `n` choices per prompt, each led by its prompt's text with `echo` (and with logprobs, the
    prompt's logprobs, once known)."""

    def __init__(
        self, request: CompletionRequest, model_name: str, prompts, echo: list[str], request_id: str, n: int, tokenizer
    ):
        self.request, self.model_name, self.prompts, self.echo = request, model_name, prompts, echo
        self.request_id, self.n, self.tokenizer = request_id, n, tokenizer
        self.created = int(time.time())
        self.choices = [ChoiceState() for _ in range(len(prompts) * n)]
        self.prompt_lp: list = [None] * len(prompts)

    def note_prompt_logprobs(self, i: int, out) -> None:
        if out.prompt_logprobs is not None and self.prompt_lp[i] is None:
            ids = self.prompts[i][1]
            self.prompt_lp[i] = echo_logprobs(ids, out.prompt_logprobs, self.tokenizer.decode(ids[:1]))

    def usage(self) -> UsageInfo:
        prompt_tokens = sum(len(ids) for _, ids in self.prompts)
        completion_tokens = sum(len(c.token_ids) for c in self.choices)
        return UsageInfo(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )

    def response(self, choices: list[CompletionChoice], usage: UsageInfo | None = None) -> CompletionResponse:
        return CompletionResponse(
            id=self.request_id,
            created=self.created,
            model=self.model_name,
            choices=choices,
            usage=usage,
            weight_versions=weight_versions(self.choices) if usage is not None else None,
        )

    async def collect(self, outputs: MergedOutputs) -> CompletionResponse:
        n = self.n
        async for i, out in outputs:
            self.note_prompt_logprobs(i, out)
            for delta in out.outputs:
                self.choices[i * n + delta.index].add(delta)
        result = []
        for index, c in enumerate(self.choices):
            prefix = self.echo[index // n]
            logprobs = None
            if self.request.logprobs is not None:
                logprobs = joined_logprobs(
                    self.prompt_lp[index // n], completion_logprobs(c.token_ids, c.logprobs, len(prefix))
                )
            result.append(
                CompletionChoice(
                    index=index,
                    text=prefix + c.text,
                    logprobs=logprobs,
                    finish_reason=finish_reason(c.finish_reason),
                    stop_reason=c.stop_reason,
                )
            )
        return self.response(result, self.usage())

    async def stream(self, outputs: MergedOutputs) -> AsyncIterator[str]:
        async for i, out in outputs:
            self.note_prompt_logprobs(i, out)
            for delta in out.outputs:
                yield sse(self.response([self._stream_choice(i, delta)]))
        if self.request.include_usage:
            yield sse(self.response([], self.usage()))

    def _stream_choice(self, i: int, delta) -> CompletionChoice:
        """Prompt i's choice `delta.index`'s new text (led by the echo on its first chunk)."""
        index = i * self.n + delta.index
        c = self.choices[index]
        first = not c.token_ids and not c.text and c.text_offset == 0
        text = (self.echo[i] if first else "") + delta.text
        logprobs = None
        if self.request.logprobs is not None:
            start = c.text_offset if not first else len(self.echo[i])
            logprobs = completion_logprobs(delta.token_ids, delta.logprobs or [], start)
            c.text_offset = start + sum(len(t) for t in logprobs.tokens)
            if first:
                logprobs = joined_logprobs(self.prompt_lp[i], logprobs)
        c.add(delta)
        return CompletionChoice(
            index=index,
            text=text,
            logprobs=logprobs,
            finish_reason=finish_reason(delta.finish_reason),
            stop_reason=delta.stop_reason,
        )
