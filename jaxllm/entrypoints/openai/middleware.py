"""The guard every HTTP request passes before a route sees it (pure ASGI, so streams and client
disconnects pass through untouched):

1. a request id, sent back as `X-Request-Id` and named in every log line about the request;
2. headers past `max_header_bytes` get 431; while the server drains (SIGTERM), 503 for new work;
3. the API key (`Authorization: Bearer` or Anthropic's `x-api-key`), on every route that runs the
   model or its tokenizer; with tracing, a `traceparent` header's context made current;
4. the body, read whole up to `max_request_body_bytes` (413 past it) before the route parses it;
5. an exception that escapes a route: logged once, with its traceback and the request id; the
   client gets a 500 with the request id and no exception text.

Errors have the shape of the route's API (`serving_utils.error_response_for`).
"""

from __future__ import annotations

import logging
import secrets
import uuid

from jaxllm.entrypoints import tracing
from jaxllm.entrypoints.openai.http_server import Shutdown
from jaxllm.entrypoints.openai.server_args import OPEN_PATHS
from jaxllm.entrypoints.openai.serving_utils import error_response_for

logger = logging.getLogger("jaxllm.server")


def request_id_of(scope) -> str:
    """The id `RequestGuard` gave this request."""
    return scope.get("state", {}).get("request_id", "-")


class RequestGuard:
    def __init__(
        self,
        app,
        *,
        api_key: str | None,
        max_body_bytes: int,
        max_header_bytes: int,
        shutdown: Shutdown,
        tracing: bool = False,
    ):
        self.app = app
        self.tracing = tracing  # (a `traceparent` header's context made current for the request)
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.max_body_bytes, self.max_header_bytes = max_body_bytes, max_header_bytes
        self.shutdown = shutdown

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request_id = uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        started = False

        async def send_with_id(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode())]
            await send(message)

        refusal = self._refusal(scope)
        if refusal is not None:
            return await refusal(scope, receive, send_with_id)
        body = await self._read_body(scope, receive)
        if body is None:  # the client left while sending
            return
        if isinstance(body, int):
            response = error_response_for(
                scope["path"],
                f"the request body exceeds {self.max_body_bytes} bytes (the server's --max-request-body-bytes)",
                413,
            )
            return await response(scope, receive, send_with_id)
        trace_token = tracing.attach_request_context(scope["headers"]) if self.tracing else None
        try:
            await self.app(scope, _replay(body, receive), send_with_id)
        except Exception:
            logger.exception("request %s (%s %s) failed", request_id, scope.get("method"), scope.get("path"))
            if not started:
                message = f"internal error; the server logged it as request {request_id}"
                response = error_response_for(scope["path"], message, 500)
                await response(scope, receive, send_with_id)
        finally:
            tracing.detach_request_context(trace_token)

    def _refusal(self, scope):
        path = scope["path"]
        # uvicorn's h11 limit only catches heads that arrive in pieces; this catches the rest.
        if sum(len(name) + len(value) + 4 for name, value in scope["headers"]) > self.max_header_bytes:
            return error_response_for(path, f"the request headers exceed {self.max_header_bytes} bytes", 431)
        if self.shutdown.draining and path not in OPEN_PATHS:
            return error_response_for(
                path,
                "the server is shutting down; retry on another replica",
                503,
                headers={"Retry-After": "5", "Connection": "close"},
            )
        if self.expected is not None and path not in OPEN_PATHS:
            headers = dict(scope["headers"])  # (the key as a bearer token, or in Anthropic's x-api-key)
            given = [headers.get(b"authorization", b""), b"Bearer " + headers.get(b"x-api-key", b"")]
            if not any(secrets.compare_digest(key, self.expected) for key in given):
                message = "Unauthorized: a valid API key is required (Authorization: Bearer <key>, or x-api-key: <key>)"
                return error_response_for(path, message, 401)
        return None

    async def _read_body(self, scope, receive) -> bytes | int | None:
        """The whole body; the byte count read so far once it passes the limit; None on disconnect."""
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            return int(declared)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return size
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _replay(body: bytes, receive):
    """A `receive` that hands the app the body already read, then waits on the client (disconnects)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay():
        if pending:
            return pending.pop()
        return await receive()

    return replay
