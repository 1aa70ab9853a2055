"""Logits processors through `LLM.generate` on the tiny model: the built-ins (logit_bias,
allowed_token_ids, bad_words) and custom `LogitsProcessor`s each change the choice exactly as
the model's own distribution (an unconstrained run's top-20 logprobs) says they must, alone,
together, with a grammar, with n > 1 and beside plain requests; bad values are refused with the
field named; after warm-up none of them compiles the step again."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm import LogitsProcessor, SamplingParams
from jaxllm.sampling_params import StructuredOutputsParams

PROMPT = "The capital of France is"


def _run(llm, **kwargs):
    params = SamplingParams(**{"temperature": 0.0, "max_tokens": 1, **kwargs})
    return llm.generate(PROMPT, params, use_tqdm=False)[0].outputs


def _ranked(llm, prefix: list[int] = ()) -> list[tuple[int, float]]:
    """The model's top-20 (token, logprob) after the prompt (and `prefix`), best first."""
    prompt = llm.get_tokenizer().encode(PROMPT) + list(prefix)
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=20)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
    return sorted(((t, lp.logprob) for t, lp in out.logprobs[0].items()), key=lambda x: -x[1])[:20]


def test_logit_bias_against_the_models_distribution(llm):
    ranked = _ranked(llm)
    (t0, lp0), (t5, lp5) = ranked[0], ranked[5]
    gap = lp0 - lp5
    assert _run(llm, logit_bias={t5: gap + 0.5})[0].token_ids == [t5]
    assert _run(llm, logit_bias={t5: gap - 0.5})[0].token_ids == [t0]
    assert _run(llm, logit_bias={t0: -100.0})[0].token_ids == [ranked[1][0]]
    # The logprob reported is the model's (raw), not the biased one.
    out = _run(llm, logit_bias={t5: gap + 0.5}, logprobs=0)[0]
    assert out.logprobs[0][t5].logprob == pytest.approx(lp5, abs=1e-4)
    # Sampled: +100 makes a token certain.
    outs = _run(llm, temperature=1.0, seed=7, n=4, logit_bias={ranked[9][0]: 100.0})
    assert [o.token_ids for o in outs] == [[ranked[9][0]]] * 4


def test_allowed_token_ids_keep_to_the_best_allowed(llm):
    ranked = _ranked(llm)
    allowed = [ranked[7][0], ranked[3][0], ranked[12][0]]
    out = _run(llm, allowed_token_ids=allowed, logprobs=0)[0]
    assert out.token_ids == [ranked[3][0]]
    outs = _run(llm, temperature=1.0, seed=1, n=3, max_tokens=12, allowed_token_ids=allowed)
    assert all(set(o.token_ids) <= set(allowed) and len(o.token_ids) == 12 for o in outs)


def test_bad_words_ban_a_one_token_word(llm):
    tok = llm.get_tokenizer()
    greedy = _run(llm)[0].token_ids
    first_word = tok.decode(greedy[:1])
    out = _run(llm, bad_words=[first_word])[0]
    banned = {
        ids[0]
        for ids in (tok.encode(w, add_special_tokens=False) for w in (first_word.strip(), " " + first_word.strip()))
        if len(ids) == 1
    }
    ranked = _ranked(llm)
    assert out.token_ids == [next(t for t, _ in ranked if t not in banned)]


def test_a_longer_bad_words_last_token_is_masked_only_after_its_others(llm):
    """token_filters.FilteredMatcher on the step's bitmask rows: a one-token word everywhere, a
    two-token word's last token after its first (in the output or in a draft before the row)."""
    import numpy as np

    from jaxllm.structured_output.token_filters import FilteredMatcher, bad_word_token_ids

    tok = llm.get_tokenizer()
    assert bad_word_token_ids(["Paris"], tok) == [
        tuple(tok.encode("Paris", add_special_tokens=False)),
        tuple(tok.encode(" Paris", add_special_tokens=False)),
    ]
    allowed = np.full(4, 0xFFFFFFFF, np.uint32)
    allowed[3] = 0  # tokens 96..127 not allowed
    matcher = FilteredMatcher(None, allowed, [(5,), (7, 9)])
    for token in (3, 7):
        assert matcher.consume(token)
    rows = np.full((3, 4), -1, np.int32)
    matcher.copy().narrow(rows, 0, [8, 7])  # after 7 | after 7, 8 | after 7, 8, 7

    def allowed_ids(row):
        return {t for t in range(128) if rows[row, t // 32] >> (t % 32) & 1}

    everything = set(range(96))
    assert allowed_ids(0) == everything - {5, 9}
    assert allowed_ids(1) == everything - {5}
    assert allowed_ids(2) == everything - {5, 9}
    assert matcher.output == [3, 7] and not matcher.is_stopped and not matcher.ends_output


def test_processors_with_a_grammar(llm):
    """allowed_token_ids narrows a regex's choices; the grammar still ends the output."""
    tok = llm.get_tokenizer()
    choices = ["yes", "no", "maybe"]
    regex = "(yes|no|maybe)"
    plain = _run(llm, max_tokens=8, structured_outputs=StructuredOutputsParams(regex=regex))[0]
    assert plain.text in choices
    others = [c for c in choices if c != plain.text]
    allowed = sorted(
        {t for c in others for t in tok.encode(c, add_special_tokens=False)} | set(llm.engine.eos_token_ids)
    )
    out = _run(llm, max_tokens=8, structured_outputs=StructuredOutputsParams(regex=regex), allowed_token_ids=allowed)[0]
    assert out.text in others and out.finish_reason == "stop"


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(logit_bias={1: 101.0}), "logit_bias"),
        (dict(logit_bias={-1: 1.0}), "logit_bias"),
        (dict(logit_bias={i: 1.0 for i in range(129)}), "logit_bias"),
        (dict(allowed_token_ids=[]), "allowed_token_ids"),
        (dict(allowed_token_ids=["a"]), "allowed_token_ids"),
        (dict(bad_words=[""]), "bad_words"),
    ],
)
def test_bad_values_are_refused(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs", [dict(logit_bias={10**7: 1.0}), dict(allowed_token_ids=[10**7])])
def test_ids_past_the_vocabulary_are_refused(llm, kwargs):
    with pytest.raises(ValueError, match="past the vocabulary"):
        _run(llm, **kwargs)
    assert _run(llm)[0].token_ids  # (the engine goes on)


# ----------------------------------------------------------------------------- custom processors


class BanTokens(LogitsProcessor):
    """Bans up to 4 tokens a request names in extra_args["ban"] (a stateless processor)."""

    state = {"ids": ((4,), "int32", -1)}

    def row_state(self, params, prompt_token_ids):
        ban = (params.extra_args or {}).get("ban")
        return None if not ban else {"ids": np.array((list(ban) + [-1] * 4)[:4], np.int32)}

    def apply(self, logits, state):
        ids = state["ids"]
        rows = jnp.arange(logits.shape[0])[:, None]
        return logits.at[rows, jnp.where(ids < 0, logits.shape[1], ids)].set(-jnp.inf, mode="drop")


class ForceAfter(LogitsProcessor):
    """From the request's `after`-th output token on, only `token` (state updated as the output grows)."""

    state = {"token": ((), "int32", -1), "after": ((), "int32", 0), "produced": ((), "int32", 0)}

    def row_state(self, params, prompt_token_ids):
        args = params.extra_args or {}
        return None if "force" not in args else {"token": args["force"], "after": args["after"], "produced": 0}

    def update_state(self, state, output_token_ids):
        state["produced"][...] = len(output_token_ids)

    def apply(self, logits, state):
        on = (state["token"] >= 0) & (state["produced"] >= state["after"])
        only = jnp.arange(logits.shape[1])[None, :] == state["token"][:, None]
        return jnp.where(on[:, None] & ~only, -jnp.inf, logits)


@pytest.fixture(scope="module")
def processed_llm(tiny_model_dir):
    from jaxllm import LLM
    from tests.helpers.tiny_model import TINY_ENGINE_ARGS

    names = ["tests.engine.test_logits_processors:BanTokens", ForceAfter]
    return LLM(tiny_model_dir, **TINY_ENGINE_ARGS, logits_processors=names)


def test_custom_processors_in_one_batch_with_plain_requests(processed_llm, llm):
    """A banning request, a forcing one and plain ones share the steps; each gets what the model's
    own distribution says, the plain ones exactly the engine-without-processors' tokens."""
    ranked = _ranked(llm)
    plain = _run(llm, max_tokens=6)[0].token_ids
    prompts = [PROMPT] * 4
    params = [
        SamplingParams(temperature=0.0, max_tokens=6),
        SamplingParams(temperature=0.0, max_tokens=6, extra_args={"ban": [ranked[0][0], ranked[1][0]]}),
        SamplingParams(temperature=0.0, max_tokens=6, extra_args={"force": 77, "after": 3}),
        SamplingParams(temperature=0.7, seed=3, max_tokens=6, extra_args={"force": 55, "after": 0}),
    ]
    outs = [o.outputs[0].token_ids for o in processed_llm.generate(prompts, params, use_tqdm=False)]
    assert outs[0] == plain
    assert outs[1][0] == ranked[2][0]
    assert outs[2][:3] == plain[:3] and outs[2][3:] == [77, 77, 77]
    assert outs[3] == [55] * 6


def test_bad_processors_are_refused(tiny_model_dir):
    from jaxllm.sampling_params import resolve_logits_processors

    class Wide(LogitsProcessor):
        state = {"x": ((2,), "float64", 0.0)}

    for bad, message in [(Wide, "dtype"), (object, "not a jaxllm.LogitsProcessor"), ("no.such:Thing", "cannot import")]:
        with pytest.raises(ValueError, match=message):
            resolve_logits_processors([bad])


def test_processors_do_not_recompile_the_step_after_warm_up(tiny_model_dir):
    """Warmed up, an engine with custom processors runs logit_bias, allowed_token_ids, bad_words
    and its processors (alone, together, with n > 1, beside plain requests) on steps it already
    compiled: each request's choices are step inputs, not shapes."""
    from jaxllm import LLM
    from jaxllm.runner.compile import no_compile_guard
    from tests.helpers.tiny_model import WARM_ENGINE_ARGS

    llm = LLM(tiny_model_dir, **WARM_ENGINE_ARGS, logits_processors=[BanTokens, ForceAfter])
    greedy = dict(temperature=0.0, max_tokens=6)
    params = [
        SamplingParams(**greedy),
        SamplingParams(**greedy, logit_bias={11: 5.0, 12: -100.0}),
        SamplingParams(**greedy, allowed_token_ids=[11, 12, 13]),
        SamplingParams(**greedy, bad_words=["Paris", "the city"]),
        SamplingParams(**greedy, extra_args={"ban": [11, 12]}),
        SamplingParams(temperature=0.7, seed=3, max_tokens=6, n=2, extra_args={"force": 55, "after": 2}),
        SamplingParams(temperature=0.9, seed=1, max_tokens=6, logit_bias={7: 3.0}, bad_words=["x"]),
    ]
    with no_compile_guard():
        outs = llm.generate([PROMPT] * len(params), params, use_tqdm=False)
        for p in params[1:5]:  # each alone in its steps too
            llm.generate(PROMPT, p, use_tqdm=False)
    assert set(outs[2].outputs[0].token_ids) <= {11, 12, 13} and outs[5].outputs[0].token_ids[2:] == [55] * 4
