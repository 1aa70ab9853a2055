"""ModelRunner: a scheduled step -> padded host arrays -> one jitted call -> sampled tokens.

The step function is pure:

    step(params, kv_cache, batch, sampling) -> (tokens, logprobs, top_logprobs, top_ids, kv_cache)

with `kv_cache` donated, so the pages are updated in place. Its shapes come from a small set
of buckets (runner/compile.py), all compiled at start-up; the persistent compilation cache
makes the next start fast.

Layers run as an unrolled Python loop over per-layer weights and per-layer page arrays,
not `lax.scan` over stacked ones. Measured on the real step (`benchmarks/step.py
--compare-scan 1,32`, default model, bf16, context 512, 3 GiB pool, with the jnp attention
of the time): unrolled 33 ms (batch 1) and 171 ms (batch 32) per step; scan 2270 ms at both,
because the scanned page arrays are rewritten whole every step (and scan slices each layer's
weights into fresh buffers). Scan compiles faster per bucket; the persistent compilation
cache pays the unrolled price once (16 buckets with the native attention: about 70 s cold,
20 s from the cache, where tracing remains).
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm import kernels
from jaxllm.config import EngineConfig
from jaxllm.core.request import Request
from jaxllm.models import llama
from jaxllm.runner import sampler
from jaxllm.runner.compile import Bucket, make_buckets, pick_bucket
from jaxllm.sampling_params import MAX_LOGPROBS


PREFILL_BLOCK = 16


def _default_attention_impl(backend: str) -> str:
    if backend != "cpu":
        return "pallas"
    from jaxllm.kernels import native

    reason = native.unavailable_reason()
    if reason is None:
        return "native"
    import logging
    logging.getLogger(__name__).warning("native CPU attention unavailable (%s); using the slower jnp path", reason)
    return "cpu"


def _step(params, kv_cache, batch, sampling, *, spec, attention_impl):
    hidden, kv_cache = llama.forward(params, kv_cache, batch, spec, attention_impl=attention_impl)
    logits = llama.compute_logits(params, hidden[batch["logits_indices"]], spec)
    tokens, logprob, top_lp, top_ids = sampler.sample(logits, sampling, native=attention_impl == "native")
    return tokens, logprob, top_lp, top_ids, kv_cache


@dataclasses.dataclass(slots=True)
class StepResult:
    """Per scheduled request (same order): the sampled token, or None mid-prompt."""

    scheduled: list[tuple[Request, int]]   # (request, num_new_tokens), decodes first
    tokens: list[int | None]
    logprobs: np.ndarray        # [n] f32, the sampled tokens' logprobs
    top_logprobs: np.ndarray    # [n, MAX_LOGPROBS]
    top_ids: np.ndarray         # [n, MAX_LOGPROBS]
    timings: dict[str, float]


class ModelRunner:
    def __init__(self, config: EngineConfig, spec: llama.ModelSpec, params):
        self.config = config
        self.spec = spec
        # Commit params and the cache to the device: warm-up and serving then pass arrays with
        # the same sharding, so the programs compiled at warm-up are the ones served from.
        device = jax.devices()[0]
        self.params = jax.device_put(params, device)
        sched = config.scheduler
        self.block_size = config.cache.block_size
        self.max_blocks = config.max_blocks_per_seq
        self.prefill_block = PREFILL_BLOCK
        self.attention_impl = config.attention_backend or _default_attention_impl(jax.default_backend())
        self.buckets = make_buckets(sched.max_num_seqs, sched.max_num_batched_tokens,
                                    PREFILL_BLOCK, sched.max_num_prefill_seqs)
        self.kv_cache = kernels.allocate_kv_cache(
            spec.num_layers, spec.num_kv_heads, config.cache.num_blocks, self.block_size, spec.head_dim,
            jnp.float32 if config.dtype == "float32" else jnp.bfloat16)
        self.kv_cache = jax.device_put(self.kv_cache, device)
        self._step = jax.jit(
            functools.partial(_step, spec=spec, attention_impl=self.attention_impl), donate_argnums=(1,))
        self._inv_freq = spec.inv_freq()
        self._no_penalty_tokens: dict[int, jax.Array] = {}
        self._penalty_len = config.scheduler.max_model_len

    # ----- host-side batch construction -----
    def _empty_penalty_tokens(self, num_seqs: int) -> jax.Array:
        if num_seqs not in self._no_penalty_tokens:
            self._no_penalty_tokens[num_seqs] = jnp.full((num_seqs, self._penalty_len), -1, jnp.int32)
        return self._no_penalty_tokens[num_seqs]

    def prepare(self, scheduled: list[tuple[Request, int]]):
        """Order decodes first, pick a bucket, and fill the padded host arrays.

        Returns (ordered [(request, num_new)], bucket, batch dict, sampling dict).
        """
        # Longest contexts first: the CPU attention walks pages per part of consecutive rows.
        decodes = sorted(((r, n) for r, n in scheduled if n == 1), key=lambda rn: -rn[0].num_computed_tokens)
        chunks = [(r, n) for r, n in scheduled if n > 1]
        ordered = decodes + chunks
        q_lens = np.array([n for _, n in ordered], np.int32)
        num_tokens = int(q_lens.sum())
        chunk_rows = sum(-(-n // self.prefill_block) for _, n in chunks)
        bucket = pick_bucket(self.buckets, num_tokens, len(decodes), chunk_rows, len(ordered))
        T, S = bucket.num_tokens, bucket.num_seqs
        bs = self.block_size

        token_ids = np.zeros(T, np.int32)
        positions = np.zeros(T, np.int32)
        slot_mapping = np.full(T, -1, np.int32)
        block_tables = np.zeros((len(ordered), self.max_blocks), np.int32)
        kv_lens = np.zeros(len(ordered), np.int32)
        t = 0
        for i, (req, n) in enumerate(ordered):
            start = req.num_computed_tokens
            token_ids[t:t + n] = req.token_slice(start, start + n)
            pos = np.arange(start, start + n, dtype=np.int32)
            positions[t:t + n] = pos
            ids = np.asarray(req.block_ids, np.int32)
            slot_mapping[t:t + n] = ids[pos // bs] * bs + pos % bs
            block_tables[i, :len(ids)] = ids
            kv_lens[i] = start + n
            t += n

        batch = {"token_ids": token_ids, "positions": positions, "slot_mapping": slot_mapping}
        batch["rope_cos"], batch["rope_sin"] = llama.rope_tables(positions, self._inv_freq, xp=np)
        logits_indices = np.zeros(S, np.int32)
        logits_indices[:len(ordered)] = np.cumsum(q_lens) - 1
        batch["logits_indices"] = logits_indices
        nd = len(decodes)
        if self.attention_impl == "cpu":
            d = bucket.num_decode_rows
            idx = np.full((d, 1), T, np.int32)
            idx[:nd, 0] = np.arange(nd)
            bt = np.zeros((d, self.max_blocks), np.int32)
            bt[:nd] = block_tables[:nd]
            kl = np.zeros(d, np.int32)
            kl[:nd] = kv_lens[:nd]
            ql = np.zeros(d, np.int32)
            ql[:nd] = 1
            batch.update(decode_token_idx=idx, decode_block_tables=bt, decode_kv_lens=kl, decode_q_lens=ql)
            if bucket.num_prefill_rows:
                p_idx, p_bt, p_kv, p_q = kernels.ragged_to_rows(
                    q_lens[nd:], kv_lens[nd:], block_tables[nd:], num_tokens=T,
                    num_rows=bucket.num_prefill_rows, q_block=self.prefill_block)
                p_idx = np.where(p_idx < T, p_idx + nd, T).astype(np.int32)  # offsets past the decodes
                batch.update(prefill_token_idx=p_idx, prefill_block_tables=p_bt,
                             prefill_kv_lens=p_kv, prefill_q_lens=p_q)
        else:
            bt = np.zeros((S, self.max_blocks), np.int32)
            bt[:len(ordered)] = block_tables
            kl = np.zeros(S, np.int32)
            kl[:len(ordered)] = kv_lens
            cu = np.full(S + 1, num_tokens, np.int32)
            cu[0] = 0
            cu[1:len(ordered) + 1] = np.cumsum(q_lens)
            batch.update(block_tables=bt, kv_lens=kl, cu_q_lens=cu, num_seqs=np.int32(len(ordered)))
        return ordered, bucket, batch, self._sampling_arrays(ordered, S)

    def _sampling_arrays(self, ordered, S):
        n = len(ordered)
        temperature = np.zeros(S, np.float32)
        top_p = np.ones(S, np.float32)
        top_k = np.zeros(S, np.int32)
        min_p = np.zeros(S, np.float32)
        presence = np.zeros(S, np.float32)
        frequency = np.zeros(S, np.float32)
        repetition = np.ones(S, np.float32)
        seeds = np.zeros(S, np.uint32)
        output_index = np.zeros(S, np.int32)
        output_start = np.zeros(S, np.int32)
        banned = np.full((S, sampler.NUM_BANNED), -1, np.int32)
        any_penalty = any_logprobs = any_top = any_banned = False
        for i, (req, _) in enumerate(ordered):
            p = req.sampling_params
            temperature[i] = p.temperature
            top_p[i] = p.top_p
            top_k[i] = max(p.top_k, 0)
            min_p[i] = p.min_p
            presence[i], frequency[i], repetition[i] = p.presence_penalty, p.frequency_penalty, p.repetition_penalty
            seeds[i] = req.seed & 0xFFFFFFFF
            output_index[i] = len(req.output_token_ids)
            output_start[i] = req.num_prompt_tokens
            if len(req.output_token_ids) < p.min_tokens:
                stop_ids = list(p.stop_token_ids) + ([] if p.ignore_eos else list(req.eos_token_ids))
                banned[i, :len(stop_ids)] = stop_ids[: sampler.NUM_BANNED]
                any_banned |= bool(stop_ids)
            any_penalty |= p.uses_penalties
            any_logprobs |= p.logprobs is not None
            any_top |= p.temperature > 0 and (p.top_k > 0 or p.top_p < 1.0)
        if any_penalty:
            penalty_tokens = np.full((S, self._penalty_len), -1, np.int32)
            for i, (req, _) in enumerate(ordered):
                if req.sampling_params.uses_penalties:
                    toks = req.all_token_ids
                    penalty_tokens[i, :len(toks)] = toks
        else:
            penalty_tokens = self._empty_penalty_tokens(S)
        all_greedy = all(req.sampling_params.temperature == 0 for req, _ in ordered)
        flags = np.zeros(sampler.NUM_FLAGS, np.bool_)
        flags[[sampler.FLAG_ALL_GREEDY, sampler.FLAG_TOP_K_TOP_P, sampler.FLAG_PENALTIES, sampler.FLAG_LOGPROBS,
               sampler.FLAG_BANNED]] = all_greedy, any_top, any_penalty, any_logprobs, any_banned
        return dict(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                    presence_penalty=presence, frequency_penalty=frequency, repetition_penalty=repetition,
                    seeds=seeds, output_index=output_index, output_start=output_start,
                    banned_tokens=banned, penalty_tokens=penalty_tokens, flags=flags)

    # ----- device step -----
    def execute(self, scheduled: list[tuple[Request, int]]) -> StepResult:
        t0 = time.perf_counter()
        ordered, bucket, batch, sampling = self.prepare(scheduled)
        t1 = time.perf_counter()
        batch, sampling = jax.device_put((batch, sampling))
        tokens, logprob, top_lp, top_ids, self.kv_cache = self._step(self.params, self.kv_cache, batch, sampling)
        tokens, logprob, top_lp, top_ids = jax.device_get((tokens, logprob, top_lp, top_ids))
        t2 = time.perf_counter()
        n = len(ordered)
        out_tokens = [
            int(tokens[i]) if req.num_computed_tokens + q == req.num_tokens else None
            for i, (req, q) in enumerate(ordered)
        ]
        return StepResult(ordered, out_tokens, logprob[:n], top_lp[:n], top_ids[:n],
                          {"prepare": t1 - t0, "device": t2 - t1, "bucket_tokens": bucket.num_tokens})

    def warmup(self, progress: bool = True) -> float:
        """Compile every bucket (all-padding batches write nowhere). Returns seconds taken."""
        from tqdm.auto import tqdm

        start = time.perf_counter()
        for bucket in tqdm(self.buckets, desc="compiling buckets", disable=not progress, unit="bucket"):
            batch, sampling = self._dummy_inputs(bucket)
            out = self._step(self.params, self.kv_cache, batch, sampling)
            self.kv_cache = out[-1]
            jax.block_until_ready(out[0])
        return time.perf_counter() - start

    def _dummy_inputs(self, bucket: Bucket):
        T, S = bucket.num_tokens, bucket.num_seqs
        batch = {"token_ids": np.zeros(T, np.int32), "positions": np.zeros(T, np.int32),
                 "slot_mapping": np.full(T, -1, np.int32), "logits_indices": np.zeros(S, np.int32)}
        batch["rope_cos"], batch["rope_sin"] = llama.rope_tables(batch["positions"], self._inv_freq, xp=np)
        if self.attention_impl == "cpu":
            for group, rows, qb in (("decode", bucket.num_decode_rows, 1),
                                    ("prefill", bucket.num_prefill_rows, self.prefill_block)):
                if group == "prefill" and rows == 0:
                    continue
                batch.update({f"{group}_token_idx": np.full((rows, qb), T, np.int32),
                              f"{group}_block_tables": np.zeros((rows, self.max_blocks), np.int32),
                              f"{group}_kv_lens": np.zeros(rows, np.int32),
                              f"{group}_q_lens": np.zeros(rows, np.int32)})
        else:
            batch.update(block_tables=np.zeros((S, self.max_blocks), np.int32), kv_lens=np.zeros(S, np.int32),
                         cu_q_lens=np.zeros(S + 1, np.int32), num_seqs=np.int32(0))
        return batch, self._sampling_arrays([], S)

    def copy_pages(self, src: list[int], dst: list[int]) -> None:
        """Copy whole pages src[i] -> dst[i] in every layer (copy-on-write)."""
        if not src:
            return
        # Pad to a power of two by repeating the first pair (an identical write), so only
        # log2(max_num_seqs) shapes are ever compiled.
        pad = (1 << (len(src) - 1).bit_length()) - len(src)
        src, dst = list(src) + [src[0]] * pad, list(dst) + [dst[0]] * pad
        self.kv_cache = _copy_pages(self.kv_cache, jnp.asarray(src, jnp.int32), jnp.asarray(dst, jnp.int32))


@functools.partial(jax.jit, donate_argnums=(0,))
def _copy_pages(kv_cache, src, dst):
    return [(k.at[:, dst].set(k[:, src]), v.at[:, dst].set(v[:, src])) for k, v in kv_cache]


__all__ = ["ModelRunner", "StepResult", "MAX_LOGPROBS"]
