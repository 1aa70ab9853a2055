"""Tool calling for /v1/chat/completions: what `tools` and `tool_choice` do to a request.

    none      the tools go to the chat template; the output is content
    auto      the model decides: its output is parsed with the server's --tool-call-parser
              (needs --enable-auto-tool-choice, as in vLLM)
    required  the output is constrained to a JSON array of calls, `[{"name": ..., "parameters":
              {...}}, ...]`, each call's arguments to its function's schema (at most `max_calls`
              of them), so it always parses
    a name    the output is constrained to that function's arguments

`ToolCalling.extract` turns a finished output into (content, calls); `ToolCalling.stream()`
does it delta by delta, yielding content and `ToolDelta`s as OpenAI's streamed tool calls:
a call's first delta has its id and name, the later ones more of its arguments. Calls past
`max_calls` (one without parallel_tool_calls; the Responses API's max_tool_calls) are dropped.
"""

from __future__ import annotations

import dataclasses
import json

from jaxllm.entrypoints.openai.protocol import ChatCompletionRequest
from jaxllm.entrypoints.openai.serving_utils import APIError
from jaxllm.entrypoints.openai.tool_parsers import ToolCall, ToolParser, json_values, new_call_id
from jaxllm.sampling_params import StructuredOutputsParams

ANY_OBJECT = {"type": "object"}


def _required_calls(values: list) -> list[ToolCall]:
    """The calls among the elements of a `required` output's JSON array."""
    return [
        ToolCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False))
        for c in values
        if isinstance(c, dict) and isinstance(c.get("name"), str) and "parameters" in c
    ]


@dataclasses.dataclass
class ToolDelta:
    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


class ToolCalling:
    """One request's tool settings. Raises APIError (400) for tools it cannot honour.
    `max_calls`: at most this many calls (the Responses API's max_tool_calls; None: any number),
    one at most when the request's parallel_tool_calls is false."""

    def __init__(self, request: ChatCompletionRequest, parser: ToolParser | None, max_calls: int | None = None):
        self.tools = {t.function.name: t.function for t in request.tools or []}
        if len(self.tools) < len(request.tools or []):
            raise APIError("tool function names must be unique", param="tools")
        choice = request.tool_choice
        if choice is None:
            choice = "auto" if self.tools else "none"
        self.mode = choice if isinstance(choice, str) else "named"
        self.name = choice.function.name if self.mode == "named" else None
        if request.parallel_tool_calls is False:
            max_calls = 1 if max_calls is None else min(max_calls, 1)
        self.max_calls = max_calls
        self.parser = parser
        if self.mode != "none" and not self.tools:
            raise APIError(f"tool_choice {self.mode!r} needs tools", param="tool_choice")
        if self.mode == "named" and self.name not in self.tools:
            raise APIError(
                f"tool_choice names the function {self.name!r}, which is not among the tools", param="tool_choice"
            )
        if self.mode == "auto" and parser is None:
            raise APIError(
                '"auto" tool choice requires the server to run with --enable-auto-tool-choice and '
                '--tool-call-parser (or give tool_choice "required", "none" or a function)',
                param="tool_choice",
            )
        if max_calls == 0 and self.mode in ("required", "named"):
            raise APIError(
                f"tool_choice {self.mode!r} asks for a call; max_tool_calls 0 allows none", param="max_tool_calls"
            )

    @property
    def template_tools(self) -> list[dict] | None:
        """The tools as chat templates read them (OpenAI's shape)."""
        return [{"type": "function", "function": f.model_dump(exclude_none=True)} for f in self.tools.values()] or None

    def constraint(self) -> StructuredOutputsParams | None:
        """The output constraint that makes a required or named call parse."""
        if self.mode == "named":
            return StructuredOutputsParams(json=self.tools[self.name].parameters or ANY_OBJECT)
        if self.mode != "required":
            return None
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "parameters": f.parameters or ANY_OBJECT},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for name, f in self.tools.items()
        ]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        return StructuredOutputsParams(
            json=schema if self.max_calls is None else {**schema, "maxItems": self.max_calls}
        )

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        if self.mode == "none":
            return text, []
        if self.mode == "named":
            return None, [ToolCall(self.name, text)]
        if self.mode == "required":
            values, _ = json_values(text)
            calls = _required_calls(values[0]) if values and isinstance(values[0], list) else []
            return (None, calls) if calls else (text, [])  # (cut short by max_tokens: no call)
        content, calls = self.parser.extract(text)
        return content, calls[: self.max_calls]

    def finish_reason(self, num_calls: int, reason: str | None) -> str | None:
        """OpenAI's: "tool_calls" when the model chose to call (a named call ends with "stop")."""
        return "tool_calls" if num_calls and reason == "stop" and self.mode != "named" else reason

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self)


class ToolCallStream:
    """One streamed choice: `feed(delta_text)` and `finish()` -> (content delta, [ToolDelta])."""

    def __init__(self, calling: ToolCalling):
        self.calling = calling
        self.parsed = calling.parser.stream() if calling.mode == "auto" else None
        self.text = ""
        self.pos: int | None = None  # required: where the array's next element begins
        self.num_calls = 0

    def _deltas(self, calls: list[ToolCall]) -> list[ToolDelta]:
        if self.calling.max_calls is not None:
            calls = calls[: max(0, self.calling.max_calls - self.num_calls)]
        out = [ToolDelta(self.num_calls + i, c.id, c.name, c.arguments) for i, c in enumerate(calls)]
        self.num_calls += len(calls)
        return out

    def feed(self, delta: str) -> tuple[str, list[ToolDelta]]:
        mode = self.calling.mode
        if mode == "none":
            return delta, []
        if mode == "auto":
            content, calls = self.parsed.feed(delta)
            return content, self._deltas(calls)
        if mode == "named":  # the arguments as they come
            if not self.num_calls:
                self.num_calls = 1
                return "", [ToolDelta(0, new_call_id(), self.calling.name, delta)]
            return "", [ToolDelta(0, arguments=delta)] if delta else []
        # required: each element of the JSON array once it is complete
        self.text += delta
        if self.pos is None:
            start = self.text.find("[")
            if start < 0:
                return "", []
            self.pos = start + 1
        values, end = json_values(self.text[self.pos :])
        self.pos += end
        return "", self._deltas(_required_calls(values))

    def finish(self) -> tuple[str, list[ToolDelta]]:
        if self.calling.mode == "auto":
            content, calls = self.parsed.finish()
            return content, self._deltas(calls)
        if self.calling.mode == "required" and not self.num_calls:
            return self.text, []  # (cut short before any call completed: the text as content)
        return "", []
