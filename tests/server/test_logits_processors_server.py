"""logit_bias (OpenAI's), allowed_token_ids and bad_words (vLLM's extras) over HTTP with the
official `openai` client: the server's answers equal the offline engine's under the same
parameters, and bad values get 400 naming the field."""

from __future__ import annotations

import openai
import pytest

from jaxllm import SamplingParams

PROMPT = "The capital of France is"


MESSAGES = [{"role": "user", "content": PROMPT}]


def _offline(server, chat: bool = False, **kwargs):
    """The offline engine's greedy output (6 tokens) for the completion prompt or the chat."""
    llm = server.offline
    ids = llm.engine.apply_chat_template(MESSAGES) if chat else llm.get_tokenizer().encode(PROMPT)
    params = SamplingParams(temperature=0.0, max_tokens=6, **kwargs)
    return llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].outputs[0]


@pytest.mark.parametrize("chat", [False, True])
def test_logit_bias_and_filters_as_offline(server, chat):
    plain = _offline(server, chat).token_ids
    tok = server.offline.get_tokenizer()
    word = next(  # an output token whose text alone tokenizes back to it: a bad word that bans it
        w
        for t, w in ((t, tok.decode([t]).strip()) for t in plain)
        if w and [t] in (tok.encode(v, add_special_tokens=False) for v in (w, " " + w))
    )
    cases = [  # (the offline engine's parameters, what the HTTP request carries)
        (dict(logit_bias={plain[0]: -100.0, plain[1]: 5.0}), None),
        (dict(allowed_token_ids=sorted(set(plain[2:]) | {plain[0]})), "extra"),
        (dict(bad_words=[word]), "extra"),
    ]
    for offline, how in cases:
        want = _offline(server, chat, **offline)
        assert want.token_ids != plain
        if how == "extra":
            http = dict(extra_body=offline)
        else:
            http = dict(logit_bias={str(t): b for t, b in offline["logit_bias"].items()})
        if chat:
            got = server.client.chat.completions.create(
                model=server.model, messages=MESSAGES, temperature=0, max_tokens=6, **http
            )
            assert got.choices[0].message.content == want.text
        else:
            got = server.client.completions.create(
                model=server.model, prompt=PROMPT, temperature=0, max_tokens=6, **http
            )
            assert got.choices[0].text == want.text


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (dict(logit_bias={"x": 1}), "logit_bias"),
        (dict(logit_bias={"5": 200}), "logit_bias"),
        (dict(logit_bias={"100000000": 1}), "logit_bias"),
        (dict(extra_body={"allowed_token_ids": []}), "allowed_token_ids"),
        (dict(extra_body={"allowed_token_ids": [10**9]}), "allowed_token_ids"),
        (dict(extra_body={"bad_words": ["  "]}), "bad_words"),
    ],
)
def test_bad_values_get_400_naming_the_field(server, kwargs, param):
    with pytest.raises(openai.BadRequestError) as e:
        server.client.completions.create(model=server.model, prompt=PROMPT, max_tokens=2, **kwargs)
    assert e.value.body["param"] == param
