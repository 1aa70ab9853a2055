"""The device program of one engine step: pure, jitted once per bucket by `ModelRunner`.

    step(params, kv_cache, ints, floats, penalty_tokens, token_mask, prev_tokens, *, layout, cfg, attention, mesh,
         cpp_ops, logprobs_mode, logits_processors)
        -> (tokens, logprobs, top_logprobs, top_ids, hidden, kv_cache)

`ints` / `floats` are the bucket's packed inputs (`PackedLayout.unpack` gives `StepInputs` and
`SamplingMetadata`); the penalty tokens and the structured-output token mask travel apart;
`prev_tokens` [max rows] is the previous step's `tokens` (async scheduling: a token whose
`StepInputs.prev_rows` is set takes its id from there), and `tokens` come out padded to it. With
pipeline stages they carry one micro-batch per stage (`[M, ...]`). `hidden` (before the final
norm, for prompt logprobs) is returned on one device only, else None. `cpp_ops`: norms and
sampling in the C++ kernels (`Platform.cpp_ops`). `logprobs_mode`: `EngineArgs.logprobs_mode`;
`logits_processors`: the engine's custom ones (`EngineArgs.logits_processors`).

    pool_step(params, kv_cache, ints, floats, penalty_tokens, token_mask, prev_tokens, *, layout, cfg, attention,
              cpp_ops, pooling_mode) -> (parts, kv_cache)

is a pooling engine's step (one device): the same forward, then per sequence its share of the
pooled state (`models/pooling.py` `chunk_parts`) instead of logits and sampling.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxllm import parallel
from jaxllm.models import decoder, pooling
from jaxllm.runner import sampler
from jaxllm.runner.input_batch import PackedLayout, SamplingMetadata


def step(
    params,
    kv_cache,
    ints,
    floats,
    penalty_tokens,
    token_mask,
    prev_tokens,
    *,
    layout: PackedLayout,
    cfg,
    attention,
    mesh,
    cpp_ops: bool = False,
    logprobs_mode: str = "raw_logprobs",
    logits_processors=(),
):
    hidden = None  # [T, hidden] before the final norm, kept for prompt logprobs (one device only)
    if parallel.pp_size(mesh) > 1:  # [M, ...]: micro-batches through the pipeline stages
        logits, kv_cache = parallel.pipelined_forward(
            params,
            kv_cache,
            ints,
            floats,
            cfg=cfg,
            attention=attention,
            mesh=mesh,
            unpack=lambda i, f: layout.unpack(i, f)[0],
            cpp_ops=cpp_ops,
        )
        sampling = SamplingMetadata.concat([layout.unpack(i, f)[1] for i, f in zip(ints, floats)])
        sampling.penalty_tokens = penalty_tokens.reshape(-1, penalty_tokens.shape[-1])
        sampling.token_mask = token_mask.reshape(-1, token_mask.shape[-1])
    else:
        inputs, sampling = layout.unpack(ints, floats)
        sampling = dataclasses.replace(sampling, penalty_tokens=penalty_tokens, token_mask=token_mask)
        if inputs.prev_rows is not None:  # tokens the previous step sampled, still on the device
            prev = prev_tokens[jnp.maximum(inputs.prev_rows, 0)]
            inputs = dataclasses.replace(inputs, token_ids=jnp.where(inputs.prev_rows >= 0, prev, inputs.token_ids))
        if mesh is None:
            hidden, kv_cache = decoder.forward(params, kv_cache, inputs, cfg, attention=attention, cpp_ops=cpp_ops)
            logits = decoder.compute_logits(
                params, hidden[inputs.logits_indices], cfg, rows=inputs.num_logits(), cpp_ops=cpp_ops
            )
        else:
            logits, kv_cache = parallel.sharded_forward(
                params, kv_cache, inputs, cfg, attention=attention, mesh=mesh, cpp_ops=cpp_ops
            )
    tokens, logprob, top_lp, top_ids = sampler.sample(
        logits,
        sampling,
        *sampler.sampling_ops(cpp_ops),
        processed_logprobs=logprobs_mode == "processed_logprobs",
        processors=logits_processors,
    )
    # Every bucket's tokens as one shape ([prev_tokens.shape[0]], padded), the next step's `prev_tokens`.
    tokens = jnp.zeros(prev_tokens.shape, tokens.dtype).at[: tokens.shape[0]].set(tokens)
    return tokens, logprob, top_lp, top_ids, hidden, kv_cache


def pool_step(
    params,
    kv_cache,
    ints,
    floats,
    penalty_tokens,
    token_mask,
    prev_tokens,
    *,
    layout: PackedLayout,
    cfg,
    attention,
    cpp_ops: bool = False,
    pooling_mode: str,
):
    inputs, _ = layout.unpack(ints, floats)
    hidden, kv_cache = decoder.forward(params, kv_cache, inputs, cfg, attention=attention, cpp_ops=cpp_ops)
    if not cfg.post_norm:  # a decoder's states as its LM head sees them (an encoder has no final norm)
        _, hidden = decoder.add_norm(hidden, None, params, "final_norm", cfg, rows=inputs.num_tokens(), cpp=cpp_ops)
    return pooling.chunk_parts(hidden, inputs.query_start_loc, pooling_mode), kv_cache
