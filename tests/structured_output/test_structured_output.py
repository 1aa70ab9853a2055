"""Structured output: constraints checked before anything is queued, the step's token mask
against a NumPy reference, and outputs sampled at temperature 1 that every independent
checker (jsonschema, re, lark) accepts, whatever else shares the step."""

import dataclasses
import functools
import json
import re

import jax
import jsonschema
import lark
import numpy as np
import pytest

from jaxllm import LLM, SamplingParams, StructuredOutputsParams
from jaxllm.core.request import Request
from jaxllm.kernels import native
from jaxllm.runner import input_batch, sampler
from jaxllm.structured_output.backend import Matcher

from tests.helpers.sampling_reference import state
from tests.helpers.scheduler_steps import make_request, make_scheduler, step
from tests.helpers.schema_suite import SCHEMAS, validate
from tests.helpers.tiny_model import TINY_ENGINE_ARGS

# Bounded schemas: the tiny model's weights are random, so only the grammar brings its output
# to an end (an unbounded string could run to max_tokens).
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}, "active": {"type": "boolean"}},
            "required": ["zip", "active"],
            "additionalProperties": False,
        },
        "score": {"anyOf": [{"type": "null"}, {"type": "integer", "minimum": -9, "maximum": 9}]},
    },
    "required": ["name", "age", "role", "tags", "address", "score"],
    "additionalProperties": False,
}
LARK = r"""
start: expr
expr: NUMBER | "(" term OP term ")"
term: NUMBER | "(" NUMBER OP NUMBER ")"
OP: "+" | "-" | "*"
NUMBER: /[1-9]/
"""
GBNF = r"""
root ::= greeting " " name
greeting ::= "hello" | "hi"
name ::= [A-Z] [a-z] [a-z]?
"""


def checker(constraint: StructuredOutputsParams):
    """An independent check that text satisfies the constraint (raises if not)."""
    if constraint.json is not None:
        return lambda text: jsonschema.validate(json.loads(text), constraint.json)
    if constraint.regex is not None:
        # (\d and \w are ASCII in jaxllm's regexes)
        return lambda text: (
            re.fullmatch(constraint.regex, text, re.ASCII) or pytest.fail(f"{text!r} !~ {constraint.regex}")
        )
    if constraint.choice is not None:
        return lambda text: text in constraint.choice or pytest.fail(f"{text!r} not in {constraint.choice}")
    grammar = LARK if constraint.grammar == LARK else r'start: ("hello" | "hi") " " /[A-Z][a-z][a-z]?/'
    return lark.Lark(grammar, start="start").parse


CONSTRAINTS = [
    StructuredOutputsParams(json=PERSON),
    StructuredOutputsParams(regex=r"\(\d{3}\) \d{3}-\d{4}"),
    StructuredOutputsParams(choice=["yes", "no", "maybe so"]),
    StructuredOutputsParams(grammar=LARK),
    StructuredOutputsParams(grammar=GBNF),
]


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        dict(json="{}", regex="a"),
        dict(choice=[]),
        dict(choice=["a", ""]),
        dict(json=3),
        dict(regex=""),
        dict(json_object="yes"),
    ],
)
def test_a_constraint_is_exactly_one_valid_kind(kwargs):
    with pytest.raises(ValueError):
        StructuredOutputsParams(**kwargs)


@pytest.mark.parametrize(
    "constraint, message",
    [
        (dict(json={"type": "object", "properties": {"a": {"type": "foo"}}}), "JSON schema"),
        (dict(json='{"type": '), "JSON schema"),
        (dict(json={"$ref": "#/definitions/missing"}), "JSON schema"),
        (dict(json={"type": "string", "pattern": "[a-z"}), "JSON schema"),
        (dict(regex="a(b"), "regex"),
        (dict(grammar="start: undefined_rule"), "grammar"),
        (dict(grammar='root ::= "a" | b'), "grammar"),
    ],
)
def test_invalid_constraints_are_rejected_before_anything_is_queued(llm, constraint, message):
    with pytest.raises(ValueError, match=message):
        llm.engine.add_request("bad", "Hi", SamplingParams(structured_outputs=StructuredOutputsParams(**constraint)))
    assert not llm.engine.has_unfinished_requests()


def test_each_constraint_is_compiled_once(llm):
    manager = llm.engine.structured_output
    a = manager.compile(StructuredOutputsParams(json={"type": "object", "properties": {"x": {"type": "integer"}}}))
    b = manager.compile(StructuredOutputsParams(json='{"type": "object", "properties": {"x": {"type": "integer"}}}'))
    assert a is b
    assert manager.matcher(StructuredOutputsParams(choice=["a"])) is not manager.matcher(
        StructuredOutputsParams(choice=["a"])
    )


VOCAB = 80  # three mask words, the last one partly past the vocabulary
WIDE_LOGITS = np.random.default_rng(0).normal(size=VOCAB).astype(np.float32) * 3


@pytest.mark.parametrize("name, prompt, schema, example", SCHEMAS, ids=[s[0] for s in SCHEMAS])
def test_each_schemas_grammar_accepts_a_valid_instance_and_refuses_an_invalid_one(llm, name, prompt, schema, example):
    validate(example, schema)
    invalid = {**example, "zzz": 1} if isinstance(example, dict) else [*example, "extra"]
    with pytest.raises(jsonschema.ValidationError):
        validate(invalid, schema)
    engine = llm.engine
    for instance, valid in ((example, True), (invalid, False)):
        matcher = engine.structured_output.matcher(StructuredOutputsParams(json=schema))
        tokens = engine.tokenizer.encode(json.dumps(instance), add_special_tokens=False)
        accepted = all(matcher.consume(t) for t in tokens)
        assert accepted == valid and (matcher.is_stopped or not valid), (name, json.dumps(instance))


def _mask(allowed_rows: list[list[int]]) -> np.ndarray:
    """Packed bitmask rows (bit t % 32 of word t // 32) allowing the given tokens."""
    bits = np.zeros((len(allowed_rows), 32 * -(-VOCAB // 32)), np.uint8)
    for r, tokens in enumerate(allowed_rows):
        bits[r, tokens] = 1
    return np.packbits(bits, axis=1, bitorder="little").view(np.int32)


SAMPLERS = [
    pytest.param(jax.jit(sampler.sample), id="xla"),
    pytest.param(
        jax.jit(functools.partial(sampler.sample, argmax_logsumexp=native.argmax_logsumexp)),
        id="native",
        marks=pytest.mark.skipif(not native.available(), reason="no native kernels"),
    ),
]


@pytest.mark.parametrize("sample", SAMPLERS)
def test_masked_rows_sample_only_allowed_tokens_with_the_masked_distribution(sample):
    allowed = [[3, 7], [0, 1, 2, 31, 32, 63, 64, VOCAB - 1], [5], list(range(VOCAB))]
    S = len(allowed)
    token_mask = _mask(allowed)
    ref = np.full((S, VOCAB), -np.inf, np.float32)
    for r, tokens in enumerate(allowed):
        ref[r, tokens] = WIDE_LOGITS[tokens]
    for kw in (dict(temperature=0.0), dict(temperature=1.0, top_k=2)):
        st = dataclasses.replace(state(S, logprobs=True, **kw), token_mask=token_mask)
        st.flags[input_batch.FLAG_GRAMMAR] = True
        tokens, lp, top_lp, top_ids = map(np.asarray, sample(np.tile(WIDE_LOGITS, (S, 1)), st))
        assert all(t in a for t, a in zip(tokens, allowed))
        if kw["temperature"] == 0:
            assert tokens.tolist() == ref.argmax(-1).tolist()
        lse = np.log(np.exp(ref.astype(np.float64)).sum(-1))
        np.testing.assert_allclose(lp, ref[np.arange(S), tokens] - lse, rtol=1e-5, atol=1e-5)
        # Top logprobs are the masked distribution's: allowed tokens first, the rest -inf.
        for r, a in enumerate(allowed):
            k = min(len(a), top_ids.shape[1])
            assert sorted(top_ids[r, :k]) == sorted(np.asarray(a)[np.argsort(-WIDE_LOGITS[a])][:k])
            assert np.all(np.isneginf(top_lp[r, k:]))


def test_outputs_follow_their_constraints_at_temperature_1(llm):
    prompts = ["Tell me about a person.", "Call me at", "Is it raining?", "Compute:", "Greet someone."]
    params = [
        SamplingParams(temperature=1.0, max_tokens=300, seed=10 * i + j, structured_outputs=c)
        for i, c in enumerate(CONSTRAINTS)
        for j in range(4)
    ]
    outs = llm.generate([p for p in prompts for _ in range(4)], params, use_tqdm=False)
    for out, p in zip(outs, params):
        choice = out.outputs[0]
        assert choice.finish_reason == "stop", (choice.text, p.structured_outputs)
        checker(p.structured_outputs)(choice.text)
    assert len({o.outputs[0].text for o in outs[:4]}) > 1  # sampled, not one forced text
    assert list(json.loads(outs[0].outputs[0].text)) == list(PERSON["properties"])  # in the schema's order


def test_free_requests_get_the_same_output_alongside_constrained_ones(llm):
    free = ["The capital of France is", "Once upon a time", "1 2 3 4"]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(free, greedy, use_tqdm=False)]
    constrained = [
        SamplingParams(temperature=1.0, max_tokens=300, seed=i, structured_outputs=c) for i, c in enumerate(CONSTRAINTS)
    ]
    mixed = llm.generate(free + ["x"] * len(constrained), [greedy] * len(free) + constrained, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[: len(free)]] == alone
    for out, p in zip(mixed[len(free) :], constrained):
        checker(p.structured_outputs)(out.outputs[0].text)


def test_each_of_n_choices_follows_its_own_grammar(llm):
    params = SamplingParams(
        n=4, temperature=1.0, seed=1, max_tokens=300, structured_outputs=StructuredOutputsParams(json=PERSON)
    )
    out = llm.generate(["A person:"], params, use_tqdm=False)[0]
    for choice in out.outputs:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.text), PERSON)
    assert len({c.text for c in out.outputs}) == 4
    out = llm.generate(
        ["JSON please:"],
        dataclasses.replace(params, structured_outputs=StructuredOutputsParams(json_object=True)),
        use_tqdm=False,
    )[0]
    for choice in out.outputs:  # (an object of unbounded strings may run to max_tokens)
        assert choice.finish_reason == "length" or isinstance(json.loads(choice.text), dict)


def test_speculative_decoding_verifies_drafts_against_the_grammar(tiny_model_dir, llm):
    spec = LLM(
        tiny_model_dir,
        **TINY_ENGINE_ARGS,
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": 3,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 2,
        },
    )
    constraint = StructuredOutputsParams(regex=r"(abc ){3,6}(x|yz)")
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=constraint)
    prompts = ["abc abc abc abc", "abc x abc yz abc abc"]
    expect = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
    assert [o.outputs[0].text for o in spec.generate(prompts, params, use_tqdm=False)] == expect
    assert spec.engine.stats.num_draft_tokens > 0
    for text in expect:
        checker(constraint)(text)


class _Counting(Matcher):
    """A grammar that allows anything and is complete after `length` tokens."""

    backend = None

    def __init__(self, length, refuse=None):
        self.tokens, self.length, self.refuse = [], length, refuse

    def consume(self, token):
        self.tokens.append(token)
        return token != self.refuse

    @property
    def is_stopped(self):
        return len(self.tokens) >= self.length

    def copy(self):
        return _Counting(self.length, self.refuse)


@pytest.mark.parametrize("grammar, reason, num_out", [(_Counting(3), "stop", 3), (_Counting(9, refuse=77), "error", 2)])
def test_the_scheduler_feeds_the_grammar_and_stops_when_it_is_complete(grammar, reason, num_out):
    s = make_scheduler()
    request: Request = make_request("r", 5, max_tokens=8)
    request.grammar = grammar
    s.add_request(request)
    outputs = []
    while s.has_unfinished_requests():
        outputs += step(s, {"r": 77 if len(outputs) == 1 else None})[1].outputs
    assert [o.finish_reason for o in outputs] == [None] * (num_out - 1) + [reason]
    assert grammar.tokens == request.output_token_ids and s.kv.num_used_pages == 0
