"""The scheduler on the host alone: a scheduler over a small KV pool, requests, and steps whose
model is a fake (a token fixed by the request's id and length)."""

from __future__ import annotations

import numpy as np

from jaxllm.engine_config import SchedulerConfig
from jaxllm.core.kv_cache_manager import KVCacheManager
from jaxllm.core.outputs import ModelRunnerOutput
from jaxllm.core.request import Request
from jaxllm.core.scheduler import Scheduler
from jaxllm.sampling_params import MAX_LOGPROBS, SamplingParams


EOS = 2


def make_scheduler(
    *,
    num_pages=64,
    page_size=4,
    budget=32,
    max_num_seqs=8,
    max_prefill=8,
    max_model_len=256,
    swap_pages=0,
    prefix_caching=True,
    policy="fcfs",
) -> Scheduler:
    kv = KVCacheManager(num_pages, page_size, enable_prefix_caching=prefix_caching, num_swap_pages=swap_pages)
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        max_num_prefill_seqs=max_prefill,
        preemption_mode="swap" if swap_pages else "recompute",
        scheduling_policy=policy,
    )
    return Scheduler(config, kv)


def make_request(request_id, prompt_len, *, max_tokens=8, first_token=100, **params) -> Request:
    params.setdefault("ignore_eos", True)
    prompt = list(range(first_token, first_token + prompt_len))
    return Request(
        request_id, prompt, SamplingParams(temperature=0, max_tokens=max_tokens, **params), eos_token_ids=(EOS,)
    )


def next_token(request: Request) -> int:
    """The fake model: a token fixed by the request's id and length (never EOS)."""
    return 10 + (sum(map(ord, request.request_id)) * 7 + request.num_tokens * 13) % 50


def fake_output(scheduler_output, tokens=None) -> ModelRunnerOutput:
    """A token for each scheduled request whose new tokens reach its last one (`tokens` maps
    request ids to forced tokens)."""
    sampled, num_sampled = [], []
    for request, n in scheduler_output.scheduled:
        done = request.num_computed_tokens + n == request.num_tokens
        forced = (tokens or {}).get(request.request_id)
        if done:
            sampled.append(forced if forced is not None else next_token(request))
        num_sampled.append(int(done))
    n = len(sampled)
    return ModelRunnerOutput(
        np.asarray(sampled, np.int32),
        np.full(n, -0.5, np.float32),
        np.zeros((n, MAX_LOGPROBS), np.float32),
        np.zeros((n, MAX_LOGPROBS), np.int32),
        np.asarray(num_sampled),
    )


def step(scheduler, tokens=None):
    out = scheduler.schedule()
    return out, scheduler.update_from_output(out, fake_output(out, tokens))
