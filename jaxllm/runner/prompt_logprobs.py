"""Prompt logprobs: the log-probability of each prompt token (and the top ones) under the
model, as evaluation tools score text (`SamplingParams.prompt_logprobs`, `echo` + `logprobs`).

The step keeps its hidden states `[T, hidden]` as an output. After a step in which a request
that asks for them computed part of its prompt, the rows of its chunk are taken from there
and sent through the LM head in fixed-size calls of one compiled shape (`ROWS` rows), apart
from the step: steps without such requests pay nothing, and no step shape depends on them.
Token p + 1's logprob comes from position p's row; positions a request has already reported
are skipped, so a request recomputed after a preemption reports each once.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.models import decoder
from jaxllm.sampling_params import MAX_LOGPROBS

ROWS = 128  # rows per call (one compiled shape)


def _prompt_logprobs(params, hidden, targets, *, cfg):
    """hidden [R, hidden] (before the final norm), targets [R] -> the raw distribution's
    (logprob of each target [R], its rank [R] (1 = the argmax), top logprobs [R, K], top ids [R, K])."""
    logits = decoder.compute_logits(params, hidden, cfg)
    lse = jax.nn.logsumexp(logits, axis=-1)
    target = jnp.take_along_axis(logits, targets[:, None], axis=-1)
    rank = 1 + jnp.sum(logits > target, axis=-1, dtype=jnp.int32)
    top, ids = jax.lax.top_k(logits, MAX_LOGPROBS)
    return target[:, 0] - lse, rank, top - lse[:, None], ids.astype(jnp.int32)


class PromptLogprobs:
    """Computes the prompt logprobs a step's chunks give; compiled on first use."""

    def __init__(self, cfg: decoder.ModelConfig):
        self._fn = jax.jit(functools.partial(_prompt_logprobs, cfg=cfg))

    def __call__(self, params, scheduled, rows: np.ndarray, query_start_loc: np.ndarray, hidden) -> dict[str, tuple]:
        """request id -> (logprob [c], rank [c], top logprobs [c, K], top ids [c, K]) for the
        prompt tokens `scheduled` [(request, num_new)] covered this step; `rows[i]` is
        scheduled[i]'s sequence in the step, whose tokens start at `query_start_loc[rows[i]]`
        of `hidden` (the step's output)."""
        wanted = []  # (request id, flat token indices, target tokens)
        for (request, num_new), row in zip(scheduled, rows):
            if request.prompt_logprobs is None:
                continue
            first = max(request.num_computed_tokens, request.num_prompt_logprobs)
            end = min(request.num_computed_tokens + num_new, request.num_prompt_tokens - 1)
            if end > first:
                flat = query_start_loc[row] + np.arange(first, end) - request.num_computed_tokens
                wanted.append((request.request_id, flat, request.prompt_token_ids[first + 1 : end + 1]))
        if not wanted:
            return {}
        if hidden is None:
            raise ValueError("prompt_logprobs need the model's hidden states, which a sharded step does not keep")
        flat = np.concatenate([w[1] for w in wanted])
        targets = np.concatenate([w[2] for w in wanted]).astype(np.int32)
        hidden = np.asarray(hidden)[flat]
        parts = []
        for i in range(0, len(flat), ROWS):
            n = min(ROWS, len(flat) - i)
            h = np.zeros((ROWS, hidden.shape[1]), hidden.dtype)
            t = np.zeros(ROWS, np.int32)
            h[:n], t[:n] = hidden[i : i + n], targets[i : i + n]
            parts.append([np.asarray(x)[:n] for x in self._fn(params, h, t)])
        columns = [np.concatenate(c) for c in zip(*parts)]
        result, offset = {}, 0
        for request_id, positions, _ in wanted:
            result[request_id] = tuple(c[offset : offset + len(positions)] for c in columns)
            offset += len(positions)
        return result
