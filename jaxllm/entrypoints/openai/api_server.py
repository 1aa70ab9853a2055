"""The OpenAI-compatible HTTP server: a FastAPI app over one `AsyncLLM`.

This module builds the app (`build_app`: routes, the `RequestGuard` middleware, exception
handlers that answer OpenAI's error JSON) and runs it (`bind_socket`, `run_server`, over the
hardened uvicorn in `http_server.py`). The handlers live by
route group: `serving_completion.py` (/v1/completions), `serving_chat.py`
(/v1/chat/completions), `serving_embedding.py` (/v1/embeddings, /pooling: a pooling engine's),
`serving_tokenization.py` (/tokenize, /detokenize), over the shared
base in `serving_engine.py` and the helpers in `serving_utils.py`; `playground/index.html` is
the chat page at /. `metrics.py` (beside this package) has the Prometheus metrics and the log
lines about requests and the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import pathlib
import socket
import time
from concurrent.futures import ThreadPoolExecutor

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxllm.version import __version__
from jaxllm.engine.async_llm import AsyncLLM, EngineDeadError
from jaxllm.entrypoints.anthropic.protocol import (
    AnthropicError,
    CountTokensRequest,
    CountTokensResponse,
    MessageResponse,
    MessagesRequest,
)
from jaxllm.entrypoints.anthropic.serving_messages import AnthropicServingMessages
from jaxllm.entrypoints.metrics import CONTENT_TYPE, ServerMetrics, StatLogger
from jaxllm.entrypoints.tracing import RequestTracer
from jaxllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    SleepRequest,
    TokenizeRequest,
    TokenizeResponse,
    UpdateWeightsRequest,
)
from jaxllm.entrypoints.openai.serving_chat import OpenAIServingChat
from jaxllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from jaxllm.entrypoints.openai.serving_embedding import (
    EmbeddingRequest,
    EmbeddingResponse,
    OpenAIServingEmbedding,
    PoolingRequest,
    PoolingResponse,
)
from jaxllm.entrypoints.openai.serving_lora import add_lora_routes, lora_cards, register_lora_modules
from jaxllm.entrypoints.openai.serving_responses import OpenAIServingResponses
from jaxllm.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from jaxllm.entrypoints.openai.responses_protocol import ResponseObject, ResponsesRequest
from jaxllm.entrypoints.openai.serving_utils import APIError, error_response, error_response_for
from jaxllm.entrypoints.openai.http_server import Server, Shutdown, guarded_protocol
from jaxllm.entrypoints.openai.middleware import RequestGuard, request_id_of
from jaxllm.entrypoints.openai.server_args import ServerArgs
from jaxllm.weights.update import WeightUpdateError, checkpoint_weights

logger = logging.getLogger("jaxllm.server")
PLAYGROUND = pathlib.Path(__file__).with_name("playground") / "index.html"


# ----------------------------------------------------------------------------- the app

# Every error is OpenAI's error JSON (`ErrorResponse`); the OpenAPI schema says which statuses occur.
_ERRORS = {
    400: "invalid request (wrong type, out of range, over a limit, too long for the context)",
    401: "missing or wrong API key",
    403: "not allowed on this server (a runtime change it was not started for)",
    404: "unknown model (or adapter)",
    413: "request body too large",
    429: "the queue is full; retry after Retry-After seconds",
    431: "request headers too large",
    500: "internal error (logged by the server with the X-Request-Id)",
    503: "the engine has stopped, or the server is shutting down",
}


def _responses(ok_model=None, *statuses: int, stream: bool = False, error_model=ErrorResponse) -> dict:
    out = {status: {"model": error_model, "description": _ERRORS[status]} for status in statuses}
    if ok_model is not None:
        out[200] = {
            "model": ok_model,
            "description": "the result"
            + ("; with `stream: true`, server-sent events of chunks, then `data: [DONE]`" if stream else ""),
        }
        if stream:
            # Each event (OpenAPI < 3.2: `schema` describes one event): `data:` a chunk's JSON, or [DONE].
            out[200]["content"] = {
                "text/event-stream": {
                    "schema": {"type": "object", "properties": {"data": {"type": "string"}}, "required": ["data"]}
                }
            }
    return out


_GUARDED = (400, 401, 413, 431, 500, 503)  # what any route behind the API key can answer


def build_app(llm: AsyncLLM, args: ServerArgs | None = None, shutdown: Shutdown | None = None, tracer=None) -> FastAPI:
    """The FastAPI app serving `llm` under the limits in `args`; `tracer` (a
    `tracing.RequestTracer`, else one for `args.otlp_traces_endpoint` if set) traces requests."""
    args = args or ServerArgs()
    if tracer is None and args.otlp_traces_endpoint:
        tracer = RequestTracer.to_endpoint(args.otlp_traces_endpoint)
    if args.enable_weight_updates and not args.api_key:
        raise ValueError("--enable-weight-updates needs --api-key: its routes replace the model being served")
    shutdown = shutdown or Shutdown()
    stat_logger = None if args.disable_log_stats else StatLogger(llm.engine, args.log_stats_interval)

    @contextlib.asynccontextmanager
    async def lifespan(_):
        task = asyncio.create_task(stat_logger.run()) if stat_logger is not None else None
        try:
            yield
        finally:
            if task is not None:
                task.cancel()
            if tracer is not None:
                tracer.shutdown()  # (sends the spans still batched)

    app = FastAPI(
        title="jaxllm",
        version=__version__,
        lifespan=lifespan,
        description="OpenAI-compatible API for jaxllm (completions, chat, embeddings, models), plus pooling, tokenize, "
        "detokenize, health, version and Prometheus metrics.",
    )
    server_metrics = ServerMetrics(llm.engine, llm.engine.model_name, tracer)
    app.add_middleware(
        RequestGuard,
        api_key=args.api_key,
        max_body_bytes=args.max_request_body_bytes,
        max_header_bytes=args.max_header_bytes,
        shutdown=shutdown,
        tracing=tracer is not None,
    )
    _add_error_handlers(app)
    _add_service_routes(app, llm, args, shutdown, server_metrics)
    _add_openai_routes(app, llm, args, shutdown, server_metrics)
    if args.lora_modules:
        register_lora_modules(llm.engine, args.lora_modules)
    if llm.engine.config.lora is not None:
        add_lora_routes(app, llm, args.api_key, lambda *codes: _responses(None, *_GUARDED, *codes))
    if args.enable_weight_updates:
        _add_weight_routes(app, llm)
    _drop_422s_from_openapi(app)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Every error answered as OpenAI's error object (validation errors as 400s)."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return error_response_for(request.url.path, e.message, e.status, e.param, e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        errors = e.errors()
        parts, param = [], None
        for err in errors[:3]:
            loc = [str(x) for x in err.get("loc", ()) if x != "body"]
            if err.get("type") == "json_invalid":
                parts.append(f"the body is not valid JSON: {err.get('ctx', {}).get('error', err.get('msg'))}")
                continue
            param = param or (loc[0] if loc else None)
            parts.append(f"{'.'.join(loc) or 'body'}: {err.get('msg')}")
        return error_response_for(request.url.path, "; ".join(parts) or "invalid request", 400, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        return error_response_for(request.url.path, str(e.detail), e.status_code)

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(request: Request, e: EngineDeadError):
        return error_response_for(request.url.path, "the engine has stopped; the server is restarting", 503)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, e: Exception):
        # Starlette re-raises after answering; RequestGuard logs it, once, with the request id.
        message = f"internal error; the server logged it as request {request_id_of(request.scope)}"
        return error_response_for(request.url.path, message, 500)


def _add_service_routes(
    app: FastAPI, llm: AsyncLLM, args: ServerArgs, shutdown: Shutdown, server_metrics: ServerMetrics
) -> None:
    """/health, /version, /metrics and the playground at /."""

    @app.get(
        "/health",
        response_class=Response,
        responses={
            200: {"description": "serving (empty body)"},
            503: {"model": ErrorResponse, "description": _ERRORS[503]},
        },
    )
    async def health():
        if not llm.is_running:
            return error_response("the engine has stopped", 503)
        if shutdown.draining:
            return error_response("the server is shutting down", 503)
        return Response(status_code=200)

    if not args.disable_playground:

        @app.get("/", response_class=HTMLResponse, include_in_schema=False)
        async def playground():
            """The chat playground (playground/index.html): a page that calls /v1/chat/completions."""
            return HTMLResponse(PLAYGROUND.read_text(encoding="utf-8"))

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get(
        "/metrics",
        response_class=Response,
        responses={200: {"description": "Prometheus text format", "content": {"text/plain": {}}}},
    )
    async def metrics():
        return Response(server_metrics.render(), media_type=CONTENT_TYPE)


def _add_openai_routes(
    app: FastAPI, llm: AsyncLLM, args: ServerArgs, shutdown: Shutdown, server_metrics: ServerMetrics
) -> None:
    """/v1/models, /v1/completions, /v1/chat/completions, /v1/responses, /v1/messages (Anthropic's),
    /v1/embeddings, /pooling, /tokenize and /detokenize."""
    engine = llm.engine
    workers = ThreadPoolExecutor(max_workers=2, thread_name_prefix="jaxllm-tokenizer")
    parts = (llm, server_metrics, args, shutdown, workers)
    completion, chat, embedding, tokenization = (
        OpenAIServingCompletion(*parts),
        OpenAIServingChat(*parts),
        OpenAIServingEmbedding(*parts),
        OpenAIServingTokenization(*parts),
    )

    @app.get("/v1/models", responses=_responses(None, 401, 431, 500, 503))
    async def models() -> ModelList:
        card = ModelCard(
            id=engine.model_name,
            max_model_len=engine.config.scheduler.max_model_len,
            weight_version=engine.weight_version,
        )
        return ModelList(data=[card, *lora_cards(engine)])

    @app.post("/v1/completions", responses=_responses(CompletionResponse, *_GUARDED, 404, 429, stream=True))
    async def completions(request: CompletionRequest, raw: Request):
        return await completion.create_completion(request, raw)

    @app.post("/v1/chat/completions", responses=_responses(ChatCompletionResponse, *_GUARDED, 404, 429, stream=True))
    async def chat_completions(request: ChatCompletionRequest, raw: Request):
        return await chat.create_chat_completion(request, raw)

    responses = OpenAIServingResponses(chat, args.responses_store_size)

    @app.post("/v1/responses", responses=_responses(ResponseObject, *_GUARDED, 404, 429, stream=True))
    async def create_response(request: ResponsesRequest, raw: Request):
        """OpenAI's Responses API (serving_responses.py)."""
        return await responses.create_response(request, raw)

    messages = AnthropicServingMessages(chat)
    anthropic_errors = dict(error_model=AnthropicError)

    @app.post(
        "/v1/messages", responses=_responses(MessageResponse, *_GUARDED, 404, 429, stream=True, **anthropic_errors)
    )
    async def create_message(request: MessagesRequest, raw: Request):
        """Anthropic's Messages API (jaxllm/entrypoints/anthropic)."""
        return await messages.create_message(request, raw)

    @app.post("/v1/messages/count_tokens", responses=_responses(None, *_GUARDED, 404, **anthropic_errors))
    async def count_message_tokens(request: CountTokensRequest) -> CountTokensResponse:
        return await messages.count_tokens(request)

    @app.post("/v1/embeddings", responses=_responses(EmbeddingResponse, *_GUARDED, 404, 429))
    async def embeddings(request: EmbeddingRequest, raw: Request):
        return await embedding.create_embedding(request, raw)

    @app.post("/pooling", responses=_responses(PoolingResponse, *_GUARDED, 404, 429))
    async def pooling(request: PoolingRequest, raw: Request):
        return await embedding.create_pooling(request, raw)

    @app.post("/tokenize", responses=_responses(None, *_GUARDED, 404))
    async def tokenize(request: TokenizeRequest) -> TokenizeResponse:
        return await tokenization.tokenize(request)

    @app.post("/detokenize", responses=_responses(None, *_GUARDED, 404))
    async def detokenize(request: DetokenizeRequest) -> DetokenizeResponse:
        return await tokenization.detokenize(request)


def _add_weight_routes(app: FastAPI, llm: AsyncLLM) -> None:
    """--enable-weight-updates: a trainer's routes (behind the API key, which the flag requires)."""
    engine = llm.engine

    @app.post("/update_weights", responses=_responses(None, *_GUARDED, 404))
    async def update_weights(request: UpdateWeightsRequest):
        """Load the checkpoint at `path` (off the engine thread), then serve it from the next step."""
        start = time.perf_counter()
        try:
            weights = await asyncio.to_thread(checkpoint_weights, request.path, engine.config.dtype)
        except FileNotFoundError as e:
            raise APIError(f"no checkpoint at {request.path!r}: {e}", 404, param="path") from None
        except ValueError as e:
            raise APIError(f"{request.path}: {e}", 400, param="path") from None
        try:
            await llm.update_weights(weights, version=request.version, in_flight=request.in_flight)
        except WeightUpdateError as e:
            raise APIError(f"{request.path}: {e}", 400, param="path") from None
        return {"weight_version": engine.weight_version, "seconds": round(time.perf_counter() - start, 3)}

    @app.post("/sleep", responses=_responses(None, *_GUARDED))
    async def sleep(request: SleepRequest):
        """Once the requests in flight have finished (new ones wait), free the KV pool (level 1)
        and the weights too (level 2: POST /update_weights before /wake_up)."""
        await llm.sleep(request.level)
        return {"sleep_level": engine.sleep_level}

    @app.post("/wake_up", responses=_responses(None, *_GUARDED))
    async def wake_up():
        try:
            await llm.wake_up()
        except RuntimeError as e:
            raise APIError(str(e), 400) from None
        return {"sleep_level": engine.sleep_level}

    @app.get("/is_sleeping", responses=_responses(None, 401, 431, 500, 503))
    async def is_sleeping():
        return {"is_sleeping": engine.sleep_level > 0, "sleep_level": engine.sleep_level}


def _drop_422s_from_openapi(app: FastAPI) -> None:
    """FastAPI's schema without its 422s: validation errors are answered 400, as OpenAI does."""
    build_openapi = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            for path in build_openapi()["paths"].values():
                for operation in path.values():
                    operation["responses"].pop("422", None)
        return app.openapi_schema

    app.openapi = openapi


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


def run_server(engine_args, args: ServerArgs | None = None) -> int:
    """Load and warm up the engine, then serve until SIGTERM/SIGINT (exit status 0, after the drain)
    or until the engine dies (status 1, so that a supervisor restarts the process). Prints one
    line starting with "jaxllm: ready" (with the URL) once requests are accepted."""
    import uvicorn

    args = args or ServerArgs()
    args.verify()
    start = time.perf_counter()
    sock = bind_socket(args.host, args.port)
    llm = None
    try:
        llm = AsyncLLM(engine_args)
        shutdown = Shutdown()
        app = build_app(llm, args, shutdown)
        bound_host, bound_port = sock.getsockname()[:2]
        url = f"http://{f'[{bound_host}]' if ':' in bound_host else bound_host}:{bound_port}/v1"

        def ready():
            engine = llm.engine
            print(
                f"jaxllm: ready at {url} serving {engine.model_name!r} (start-up "
                f"{time.perf_counter() - start:.1f} s, warm-up {engine.warmup_seconds:.1f} s)",
                flush=True,
            )

        config = uvicorn.Config(
            app,
            log_level=args.uvicorn_log_level,
            http=guarded_protocol(args.request_read_timeout),
            limit_concurrency=args.limit_concurrency,
            timeout_keep_alive=args.timeout_keep_alive,
            h11_max_incomplete_event_size=args.max_header_bytes,
            # A backstop only: the drain ends every stream itself when shutdown_timeout is reached.
            timeout_graceful_shutdown=int(args.shutdown_timeout) + 10,
        )
        server = Server(config, shutdown=shutdown, shutdown_timeout=args.shutdown_timeout, on_ready=ready)
        llm.on_dead = lambda error: server.fail(1)
        server.run(sockets=[sock])
        if server.exit_code:
            logger.critical("exiting with status %d: the engine stopped and cannot recover", server.exit_code)
        return server.exit_code
    finally:
        if llm is not None:
            llm.shutdown()
        sock.close()
