"""Helpers the OpenAI routes share: the error type and OpenAI's error JSON, waiting on a client
that may disconnect, SSE lines, and the logprobs formats of the completions and chat APIs."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable

from fastapi import Request
from fastapi.responses import JSONResponse

from jaxllm.entrypoints.anthropic import protocol as anthropic
from jaxllm.entrypoints.openai.protocol import (
    ChatChoiceLogprobs,
    ChatLogprob,
    ChatTopLogprob,
    CompletionLogProbs,
    ErrorInfo,
    ErrorResponse,
    SamplingRequest,
)
from jaxllm.outputs import Logprob

# ----------------------------------------------------------------------------- errors


class APIError(Exception):
    """Answered as OpenAI's error JSON with this HTTP status (and these extra headers)."""

    def __init__(
        self, message: str, status: int = 400, *, param: str | None = None, headers: dict[str, str] | None = None
    ):
        super().__init__(message)
        self.message, self.status, self.param, self.headers = message, status, param, headers


_ERROR_TYPES = {
    401: "authentication_error",
    404: "not_found_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable",
}


def error_body(message: str, status: int, param: str | None = None) -> dict:
    info = ErrorInfo(message=message, type=_ERROR_TYPES.get(status, "invalid_request_error"), param=param, code=status)
    return ErrorResponse(error=info).model_dump()


def error_response(
    message: str, status: int, param: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(error_body(message, status, param), status_code=status, headers=headers)


def error_response_for(
    path: str, message: str, status: int, param: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    """The error answer in the shape of the API `path` belongs to: Anthropic's on /v1/messages
    (jaxllm/entrypoints/anthropic), OpenAI's elsewhere."""
    if path.startswith(anthropic.PATH_PREFIX):
        return anthropic.error_response(message, status, headers)
    return error_response(message, status, param, headers)


def bad_value(e: ValueError, request: SamplingRequest | None = None) -> APIError:
    """SamplingParams and the engine word their errors "<field> must be ..."; name the field."""
    message = str(e)
    field = re.match(r"\w*", message).group()
    known = request is not None and field in type(request).model_fields
    return APIError(message, 400, param=field if known else None)


# ----------------------------------------------------------------------------- client disconnects


class ClientDisconnected(Exception):
    pass


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable):
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
        raise ClientDisconnected()
    return task.result()


# ----------------------------------------------------------------------------- response pieces


def sse(payload) -> str:
    data = payload.model_dump_json() if hasattr(payload, "model_dump_json") else json.dumps(payload)
    return f"data: {data}\n\n"


def finish_reason(reason: str | None) -> str | None:
    return None if reason == "abort" else reason


def _sampled(token_id: int, entry: dict[int, Logprob]) -> tuple[Logprob, list[Logprob]]:
    """(the sampled token's Logprob, the ranked top-k Logprobs, best first)."""
    top = sorted((lp for lp in entry.values() if lp.rank is not None), key=lambda lp: lp.rank)
    return entry[token_id], top


MIN_LOGPROB = -9999.0  # JSON has no -inf: tokens a grammar rules out are reported with this (as vLLM does)


def _json_logprob(value: float) -> float:
    return max(value, MIN_LOGPROB)


def completion_logprobs(token_ids: list[int], entries: list[dict[int, Logprob]], offset: int) -> CompletionLogProbs:
    out = CompletionLogProbs()
    for token_id, entry in zip(token_ids, entries):
        chosen, top = _sampled(token_id, entry)
        token = chosen.decoded_token or ""
        out.tokens.append(token)
        out.token_logprobs.append(_json_logprob(chosen.logprob))
        out.top_logprobs.append({lp.decoded_token or "": _json_logprob(lp.logprob) for lp in [*top, chosen]})
        out.text_offset.append(offset)
        offset += len(token)
    return out


def echo_logprobs(
    prompt_token_ids: list[int], entries: list[dict[int, Logprob] | None], first_token_text: str
) -> CompletionLogProbs:
    """An echoed prompt's logprobs (`RequestOutput.prompt_logprobs`): the first token has none."""
    rest = completion_logprobs(prompt_token_ids[1:], entries[1:], len(first_token_text))
    return CompletionLogProbs(
        text_offset=[0, *rest.text_offset],
        token_logprobs=[None, *rest.token_logprobs],
        tokens=[first_token_text, *rest.tokens],
        top_logprobs=[None, *rest.top_logprobs],
    )


def joined_logprobs(a: CompletionLogProbs | None, b: CompletionLogProbs) -> CompletionLogProbs:
    """`a`'s tokens then `b`'s (an echoed prompt's, then the completion's)."""
    if a is None:
        return b
    return CompletionLogProbs(**{name: getattr(a, name) + getattr(b, name) for name in CompletionLogProbs.model_fields})


def chat_logprobs(token_ids: list[int], entries: list[dict[int, Logprob]]) -> ChatChoiceLogprobs:
    def item(lp: Logprob, cls=ChatTopLogprob, **extra):
        token = lp.decoded_token or ""
        return cls(token=token, logprob=_json_logprob(lp.logprob), bytes=list(token.encode()), **extra)

    content = []
    for token_id, entry in zip(token_ids, entries):
        chosen, top = _sampled(token_id, entry)
        content.append(item(chosen, ChatLogprob, top_logprobs=[item(lp) for lp in top]))
    return ChatChoiceLogprobs(content=content)
