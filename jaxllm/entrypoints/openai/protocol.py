"""OpenAI API request and response bodies (pydantic), as the official `openai` client sends
and reads them, plus vLLM's extra sampling fields (top_k, min_p, repetition_penalty, ...).

Requests validate types (and that every string is valid Unicode); value ranges are checked once,
by `SamplingParams`, whose ValueError the server turns into a 400, and the server's limits by the
handlers (`serving_engine.OpenAIServing.check_request`).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer

from jaxllm.sampling_params import FLOAT_RANGES, MAX_LOGPROBS, SamplingParams, StructuredOutputsParams


class OpenAIModel(BaseModel):
    # Fields this server does not know (user, metadata, store, ...) are accepted and ignored.
    model_config = ConfigDict(extra="ignore")


# ----------------------------------------------------------------------------- errors


class ErrorInfo(OpenAIModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(OpenAIModel):
    error: ErrorInfo


# ----------------------------------------------------------------------------- requests


def _check_text(value) -> None:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:  # JSON's \ud800 escapes can carry lone surrogates; no tokenizer takes them
            raise ValueError("must be valid Unicode text (it contains a lone surrogate)") from None
    elif isinstance(value, (list, tuple)):
        for item in value:
            _check_text(item)
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_text(key)
            _check_text(item)


class RequestModel(OpenAIModel):
    @field_validator("*", mode="after")
    @classmethod
    def _valid_unicode(cls, value):
        _check_text(value)
        return value


class StreamOptions(RequestModel):
    include_usage: bool | None = False


def _ranged(name: str):
    """A float field with SamplingParams' range for it, published in the OpenAPI schema."""
    low, high, low_ok = FLOAT_RANGES[name]
    return Field(None, **{"ge" if low_ok else "gt": low}, le=high, allow_inf_nan=False)


class SamplingRequest(RequestModel):
    """Fields shared by /v1/completions and /v1/chat/completions. `None` means the default."""

    model: str | None = None
    n: int | None = Field(1, ge=1)
    temperature: float | None = _ranged("temperature")
    top_p: float | None = _ranged("top_p")
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = _ranged("presence_penalty")
    frequency_penalty: float | None = _ranged("frequency_penalty")
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # vLLM's extra fields (pass them with the openai client's `extra_body`).
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = _ranged("min_p")
    repetition_penalty: float | None = _ranged("repetition_penalty")
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int = 0  # lower first, on a server started with --scheduling-policy priority
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # Structured output: OpenAI's response_format, vLLM's structured_outputs object (json, regex,
    # choice, grammar, json_object) and its older guided_* fields; at most one of them.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def unsupported(self) -> str | None:
        """Name of a set field this server cannot honour, if any."""
        return None

    def structured_output(self) -> StructuredOutputsParams | None:
        """The request's output constraint, or None. Raises ValueError (naming the field) if
        several are given or one is malformed."""
        given = {
            name: value
            for name in ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
            if (value := getattr(self, name)) is not None
        }
        kind = (self.response_format or {}).get("type", "text")
        if kind != "text":
            given["response_format"] = self.response_format
        if len(given) > 1:
            raise ValueError(f"give at most one output constraint; got {', '.join(given)}")
        if not given:
            return None
        ((name, value),) = given.items()
        if name == "response_format":
            if kind == "json_object":
                return StructuredOutputsParams(json_object=True)
            if kind != "json_schema":
                raise ValueError(f"response_format type must be 'text', 'json_object' or 'json_schema', got {kind!r}")
            spec = self.response_format.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise ValueError("response_format json_schema needs a 'schema' object")
            return StructuredOutputsParams(json=schema)
        if name == "structured_outputs":
            known = {f.name for f in dataclasses.fields(StructuredOutputsParams)}
            if set(value) - known:
                raise ValueError(
                    f"unknown structured_outputs field(s) {sorted(set(value) - known)}; known: {sorted(known)}"
                )
            return StructuredOutputsParams(**value)
        return StructuredOutputsParams(**{name.removeprefix("guided_"): value})

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """Raises ValueError for out-of-range values."""

        def pick(value, default):
            return default if value is None else value

        logit_bias = None
        if self.logit_bias:
            try:
                logit_bias = {int(token): bias for token, bias in self.logit_bias.items()}
            except ValueError:
                raise ValueError("logit_bias must map token ids (integers, as strings) to biases") from None
        return SamplingParams(
            n=pick(self.n, 1),
            temperature=pick(self.temperature, 1.0),
            top_p=pick(self.top_p, 1.0),
            top_k=pick(self.top_k, 0),
            min_p=pick(self.min_p, 0.0),
            presence_penalty=pick(self.presence_penalty, 0.0),
            frequency_penalty=pick(self.frequency_penalty, 0.0),
            repetition_penalty=pick(self.repetition_penalty, 1.0),
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            structured_outputs=self.structured_output(),
            logit_bias=logit_bias,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
        )

    def logprobs_field(self) -> tuple[str, int | None]:
        """(name, value) of the field giving how many top log-probabilities to return per token."""
        raise NotImplementedError

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingRequest):
    # A string, a list of strings, a list of token ids, or a list of token-id lists.
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = False
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None

    def logprobs_field(self) -> tuple[str, int | None]:
        return "logprobs", self.logprobs

    def unsupported(self) -> str | None:
        if self.suffix:
            return "suffix"
        if self.best_of is not None and self.best_of != (self.n or 1):
            return "best_of"
        return super().unsupported()


class ContentPart(RequestModel):
    type: str
    text: str | None = None


TOOL_NAME = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for function names


class FunctionCallIn(RequestModel):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(RequestModel):
    """A tool call of an earlier assistant message, as the client sends it back."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(RequestModel):
    # "developer" is OpenAI's newer name for "system"; "tool" carries a tool's result.
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant
    tool_call_id: str | None = None  # tool


class FunctionDefinition(RequestModel):
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments (none: any object)
    strict: bool | None = None


class ChatTool(RequestModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage]
    max_tokens: int | None = Field(None, ge=1)  # deprecated by OpenAI for max_completion_tokens
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[ChatTool] | None = None
    # Default: "auto" with tools, "none" without (as OpenAI).
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = True
    # vLLM's extras for the chat template: kwargs from an allow-list (jaxllm.chat_template), and a
    # template of the request's own only if the server runs with --trust-request-chat-template.
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None
    # vLLM's: with --reasoning-parser, whether the answer carries `reasoning_content`.
    include_reasoning: bool = True

    def logprobs_field(self) -> tuple[str, int | None]:
        return "top_logprobs", self.top_logprobs

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class LoadLoRAAdapterRequest(RequestModel):
    """POST /v1/load_lora_adapter (vLLM's): serve the PEFT adapter at `lora_path` as model `lora_name`."""

    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(RequestModel):
    """POST /v1/unload_lora_adapter (vLLM's)."""

    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None


class UpdateWeightsRequest(RequestModel):
    """POST /update_weights: the engine's weights from the checkpoint at `path` (an HF directory
    or a GGUF file of the same model), served from the next step on."""

    path: str
    version: int | str | None = None
    in_flight: Literal["keep", "wait", "abort"] = "keep"


class SleepRequest(RequestModel):
    level: Literal[1, 2] = 1


class TokenizeRequest(RequestModel):
    """Either `prompt` (text) or `messages` (rendered through the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int]


# ----------------------------------------------------------------------------- responses


def _now() -> int:
    return int(time.time())


class UsageInfo(OpenAIModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class ModelCard(OpenAIModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "jaxllm"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int | None = None
    weight_version: int | str | None = None  # the weights serving (LLMEngine.update_weights)


class ModelList(OpenAIModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class CompletionLogProbs(OpenAIModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(OpenAIModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(OpenAIModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    # The weight versions that computed its tokens (LLMEngine.update_weights), each once, in order.
    weight_versions: list[int | str] | None = None


class ChatTopLogprob(OpenAIModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(OpenAIModel):
    content: list[ChatLogprob] | None = None


class FunctionCall(OpenAIModel):
    name: str
    arguments: str  # JSON text


class ToolCallOut(OpenAIModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(OpenAIModel):
    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = None  # with --reasoning-parser
    tool_calls: list[ToolCallOut] | None = None


class ChatCompletionChoice(OpenAIModel):
    index: int
    message: AssistantMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    # The weight versions that computed its tokens (LLMEngine.update_weights), each once, in order.
    weight_versions: list[int | str] | None = None


class SparseModel(OpenAIModel):
    """Serialized without its None fields (stream deltas carry only what changed)."""

    @model_serializer(mode="wrap")
    def _only_set(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaFunctionCall(SparseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(SparseModel):
    """A streamed tool call: its first delta has the id, type and name; later ones add arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(SparseModel):
    """What a stream chunk adds to a choice's message: only the fields that changed."""

    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionStreamChoice(OpenAIModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(OpenAIModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


class TokenizeResponse(OpenAIModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(OpenAIModel):
    prompt: str
