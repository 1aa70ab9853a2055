"""Tool calls in model output: parsers for the formats of the supported families, chosen with
`--tool-call-parser` (vLLM's names), plain and streamed.

    hermes       Hermes, Qwen 2.5/3:   <tool_call>{"name": ..., "arguments": {...}}</tool_call>
    llama3_json  Llama 3.1-3.3:        {"name": ..., "parameters": {...}}  (optionally after
                                       <|python_tag|>; several separated by ";")
    mistral      Mistral:              [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]
                                       or [TOOL_CALLS]name[ARGS]{...} (newer tokenizers)

`ToolParser.extract(text)` splits a whole output into its content and its calls. Streaming,
`ToolParser.stream()` gives a `ToolStream` per choice: text before a tool call streams as
content as it comes; from where a call may begin the text is held until the call is complete
(or the output ends), and each call is sent whole, as one OpenAI tool-call delta. A call that
does not parse is returned as content, so nothing the model wrote is lost.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclasses.dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as the OpenAI API carries it
    id: str = dataclasses.field(default_factory=new_call_id)


def _call(obj, args_key: str) -> ToolCall | None:
    """A ToolCall from a parsed {"name": ..., args_key: {...}} object, or None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def json_values(text: str) -> tuple[list, int]:
    """The JSON values at the start of `text` (separated by whitespace, "," or ";"), and where
    parsing stopped."""
    decoder, values, pos = json.JSONDecoder(), [], 0
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,;":
            pos += 1
        if pos >= len(text):
            return values, pos
        try:
            value, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return values, pos
        values.append(value)


class ToolParser:
    """One tool-call format. Subclasses set `name`, `markers` (the text a tool call starts with)
    and `parse_calls`."""

    name: str
    markers: tuple[str, ...]
    # The marker is a special token, which the detokenizer must keep in the text.
    needs_special_tokens = False
    # Streaming: the text that completes a call (None: calls are complete when the output is).
    end_marker: str | None = None
    # A call is the whole output (held while only whitespace has come).
    whole_output = False

    def parse_calls(self, text: str) -> tuple[list[ToolCall], str]:
        """`text` starts at a marker: the complete calls at its start, and the rest of it."""
        raise NotImplementedError

    def find_start(self, text: str) -> int:
        """Where the first tool call begins in `text` (len(text) if nowhere)."""
        starts = [i for i in (text.find(m) for m in self.markers) if i >= 0]
        return min(starts, default=len(text))

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole output; content None when there is none."""
        start = self.find_start(text)
        calls, rest = self.parse_calls(text[start:]) if start < len(text) else ([], "")
        if not calls:
            return text or None, []
        content = (text[:start] + rest).strip()
        return content or None, calls

    def stream(self) -> ToolStream:
        return ToolStream(self)


class HermesParser(ToolParser):
    name = "hermes"
    markers = ("<tool_call>",)
    end_marker = "</tool_call>"
    _BLOCK = re.compile(r"\s*<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)

    def parse_calls(self, text):
        calls, pos = [], 0
        while True:
            m = self._BLOCK.match(text, pos)
            if m is None:
                return calls, text[pos:]
            values, _ = json_values(m.group(1))
            call = _call(values[0], "arguments") if len(values) == 1 else None
            if call is None:
                return calls, text[pos:]
            calls.append(call)
            pos = m.end()


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    markers = ("<|python_tag|>", "{")
    whole_output = True

    def find_start(self, text):
        # A call is the whole output: a JSON object first (after whitespace, or the python tag).
        stripped = text.lstrip()
        return len(text) - len(stripped) if stripped.startswith(self.markers) else len(text)

    def parse_calls(self, text):
        text = text.strip().removeprefix("<|python_tag|>")
        values, pos = json_values(text)
        calls = [_call(v, "parameters") for v in values]
        if not calls or None in calls:
            return [], text
        return calls, text[pos:]


class MistralParser(ToolParser):
    name = "mistral"
    markers = ("[TOOL_CALLS]",)
    needs_special_tokens = True
    _NAMED = re.compile(r"\s*\[TOOL_CALLS\]\s*([\w.-]+)\s*\[ARGS\]", re.S)

    def parse_calls(self, text):
        body = text.removeprefix("[TOOL_CALLS]").lstrip()
        if body.startswith("["):  # [TOOL_CALLS][{...}, ...]
            values, pos = json_values(body)
            calls = [_call(v, "arguments") for v in values[0]] if values and isinstance(values[0], list) else []
            return ([], text) if not calls or None in calls else (calls, body[pos:])
        calls, pos = [], 0  # [TOOL_CALLS]name[ARGS]{...} (repeated)
        while (m := self._NAMED.match(text, pos)) is not None:
            start = len(text) - len(text[m.end() :].lstrip())
            try:
                args, end = json.JSONDecoder().raw_decode(text, start)
            except json.JSONDecodeError:
                break
            if not isinstance(args, dict):
                break
            calls.append(ToolCall(m.group(1), json.dumps(args, ensure_ascii=False)))
            pos = end
        return calls, text[pos:]


PARSERS = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)}


def get_tool_parser(name: str) -> ToolParser:
    if name not in PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; known: {', '.join(sorted(PARSERS))}")
    return PARSERS[name]()


class ToolStream:
    """One streamed choice: `feed(delta)` -> (content delta, complete calls); `finish()` the same
    for what was held back, once the output is complete."""

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self.text = ""  # everything so far
        self.sent = 0  # characters of `text` already returned as content
        self.in_calls = False  # a tool call began at `sent`
        self.parsed = 0  # calls in `text` before this are returned
        self.num_calls = 0

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        self.text += delta
        content = ""
        if not self.in_calls:
            pending = self.text[self.sent :]
            start = self.parser.find_start(pending)
            if start == len(pending):
                # Hold back an ending that may be the start of a marker split over deltas (and,
                # for a format whose call is the whole output, anything before its first text).
                keep = max(
                    (k for m in self.parser.markers for k in range(1, len(m)) if pending.endswith(m[:k])), default=0
                )
                if self.parser.whole_output and not pending.strip():
                    keep = len(pending)
                content = pending[: len(pending) - keep]
                self.sent += len(content)
                return content, []
            content = pending[:start]
            self.sent = self.parsed = self.sent + start
            self.in_calls = True
        return content, self._complete_calls()

    def _parse(self, end: int) -> tuple[list[ToolCall], str]:
        """The calls in text[parsed:end] (past them: `parsed`), and the text after them."""
        calls, rest = self.parser.parse_calls(self.text[self.parsed : end])
        self.parsed = end - len(rest)
        self.num_calls += len(calls)
        return calls, rest

    def _complete_calls(self) -> list[ToolCall]:
        """The calls that a closing marker has completed since the last ones returned."""
        end = self.parser.end_marker
        closed = self.text.rfind(end, self.parsed) if end is not None else -1
        return self._parse(closed + len(end))[0] if closed >= 0 else []

    def finish(self) -> tuple[str, list[ToolCall]]:
        """What was held back: the remaining calls and any text after them, or all of it as
        content if no call parses."""
        held = self.text[self.sent :]
        self.sent = len(self.text)
        if not self.in_calls:
            return held, []
        calls, rest = self._parse(len(self.text))
        if not self.num_calls:  # the marker led nowhere: it was content after all
            return held, []
        return rest.strip(), calls
