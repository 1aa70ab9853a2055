"""Reasoning in model output: `--reasoning-parser` (vLLM's names) splits what a thinking model
writes into `reasoning_content` (its thoughts, between `<think>` and `</think>`) and `content`
(the answer after them), whole and streamed.

    deepseek_r1  DeepSeek-R1 and its distills: the output starts inside the thoughts (their chat
                 template ends the prompt with `<think>`; an opening tag in the output is dropped)
                 and everything before `</think>` is reasoning; without one, all of it is.
    qwen3        Qwen3 (and QwQ): the output is reasoning only inside `<think>...</think>`: when it
                 starts with `<think>`, or when the prompt left one open (a template that opens the
                 block, as Qwen3-2507's thinking models do). `enable_thinking: false` in
                 `chat_template_kwargs` makes Qwen3's template close the block in the prompt: the
                 output is then all content.

Streaming holds back any text that may be the start of a tag until the next delta says whether
it is one, so no delta ever carries part of a tag. Tool calls and structured output apply to the
content only: `constrain` prefixes a request's grammar with the thoughts (any text, ended by the
first `</think>`), so the grammar starts where the reasoning ends.
"""

from __future__ import annotations

import dataclasses
import json

from jaxllm.sampling_params import StructuredOutputsParams
from jaxllm.structured_output.llguidance_backend import JSON_OPTIONS


@dataclasses.dataclass
class ReasoningParser:
    name: str
    # Whether the output begins inside the thoughts whatever the prompt (DeepSeek-R1).
    always_open: bool
    start: str = "<think>"
    end: str = "</think>"

    def opened_by(self, prompt_text: str) -> bool:
        """Whether the output starts inside the thoughts, given the end of the rendered prompt."""
        return self.always_open or prompt_text.rfind(self.start) > prompt_text.rfind(self.end)

    def extract(self, text: str, opened: bool) -> tuple[str | None, str | None]:
        """A whole output as (reasoning, content); None for an empty part."""
        stream = self.stream(opened)
        parts = [stream.feed(text), stream.finish()]
        reasoning, content = ("".join(p[i] for p in parts) for i in (0, 1))
        return reasoning or None, content or None

    def stream(self, opened: bool) -> ReasoningStream:
        return ReasoningStream(self, opened)

    def constrain(self, params: StructuredOutputsParams, opened: bool) -> StructuredOutputsParams:
        """`params` applied after the thoughts: a Lark grammar (llguidance's dialect) of the
        reasoning (any text up to and including the first end tag, matched lazily: it ends
        there), then the constraint. Not opened: the thoughts are optional and begin with the
        start tag, so an output without them is the constraint alone."""
        import llguidance

        end = _lark_regex_literal(self.end)
        if opened or self.always_open:
            head = f"start: think body\nthink[lazy]: /(?s:.*){end}/\n"
        else:
            head = f"start: think? body\nthink[lazy]: /{_lark_regex_literal(self.start)}(?s:.*){end}/\n"
        kind, text = params.key
        if kind == "json":  # (with the compact JSON the backend asks of a schema alone)
            schema = json.loads(text)
            if isinstance(schema, dict):
                schema["x-guidance"] = {**JSON_OPTIONS, **schema.get("x-guidance", {})}
            body = f"%json {json.dumps(schema)}"
        elif kind == "regex":
            body = f"/{llguidance.regex_to_lark(text, 'dw')}/"
        elif kind == "choice":
            body = " | ".join(json.dumps(c, ensure_ascii=False) for c in json.loads(text))
        else:  # a Lark or GBNF grammar, as Lark, nested
            lark = llguidance.grammar_from("grammar", text)
            body = "%lark {\n" + lark.replace("%llguidance {}", "") + "\n}"
        return StructuredOutputsParams(grammar=f"{head}body: {body}\n")


def _lark_regex_literal(text: str) -> str:
    """`text` matched literally inside a Lark /regex/ (Rust syntax, where `\\<` is a word boundary)."""
    return "".join(f"\\{c}" if c in "\\.+*?()|[]{}^$/-&~#" else c for c in text)


class ReasoningStream:
    """One choice's output as it comes: `feed(delta)` and `finish()` -> (reasoning delta,
    content delta)."""

    def __init__(self, parser: ReasoningParser, opened: bool):
        self.parser = parser
        # "start": not yet known whether the output opens with the start tag; "reasoning"; "content".
        self.state = "reasoning" if opened or parser.always_open else "start"
        self.held = ""  # text that may be the beginning of a tag
        self.fresh = True  # in the reasoning, nothing sent yet (a leading start tag is dropped)

    def feed(self, delta: str) -> tuple[str, str]:
        text, reasoning, content = self.held + delta, "", ""
        self.held = ""
        start, end = self.parser.start, self.parser.end
        while text:
            if self.state == "start":
                stripped = text.lstrip()
                if stripped.startswith(start):
                    self.state, self.fresh = "reasoning", False
                    text = stripped[len(start) :]
                elif start.startswith(stripped):  # (all whitespace, or a part of the tag)
                    self.held = text
                    return reasoning, content
                else:
                    self.state = "content"
            elif self.state == "reasoning":
                if self.fresh:  # an opening tag the template already wrote (DeepSeek-R1 repeats it)
                    stripped = text.lstrip()
                    if start.startswith(stripped) and stripped != start:
                        self.held = text
                        return reasoning, content
                    if stripped.startswith(start):
                        text = stripped[len(start) :]
                    self.fresh = False
                    continue
                at = text.find(end)
                if at >= 0:
                    reasoning += text[:at]
                    text, self.state = text[at + len(end) :], "content"
                else:
                    keep = _partial_suffix(text, end)
                    reasoning += text[: len(text) - keep]
                    self.held = text[len(text) - keep :]
                    return reasoning, content
            else:
                return reasoning, content + text
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What was held back, where it belongs now that the output has ended."""
        held, self.held = self.held, ""
        if self.state == "reasoning":
            return held, ""
        return "", held


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper beginning of `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


PARSERS = {
    "deepseek_r1": ReasoningParser("deepseek_r1", always_open=True),
    "qwen3": ReasoningParser("qwen3", always_open=False),
}


def get_reasoning_parser(name: str) -> ReasoningParser:
    try:
        return PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of {sorted(PARSERS)}") from None
