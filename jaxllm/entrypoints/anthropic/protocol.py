"""Anthropic's Messages API (https://docs.anthropic.com/en/api/messages) as pydantic models: the
request of `POST /v1/messages` and `/v1/messages/count_tokens`, the message it answers, and the
events of its stream. Fields this server does not read (metadata, service_tier, ...) are
accepted and ignored, as on the OpenAI routes."""

from __future__ import annotations

from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import Field

from jaxllm.entrypoints.openai.protocol import TOOL_NAME, OpenAIModel, RequestModel

# ----------------------------------------------------------------------------- request


class TextBlock(RequestModel):
    type: Literal["text"] = "text"
    text: str


class ToolUseBlock(RequestModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(RequestModel):
    type: Literal["tool_result"] = "tool_result"
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False


class ThinkingBlock(RequestModel):
    """An earlier answer's thinking, sent back by the client (not shown to the model again)."""

    type: Literal["thinking", "redacted_thinking"]
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None


class OtherBlock(RequestModel):
    """A block of a kind this server cannot read (image, document, ...): refused by name."""

    type: str


Block = TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | OtherBlock


class Message(RequestModel):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(RequestModel):
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoice(RequestModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class CountTokensRequest(RequestModel):
    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    tool_choice: ToolChoice | None = None
    priority: int = 0  # vLLM's, as on the OpenAI routes: lower first, with --scheduling-policy priority


# ----------------------------------------------------------------------------- response


class Usage(OpenAIModel):
    input_tokens: int
    output_tokens: int


class TextOut(OpenAIModel):
    type: Literal["text"] = "text"
    text: str


class ThinkingOut(OpenAIModel):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""


class ToolUseOut(OpenAIModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class MessageResponse(OpenAIModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ThinkingOut | TextOut | ToolUseOut]
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None
    usage: Usage


class CountTokensResponse(OpenAIModel):
    input_tokens: int


class AnthropicErrorInfo(OpenAIModel):
    type: str
    message: str


class AnthropicError(OpenAIModel):
    type: Literal["error"] = "error"
    error: AnthropicErrorInfo


# The routes whose errors have Anthropic's shape.
PATH_PREFIX = "/v1/messages"
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


def error_body(message: str, status: int) -> dict:
    info = AnthropicErrorInfo(type=_ERROR_TYPES.get(status, "invalid_request_error"), message=message)
    return AnthropicError(error=info).model_dump()


def error_response(message: str, status: int, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status), status_code=status, headers=headers)
