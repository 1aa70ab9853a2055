"""Fixed logits, the sampler's per-row state (`state`) and vLLM's sampling order in NumPy
(`reference_probs`): the references of the sampler, speculative decoding and structured output."""

from __future__ import annotations

import numpy as np

from jaxllm.runner.input_batch import NUM_BANNED, SamplingMetadata
from jaxllm.sampling_params import MAX_LOGIT_BIAS


LOGITS = np.array([2.0, 1.5, 1.4, 1.0, 0.5, 0.2, 0.0, -0.3, -1.0, -1.5, -2.0, -4.0] + [-20.0] * 12, np.float32)


V = len(LOGITS)  # > MAX_LOGPROBS


def state(
    S,
    *,
    temperature=1.0,
    top_k=0,
    top_p=1.0,
    min_p=0.0,
    presence=0.0,
    frequency=0.0,
    repetition=1.0,
    history=None,
    output_start=0,
    seeds=None,
    banned=None,
    logprobs=False,
    bias=None,
):
    flat = lambda v, dt: np.full(S, v, dt)  # noqa: E731
    penalty_tokens = np.full((S, 8), -1, np.int32)
    if history is not None:
        penalty_tokens[:, : len(history)] = history
    banned_tokens = np.full((S, NUM_BANNED), -1, np.int32)
    if banned:
        banned_tokens[:, : len(banned)] = banned
    bias_ids = np.full((S, MAX_LOGIT_BIAS), -1, np.int32)
    bias_values = np.zeros((S, MAX_LOGIT_BIAS), np.float32)
    if bias:
        bias_ids[:, : len(bias)], bias_values[:, : len(bias)] = list(bias), list(bias.values())
    return SamplingMetadata(
        temperature=flat(temperature, np.float32),
        top_k=flat(top_k, np.int32),
        top_p=flat(top_p, np.float32),
        min_p=flat(min_p, np.float32),
        presence_penalty=flat(presence, np.float32),
        frequency_penalty=flat(frequency, np.float32),
        repetition_penalty=flat(repetition, np.float32),
        seeds=np.arange(S, dtype=np.uint32) if seeds is None else seeds,
        output_index=np.zeros(S, np.int32),
        output_start=flat(output_start, np.int32),
        penalty_tokens=penalty_tokens,
        banned_tokens=banned_tokens,
        draft_tokens=np.full(S, -1, np.int32),
        bias_ids=bias_ids,
        bias_values=bias_values,
        flags=np.array(
            [
                temperature == 0,
                top_k > 0 or top_p < 1,
                presence != 0 or frequency != 0 or repetition != 1,
                logprobs,
                bool(banned),
                False,
                False,
                bool(bias),
            ]
        ),
    )


def reference_probs(logits, *, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """vLLM's order: temperature, min_p, top_k, top_p (on the renormalised top-k set)."""
    z = logits / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    keep = p >= min_p * p.max()
    if top_k:
        keep &= z >= np.sort(z)[::-1][top_k - 1]
    q = np.where(keep, p, 0)
    q /= q.sum()
    order = np.argsort(-q)
    cum = np.cumsum(q[order])
    n_keep = np.searchsorted(cum, top_p - 1e-7) + 1 if top_p < 1 else len(z)
    top = np.zeros(len(z), bool)
    top[order[:n_keep]] = True
    keep &= top
    q = np.where(keep, p, 0)
    return q / q.sum()
