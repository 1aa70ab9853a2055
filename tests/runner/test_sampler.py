"""On-device sampling against a NumPy reference on fixed logits."""

import dataclasses
import functools

import jax
import numpy as np
import pytest

from jaxllm.kernels import native
from jaxllm.runner import sampler
from jaxllm.runner.input_batch import FLAG_DRAFTS

from tests.helpers.sampling_reference import LOGITS, V, reference_probs, state


def native_draw(logits, s, u, u_draft):
    return native.sample_rows(logits, s.temperature, s.min_p, s.top_k, s.top_p, s.draft_tokens, u, u_draft)


sample = jax.jit(sampler.sample)
# The CPU engine's sampler: argmax, logsumexp and the sampled rows' draw from the C++ kernels.
sample_native = jax.jit(functools.partial(sampler.sample, argmax_logsumexp=native.argmax_logsumexp, draw=native_draw))
needs_native = pytest.mark.skipif(not native.available(), reason="no native CPU kernels")
SAMPLERS = [pytest.param(sample, id="xla"), pytest.param(sample_native, id="native", marks=needs_native)]


@pytest.mark.parametrize("sample", SAMPLERS)
def test_greedy_first_max_and_token_logprob(sample):
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((5, 3000)).astype(np.float32)
    logits[1, [7, 2000]] = 9.0  # a tie: the first index wins, as with np.argmax
    logits[2, -1] = 9.0  # the maximum in the last column
    tokens, lp, *_ = sample(logits, state(5, temperature=0.0))
    np.testing.assert_array_equal(np.asarray(tokens), np.argmax(logits, -1))
    ref = logits.astype(np.float64)
    lse = np.log(np.exp(ref - ref.max(-1, keepdims=True)).sum(-1)) + ref.max(-1)
    np.testing.assert_allclose(np.asarray(lp), ref[np.arange(5), np.argmax(logits, -1)] - lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sample", SAMPLERS)
@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(temperature=0.5),
        dict(top_k=3),
        dict(top_p=0.7),
        dict(min_p=0.3),
        dict(temperature=1.5, top_k=6, top_p=0.8),
        dict(top_k=1),
    ],
)
def test_sampled_frequencies_match_reference(kw, sample):
    S = 6000
    tokens, *_ = sample(np.tile(LOGITS, (S, 1)), state(S, **kw))
    freq = np.bincount(np.asarray(tokens), minlength=V) / S
    expect = reference_probs(LOGITS, **kw)
    assert np.all(freq[expect == 0] == 0), "a token outside the kept set was sampled"
    tolerance = 4 * np.sqrt(expect * (1 - expect) / S) + 1e-3  # 4 sigma of a binomial frequency
    assert np.all(np.abs(freq - expect) <= tolerance), (freq, expect)


@pytest.mark.parametrize("sample", SAMPLERS)
def test_seed_determines_tokens(sample):
    S = 64
    seeds = np.random.default_rng(0).integers(0, 2**32, S, dtype=np.uint32)
    a, *_ = sample(np.tile(LOGITS, (S, 1)), state(S, seeds=seeds))
    perm = np.random.default_rng(1).permutation(S)
    b, *_ = sample(np.tile(LOGITS, (S, 1)), state(S, seeds=seeds[perm]))
    np.testing.assert_array_equal(np.asarray(a)[perm], np.asarray(b))


@pytest.mark.parametrize("sample", SAMPLERS)
def test_penalties_match_reference(sample):
    history = [0, 0, 1, 4]  # prompt token 0; outputs 0, 1, 4 (output_start = 1)
    st = state(1, temperature=0.0, presence=0.5, frequency=0.7, repetition=1.3, history=history, output_start=1)
    out = np.asarray(jax.jit(sampler.apply_penalties)(LOGITS[None], st))[0]
    ref = LOGITS.astype(np.float64).copy()
    for t in {0, 1, 4}:
        ref[t] = ref[t] / 1.3 if ref[t] > 0 else ref[t] * 1.3
    counts = {0: 1, 1: 1, 4: 1}
    for t, c in counts.items():
        ref[t] -= 0.7 * c + 0.5
    np.testing.assert_allclose(out, ref, rtol=1e-6)
    tokens, *_ = sample(LOGITS[None], st)
    assert int(tokens[0]) == int(np.argmax(ref))


@pytest.mark.parametrize("sample", SAMPLERS)
def test_banned_tokens_and_logprobs(sample):
    st = state(2, temperature=0.0, banned=[0, 1], logprobs=True)
    tokens, lp, top_lp, top_ids = sample(np.tile(LOGITS, (2, 1)), st)
    assert list(np.asarray(tokens)) == [2, 2]
    ref = LOGITS - np.log(np.exp(LOGITS).sum())
    np.testing.assert_allclose(np.asarray(lp), ref[2], rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(top_ids)[0, :12], np.argsort(-LOGITS)[:12])
    np.testing.assert_allclose(np.asarray(top_lp)[0], np.sort(ref)[::-1][:20], rtol=1e-5)


@pytest.mark.parametrize("sample", SAMPLERS)
def test_logit_bias_moves_the_choice_and_leaves_logprobs_raw(sample):
    """Greedy picks the argmax of logits + bias; a sampled row draws from softmax(logits + bias);
    the logprobs reported are the model's own (vLLM's raw logprobs)."""
    bias = {4: 1.6, 0: -100.0}  # token 4 (2.1) now leads token 1 (1.5); token 0 is out
    tokens, lp, top_lp, top_ids = sample(np.tile(LOGITS, (2, 1)), state(2, temperature=0.0, bias=bias, logprobs=True))
    raw = LOGITS - np.log(np.exp(LOGITS.astype(np.float64)).sum())
    assert list(np.asarray(tokens)) == [4, 4]
    np.testing.assert_allclose(np.asarray(lp), raw[4], rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(top_ids)[0, :12], np.argsort(-LOGITS)[:12])
    S = 6000
    tokens, *_ = sample(np.tile(LOGITS, (S, 1)), state(S, temperature=1.0, bias=bias))
    freq = np.bincount(np.asarray(tokens), minlength=V) / S
    biased = LOGITS.copy()
    for t, b in bias.items():
        biased[t] += b
    expect = reference_probs(biased)
    np.testing.assert_array_less(np.abs(freq - expect), 4 * np.sqrt(expect * (1 - expect) / S) + 1e-3)


@needs_native
@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(temperature=0.7),
        dict(top_k=5),
        dict(top_p=0.8),
        dict(min_p=0.1),
        dict(temperature=1.3, top_k=50, top_p=0.9, min_p=0.02),
        dict(top_k=1),
        dict(top_p=0.3),
    ],
)
def test_native_draw_equals_xla_draw(kw):
    """With the same uniforms the C++ draw picks the XLA draw's token: the same kept set and
    the same inverse-CDF step, on varied logits (some tied, some -inf), with drafts accepted
    and rejected."""
    rng = np.random.default_rng(7)
    rows, vocab = 512, 3000
    logits = (rng.standard_normal((rows, vocab)) * 2).astype(np.float32)
    logits[:, :20] += 3  # drafts among the likely tokens
    logits[::7, 100:110] = logits[::7, 100:101]  # ties
    logits[::5, 200:400] = -np.inf  # banned
    st = state(rows, **kw)
    drafts = np.where(rng.random(rows) < 0.5, rng.integers(0, 20, rows), -1).astype(np.int32)
    st = dataclasses.replace(st, seeds=rng.integers(0, 2**32, rows, dtype=np.uint32), draft_tokens=drafts)
    st.flags[FLAG_DRAFTS] = True
    u, u_draft = jax.jit(sampler.uniforms)(st)
    xla = np.asarray(jax.jit(sampler.draw_xla)(logits, st, u, u_draft))
    cpp = np.asarray(jax.jit(native_draw)(logits, st, u, u_draft))
    # Where they differ (about 1 row in 4000), u sits on the boundary between the two tokens:
    # float sums in another order put it on either side.
    u = np.asarray(u)
    for row in np.nonzero(cpp != xla)[0]:
        q = reference_probs(logits[row].astype(np.float64), **kw)
        if drafts[row] >= 0:  # rejected by both (each drew another token)
            q[drafts[row]] = 0
            q /= q.sum()
        assert abs(np.cumsum(q)[min(cpp[row], xla[row])] - u[row]) < 1e-5, (row, cpp[row], xla[row])
    assert (cpp != xla).sum() <= 2
    accepted = (drafts >= 0) & (xla == drafts)
    assert 0 < accepted.sum() < (drafts >= 0).sum()  # both outcomes of the draft test occur


@pytest.mark.parametrize(
    "native_ops", [pytest.param(False, id="xla"), pytest.param(True, id="native", marks=needs_native)]
)
@pytest.mark.parametrize(
    "kw",
    [dict(), dict(top_p=0.7), dict(temperature=1.5, top_k=6, top_p=0.8, min_p=0.05)],
)
def test_processed_logprobs_are_the_distribution_drawn_from(kw, native_ops):
    """logprobs_mode="processed_logprobs": each sampled token's logprob (and the top ones) is
    its log-probability under the reference's truncated, renormalised distribution."""
    ops = dict(argmax_logsumexp=native.argmax_logsumexp, draw=native_draw) if native_ops else {}
    processed = jax.jit(functools.partial(sampler.sample, processed_logprobs=True, **ops))
    S = 64
    tokens, lp, top_lp, top_ids = processed(np.tile(LOGITS, (S, 1)), state(S, logprobs=True, **kw))
    with np.errstate(divide="ignore"):
        ref = np.log(reference_probs(LOGITS, **kw))
    np.testing.assert_allclose(np.asarray(lp), ref[np.asarray(tokens)], rtol=1e-5, atol=1e-5)
    kept = np.isfinite(ref).sum()
    best = np.sort(ref)[::-1][: min(kept, 20)]
    np.testing.assert_allclose(np.asarray(top_lp)[0, : len(best)], best, rtol=1e-5, atol=1e-5)
    assert np.all(np.isneginf(np.asarray(top_lp)[0, len(best) :]))
    # Greedy rows: the processed logits' own distribution (temperature 1, nothing truncated).
    tokens, lp, *_ = processed(LOGITS[None], state(1, temperature=0.0, banned=[int(np.argmax(LOGITS))]))
    z = LOGITS.astype(np.float64).copy()
    z[np.argmax(LOGITS)] = -np.inf
    np.testing.assert_allclose(float(lp[0]), z[int(tokens[0])] - np.log(np.exp(z).sum()), rtol=1e-5)
