"""The OpenAI-compatible HTTP server: a FastAPI app over one `AsyncLLM`.

This module builds the app (`build_app`: routes, API-key middleware, exception handlers that
answer OpenAI's error JSON) and runs it (`bind_socket`, `run_server`). The handlers live by
route group: `serving_completion.py` (/v1/completions), `serving_chat.py`
(/v1/chat/completions), `serving_tokenization.py` (/tokenize, /detokenize), over the shared
base in `serving_engine.py` and the helpers in `serving_utils.py`.
"""

from __future__ import annotations

import logging
import secrets
import socket
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

import jaxllm
from jaxllm.engine.async_llm import AsyncLLM, EngineDeadError
from jaxllm.entrypoints.metrics import CONTENT_TYPE, ServerMetrics
from jaxllm.entrypoints.openai.protocol import (
    ChatCompletionRequest, CompletionRequest, DetokenizeRequest, DetokenizeResponse, ModelCard, ModelList,
    TokenizeRequest, TokenizeResponse)
from jaxllm.entrypoints.openai.serving_chat import OpenAIServingChat
from jaxllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from jaxllm.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from jaxllm.entrypoints.openai.serving_utils import APIError, error_response

logger = logging.getLogger("jaxllm.server")


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
    engine = llm.engine
    server_metrics = ServerMetrics(engine, engine.model_name)
    completion = OpenAIServingCompletion(llm, server_metrics)
    chat = OpenAIServingChat(llm, server_metrics)
    tokenization = OpenAIServingTokenization(llm, server_metrics)
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
        return Response(server_metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=engine.model_name, max_model_len=engine.config.scheduler.max_model_len)])

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest, raw: Request):
        return await completion.create_completion(request, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatCompletionRequest, raw: Request):
        return await chat.create_chat_completion(request, raw)

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest) -> TokenizeResponse:
        return tokenization.tokenize(request)

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> DetokenizeResponse:
        return tokenization.detokenize(request)

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
