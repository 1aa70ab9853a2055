"""OpenAI's Responses API (`POST /v1/responses`) request as pydantic models. Fields this server
does not read (metadata, user, include, ...) are accepted and ignored; those it cannot honour
are refused by `ResponsesRequest.unsupported`."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from jaxllm.entrypoints.openai.protocol import TOOL_NAME, OpenAIModel, RequestModel


class TextPart(RequestModel):
    type: Literal["input_text", "output_text", "text"]
    text: str


class OtherPart(RequestModel):
    """A content part of a kind this server cannot read (input_image, input_file, ...)."""

    type: str


class MessageItem(RequestModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextPart | OtherPart]


class FunctionCallItem(RequestModel):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None


class FunctionCallOutputItem(RequestModel):
    type: Literal["function_call_output"]
    call_id: str
    output: str


class ReasoningItem(RequestModel):
    """An earlier answer's reasoning, sent back (not shown to the model again)."""

    type: Literal["reasoning"]


class OtherItem(RequestModel):
    type: str


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem | OtherItem


class FunctionTool(RequestModel):
    type: Literal["function"] = "function"
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(RequestModel):
    type: Literal["function"]
    name: str


class TextFormat(RequestModel):
    type: Literal["text", "json_schema", "json_object"]
    name: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(RequestModel):
    format: TextFormat | None = None


class ResponsesRequest(RequestModel):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "required", "none"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = True
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool | None = False
    store: bool | None = True
    previous_response_id: str | None = None
    background: bool | None = False
    truncation: Literal["auto", "disabled"] | None = None

    def unsupported(self) -> str | None:
        """A set field this server cannot honour."""
        if self.background:
            return "background"
        return None


class ResponseUsage(OpenAIModel):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: dict[str, int] = Field(default_factory=lambda: {"cached_tokens": 0})
    output_tokens_details: dict[str, int] = Field(default_factory=lambda: {"reasoning_tokens": 0})


class ResponseObject(OpenAIModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    incomplete_details: dict[str, str] | None = None
    error: dict[str, Any] | None = None
    model: str
    output: list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    temperature: float | None = None
    top_p: float | None = None
    max_output_tokens: int | None = None
    previous_response_id: str | None = None
    store: bool = True
    usage: ResponseUsage | None = None
