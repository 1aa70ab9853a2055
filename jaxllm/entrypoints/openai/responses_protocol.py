"""OpenAI's Responses API (`POST /v1/responses`) request as pydantic models. As on the chat route,
fields this server does not know (metadata, user, service_tier, ...) are accepted and ignored;
the API's fields that would change the answer and that it cannot honour are refused, naming the
field, by `ResponsesRequest.unsupported`."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from jaxllm.entrypoints.openai.protocol import TOOL_NAME, OpenAIModel, RequestModel
from jaxllm.sampling_params import MAX_LOGPROBS


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


class ReasoningConfig(RequestModel):
    effort: str | None = None  # "low", "medium", "high", ...: the chat template's reasoning_effort
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None  # (summary's older name)


# What `include` may ask for: the answer's token logprobs (with `top_logprobs` alternatives).
OUTPUT_LOGPROBS = "message.output_text.logprobs"


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
    include: list[str] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    max_tool_calls: int | None = Field(None, ge=0)
    reasoning: ReasoningConfig | None = None
    priority: int = 0  # vLLM's: lower first, on a server started with --scheduling-policy priority
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None  # a stored prompt template's id and variables

    @property
    def logprobs(self) -> bool:
        return OUTPUT_LOGPROBS in (self.include or [])

    def unsupported(self) -> tuple[str, str] | None:
        """(field, why) for a set field this server cannot honour."""
        if self.background:
            return "background", "background responses are not supported by this server"
        if self.conversation is not None:
            return "conversation", "conversations are not supported by this server; chain with previous_response_id"
        if self.prompt is not None:
            return "prompt", "stored prompt templates are not supported by this server; send instructions and input"
        if self.truncation == "auto":
            return "truncation", "truncation 'auto' is not supported by this server (only 'disabled')"
        for item in self.include or []:
            if item != OUTPUT_LOGPROBS:
                return "include", f"include {item!r} is not supported by this server (only {OUTPUT_LOGPROBS!r})"
        if self.top_logprobs and not self.logprobs:
            return "top_logprobs", f"top_logprobs needs include to list {OUTPUT_LOGPROBS!r}"
        if self.reasoning is not None and (self.reasoning.summary or self.reasoning.generate_summary):
            return "reasoning", "reasoning summaries are not written by this server (the reasoning item has the text)"
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
    max_tool_calls: int | None = None
    top_logprobs: int | None = None
    truncation: Literal["auto", "disabled"] = "disabled"
    reasoning: dict[str, Any] | None = None
    previous_response_id: str | None = None
    store: bool = True
    usage: ResponseUsage | None = None
