"""`OpenAIServing`, the base of the route groups (`serving_completion.py`, `serving_chat.py`,
`serving_tokenization.py`): the engine and its limits, the checks every endpoint makes, the chat
template, and running engine requests into a plain or streamed (SSE) response.

One HTTP request becomes one engine request per prompt (`/v1/completions` takes several).
Each engine request streams deltas (`output_kind="delta"`) into `MergedOutputs`, which hands
them to the response in arrival order; a streamed response turns each into an SSE chunk, a
plain one accumulates them. When the client goes away the handler is cancelled, which
cancels the engine requests' tasks: `AsyncLLM.generate` then aborts them and frees their pages.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask

from jaxllm.engine.async_llm import AsyncLLM
from jaxllm.entrypoints.metrics import ServerMetrics
from jaxllm.entrypoints.openai.protocol import ChatMessage, SamplingRequest
from jaxllm.entrypoints.openai.serving_utils import (
    APIError, ClientDisconnected, bad_value, error_body, sse, unless_disconnected)
from jaxllm.outputs import CompletionOutput, Logprob, RequestOutput

logger = logging.getLogger("jaxllm.server")


class MergedOutputs:
    """Engine requests (one per prompt) running concurrently; yields `(prompt_index, output)` in
    arrival order. `close()` cancels whatever still runs, which aborts it in the engine."""

    _DONE = object()

    def __init__(self, streams: list[AsyncIterator[RequestOutput]]):
        self._queue: asyncio.Queue = asyncio.Queue()
        self._early: list[tuple[int, object]] = []
        self._running = len(streams)
        self._tasks = [asyncio.create_task(self._drain(i, s)) for i, s in enumerate(streams)]

    async def _drain(self, i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in stream:
                self._queue.put_nowait((i, out))
        except Exception as e:  # handed to the consumer; cancellation is not caught
            self._queue.put_nowait((i, e))
        else:
            self._queue.put_nowait((i, self._DONE))

    async def _next(self) -> tuple[int, object]:
        i, item = await self._queue.get()
        if isinstance(item, Exception):
            raise item
        return i, item

    async def wait_started(self) -> None:
        """Wait for every request's first output. A bad request raises its ValueError here, so a
        streamed response can still answer 400 before it sends its headers."""
        started: set[int] = set()
        while len(started) < len(self._tasks):
            i, item = await self._next()
            started.add(i)
            self._early.append((i, item))

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        while self._running:
            i, item = self._early.pop(0) if self._early else await self._next()
            if item is self._DONE:
                self._running -= 1
            else:
                yield i, item

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


@dataclasses.dataclass(slots=True)
class ChoiceState:
    """One choice's output so far (the deltas of one CompletionOutput, joined)."""

    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text_offset: int = 0   # characters already given a logprob offset (completions API)

    def add(self, delta: CompletionOutput) -> None:
        self.text += delta.text
        self.token_ids += delta.token_ids
        self.logprobs += delta.logprobs or []
        self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason


def _message_dicts(messages: list[ChatMessage]) -> list[dict]:
    out = []
    for m in messages:
        content = m.content
        if isinstance(content, list):
            for part in content:
                if part.type != "text":
                    raise APIError(f"message content parts of type {part.type!r} are not supported (only 'text')",
                                   param="messages")
            content = "".join(part.text or "" for part in content)
        message = {"role": m.role, "content": content or ""}
        if m.name:
            message["name"] = m.name
        out.append(message)
    return out


class OpenAIServing:
    """What the route groups share; each app makes one of each over one `AsyncLLM` and one
    `ServerMetrics`."""

    def __init__(self, llm: AsyncLLM, metrics: ServerMetrics):
        self.llm = llm
        engine = llm.engine
        self.tokenizer = engine.tokenizer
        self.model_name = engine.model_name
        self.max_model_len = engine.config.scheduler.max_model_len
        self.metrics = metrics

    # ----- checks shared by the endpoints -----
    def check_model(self, model: str | None) -> None:
        if model and model != self.model_name:
            raise APIError(f"The model `{model}` does not exist; this server serves `{self.model_name}`.",
                           param="model")

    def check_request(self, request: SamplingRequest) -> None:
        self.check_model(request.model)
        field = request.unsupported()
        if field:
            raise APIError(f"{field} is not supported by this server (as given)", param=field)

    def check_length(self, num_prompt_tokens: int, max_tokens: int | None, prompt_param: str = "prompt") -> None:
        wanted = num_prompt_tokens + (max_tokens or 1)
        if wanted > self.max_model_len:
            raise APIError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{wanted} tokens ({num_prompt_tokens} in the prompt, {max_tokens or 1} in the completion). "
                f"Please reduce the length of the prompt or of the completion.",
                param=prompt_param if num_prompt_tokens >= self.max_model_len else "max_tokens")

    def chat_prompt(self, messages: list[ChatMessage], add_generation_prompt: bool, kwargs: dict | None) -> list[int]:
        try:
            return self.llm.engine.apply_chat_template(_message_dicts(messages),
                                                       add_generation_prompt=add_generation_prompt, **(kwargs or {}))
        except APIError:
            raise
        except Exception as e:  # jinja raises its own errors for conversations a template rejects
            raise APIError(f"the chat template rejected the messages: {e}", param="messages") from e

    # ----- running engine requests into a response -----
    def start(self, prompts: list[tuple[str | None, list[int]]], params, request_id: str) -> MergedOutputs:
        streams = [self.metrics.track(self.llm.generate({"prompt": text, "prompt_token_ids": ids}, params,
                                                        f"{request_id}-{i}", output_kind="delta"))
                   for i, (text, ids) in enumerate(prompts)]
        return MergedOutputs(streams)

    async def respond(self, raw: Request, outputs: MergedOutputs, request: SamplingRequest, collect, stream):
        """Run `collect(outputs)` for a plain response or `stream(outputs)` (SSE lines) for a
        streamed one; map bad requests to 400 and a client that left to 499."""
        try:
            if not request.stream:
                try:
                    return await unless_disconnected(raw, collect(outputs))
                finally:
                    await outputs.close()
            try:
                await unless_disconnected(raw, outputs.wait_started())
            except BaseException:
                await outputs.close()
                raise
            return StreamingResponse(self._sse_lines(stream(outputs), outputs), media_type="text/event-stream",
                                     background=BackgroundTask(outputs.close))
        except ValueError as e:
            raise bad_value(e, request) from e
        except ClientDisconnected:
            return Response(status_code=499)

    @staticmethod
    async def _sse_lines(chunks: AsyncIterator[str], outputs: MergedOutputs) -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield chunk
        except Exception as e:  # headers are sent: report in-band, as vLLM does
            status = 400 if isinstance(e, ValueError) else 500
            if status == 500:
                logger.exception("stream failed")
            yield sse(error_body(str(e), status))
        finally:
            await outputs.close()
        yield "data: [DONE]\n\n"
