"""Property-based fuzzing of the live server from its own OpenAPI schema (schemathesis): for
every operation, requests generated from the schema, valid ones and invalid ones, never get a
5xx, every response's status, content type and body match the schema, and the server answers
the same greedy request identically before and after."""

from __future__ import annotations

import hypothesis
import pytest
import schemathesis
from schemathesis.checks import not_a_server_error
from schemathesis.generation.modes import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.helpers.live_server import AUTH


EXAMPLES = 60  # per operation and mode
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
OPERATIONS = [
    "GET /health",
    "GET /version",
    "GET /metrics",
    "GET /v1/models",
    "POST /v1/completions",
    "POST /v1/chat/completions",
    "POST /v1/responses",
    "POST /v1/messages",
    "POST /v1/messages/count_tokens",
    "POST /tokenize",
    "POST /detokenize",
    "POST /v1/embeddings",
    "POST /pooling",
]
# A pooling engine's routes, fuzzed on the embedding server (a generation server answers them 400).
POOLING_OPERATIONS = ["POST /v1/embeddings", "POST /pooling"]


@pytest.fixture(scope="module")
def api_schema(server):
    return schemathesis.openapi.from_url(server.url + "/openapi.json")


@pytest.fixture(scope="module")
def greedy_before(server):
    return greedy_answer(server)


def greedy_answer(server) -> str:
    return (
        server.client.completions.create(
            model=server.model, prompt="Once upon a time", max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
    )


def test_schema_lists_every_operation(api_schema):
    assert sorted(op.ok().label for op in api_schema.get_all_operations()) == sorted(OPERATIONS)


def runs(labels: list[str]) -> list[tuple[str, GenerationMode]]:
    """Each operation with valid requests, and those that take a body with invalid ones too."""
    return [(label, GenerationMode.POSITIVE) for label in labels] + [
        (label, GenerationMode.NEGATIVE) for label in labels if label.startswith("POST")
    ]


RUNS = runs([label for label in OPERATIONS if label not in POOLING_OPERATIONS])
POOLING_RUNS = runs(POOLING_OPERATIONS)


@pytest.mark.parametrize("label, mode", RUNS, ids=[f"{label}-{mode.value}" for label, mode in RUNS])
def test_fuzz_operation(api_schema, server, greedy_before, label, mode):
    fuzz_operation(api_schema, server, label, mode)


@pytest.mark.parametrize("label, mode", POOLING_RUNS, ids=[f"{label}-{mode.value}" for label, mode in POOLING_RUNS])
def test_fuzz_pooling_operation(embedding_server, label, mode):
    schema = schemathesis.openapi.from_url(embedding_server.url + "/openapi.json")
    fuzz_operation(schema, embedding_server, label, mode)
    embedding_server.assert_healthy()


def fuzz_operation(api_schema, server, label: str, mode: GenerationMode, expect_ok: bool = True) -> None:
    """`expect_ok`: some valid requests must succeed (not for routes that random values cannot
    satisfy, such as detokenize's ids or an adapter's path)."""
    operation = api_schema.find_operation_by_label(label)

    @hypothesis.given(case=operation.as_strategy(generation_mode=mode))
    @hypothesis.settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(hypothesis.HealthCheck),
    )
    def fuzz(case):
        response = case.call_and_validate(base_url=server.url, headers=AUTH, checks=CHECKS, timeout=120)
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1

    statuses: dict[int, int] = {}
    fuzz()
    print(f"\n{label} {mode.value}: {sum(statuses.values())} requests, statuses {sorted(statuses.items())}")
    if mode is GenerationMode.POSITIVE and expect_ok and label != "POST /detokenize":
        assert 200 in statuses, statuses  # valid requests do reach the engine (or the tokenizer)


def test_same_answer_after_fuzzing(server, greedy_before):
    server.assert_healthy()
    assert greedy_answer(server) == greedy_before
