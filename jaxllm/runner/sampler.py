"""On-device sampling, vectorised over the batch with per-request parameters.

Every parameter is an array `[S]` (or `[S, ...]`), so changing them never recompiles. The
order follows vLLM: penalties -> temperature -> min_p -> top_k -> top_p -> sample. Work that
only some requests need sits behind `lax.cond` on a batch-wide flag, so an all-greedy batch
pays for one argmax.

No full-vocabulary sort: top-k and top-p cut-offs are found by bisection over the float32
bit patterns (32 passes of compare-and-sum, exact), and a token is drawn by inverse CDF on the
unsorted, masked probabilities with one uniform per request. The uniform is a hash of
(seed, output_index) (`uniforms`), so a seeded request draws the same tokens whatever else
is in the batch, and after a preemption.

The sampling state is a `SamplingMetadata` (runner/input_batch.py: fields and shapes);
its `flags` say which stages any sequence of the batch needs.

The greedy path runs on every decode step over [S, vocab]; the sampled token's logprob is
`logit - logsumexp` (no [S, vocab] log_softmax is written unless top logprobs are asked
for). Where the platform runs the step's ops in C++ (`sampling_ops(cpp=True)`: a CPU with the
kernels built) the argmax and logsumexp are one pass of the C++ kernel
(`kernels.native.argmax_logsumexp`): on [128, 49152] XLA:CPU took 14 ms for
`jnp.argmax` and 6 ms for the logsumexp, the kernel about 3.5 ms for both (2 threads). The
sampled rows' draw is C++ there too (`kernels.native.sample_rows`): in XLA it is about 60
kernels, three quarters of each step shape's compile time.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxllm.runner import logits_processors
from jaxllm.runner.input_batch import (
    FLAG_ALL_GREEDY,
    FLAG_BANNED,
    FLAG_BIAS,
    FLAG_CUSTOM,
    FLAG_DRAFTS,
    FLAG_GRAMMAR,
    FLAG_LOGPROBS,
    FLAG_PENALTIES,
    FLAG_TOP_K_TOP_P,
    SamplingMetadata,
)
from jaxllm.sampling_params import MAX_LOGPROBS


def xla_argmax_logsumexp(x: jax.Array, token_mask: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Per row of x [S, V]: the first index of the max and the logsumexp, over the tokens
    `token_mask` allows (None: all)."""
    if token_mask is not None:
        x = apply_token_mask(x, token_mask)
    return jnp.argmax(x, axis=-1).astype(jnp.int32), jax.nn.logsumexp(x, axis=-1)


def _sortable(x: jax.Array) -> jax.Array:
    """Map float32 to uint32 so that integer order equals float order."""
    i = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(i >> 31 == 1, ~i, i | jnp.uint32(0x80000000))


def _bisect_threshold(keys: jax.Array, enough) -> jax.Array:
    """Per row, the largest key t with `enough(keys >= t)` true (exact after 32 halvings).

    keys: [S, V] uint32 from `_sortable`; `enough(mask [S, V]) -> [S] bool` must be monotone
    (true for t = min key, false for t = max key + 1).
    """

    def body(_, lo_hi):
        lo, hi = lo_hi
        mid = lo + (hi - lo) // 2 + (hi - lo) % 2
        ok = enough(keys >= mid[:, None])
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    lo, _ = jax.lax.fori_loop(0, 32, body, (keys.min(-1), keys.max(-1) + 1))
    return lo


def apply_token_mask(logits, token_mask):
    """Tokens a row's packed bitmask leaves out (`[R, ceil(V / 32)]` int32: bit t % 32 of
    word t // 32) to -inf: structured output's grammar masks."""
    bits = (token_mask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
    allowed = bits.reshape(logits.shape[0], -1)[:, : logits.shape[-1]] != 0
    return jnp.where(allowed, logits, -jnp.inf)


def apply_penalties(logits, s):
    vocab = logits.shape[-1]
    tokens = s.penalty_tokens
    pos = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :]
    is_output = pos >= s.output_start[:, None]
    tok = jnp.where(tokens < 0, vocab, tokens)
    rows = jnp.arange(tokens.shape[0])[:, None]
    out_counts = jnp.zeros(logits.shape, jnp.float32).at[rows, tok].add(is_output.astype(jnp.float32), mode="drop")
    seen = jnp.zeros(logits.shape, jnp.bool_).at[rows, tok].set(True, mode="drop")
    rep = s.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - s.frequency_penalty[:, None] * out_counts
    return logits - s.presence_penalty[:, None] * (out_counts > 0)


def _mix(x: jax.Array) -> jax.Array:
    """A uint32 -> uint32 bijection that spreads every input bit over the output (Wellons'
    "lowbias32" integer hash)."""
    x ^= x >> 16
    x *= jnp.uint32(0x7FEB352D)
    x ^= x >> 15
    x *= jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def uniforms(s: SamplingMetadata) -> tuple[jax.Array, jax.Array]:
    """Each row's two uniforms in [0, 1): the draw's, and a draft's acceptance test's, hashed
    from (seed, output_index, which), so a seeded request draws the same numbers whatever else
    is in the batch and after a preemption. A counter hash, not jax.random's threefry: a few
    integer ops in one kernel, where threefry's fold_in and uniform compiled to ~0.6 s of every
    step shape."""
    seed = _mix(s.seeds.astype(jnp.uint32) ^ jnp.uint32(0x9E3779B9))
    index = s.output_index.astype(jnp.uint32) * jnp.uint32(2)

    def uniform(which: int) -> jax.Array:
        bits = _mix(seed ^ _mix(index + jnp.uint32(which) + jnp.uint32(0x85EBCA6B)))
        return (bits >> 8).astype(jnp.float32) * jnp.float32(2.0**-24)

    return uniform(0), uniform(1)


def truncated(logits, s) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(logits / temperature, their softmax, the tokens min_p, top_k and top_p keep) per row
    (a greedy row's temperature taken as 1)."""
    temp = jnp.where(s.temperature > 0, s.temperature, 1.0)
    logits = logits / temp[:, None]
    probs = jax.nn.softmax(logits, axis=-1)
    keep = probs >= (s.min_p * probs.max(-1))[:, None]

    def top_k_top_p(keep):
        vocab = logits.shape[-1]
        k = jnp.where(s.top_k > 0, jnp.minimum(s.top_k, vocab), vocab)
        logit_keys = _sortable(logits)
        keep &= logit_keys >= _bisect_threshold(logit_keys, lambda m: m.sum(-1) >= k)[:, None]
        masked = jnp.where(keep, probs, 0.0)
        masked = masked / masked.sum(-1, keepdims=True)
        prob_keys = _sortable(masked)
        t = _bisect_threshold(prob_keys, lambda m: jnp.where(m, masked, 0.0).sum(-1) >= s.top_p)
        return keep & ((prob_keys >= t[:, None]) | (s.top_p >= 1.0)[:, None])

    return logits, probs, jax.lax.cond(s.flags[FLAG_TOP_K_TOP_P], top_k_top_p, lambda k: k, keep)


def draw_xla(logits, s, u, u_draft):
    """Temperature, min_p, top_k, top_p, then one inverse-CDF draw per row with the uniform `u`.

    A row with a draft token d (speculative decoding) first accepts d with probability p(d)
    (`u_draft < p(d)`), else draws from p with d taken out: rejection sampling against a
    proposal that puts all its mass on d, so the token's distribution is exactly p whatever
    the draft (n-gram and greedy draft models propose that way). The native backend's
    `kernels.native.sample_rows` does the same row by row in C++."""
    logits, probs, keep = truncated(logits, s)

    def verify_drafts(keep):  # -> (accepted [S], keep without each rejected draft)
        rows = jnp.arange(logits.shape[0])
        draft = jnp.maximum(s.draft_tokens, 0)
        p_draft = jnp.where(keep[rows, draft], probs[rows, draft], 0.0) / jnp.where(keep, probs, 0.0).sum(-1)
        accepted = (s.draft_tokens >= 0) & (u_draft < p_draft)
        rejected = (s.draft_tokens >= 0) & ~accepted
        return accepted, keep & ~(rejected[:, None] & (jnp.arange(logits.shape[-1])[None, :] == draft[:, None]))

    accepted, keep = jax.lax.cond(
        s.flags[FLAG_DRAFTS], verify_drafts, lambda k: (jnp.zeros(k.shape[0], jnp.bool_), k), keep
    )
    masked = jnp.where(keep, probs, 0.0)
    cdf = jnp.cumsum(masked, axis=-1)
    token = jnp.sum(cdf <= (u * cdf[:, -1])[:, None], axis=-1)
    # Guard the float edge (u == total): fall back to the last kept token.
    last_kept = logits.shape[-1] - 1 - jnp.argmax(keep[:, ::-1], axis=-1)
    return jnp.where(accepted, s.draft_tokens, jnp.minimum(token, last_kept)).astype(jnp.int32)


def sampling_ops(cpp: bool):
    """(argmax_logsumexp, draw) for `sample`: the C++ kernels' (`cpp`: `Platform.cpp_ops`) or XLA's."""
    if not cpp:
        return xla_argmax_logsumexp, draw_xla
    from jaxllm.kernels import native

    def draw(logits, s, u, u_draft):
        return native.sample_rows(logits, s.temperature, s.min_p, s.top_k, s.top_p, s.draft_tokens, u, u_draft)

    return native.argmax_logsumexp, draw


def sample(
    logits: jax.Array,
    s: SamplingMetadata,
    argmax_logsumexp=xla_argmax_logsumexp,
    draw=draw_xla,
    *,
    processed_logprobs: bool = False,
    processors=(),
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """logits [S, V] f32 (a row per logits row) -> (tokens [S] int32, token logprob [S] f32,
    top_logprobs [S, MAX_LOGPROBS] f32, top_ids [S, MAX_LOGPROBS] int32).

    Logprobs are those of the model's raw distribution (before penalties and temperature),
    as vLLM reports them, but after a structured-output mask (`s.token_mask` under
    FLAG_GRAMMAR): a masked-out token's logprob is -inf. `argmax_logsumexp(x, token_mask) ->
    (argmax, logsumexp)` per row over the allowed tokens and `draw(logits, s, u, u_draft) ->
    tokens` (see `draw_xla`): XLA's, or the C++ kernels' (`sampling_ops`). `processors`: the
    engine's custom logits processors (under FLAG_CUSTOM).

    The greedy path hands the mask to `argmax_logsumexp` rather than masking the logits
    first: a lax.cond around [S, V] logits makes XLA:CPU copy them (~9 ms of every step at 128
    rows, grammar or not). The masked logits exist only in the branches that need them.
    """
    rows = jnp.arange(logits.shape[0])

    def masked():  # the logits with the grammar's mask applied (where a batch has a grammar)
        if s.token_mask is None:
            return logits
        return jax.lax.cond(s.flags[FLAG_GRAMMAR], apply_token_mask, lambda x, _: x, logits, s.token_mask)

    def mask_banned(x, s):
        banned = s.banned_tokens
        return x.at[rows[:, None], jnp.where(banned < 0, x.shape[-1], banned)].set(-jnp.inf, mode="drop")

    def add_bias(x, s):  # logit_bias (padding ids -1 dropped)
        ids = s.bias_ids
        return x.at[rows[:, None], jnp.where(ids < 0, x.shape[-1], ids)].add(s.bias_values, mode="drop")

    def custom(x, s):  # the engine's custom logits processors (runner/logits_processors.py)
        return logits_processors.apply(x, s.custom, processors)

    def processed():  # bias, mask, processors, bans, penalties (an all-greedy plain batch skips this)
        x = jax.lax.cond(s.flags[FLAG_BIAS], add_bias, lambda x, _: x, masked(), s)
        if processors:
            x = jax.lax.cond(s.flags[FLAG_CUSTOM], custom, lambda x, _: x, x, s)
        x = jax.lax.cond(s.flags[FLAG_BANNED], mask_banned, lambda x, _: x, x, s)
        return jax.lax.cond(s.flags[FLAG_PENALTIES], apply_penalties, lambda x, _: x, x, s)

    raw_argmax, lse = argmax_logsumexp(logits, s.token_mask)
    greedy_tokens = jax.lax.cond(
        s.flags[FLAG_BANNED] | s.flags[FLAG_PENALTIES] | s.flags[FLAG_BIAS] | s.flags[FLAG_CUSTOM],
        lambda: argmax_logsumexp(processed(), None)[0],
        lambda: raw_argmax,
    )
    tokens = jax.lax.cond(
        s.flags[FLAG_ALL_GREEDY],
        lambda: greedy_tokens,
        lambda: jnp.where(s.temperature > 0, draw(processed(), s, *uniforms(s)), greedy_tokens),
    )
    if processed_logprobs:  # the distribution drawn from: processed, scaled, truncated
        x, _, keep = truncated(processed(), s)
        x = jnp.where(keep | (s.temperature <= 0)[:, None], x, -jnp.inf)
        lse, scored = jax.nn.logsumexp(x, axis=-1), lambda: x
    else:
        scored = masked
    # The sampled token is one the mask allows (its raw logit is its masked one), unless a row
    # allows none: its logprob is then -inf, as every token's is.
    token_logprob = jnp.where(jnp.isneginf(lse), -jnp.inf, (x if processed_logprobs else logits)[rows, tokens] - lse)
    top_lp, top_ids = jax.lax.cond(
        s.flags[FLAG_LOGPROBS],
        lambda: (lambda v, i: (v - lse[:, None], i))(*jax.lax.top_k(scored(), MAX_LOGPROBS)),
        lambda: (
            jnp.zeros((logits.shape[0], MAX_LOGPROBS), jnp.float32),
            jnp.zeros((logits.shape[0], MAX_LOGPROBS), jnp.int32),
        ),
    )
    return tokens, token_logprob, top_lp, top_ids.astype(jnp.int32)
