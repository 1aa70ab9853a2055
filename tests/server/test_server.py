"""The OpenAI-compatible server, live on loopback (`jaxllm serve` in a subprocess), driven by the
official `openai` client and raw HTTP; the offline `LLM` over the same tiny model is the
reference for every output."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import openai
import pytest

from jaxllm import SamplingParams

from tests.helpers.live_server import API_KEY, AUTH, LiveServer


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


def offline_texts(server: LiveServer, prompts, params: SamplingParams) -> list[str]:
    return [o.outputs[0].text for o in server.offline.generate(prompts, params, use_tqdm=False)]


# ----------------------------------------------------------------------------- basics


def test_models_health_version_tokenize(server):
    models = server.client.models.list()
    assert [m.id for m in models.data] == [server.model]
    assert models.data[0].max_model_len == 512
    server.assert_healthy()
    assert httpx.get(server.url + "/version").json()["version"]
    tokens = server.post("/tokenize", {"prompt": "Hello world, how are you?"}).json()
    assert tokens["tokens"] == server.offline.get_tokenizer().encode("Hello world, how are you?")
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 512
    assert server.post("/detokenize", {"tokens": tokens["tokens"]}).json() == {"prompt": "Hello world, how are you?"}
    chat = server.post("/tokenize", {"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["tokens"] == server.offline.apply_chat_template([{"role": "user", "content": "Hi"}])


# ----------------------------------------------------------------------------- completions


PROMPTS = ["Hello there", "The capital of France is", "def fibonacci(n):"]


def test_completions_greedy_equal_offline(server):
    params = greedy(16, ignore_eos=True)
    expected = offline_texts(server, PROMPTS, params)
    response = server.client.completions.create(
        model=server.model, prompt=PROMPTS, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
    )
    assert [c.text for c in response.choices] == expected
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in response.choices)
    tokenizer = server.offline.get_tokenizer()
    prompt_tokens = sum(len(tokenizer.encode(p)) for p in PROMPTS)
    assert response.usage.prompt_tokens == prompt_tokens
    assert response.usage.completion_tokens == 3 * 16
    assert response.usage.total_tokens == prompt_tokens + 3 * 16

    # Token-id prompts (one, and a list of them) give the same text as the strings.
    ids = [tokenizer.encode(p) for p in PROMPTS]
    one = server.client.completions.create(
        model=server.model, prompt=ids[1], max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
    )
    assert one.choices[0].text == expected[1]
    many = server.client.completions.create(
        model=server.model, prompt=ids, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
    )
    assert [c.text for c in many.choices] == expected

    echoed = server.client.completions.create(
        model=server.model, prompt=PROMPTS[0], max_tokens=16, temperature=0, echo=True, extra_body={"ignore_eos": True}
    )
    assert echoed.choices[0].text == PROMPTS[0] + expected[0]


def test_completions_stream_equal_plain(server):
    expected = offline_texts(server, PROMPTS, greedy(16, ignore_eos=True))
    stream = server.client.completions.create(
        model=server.model,
        prompt=PROMPTS,
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    texts, finish, usage = ["", "", ""], [None] * 3, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
            assert chunk.choices == []
            continue
        for choice in chunk.choices:
            assert finish[choice.index] is None, "a chunk after the choice finished"
            texts[choice.index] += choice.text
            finish[choice.index] = choice.finish_reason
    assert texts == expected
    assert finish == ["length"] * 3
    assert usage.completion_tokens == 48

    raw = server.post("/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 4, "stream": True})
    assert raw.headers["content-type"].startswith("text/event-stream")
    events = [line for line in raw.text.split("\n\n") if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"


def test_completions_n_seed_stop_logprobs(server):
    # n with a seed: reproducible, and equal to the offline engine with the same seed.
    sampled = SamplingParams(n=3, temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)
    expected = [c.text for c in server.offline.generate(PROMPTS[0], sampled, use_tqdm=False)[0].outputs]
    kwargs = dict(
        model=server.model,
        prompt=PROMPTS[0],
        n=3,
        temperature=1.0,
        seed=1234,
        max_tokens=12,
        extra_body={"ignore_eos": True},
    )
    first = server.client.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == expected
    assert len(set(expected)) > 1
    assert [c.text for c in server.client.completions.create(**kwargs).choices] == expected

    # stop string: cut before its first occurrence, streamed or not.
    full = offline_texts(server, [PROMPTS[1]], greedy(24, ignore_eos=True))[0]
    stop = full[12:15]
    cut = full[: full.find(stop)]
    kwargs = dict(
        model=server.model,
        prompt=PROMPTS[1],
        max_tokens=24,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    response = server.client.completions.create(**kwargs)
    assert response.choices[0].text == cut
    assert response.choices[0].finish_reason == "stop"
    assert response.choices[0].model_extra["stop_reason"] == stop
    assert "".join(c.choices[0].text for c in server.client.completions.create(**kwargs, stream=True)) == cut

    # stop_token_ids (vLLM's extra): finishes on that token.
    token_ids = server.offline.generate(PROMPTS[1], greedy(24, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
    stopped = server.client.completions.create(
        model=server.model,
        prompt=PROMPTS[1],
        max_tokens=24,
        temperature=0,
        extra_body={"stop_token_ids": [token_ids[3]], "ignore_eos": True},
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.usage.completion_tokens == token_ids.index(token_ids[3]) + 1

    # logprobs: the greedy token is the best one, and matches the offline engine's logprob.
    reference = server.offline.generate(PROMPTS[2], greedy(8, ignore_eos=True, logprobs=3), use_tqdm=False)[0]
    response = server.client.completions.create(
        model=server.model, prompt=PROMPTS[2], max_tokens=8, temperature=0, logprobs=3, extra_body={"ignore_eos": True}
    )
    lp = response.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    for i, (token_id, entry) in enumerate(zip(reference.outputs[0].token_ids, reference.outputs[0].logprobs)):
        assert lp.token_logprobs[i] == pytest.approx(entry[token_id].logprob, abs=1e-4)
        # The top 3 of the offline engine (its sampled token is among them: greedy), by text.
        ranked = sorted((x for x in entry.values() if x.rank is not None), key=lambda x: x.rank)
        assert [x.rank for x in ranked] == [1, 2, 3] and ranked[0].decoded_token == lp.tokens[i]
        expected = {x.decoded_token: x.logprob for x in ranked}
        assert lp.top_logprobs[i].keys() == expected.keys()
        assert list(lp.top_logprobs[i].values()) == pytest.approx(list(expected.values()), abs=1e-4)
        assert lp.token_logprobs[i] == pytest.approx(max(lp.top_logprobs[i].values()), abs=1e-6)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_completions_echo_with_logprobs_scores_the_prompt(server):
    # How evaluation tools score text: echo + logprobs returns the prompt tokens' logprobs
    # (the first has none), then the completion's; streamed, the first chunk carries them.
    reference = server.offline.generate(
        PROMPTS[1], greedy(4, ignore_eos=True, logprobs=2, prompt_logprobs=2), use_tqdm=False
    )[0]
    ids = reference.prompt_token_ids
    kwargs = dict(
        model=server.model,
        prompt=PROMPTS[1],
        max_tokens=4,
        temperature=0,
        echo=True,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    plain = server.client.completions.create(**kwargs).choices[0]
    streamed = list(server.client.completions.create(**kwargs, stream=True))
    first = streamed[0].choices[0].logprobs
    assert plain.text == PROMPTS[1] + reference.outputs[0].text
    lp = plain.logprobs
    assert len(lp.tokens) == len(ids) + 4 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for p, (token, entry) in enumerate(zip(ids[1:], reference.prompt_logprobs[1:]), start=1):
        assert lp.tokens[p] == entry[token].decoded_token
        assert lp.token_logprobs[p] == pytest.approx(entry[token].logprob, abs=1e-4)
        assert len(lp.top_logprobs[p]) >= 2
    assert lp.text_offset == sorted(lp.text_offset)
    assert lp.token_logprobs[len(ids) :] == pytest.approx(
        [e[t].logprob for t, e in zip(reference.outputs[0].token_ids, reference.outputs[0].logprobs)], abs=1e-4
    )
    assert first.tokens[: len(ids)] == lp.tokens[: len(ids)]
    assert first.token_logprobs[: len(ids)] == pytest.approx(lp.token_logprobs[: len(ids)], abs=1e-6)
    assert sum(len(c.choices[0].logprobs.tokens) for c in streamed if c.choices) == len(ids) + 4


# ----------------------------------------------------------------------------- chat


CONVERSATION = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]


def test_chat_greedy_equal_offline_chat(server):
    reference = server.offline.chat(CONVERSATION, greedy(20), use_tqdm=False)[0].outputs[0]
    response = server.client.chat.completions.create(
        model=server.model, messages=CONVERSATION, max_tokens=20, temperature=0
    )
    choice = response.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == reference.text
    assert choice.finish_reason == reference.finish_reason
    assert response.usage.prompt_tokens == len(server.offline.apply_chat_template(CONVERSATION))
    assert response.usage.completion_tokens == len(reference.token_ids)

    # max_completion_tokens is the newer name of max_tokens; content parts are joined.
    parts = [
        CONVERSATION[0],
        {"role": "user", "content": [{"type": "text", "text": "Name a "}, {"type": "text", "text": "colour."}]},
    ]
    again = server.client.chat.completions.create(
        model=server.model, messages=parts, max_completion_tokens=20, temperature=0
    )
    assert again.choices[0].message.content == reference.text

    stream = server.client.chat.completions.create(
        model=server.model,
        messages=CONVERSATION,
        max_tokens=20,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reference.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == reference.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(reference.token_ids)


def test_chat_n_seed_logprobs(server):
    kwargs = dict(
        model=server.model,
        messages=CONVERSATION,
        n=2,
        temperature=1.0,
        seed=7,
        max_tokens=10,
        extra_body={"ignore_eos": True},
    )
    plain = server.client.chat.completions.create(**kwargs)
    assert [c.index for c in plain.choices] == [0, 1]
    texts = ["", ""]
    for chunk in server.client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == [c.message.content for c in plain.choices]
    assert plain.usage.completion_tokens == 20

    response = server.client.chat.completions.create(
        model=server.model,
        messages=CONVERSATION,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    content = response.choices[0].logprobs.content
    assert len(content) == 6
    for item in content:
        assert len(item.top_logprobs) == 2
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob, abs=1e-6)
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob


# ----------------------------------------------------------------------------- load and failure


def test_32_concurrent_streams_with_bad_requests_between(server):
    rng = random.Random(0)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
    prompts = [f"Request {i}: " + " ".join(rng.choices(words, k=rng.randint(1, 60))) for i in range(32)]
    lengths = [rng.randint(8, 40) for _ in range(32)]
    expected = [
        server.offline.generate(p, greedy(n, ignore_eos=True), use_tqdm=False)[0].outputs[0]
        for p, n in zip(prompts, lengths)
    ]
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)

    async def stream_one(prompt: str, max_tokens: int):
        stream = await client.completions.create(
            model=server.model,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0,
            logprobs=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        text, num_tokens = "", 0
        async for chunk in stream:
            text += chunk.choices[0].text
            num_tokens += len(chunk.choices[0].logprobs.tokens)
        return text, num_tokens

    async def bad_one(i: int):
        with pytest.raises(openai.BadRequestError):
            await client.completions.create(
                model=server.model, prompt="x", max_tokens=4, temperature=-1.0 - i, stream=bool(i % 2)
            )

    async def run():
        tasks = [stream_one(p, n) for p, n in zip(prompts, lengths)] + [bad_one(i) for i in range(4)]
        try:
            return await asyncio.gather(*tasks)
        finally:
            await client.close()

    results = asyncio.run(run())[:32]
    for (text, num_tokens), reference, n in zip(results, expected, lengths):
        assert num_tokens == n  # no token lost or duplicated
        assert text == reference.text
    server.assert_healthy()


def _wait_idle(server: LiveServer, aborts_before: float, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        idle = (
            m[("jaxllm:num_requests_running", ())] == 0
            and m[("jaxllm:kv_cache_usage_perc", ())] == 0
            and m.get(("jaxllm:request_success_total", (("finished_reason", "abort"),)), 0) > aborts_before
        )
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


def test_client_disconnect_aborts_request(server):
    abort_key = ("jaxllm:request_success_total", (("finished_reason", "abort"),))
    aborts = server.metrics().get(abort_key, 0)
    body = {
        "model": server.model,
        "prompt": "Tell me a long story",
        "max_tokens": 480,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=AUTH, timeout=60) as response:
        assert response.status_code == 200
        data = [line for _, line in zip(range(3), (x for x in response.iter_lines() if x.startswith("data:")))]
        assert len(data) == 3
    m = _wait_idle(server, aborts)
    assert m[abort_key] == aborts + 1
    assert m[("jaxllm:num_requests_running", ())] == 0
    assert m[("jaxllm:kv_cache_usage_perc", ())] == 0.0

    # A plain (non-streamed) request whose client gives up is aborted too. (It gives up after 0.3 s:
    # the 480 tokens take about a second on the tiny model, and after 0.5 s, once in a full run of
    # the suite, the request had finished before the server saw the client go.)
    with pytest.raises(httpx.ReadTimeout):
        server.post(
            "/v1/chat/completions",
            {
                "model": server.model,
                "max_tokens": 480,
                "ignore_eos": True,
                "messages": [{"role": "user", "content": "Go on"}],
            },
            timeout=httpx.Timeout(60, read=0.3),
        )
    m = _wait_idle(server, aborts + 1)
    assert m[abort_key] == aborts + 2
    assert m[("jaxllm:kv_cache_usage_perc", ())] == 0.0

    # The server keeps serving.
    expected = offline_texts(server, [PROMPTS[0]], greedy(5))
    assert (
        server.client.completions.create(model=server.model, prompt=PROMPTS[0], max_tokens=5, temperature=0)
        .choices[0]
        .text
        == expected[0]
    )


def test_openai_client_raises_on_errors(server):
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        server.client.completions.create(model=server.model, prompt="hi", max_tokens=-3)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert server.client.completions.create(model=server.model, prompt="hi", max_tokens=2).choices[0].text is not None


# ----------------------------------------------------------------------------- metrics


def test_metrics_move_as_requests_complete(server):
    def value(m, name, **labels):
        return m.get((name, tuple(sorted(labels.items()))), 0.0)

    before = server.metrics()
    for name in (
        "jaxllm:num_requests_running",
        "jaxllm:num_requests_waiting",
        "jaxllm:kv_cache_usage_perc",
        "jaxllm:num_preemptions_total",
        "jaxllm:time_to_first_token_seconds_count",
        "jaxllm:spec_decode_num_draft_tokens_total",
        "jaxllm:spec_decode_num_accepted_tokens_total",
    ):
        assert (name, ()) in before, name
    prompt = [random.Random(time.time_ns()).randrange(100, 40000) for _ in range(20)]  # no cached prefix
    server.client.completions.create(
        model=server.model, prompt=prompt, max_tokens=7, temperature=0, extra_body={"ignore_eos": True}
    )
    after = server.metrics()
    delta = {key: after.get(key, 0.0) - before.get(key, 0.0) for key in after}
    assert delta[("jaxllm:prompt_tokens_total", ())] == 20
    assert delta[("jaxllm:generation_tokens_total", ())] == 7
    assert delta[("jaxllm:request_success_total", (("finished_reason", "length"),))] == 1
    for name in ("time_to_first_token", "e2e_request_latency", "request_queue_time"):
        assert delta[(f"jaxllm:{name}_seconds_count", ())] == 1, name
    assert delta[("jaxllm:inter_token_latency_seconds_count", ())] == 6
    assert delta[("jaxllm:e2e_request_latency_seconds_sum", ())] > 0
    assert value(after, "jaxllm:num_requests_running") == 0

    # The same 40-token prompt twice: the second hits the prefix cache (in tokens, whole pages).
    prompt = [random.Random(time.time_ns()).randrange(100, 40000) for _ in range(40)]
    for _ in range(2):
        server.client.completions.create(model=server.model, prompt=prompt, max_tokens=2, temperature=0)
    final = server.metrics()
    assert value(final, "jaxllm:prefix_cache_queries_total") >= value(after, "jaxllm:prefix_cache_queries_total") + 40
    assert value(final, "jaxllm:prefix_cache_hits_total") >= value(after, "jaxllm:prefix_cache_hits_total") + 32


def test_priority_needs_a_priority_server(server):
    response = server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "priority": 1})
    assert response.status_code == 400 and response.json()["error"]["param"] == "priority"
    assert "--scheduling-policy priority" in response.json()["error"]["message"]
