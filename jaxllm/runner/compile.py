"""Bucketed shapes, JAX's persistent compilation cache (over several processes; one process keeps
its steps in runner/executables.py), and the no-recompile guard."""

from __future__ import annotations

import contextlib
import dataclasses
import os

import jax


@dataclasses.dataclass(frozen=True, order=True)
class Bucket:
    """Static shape of one compiled step.

    num_tokens: T, flat tokens of the step. num_decode_rows: one-token attention rows
    (decodes). num_prefill_rows: attention rows of `prefill_row_tokens` query tokens (prompt
    chunks; only the `cpu` attention backend's shapes depend on them).
    num_seqs: S, sequences. all_logits: every token gets logits and a sampled token (R = T
    rows: speculative decoding verifies each draft); else each sequence's last token (R = S).
    """

    num_tokens: int
    num_decode_rows: int
    num_prefill_rows: int
    num_seqs: int
    all_logits: bool = False

    @property
    def num_logits(self) -> int:
        """R: rows of logits (and of sampling state) in the step."""
        return self.num_tokens if self.all_logits else self.num_seqs

    def fits(
        self, num_tokens: int, num_decode: int, num_prefill_rows: int, num_seqs: int, all_logits: bool = False
    ) -> bool:
        return (
            num_tokens <= self.num_tokens
            and num_decode <= self.num_decode_rows
            and num_prefill_rows <= self.num_prefill_rows
            and num_seqs <= self.num_seqs
            and self.all_logits >= all_logits
        )


def _powers_of_two(lo: int, hi: int) -> list[int]:
    out, x = [], lo
    while x < hi:
        out.append(x)
        x *= 2
    return out + [hi]


# Decode rows of the small version of each mixed bucket: a prompt chunk among up to 16 decodes.
FEW_DECODES = 16


def make_buckets(
    max_num_seqs: int,
    max_num_batched_tokens: int,
    prefill_row_tokens: int,
    max_num_prefill_seqs: int,
    num_speculative_tokens: int = 0,
    max_spec_seqs: int = 0,
    catch_up_seqs: int = 0,
) -> list[Bucket]:
    """Decode-only buckets (powers of two from 2 — a one-row batch is padded to two, since a
    single-row dot is a slow GEMV on XLA:CPU — plus 48, 96, ...) and mixed buckets (32 tokens
    up to max_num_batched_tokens) for steps with prompt chunks, each for up to max_num_seqs
    decodes and for up to FEW_DECODES. With speculative decoding, also
    verification buckets: d sequences holding 2d or d (1 + num_speculative_tokens) tokens, with
    logits for every token, for d in powers of two from 1 up to max_spec_seqs. A draft model's
    steps (`catch_up_seqs`: its proposer's sequences at most) also have buckets of d sequences of
    up to 2 tokens: after a round whose drafts were all accepted, a sequence's last draft and the
    target's token, which would otherwise take a 32-token mixed step."""
    decode_sizes = _powers_of_two(2, max(2, max_num_seqs))
    # Between larger powers of two, also 1.5x (48) and from 64 on quarter steps (80, 96, 112,
    # ...): a draining decode batch then pads at most ~20%. Below 32 rows a step costs about
    # the same whatever the batch (it streams the weights), so padding there is nearly free.
    steps = {32: (3,), 64: (5, 6, 7)}
    decode_sizes += [
        d * k // 4 if d >= 64 else d * k // 2
        for d in decode_sizes
        if d >= 32
        for k in steps[min(d, 64)]
        if (d * k // 4 if d >= 64 else d * k // 2) < max_num_seqs
    ]
    buckets = [Bucket(d, d, 0, d) for d in decode_sizes]
    for t in _powers_of_two(min(32, max_num_batched_tokens), max_num_batched_tokens):
        rows = -(-t // prefill_row_tokens) + max_num_prefill_seqs
        # Each token count twice: with room for every decode, and for a few (FEW_DECODES). A
        # step's logits and sampling are [S, vocab] whatever its live rows: steps with a prompt
        # chunk took 0.70 against 0.80-0.91 ms a prompt token in 24 rows rather than 136 (closed
        # loops of 16, 4 and 1 requests, 2-vCPU Zen 4).
        for d in {min(t, max_num_seqs), min(t, max_num_seqs, FEW_DECODES)}:
            buckets.append(Bucket(t, d, rows, d + max_num_prefill_seqs))
    k = num_speculative_tokens
    if k:  # from one sequence (its k + 1 tokens are rows enough for the GEMMs)
        for d in _powers_of_two(1, max(1, min(max_spec_seqs, max_num_seqs))):
            # Every sequence with k drafts, or about one draft each (where few drafts are proposed,
            # a step padded to d * (k + 1) rows would cost up to 1.5x a decode step).
            for t in {2 * d, d * (k + 1)}:
                if t <= max_num_batched_tokens:
                    buckets.append(Bucket(t, d, d, d, all_logits=True))
    for d in _powers_of_two(1, min(catch_up_seqs, max_num_seqs)) if catch_up_seqs else ():
        if 2 * d <= max_num_batched_tokens:
            buckets.append(Bucket(2 * d, d, d, d))
    return sorted(set(buckets), key=lambda b: (b.num_tokens, b.num_seqs, b.num_prefill_rows, b.all_logits))


def make_pooling_buckets(max_num_seqs: int, max_num_batched_tokens: int, prefill_row_tokens: int) -> list[Bucket]:
    """A pooling engine's buckets: steps of whole prompts (or prompt chunks) only, T tokens in
    powers of two from 16 up to max_num_batched_tokens, each for up to min(T, max_num_seqs)
    sequences (one-token prompts count as decodes: as many rows for those)."""
    buckets = []
    for t in _powers_of_two(min(16, max_num_batched_tokens), max_num_batched_tokens):
        seqs = min(t, max_num_seqs)
        buckets.append(Bucket(t, seqs, -(-t // prefill_row_tokens) + seqs, seqs))
    return buckets


def pick_bucket(
    buckets: list[Bucket],
    num_tokens: int,
    num_decode: int,
    num_prefill_rows: int,
    num_seqs: int,
    all_logits: bool = False,
) -> Bucket:
    for bucket in buckets:
        if bucket.fits(num_tokens, num_decode, num_prefill_rows, num_seqs, all_logits):
            return bucket
    raise ValueError(
        f"no compiled bucket holds {num_tokens} tokens, {num_decode} decodes, "
        f"{num_prefill_rows} prefill rows, {num_seqs} sequences" + (" with logits for every token" * all_logits)
    )


def enable_persistent_cache(cache_dir: str) -> None:
    """Cache compiled programs on disk so the next start skips XLA compilation."""
    if not cache_dir:
        return
    from jax.experimental.compilation_cache import compilation_cache

    os.makedirs(cache_dir, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    # JAX decides once, at the process's first compilation, whether the cache is on; anything
    # compiled before this call (weight conversion, a user's own jit) would leave it off.
    compilation_cache.reset_cache()


class CompilationCounter:
    """Counts XLA compilations (persistent-cache hits excluded) while installed; with
    `cache_hits=True`, executables loaded from JAX's persistent cache instead."""

    _COMPILED = "/jax/core/compile/backend_compile_duration"
    _CACHE_HIT = "/jax/compilation_cache/cache_retrieval_time_sec"

    def __init__(self, cache_hits: bool = False):
        self.count = 0
        self._event = self._CACHE_HIT if cache_hits else self._COMPILED
        self._active = False

    def _listener(self, event: str, duration: float, **_) -> None:
        if self._active and event == self._event:
            self.count += 1

    def __enter__(self):
        self._active = True
        jax.monitoring.register_event_duration_secs_listener(self._listener)
        return self

    def __exit__(self, *exc):
        self._active = False
        with contextlib.suppress(Exception):
            jax.monitoring.unregister_event_duration_listener(self._listener)


@contextlib.contextmanager
def no_compile_guard():
    """Fail if anything is compiled inside the `with` body (use after warm-up)."""
    with CompilationCounter() as counter:
        yield counter
    if counter.count:
        raise AssertionError(f"{counter.count} XLA compilation(s) happened after warm-up")
