"""Structured output over HTTP: OpenAI's response_format (the official client's `parse` with a
pydantic model), vLLM's structured_outputs and guided_* fields on both endpoints, streamed
and plain alike, and invalid constraints answered 400 before anything runs."""

from __future__ import annotations

import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from jaxllm import SamplingParams, StructuredOutputsParams

from tests.helpers.schema_suite import SCHEMAS, validate

PET = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "kind": {"enum": ["cat", "dog", "fish"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 30},
    },
    "required": ["name", "kind", "age"],
    "additionalProperties": False,
}


class Pet(BaseModel):
    name: str = Field(max_length=6)
    kind: Literal["cat", "dog", "fish"]
    age: int = Field(ge=0, le=30)
    vaccinated: bool


def test_chat_parse_returns_the_pydantic_model(server):
    for seed in range(3):
        completion = server.client.chat.completions.parse(
            model=server.model,
            messages=[{"role": "user", "content": "Describe a pet."}],
            response_format=Pet,
            seed=seed,
            max_completion_tokens=200,
        )
        message = completion.choices[0].message
        assert completion.choices[0].finish_reason == "stop"
        assert isinstance(message.parsed, Pet)
        assert Pet.model_validate_json(message.content) == message.parsed


@pytest.mark.parametrize(
    "fields, constraint",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "pet", "schema": PET, "strict": True}}},
            StructuredOutputsParams(json=PET),
        ),
        ({"guided_json": PET}, StructuredOutputsParams(json=PET)),
        (
            {"structured_outputs": {"regex": r"[A-Z][a-z]{2,5} [0-9]{2}"}},
            StructuredOutputsParams(regex=r"[A-Z][a-z]{2,5} [0-9]{2}"),
        ),
        ({"guided_choice": ["red", "green", "blue"]}, StructuredOutputsParams(choice=["red", "green", "blue"])),
        (
            {"guided_grammar": 'root ::= "x" [0-9] ("+" "x" [0-9])?'},
            StructuredOutputsParams(grammar='root ::= "x" [0-9] ("+" "x" [0-9])?'),
        ),
    ],
)
def test_completions_follow_the_constraint_streamed_or_not_as_offline(server, fields, constraint):
    prompts = ["A pet:", "Name and number:"]
    offline = [
        o.outputs[0].text
        for o in server.offline.generate(
            prompts,
            SamplingParams(temperature=1.0, seed=5, max_tokens=200, structured_outputs=constraint),
            use_tqdm=False,
        )
    ]
    plain = server.client.completions.create(
        model=server.model, prompt=prompts, max_tokens=200, seed=5, extra_body=fields
    )
    streamed = [""] * len(prompts)
    for chunk in server.client.completions.create(
        model=server.model, prompt=prompts, max_tokens=200, seed=5, stream=True, extra_body=fields
    ):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert [c.text for c in plain.choices] == streamed == offline
    for text in offline:
        if constraint.json is not None:
            jsonschema.validate(json.loads(text), constraint.json)
        elif constraint.choice is not None:
            assert text in constraint.choice
        elif constraint.regex is not None:
            assert re.fullmatch(constraint.regex, text)
        else:
            assert re.fullmatch(r"x[0-9](\+x[0-9])?", text)


def test_masked_logprobs_are_reported_as_json_numbers(server):
    response = server.post(
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "Yes?"}],
            "max_tokens": 10,
            "guided_choice": ["yes"],
            "logprobs": True,
            "top_logprobs": 5,
        },
    ).json()
    choice = response["choices"][0]
    assert choice["message"]["content"] == "yes" and choice["finish_reason"] == "stop"
    # Tokens the grammar rules out come back at -9999 (JSON has no -inf), as vLLM reports them.
    first = choice["logprobs"]["content"][0]
    assert "yes".startswith(first["token"])
    assert sorted(t["logprob"] for t in first["top_logprobs"])[:2] == [-9999.0, -9999.0]


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"guided_json": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}, "invalid JSON schema"),
        ({"guided_regex": "(unclosed"}, "invalid regex"),
        ({"structured_outputs": {"grammar": "start: missing_rule"}}, "invalid grammar"),
        ({"structured_outputs": {"json": {}, "regex": "a"}}, "exactly one"),
        ({"structured_outputs": {"yaml": "a: 1"}}, "unknown structured_outputs"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "at most one"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "needs a 'schema'"),
        ({"response_format": {"type": "yaml"}}, "response_format type"),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_invalid_constraints_are_answered_400(server, fields, message, stream):
    for create in (
        lambda: server.client.completions.create(
            model=server.model, prompt="Hi", max_tokens=4, stream=stream, extra_body=fields
        ),
        lambda: server.client.chat.completions.create(
            model=server.model,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=4,
            stream=stream,
            extra_body=fields,
        ),
    ):
        with pytest.raises(openai.BadRequestError, match=message):
            create()
    server.assert_healthy()


@pytest.mark.slow
def test_the_default_model_answers_every_schema_validly_through_the_client(tmp_path):
    # The real model sampling at temperature 1, two requests per schema of the suite, sent
    # together (benchmarks/structured_output.py samples 8 per schema).
    from jaxllm.models.loader import default_model_path
    from tests.helpers.live_server import start_server

    path = default_model_path()
    server = start_server(
        path,
        str(tmp_path),
        "--kv-cache-memory",
        "256MiB",
        "--max-model-len",
        "384",
        "--served-model-name",
        os.path.basename(path),
    )

    def ask(job):
        (name, prompt, schema, _), seed = job
        response = server.client.chat.completions.create(
            model=server.model,
            messages=[{"role": "user", "content": f"{prompt} Answer in JSON."}],
            seed=seed,
            temperature=1.0,
            max_tokens=200,
            response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}},
        )
        return name, schema, response.choices[0]

    try:
        with ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(ask, [(s, seed) for s in SCHEMAS for seed in (1, 2)]))
        for name, schema, choice in answers:
            assert choice.finish_reason == "stop", (name, choice.message.content)
            validate(json.loads(choice.message.content), schema)
        parsed = (
            server.client.chat.completions.parse(
                model=server.model,
                messages=[{"role": "user", "content": "Describe a pet."}],
                response_format=Pet,
                temperature=1.0,
                seed=0,
                max_tokens=100,
            )
            .choices[0]
            .message.parsed
        )
        assert isinstance(parsed, Pet)
    finally:
        server.stop()
