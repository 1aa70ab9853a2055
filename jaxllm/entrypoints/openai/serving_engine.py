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
import functools
import json
import logging
from collections.abc import AsyncIterator
from concurrent.futures import Executor

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask

from jaxllm.chat_template import check_template_kwargs
from jaxllm.engine.async_llm import AsyncLLM, EngineDeadError, RequestFailedError
from jaxllm.engine.trainer import EngineSleepingError
from jaxllm.entrypoints.metrics import ServerMetrics
from jaxllm.entrypoints.openai.http_server import Shutdown
from jaxllm.entrypoints.openai.middleware import request_id_of
from jaxllm.entrypoints.openai.protocol import ChatMessage, SamplingRequest
from jaxllm.entrypoints.openai.server_args import ServerArgs
from jaxllm.entrypoints.openai.serving_lora import find_adapter
from jaxllm.entrypoints.openai.serving_utils import (
    APIError,
    ClientDisconnected,
    bad_value,
    error_body,
    sse,
    unless_disconnected,
)
from jaxllm.lora.request import LoRARequest
from jaxllm.outputs import CompletionOutput, Logprob, RequestOutput

logger = logging.getLogger("jaxllm.server")

MAX_STOP_CHARS = 4096  # the detokenizer holds back as many characters as the longest stop string


class ServerShuttingDown(Exception):
    """The shutdown grace period ended before this request did."""


class ClientTooSlow(Exception):
    """The client read its stream so much slower than the engine wrote it that its backlog
    passed --max-stream-backlog: the request was stopped."""


class MergedOutputs:
    """Engine requests (one per prompt) running concurrently; yields `(prompt_index, output)` in
    arrival order. `close()` cancels whatever still runs, which aborts it in the engine; `stop()`
    makes the consumer raise `ServerShuttingDown` at its next output. A consumer that falls more
    than `max_backlog` outputs behind (a client that stops reading its stream) has its requests
    aborted: what is buffered for it stays bounded, and only its own requests are affected."""

    _DONE = object()

    def __init__(self, streams: list[AsyncIterator[RequestOutput]], max_backlog: int | None = None):
        self.max_backlog = max_backlog
        self._queue: asyncio.Queue = asyncio.Queue()
        self._early: list[tuple[int, object]] = []
        self._running = len(streams)
        self._tasks = [asyncio.create_task(self._drain(i, s)) for i, s in enumerate(streams)]

    async def _drain(self, i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in stream:
                self._queue.put_nowait((i, out))
                if self.max_backlog is not None and self._queue.qsize() > self.max_backlog:
                    await stream.aclose()  # (aborts the engine request: its pages are freed)
                    message = f"the client fell {self.max_backlog} outputs behind its stream; the request was stopped"
                    self._queue.put_nowait((i, ClientTooSlow(message)))
                    return
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

    def stop(self) -> None:
        self._queue.put_nowait((-1, ServerShuttingDown("the server is shutting down")))

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
    text_offset: int = 0  # characters already given a logprob offset (completions API)
    weight_versions: list = dataclasses.field(default_factory=list)  # per token

    def add(self, delta: CompletionOutput) -> None:
        self.text += delta.text
        self.token_ids += delta.token_ids
        self.weight_versions += delta.weight_versions
        self.logprobs += delta.logprobs or []
        self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason


def weight_versions(choices: list[ChoiceState]) -> list:
    """The weight versions that computed the choices' tokens, each once, in order (one, unless
    the weights changed while the request ran)."""
    return list(dict.fromkeys(v for c in choices for v in c.weight_versions))


def _message_dicts(messages: list[ChatMessage]) -> list[dict]:
    out = []
    for m in messages:
        content = m.content
        if isinstance(content, list):
            for part in content:
                if part.type != "text":
                    raise APIError(
                        f"message content parts of type {part.type!r} are not supported (only 'text')", param="messages"
                    )
            content = "".join(part.text or "" for part in content)
        # OpenAI's "developer" role is the system role of older models (and of chat templates).
        message = {"role": "system" if m.role == "developer" else m.role, "content": content or ""}
        if m.name:
            message["name"] = m.name
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            # Templates read the arguments as an object (transformers' convention); clients send JSON text.
            message["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)},
                }
                for c in m.tool_calls
            ]
        out.append(message)
    return out


def _arguments(arguments: str | dict):
    if isinstance(arguments, dict):
        return arguments
    try:
        return json.loads(arguments)
    except ValueError:
        raise APIError("a tool call's arguments must be a JSON object", param="messages") from None


def api_error(e: Exception, request_id: str, request: SamplingRequest | None = None) -> APIError | None:
    """The error answer for an exception raised while a request runs; None if unexpected (a bug:
    the caller lets it propagate, to be logged once with its traceback)."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, ValueError):
        return bad_value(e, request)
    if isinstance(e, ClientTooSlow):
        return APIError(str(e), 408)
    if isinstance(e, ServerShuttingDown):
        return APIError("the server is shutting down; the request was stopped before it finished", 503)
    if isinstance(e, EngineDeadError):
        return APIError("the engine has stopped; the server is restarting", 503)
    if isinstance(e, EngineSleepingError):
        return APIError(f"{e} (POST /wake_up)", 503, headers={"Retry-After": "1"})
    if isinstance(e, RequestFailedError):  # the engine logged the traceback with this id
        return APIError(
            f"the engine failed while computing this request ({request_id}); other requests are unaffected", 500
        )
    return None


class OpenAIServing:
    """What the route groups share; each app makes one of each over one `AsyncLLM`, its
    `ServerMetrics`, `ServerArgs`, `Shutdown` and tokenizer worker threads."""

    def __init__(self, llm: AsyncLLM, metrics: ServerMetrics, args: ServerArgs, shutdown: Shutdown, workers: Executor):
        self.llm = llm
        engine = llm.engine
        self.tokenizer = engine.tokenizer
        self.model_name = engine.model_name
        self.max_model_len = engine.config.scheduler.max_model_len
        self.max_num_seqs = engine.config.scheduler.max_num_seqs
        self.max_logprobs = engine.config.max_logprobs
        self.metrics, self.args, self.shutdown, self.workers = metrics, args, shutdown, workers

    async def in_worker(self, fn, *args):
        """Run tokenizer work (tokenize, detokenize, chat templates) off the event loop: a
        megabyte prompt takes ~0.5 s to tokenize, and every stream would stall meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(self.workers, functools.partial(fn, *args))

    # ----- checks shared by the endpoints -----
    def check_model(self, model: str | None) -> LoRARequest | None:
        """The adapter `model` names (None: the base model); 404 for a name the server does not serve."""
        if not model or model == self.model_name:
            return None
        lora = find_adapter(self.llm.engine, model)
        if lora is None:
            adapters = ", ".join(f"`{r.lora_name}`" for r in self.llm.engine.lora_requests())
            raise APIError(
                f"The model `{model}` does not exist; this server serves `{self.model_name}`"
                + (f" and the LoRA adapters {adapters}." if adapters else "."),
                404,
                param="model",
            )
        return lora

    def check_request(self, request: SamplingRequest) -> LoRARequest | None:
        """Checks made before anything is allocated or tokenized; returns the adapter the request's
        `model` names, if any."""
        lora = self.check_model(request.model)
        if request.priority and self.llm.engine.config.scheduler.scheduling_policy != "priority":
            raise APIError(
                "priority needs a server started with --scheduling-policy priority (this one serves fcfs)",
                param="priority",
            )
        if self.llm.engine.pooling is not None:
            raise APIError(
                f"The model `{self.model_name}` is served for embeddings (/v1/embeddings, /pooling): it does "
                "not generate text",
                param="model",
            )
        field = request.unsupported()
        if field:
            raise APIError(f"{field} is not supported by this server (as given)", param=field)
        for name in ("n", "best_of"):
            value = getattr(request, name, None)
            if value is not None and value > self.max_num_seqs:
                raise APIError(
                    f"{name} must be at most {self.max_num_seqs} (the server's --max-num-seqs), got {value}", param=name
                )
        stops = [request.stop] if isinstance(request.stop, str) else request.stop or []
        if len(stops) > self.args.max_stop_strings:
            raise APIError(
                f"at most {self.args.max_stop_strings} stop strings are allowed (the server's "
                f"--max-stop-strings), got {len(stops)}",
                param="stop",
            )
        if any(len(stop) > MAX_STOP_CHARS for stop in stops):
            raise APIError(f"stop strings must be at most {MAX_STOP_CHARS} characters", param="stop")
        name, value = request.logprobs_field()
        if value is not None and not 0 <= value <= self.max_logprobs:
            raise APIError(
                f"{name} must be in [0, {self.max_logprobs}] (the server's --max-logprobs), got {value}", param=name
            )
        if request.stream_options is not None and not request.stream:
            raise APIError("stream_options is only allowed when stream is true", param="stream_options")
        return lora

    def sampling_params(self, request: SamplingRequest, max_tokens: int | None, logprobs: int | None):
        try:
            return request.sampling_params(max_tokens, logprobs)
        except ValueError as e:
            raise bad_value(e, request) from e

    def check_length(self, num_prompt_tokens: int, max_tokens: int | None, prompt_param: str = "prompt") -> None:
        wanted = num_prompt_tokens + (max_tokens or 1)
        if wanted > self.max_model_len:
            raise APIError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{wanted} tokens ({num_prompt_tokens} in the prompt, {max_tokens or 1} in the completion). "
                f"Please reduce the length of the prompt or of the completion.",
                param=prompt_param if num_prompt_tokens >= self.max_model_len else "max_tokens",
            )

    async def encode(self, text: str, *, add_special_tokens: bool = True, param: str = "prompt") -> list[int]:
        try:
            return await self.in_worker(
                functools.partial(self.tokenizer.encode, add_special_tokens=add_special_tokens), text
            )
        except Exception as e:  # e.g. text the tokenizer cannot take
            raise APIError(f"{param} could not be tokenized: {type(e).__name__}", param=param) from e

    async def chat_prompt(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool,
        template_kwargs: dict | None = None,
        chat_template: str | None = None,
        tools: list[dict] | None = None,
    ) -> list[int]:
        try:
            template_kwargs = check_template_kwargs(template_kwargs or {})
        except ValueError as e:
            raise APIError(str(e), param="chat_template_kwargs") from e
        if chat_template is not None and not self.args.trust_request_chat_template:
            raise APIError(
                "chat_template is not accepted from requests: the server renders the model's own "
                "template (an operator can allow it with --trust-request-chat-template)",
                param="chat_template",
            )
        template_kwargs.setdefault("add_generation_prompt", add_generation_prompt)  # the kwargs' value wins
        if tools:
            template_kwargs["tools"] = tools
        render = functools.partial(
            self.llm.engine.apply_chat_template,
            _message_dicts(messages),
            chat_template=chat_template,
            **template_kwargs,
        )
        try:
            return await self.in_worker(render)
        except ValueError as e:  # the template refused the conversation, or hit a bound
            raise APIError(str(e), param="messages") from e

    # ----- running engine requests into a response -----
    def start(
        self,
        prompts: list[tuple[str | None, list[int]]],
        params,
        request_id: str,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> MergedOutputs:
        limit = self.max_num_seqs + self.args.max_waiting_requests
        if self.llm.num_unfinished_requests + len(prompts) > limit:
            raise APIError(
                f"the server is at capacity ({limit} requests running or queued); retry later",
                429,
                headers={"Retry-After": "1"},
            )
        streams = [
            self.metrics.track(
                self.llm.generate(
                    {"prompt": text, "prompt_token_ids": ids},
                    params,
                    f"{request_id}-{i}",
                    output_kind="delta",
                    priority=priority,
                    lora_request=lora_request,
                ),
                log=not self.args.disable_log_requests,
                params=params,
            )
            for i, (text, ids) in enumerate(prompts)
        ]
        outputs = MergedOutputs(streams, self.args.max_stream_backlog)
        self.shutdown.register(outputs)
        return outputs

    async def respond(
        self,
        raw: Request,
        outputs: MergedOutputs,
        request: SamplingRequest,
        collect,
        stream,
        *,
        stream_end: str = "data: [DONE]\n\n",
        stream_error=None,
    ):
        """Run `collect(outputs)` for a plain response or `stream(outputs)` (SSE lines) for a
        streamed one; map failures to their error answers and a client that left to 499.
        `stream_end`: the stream's last line; `stream_error(message, status, param)`: the event
        of a failure once the stream has begun (default: OpenAI's error object)."""
        request_id = request_id_of(raw.scope)
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
            return StreamingResponse(
                self._sse_lines(stream(outputs), outputs, request_id, stream_end, stream_error),
                media_type="text/event-stream",
                background=BackgroundTask(outputs.close),
            )
        except ClientDisconnected:
            return Response(status_code=499)
        except Exception as e:
            error = api_error(e, request_id, request)
            if error is None:
                raise
            raise error from e

    @staticmethod
    async def _sse_lines(
        chunks: AsyncIterator[str], outputs: MergedOutputs, request_id: str, end: str, error_event
    ) -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield chunk
        except Exception as e:  # headers are sent: report in-band, as vLLM does
            error = api_error(e, request_id)
            if error is None:  # a bug: log it once, tell the client only the request id
                logger.exception("request %s: the stream failed", request_id)
                error = APIError(f"internal error; the server logged it as request {request_id}", 500)
            if error_event is not None:
                yield error_event(error.message, error.status, error.param)
            else:
                yield sse(error_body(error.message, error.status, error.param))
        finally:
            await outputs.close()
        if end:
            yield end
