"""The pooling side of LLMEngine: which runner an engine is, a pooling engine's options, and its
requests (prompts in, embeddings out).

A pooling engine (`runner="pooling"`) runs the same scheduler, KV pool and forward as generation,
with its own compiled steps (runner/compile.py `make_pooling_buckets`, runner/device_step.py
`pool_step`): each request computes its prompt, batched with others and, for a decoder, chunked
by the same token budget; an encoder's prompt runs whole (its tokens attend to every other). It
ends once its prompt is computed, its pages freed, with its pooled state (models/pooling.py).
"""

from __future__ import annotations

import dataclasses
import os
import time

from jaxllm.config import EngineArgs
from jaxllm.core.request import Request
from jaxllm.models.pooling import PoolingConfig, checkpoint_pooling, resolve_pooling
from jaxllm.pooling_params import PoolingParams
from jaxllm.sampling_params import SamplingParams

# A pooling engine's defaults for the options a user leaves at theirs: wide steps of many
# prompts (nothing decodes, so a step is as wide as its batch of prompts).
POOLING_DEFAULTS = {"max_num_seqs": 256, "max_num_batched_tokens": 8192, "max_num_prefill_seqs": 256}
_ARG_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EngineArgs)}
# What a pooling request's Request carries for the parts of the engine that read sampling params.
_NO_SAMPLING = SamplingParams(max_tokens=1, detokenize=False)


def resolve_runner(args: EngineArgs, loaded, one_device: bool) -> tuple[EngineArgs, PoolingConfig | None]:
    """(`args` for the runner `args.runner` picks for the loaded model, its pooling or None for a
    generation engine). Raises ValueError for a combination it cannot run."""
    cfg, runner = loaded.cfg, args.runner
    if runner == "auto":
        declared = os.path.isdir(loaded.source) and checkpoint_pooling(loaded.source) is not None
        runner = "pooling" if cfg.bidirectional or declared else "generate"
    if runner == "generate":
        if cfg.bidirectional:
            raise ValueError(
                f"{loaded.source} is an encoder ({cfg.architecture}): it embeds, it does not generate "
                "(runner='pooling': LLM.embed, /v1/embeddings)"
            )
        if args.pooler_config is not None:
            raise ValueError("pooler_config is a pooling engine's option (runner='pooling')")
        return args, None
    pooling = resolve_pooling(loaded.source, cfg, args.pooler_config)
    if not one_device:
        raise ValueError("runner='pooling' runs on one device: no tensor, pipeline or data parallelism yet")
    if args.speculative_config is not None:
        raise ValueError("speculative decoding is for generation: a pooling engine takes no speculative_config")
    changes = {name: value for name, value in POOLING_DEFAULTS.items() if getattr(args, name) == _ARG_DEFAULTS[name]}
    if args.max_model_len is None and pooling.max_seq_length:
        changes["max_model_len"] = min(pooling.max_seq_length, cfg.max_position_embeddings)
    # Mean pooling needs every prompt token's state: no prefix is taken from a cache.
    return dataclasses.replace(args, **changes, enable_prefix_caching=False, async_scheduling=False), pooling


class PoolingMixin:
    """LLMEngine's pooling requests (`add_request` hands them here)."""

    def _add_pooling_request(self, request_id, prompt, params, prompt_token_ids, arrival_time, priority=0) -> None:
        if self.pooling is None:
            raise ValueError(
                f"model {self.model_name!r} generates text: it serves no embeddings (start it with runner='pooling')"
            )
        if not isinstance(params, PoolingParams):
            raise ValueError(
                f"model {self.model_name!r} is served for embeddings (runner='pooling'): it does not generate "
                "text; give PoolingParams (LLM.embed, /v1/embeddings)"
            )
        params.verify()
        params = self._resolve_pooling_params(params)
        prompt, prompt_token_ids = self._prompt_token_ids(
            prompt, prompt_token_ids, truncate=params.truncate_prompt_tokens
        )
        self._check_pooling_prompt(prompt_token_ids)
        now = time.monotonic() if arrival_time is None else arrival_time
        request = Request(
            request_id,
            prompt_token_ids,
            _NO_SAMPLING,
            parent_id=request_id,
            prompt=prompt,
            arrival_time=now,
            priority=priority,
            pooling_params=params,
        )
        self.engine_core.add_request(request)  # raises (nothing kept) if the scheduler refuses it
        self.output_processor.add_request(request_id, prompt, prompt_token_ids, params, "final", now, [request_id])

    def _resolve_pooling_params(self, params: PoolingParams) -> PoolingParams:
        """A copy of `params` with the model's normalization filled in and `-1` truncation as
        max_model_len; raises ValueError for `dimensions` the model was not trained for."""
        params = dataclasses.replace(params)
        if params.normalize is None:
            params.normalize = self.pooling.normalize
        if params.truncate_prompt_tokens == -1:
            params.truncate_prompt_tokens = self.config.scheduler.max_model_len
        if params.dimensions is not None:
            sizes, hidden = self.pooling.matryoshka, self.cfg.hidden_size
            if sizes is None:
                raise ValueError(f"model {self.model_name!r} does not support embeddings cut to a size (dimensions)")
            if params.dimensions > hidden or (sizes and params.dimensions not in sizes):
                allowed = f"one of {list(sizes)}" if sizes else f"at most {hidden}"
                raise ValueError(f"dimensions={params.dimensions} is not supported: {allowed}")
        return params

    def _check_pooling_prompt(self, prompt_token_ids: list[int]) -> None:
        if not prompt_token_ids:
            raise ValueError("the input is empty")
        max_len = self.config.scheduler.max_model_len
        if len(prompt_token_ids) > max_len:
            raise ValueError(
                f"the input has {len(prompt_token_ids)} tokens; this model's context (max_model_len) is "
                f"{max_len} (truncate_prompt_tokens cuts longer inputs to fit)"
            )
        vocab = self.cfg.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
        self.kv_cache_manager.check_fits(len(prompt_token_ids), self.config.scheduler.max_num_batched_tokens)
