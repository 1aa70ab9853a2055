"""The OpenAI-compatible HTTP server: a FastAPI app over one `AsyncLLM`.

One HTTP request becomes one engine request per prompt (`/v1/completions` takes several).
Each engine request streams deltas (`output_kind="delta"`) into `_MergedOutputs`, which hands
them to the response in arrival order; a streamed response turns each into an SSE chunk, a
plain one accumulates them. When the client goes away the handler is cancelled, which
cancels the engine requests' tasks: `AsyncLLM.generate` then aborts them and frees their pages.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import re
import secrets
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

import jaxllm
from jaxllm.engine.async_llm import AsyncLLM, EngineDeadError
from jaxllm.entrypoints.metrics import CONTENT_TYPE, ServerMetrics
from jaxllm.entrypoints.openai.protocol import (
    AssistantMessage, ChatChoiceLogprobs, ChatCompletionChoice, ChatCompletionRequest, ChatCompletionResponse,
    ChatCompletionStreamChoice, ChatCompletionStreamResponse, ChatLogprob, ChatMessage, ChatTopLogprob,
    CompletionChoice, CompletionLogProbs, CompletionRequest, CompletionResponse, DeltaMessage, DetokenizeRequest,
    DetokenizeResponse, ErrorInfo, ErrorResponse, ModelCard, ModelList, SamplingRequest, TokenizeRequest,
    TokenizeResponse, UsageInfo)
from jaxllm.outputs import CompletionOutput, Logprob, RequestOutput

logger = logging.getLogger("jaxllm.server")


# ----------------------------------------------------------------------------- errors


class APIError(Exception):
    """Answered as OpenAI's error JSON with this HTTP status."""

    def __init__(self, message: str, status: int = 400, *, param: str | None = None):
        super().__init__(message)
        self.message, self.status, self.param = message, status, param


_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                405: "invalid_request_error", 500: "internal_server_error", 503: "service_unavailable"}


def error_body(message: str, status: int, param: str | None = None) -> dict:
    info = ErrorInfo(message=message, type=_ERROR_TYPES.get(status, "invalid_request_error"), param=param,
                     code=status)
    return ErrorResponse(error=info).model_dump()


def error_response(message: str, status: int, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param), status_code=status)


def _bad_value(e: ValueError, request: SamplingRequest | None = None) -> APIError:
    """SamplingParams and the engine word their errors "<field> must be ..."; name the field."""
    message = str(e)
    field = re.match(r"\w*", message).group()
    known = request is not None and field in type(request).model_fields
    return APIError(message, 400, param=field if known else None)


class _ClientDisconnected(Exception):
    pass


# ----------------------------------------------------------------------------- concurrency helpers


class _MergedOutputs:
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


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Awaitable):
    """Run `work`, cancelling it if the client disconnects first (uvicorn does not cancel a
    handler whose client has gone)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise _ClientDisconnected()
    return task.result()


# ----------------------------------------------------------------------------- per-choice state


@dataclasses.dataclass(slots=True)
class _Choice:
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


def _sampled(token_id: int, entry: dict[int, Logprob]) -> tuple[Logprob, list[Logprob]]:
    """(the sampled token's Logprob, the ranked top-k Logprobs, best first)."""
    top = sorted((lp for lp in entry.values() if lp.rank is not None), key=lambda lp: lp.rank)
    return entry[token_id], top


def completion_logprobs(token_ids: list[int], entries: list[dict[int, Logprob]], offset: int) -> CompletionLogProbs:
    out = CompletionLogProbs()
    for token_id, entry in zip(token_ids, entries):
        chosen, top = _sampled(token_id, entry)
        token = chosen.decoded_token or ""
        out.tokens.append(token)
        out.token_logprobs.append(chosen.logprob)
        out.top_logprobs.append({lp.decoded_token or "": lp.logprob for lp in [*top, chosen]})
        out.text_offset.append(offset)
        offset += len(token)
    return out


def chat_logprobs(token_ids: list[int], entries: list[dict[int, Logprob]]) -> ChatChoiceLogprobs:
    def item(lp: Logprob, cls=ChatTopLogprob, **extra):
        token = lp.decoded_token or ""
        return cls(token=token, logprob=lp.logprob, bytes=list(token.encode()), **extra)

    content = []
    for token_id, entry in zip(token_ids, entries):
        chosen, top = _sampled(token_id, entry)
        content.append(item(chosen, ChatLogprob, top_logprobs=[item(lp) for lp in top]))
    return ChatChoiceLogprobs(content=content)


def _finish_reason(reason: str | None) -> str | None:
    return None if reason == "abort" else reason


def _sse(payload) -> str:
    data = payload.model_dump_json() if hasattr(payload, "model_dump_json") else json.dumps(payload)
    return f"data: {data}\n\n"


# ----------------------------------------------------------------------------- the endpoints


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
    """The request handlers; one per app."""

    def __init__(self, llm: AsyncLLM):
        self.llm = llm
        engine = llm.engine
        self.tokenizer = engine.tokenizer
        self.model_name = engine.model_name
        self.max_model_len = engine.config.scheduler.max_model_len
        self.metrics = ServerMetrics(engine, self.model_name)

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

    def start(self, prompts: list[tuple[str | None, list[int]]], params, request_id: str) -> _MergedOutputs:
        streams = [self.metrics.track(self.llm.generate({"prompt": text, "prompt_token_ids": ids}, params,
                                                        f"{request_id}-{i}", output_kind="delta"))
                   for i, (text, ids) in enumerate(prompts)]
        return _MergedOutputs(streams)

    async def respond(self, raw: Request, outputs: _MergedOutputs, request: SamplingRequest, collect, stream):
        """Run `collect(outputs)` for a plain response or `stream(outputs)` (SSE lines) for a
        streamed one; map bad requests to 400 and a client that left to 499."""
        try:
            if not request.stream:
                try:
                    return await _unless_disconnected(raw, collect(outputs))
                finally:
                    await outputs.close()
            try:
                await _unless_disconnected(raw, outputs.wait_started())
            except BaseException:
                await outputs.close()
                raise
            return StreamingResponse(self._sse_lines(stream(outputs), outputs), media_type="text/event-stream",
                                     background=BackgroundTask(outputs.close))
        except ValueError as e:
            raise _bad_value(e, request) from e
        except _ClientDisconnected:
            return Response(status_code=499)

    @staticmethod
    async def _sse_lines(chunks: AsyncIterator[str], outputs: _MergedOutputs) -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield chunk
        except Exception as e:  # headers are sent: report in-band, as vLLM does
            status = 400 if isinstance(e, ValueError) else 500
            if status == 500:
                logger.exception("stream failed")
            yield _sse(error_body(str(e), status))
        finally:
            await outputs.close()
        yield "data: [DONE]\n\n"

    # ----- /v1/completions -----
    def completion_prompts(self, prompt) -> list[tuple[str | None, list[int]]]:
        if isinstance(prompt, str):
            prompt = [prompt]
        elif prompt and isinstance(prompt[0], int):
            prompt = [prompt]
        if not prompt:
            raise APIError("prompt must not be empty", param="prompt")
        out = []
        for p in prompt:
            if isinstance(p, str):
                out.append((p, self.llm.encode(p)))
            else:
                out.append((None, list(p)))
        return out

    async def completions(self, request: CompletionRequest, raw: Request):
        self.check_request(request)
        try:
            params = request.sampling_params(request.max_tokens, request.logprobs)
        except ValueError as e:
            raise _bad_value(e, request) from e
        prompts = self.completion_prompts(request.prompt)
        for _, ids in prompts:
            self.check_length(len(ids), request.max_tokens)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        created, n = int(time.time()), params.n
        choices = [_Choice() for _ in range(len(prompts) * n)]
        echo = [(text if text is not None else self.tokenizer.decode(ids)) if request.echo else ""
                for text, ids in prompts]

        def usage() -> UsageInfo:
            prompt_tokens = sum(len(ids) for _, ids in prompts)
            completion_tokens = sum(len(c.token_ids) for c in choices)
            return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                             total_tokens=prompt_tokens + completion_tokens)

        async def collect(outputs: _MergedOutputs) -> CompletionResponse:
            async for i, out in outputs:
                for delta in out.outputs:
                    choices[i * n + delta.index].add(delta)
            result = []
            for index, c in enumerate(choices):
                prefix = echo[index // n]
                logprobs = None
                if request.logprobs is not None:
                    logprobs = completion_logprobs(c.token_ids, c.logprobs, len(prefix))
                result.append(CompletionChoice(index=index, text=prefix + c.text, logprobs=logprobs,
                                               finish_reason=_finish_reason(c.finish_reason),
                                               stop_reason=c.stop_reason))
            return CompletionResponse(id=request_id, created=created, model=self.model_name, choices=result,
                                      usage=usage())

        async def stream(outputs: _MergedOutputs) -> AsyncIterator[str]:
            async for i, out in outputs:
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
                    c.add(delta)
                    choice = CompletionChoice(index=index, text=text, logprobs=logprobs,
                                              finish_reason=_finish_reason(delta.finish_reason),
                                              stop_reason=delta.stop_reason)
                    yield _sse(CompletionResponse(id=request_id, created=created, model=self.model_name,
                                                  choices=[choice]))
            if request.include_usage:
                yield _sse(CompletionResponse(id=request_id, created=created, model=self.model_name, choices=[],
                                              usage=usage()))

        return await self.respond(raw, self.start(prompts, params, request_id), request, collect, stream)

    # ----- /v1/chat/completions -----
    async def chat_completions(self, request: ChatCompletionRequest, raw: Request):
        self.check_request(request)
        if request.top_logprobs and not request.logprobs:
            raise APIError("top_logprobs needs logprobs set to true", param="top_logprobs")
        # max_completion_tokens replaces max_tokens; neither: as much as the context leaves.
        max_tokens = request.max_tokens if request.max_completion_tokens is None else request.max_completion_tokens
        try:
            params = request.sampling_params(max_tokens, request.num_logprobs)
        except ValueError as e:
            raise _bad_value(e, request) from e
        prompt_ids = self.chat_prompt(request.messages, request.add_generation_prompt, request.chat_template_kwargs)
        self.check_length(len(prompt_ids), max_tokens, "messages")
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        created, n = int(time.time()), params.n
        choices = [_Choice() for _ in range(n)]

        def usage() -> UsageInfo:
            completion_tokens = sum(len(c.token_ids) for c in choices)
            return UsageInfo(prompt_tokens=len(prompt_ids), completion_tokens=completion_tokens,
                             total_tokens=len(prompt_ids) + completion_tokens)

        def chunk(choice_list: list[ChatCompletionStreamChoice], usage_info: UsageInfo | None = None) -> str:
            response = ChatCompletionStreamResponse(id=request_id, created=created, model=self.model_name,
                                                    choices=choice_list)
            if usage_info is not None:
                response.usage = usage_info
            return _sse(response)

        async def collect(outputs: _MergedOutputs) -> ChatCompletionResponse:
            async for _, out in outputs:
                for delta in out.outputs:
                    choices[delta.index].add(delta)
            result = [ChatCompletionChoice(
                index=i, message=AssistantMessage(content=c.text),
                logprobs=chat_logprobs(c.token_ids, c.logprobs) if request.logprobs else None,
                finish_reason=_finish_reason(c.finish_reason), stop_reason=c.stop_reason)
                for i, c in enumerate(choices)]
            return ChatCompletionResponse(id=request_id, created=created, model=self.model_name, choices=result,
                                          usage=usage())

        async def stream(outputs: _MergedOutputs) -> AsyncIterator[str]:
            yield chunk([ChatCompletionStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""),
                                                    logprobs=None, finish_reason=None) for i in range(n)])
            async for _, out in outputs:
                for delta in out.outputs:
                    choices[delta.index].add(delta)
                    choice = ChatCompletionStreamChoice(
                        index=delta.index, delta=DeltaMessage(content=delta.text),
                        logprobs=chat_logprobs(delta.token_ids, delta.logprobs or []) if request.logprobs else None,
                        finish_reason=_finish_reason(delta.finish_reason))
                    if delta.finish_reason is not None:
                        choice.stop_reason = delta.stop_reason
                    yield chunk([choice])
            if request.include_usage:
                yield chunk([], usage())

        return await self.respond(raw, self.start([(None, prompt_ids)], params, request_id), request, collect, stream)

    # ----- tokenizer endpoints -----
    def tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        self.check_model(request.model)
        if request.messages is not None:
            ids = self.chat_prompt(request.messages, request.add_generation_prompt, None)
        elif request.prompt is not None:
            ids = self.tokenizer.encode(request.prompt, add_special_tokens=request.add_special_tokens)
        else:
            raise APIError("give `prompt` or `messages`", param="prompt")
        return TokenizeResponse(count=len(ids), max_model_len=self.max_model_len, tokens=list(ids))

    def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self.check_model(request.model)
        vocab = len(self.tokenizer)
        bad = [t for t in request.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})", param="tokens")
        return DetokenizeResponse(prompt=self.tokenizer.decode(request.tokens))


# ----------------------------------------------------------------------------- the app


class _APIKeyMiddleware:
    """Requires `Authorization: Bearer <key>` on /v1 routes (health, metrics and version stay
    open, as in vLLM). Pure ASGI, so streaming and disconnects pass through untouched."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                response = error_response("Unauthorized: a valid API key is required (Authorization: Bearer <key>)",
                                          401)
                return await response(scope, receive, send)
        return await self.app(scope, receive, send)


def build_app(llm: AsyncLLM, *, api_key: str | None = None) -> FastAPI:
    """The FastAPI app serving `llm`. `api_key` guards the /v1 routes."""
    app = FastAPI(title="jaxllm", version=jaxllm.__version__,
                  description="OpenAI-compatible API for jaxllm (completions, chat, models), plus tokenize, "
                              "detokenize, health, version and Prometheus metrics.")
    serving = OpenAIServing(llm)
    app.state.serving = serving
    if api_key:
        app.add_middleware(_APIKeyMiddleware, api_key=api_key)

    @app.exception_handler(APIError)
    async def _api_error(_, e: APIError):
        return error_response(e.message, e.status, e.param)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_, e: RequestValidationError):
        errors = e.errors()
        parts, param = [], None
        for err in errors[:3]:
            loc = [str(x) for x in err.get("loc", ()) if x != "body"]
            if err.get("type") == "json_invalid":
                parts.append(f"the body is not valid JSON: {err.get('ctx', {}).get('error', err.get('msg'))}")
                continue
            param = param or (loc[0] if loc else None)
            parts.append(f"{'.'.join(loc) or 'body'}: {err.get('msg')}")
        return error_response("; ".join(parts) or "invalid request", 400, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_, e: StarletteHTTPException):
        return error_response(str(e.detail), e.status_code)

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(_, e: EngineDeadError):
        return error_response(f"the engine has stopped: {e.__cause__!r}", 500)

    @app.exception_handler(Exception)
    async def _internal_error(_, e: Exception):
        logger.exception("request failed")
        return error_response(f"internal error: {e!r}", 500)

    @app.get("/health")
    async def health():
        if not llm.is_running:
            return error_response("the engine has stopped", 503)
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": jaxllm.__version__}

    @app.get("/metrics")
    async def metrics():
        return Response(serving.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=serving.model_name, max_model_len=serving.max_model_len)])

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest, raw: Request):
        return await serving.completions(request, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatCompletionRequest, raw: Request):
        return await serving.chat_completions(request, raw)

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest) -> TokenizeResponse:
        return serving.tokenize(request)

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> DetokenizeResponse:
        return serving.detokenize(request)

    return app


# ----------------------------------------------------------------------------- running it


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind before the (slow) engine start, so a taken port fails at once; port 0 picks a free one."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror}") from e
    sock.set_inheritable(True)
    return sock


def run_server(engine_args, *, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
               log_level: str = "info") -> None:
    """Load and warm up the engine, then serve until interrupted. Prints one line starting
    with "jaxllm: ready" (with the URL) once requests are accepted."""
    import uvicorn

    start = time.perf_counter()
    sock = bind_socket(host, port)
    llm = None
    try:
        llm = AsyncLLM(engine_args)
        app = build_app(llm, api_key=api_key)
        bound_host, bound_port = sock.getsockname()[:2]
        url = f"http://{f'[{bound_host}]' if ':' in bound_host else bound_host}:{bound_port}/v1"

        class Server(uvicorn.Server):
            async def startup(self, sockets=None):
                await super().startup(sockets)
                if not self.should_exit:
                    engine = llm.engine
                    print(f"jaxllm: ready at {url} serving {engine.model_name!r} (start-up "
                          f"{time.perf_counter() - start:.1f} s, warm-up {engine.warmup_seconds:.1f} s)", flush=True)

        Server(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5)).run(sockets=[sock])
    finally:
        if llm is not None:
            llm.shutdown()
        sock.close()
