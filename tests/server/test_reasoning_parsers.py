"""The reasoning parsers (--reasoning-parser): whole outputs split as hand-worked, streamed deltas
adding up to the whole split whatever the token boundaries (no delta carries a piece of a tag),
and `constrain`'s grammars checked by llguidance on a real tokenizer: free thoughts, then the
request's own constraint."""

from __future__ import annotations

import json

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from jaxllm.entrypoints.openai.reasoning_parsers import PARSERS, get_reasoning_parser
from jaxllm.sampling_params import StructuredOutputsParams

R1, QWEN3 = PARSERS["deepseek_r1"], PARSERS["qwen3"]


@pytest.mark.parametrize(
    "parser, opened, text, want",
    [
        (R1, True, "Let me see.</think>\n\nIt is 4.", ("Let me see.", "\n\nIt is 4.")),
        (R1, True, "<think>\nhm</think>four", ("\nhm", "four")),  # (a repeated opening tag is dropped)
        (R1, True, "still thinking", ("still thinking", None)),
        (R1, True, "</think>only an answer", (None, "only an answer")),
        (QWEN3, False, "<think>a</think>b</think>c", ("a", "b</think>c")),
        (QWEN3, False, "  <think>x", ("x", None)),  # (cut short inside the thoughts)
        (QWEN3, False, "no thoughts at all", (None, "no thoughts at all")),
        (QWEN3, False, "a <think> later</think>", (None, "a <think> later</think>")),
        (QWEN3, True, "opened by the template</think>done", ("opened by the template", "done")),
        (QWEN3, False, "", (None, None)),
    ],
)
def test_whole_outputs_split_as_worked_by_hand(parser, opened, text, want):
    assert parser.extract(text, opened) == want


def test_the_prompt_decides_whether_the_output_starts_in_the_thoughts():
    assert QWEN3.opened_by("<|im_start|>assistant\n<think>\n")
    assert not QWEN3.opened_by("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # enable_thinking false
    assert not QWEN3.opened_by("<|im_start|>assistant\n")
    assert R1.opened_by("<|Assistant|>")
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        get_reasoning_parser("nope")


# Text around the tags, with their characters in it so that a tag's beginning appears where no tag is.
_TEXT = st.text(alphabet=st.sampled_from(list("ab <>/thinkTHINK\n")), max_size=30).filter(
    lambda t: "<think>" not in t and "</think>" not in t
)


@settings(max_examples=300, deadline=None)
@given(
    parser=st.sampled_from([R1, QWEN3]),
    opened=st.booleans(),
    lead=st.sampled_from(["", " ", "\n", "<think>", "\n<think>"]),
    thoughts=_TEXT,
    closed=st.booleans(),
    answer=_TEXT,
    cuts=st.lists(st.integers(0, 80), max_size=12),
)
def test_streamed_deltas_add_up_to_the_whole_split(parser, opened, lead, thoughts, closed, answer, cuts):
    text = lead + thoughts + ("</think>" + answer if closed else "")
    bounds = sorted({0, len(text), *(c for c in cuts if c < len(text))})
    stream = parser.stream(opened)
    deltas = [stream.feed(text[a:b]) for a, b in zip(bounds, bounds[1:])] + [stream.finish()]
    reasoning = "".join(r for r, _ in deltas)
    content = "".join(c for _, c in deltas)
    assert (reasoning or None, content or None) == parser.extract(text, opened)
    # No delta holds a piece of a tag: the parts are exactly the text around the tags.
    starts_open = opened or parser.always_open or lead.lstrip().startswith("<think>")
    if starts_open and closed:
        assert (reasoning, content) == (thoughts if lead.strip() else lead + thoughts, answer)
    elif starts_open:
        assert content == ""
    else:
        assert reasoning == "" and content == text


@pytest.fixture(scope="module")
def grammar_backend(tiny_model_dir):
    import transformers

    from jaxllm.structured_output.llguidance_backend import LLGuidanceBackend

    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    return LLGuidanceBackend(tokenizer, len(tokenizer), [tokenizer.eos_token_id]), tokenizer


def _accepts(grammar_backend, params: StructuredOutputsParams, text: str) -> bool:
    """Whether the grammar of `params` takes `text` whole and may end there."""
    backend, tokenizer = grammar_backend
    matcher = backend.compile(*params.key)
    ids = tokenizer.encode(text, add_special_tokens=False)
    return all(matcher.consume(t) for t in ids) and matcher.matcher.is_accepting()


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}
CONSTRAINTS = [
    (StructuredOutputsParams(json=SCHEMA), '{"n": 4}', '{"n": "four"}'),
    (StructuredOutputsParams(json_object=True), '{"x": [1]}', "[1]"),
    (StructuredOutputsParams(regex=r"\d{2}-[a-z]+"), "42-ok", "4-ok"),
    (StructuredOutputsParams(choice=['say "yes"', "no"]), 'say "yes"', "maybe"),
    (StructuredOutputsParams(grammar='start: "A" NUM\nNUM: /[0-9]+/'), "A12", "B12"),
    (StructuredOutputsParams(grammar='root ::= "x" [0-9] [0-9]'), "x42", "x4"),  # GBNF
]


@pytest.mark.parametrize("params, good, bad", CONSTRAINTS)
def test_the_grammar_starts_after_the_thoughts(grammar_backend, params, good, bad):
    opened = R1.constrain(params, opened=True)
    assert _accepts(grammar_backend, opened, f"Some <b>thoughts</b>, {{not json}}.</think>{good}")
    assert _accepts(grammar_backend, opened, f"</think>{good}")
    assert not _accepts(grammar_backend, opened, f"thoughts</think>{bad}")
    assert not _accepts(grammar_backend, opened, good)  # (the thoughts must end first)
    optional = QWEN3.constrain(params, opened=False)
    assert _accepts(grammar_backend, optional, good)
    assert _accepts(grammar_backend, optional, f"<think>\nhm, {json.dumps(good)}\n</think>{good}")
    assert not _accepts(grammar_backend, optional, f"hm</think>{good}")
    assert not _accepts(grammar_backend, optional, bad)
