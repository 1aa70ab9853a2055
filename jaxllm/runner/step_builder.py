"""Step inputs: the scheduled requests' rows -> one bucket's packed host buffers.

`StepBuilder` owns the persistent batch's step-side state: each bucket's host buffers (two
sets, taken in turn, so that preparing the step ahead never writes what the step in flight
reads), the cached device arrays of -1s that stand for "no penalties" and "every token
allowed", and the split of a batch into pipeline micro-batches. `prepare_step` is what the
runner calls; `padding` gives a bucket's all-padding inputs (warm-up, idle micro-batches,
abstract shapes for compiling).
"""

from __future__ import annotations

import jax
import numpy as np

from jaxllm import parallel
from jaxllm.models import decoder
from jaxllm.runner.compile import Bucket
from jaxllm.runner.input_batch import (
    FLAG_GRAMMAR,
    BucketBuffers,
    InputBatch,
    PackedLayout,
    SamplingMetadata,
    StepInputs,
    TokenMasks,
    fill,
)
from jaxllm.structured_output import mask_words
from jaxllm.utils import cdiv

PADDING = -1  # the micro-batch index of a bucket's all-padding buffers


class StepBuilder:
    """Fills buckets' buffers from `input_batch`'s rows. `pick(demand)`: the compiled bucket for
    a demand (`CompiledSteps.pick`); `inputs_sharding`: where the step's inputs go (one device,
    or every device of the mesh, replicated)."""

    def __init__(
        self,
        config,
        cfg,
        attention,
        input_batch: InputBatch,
        buckets: list[Bucket],
        *,
        num_stages: int,
        inputs_sharding,
        pick=None,
        lora_slot_of=None,
    ):
        self.config, self.cfg, self.attention, self.input_batch = config, cfg, attention, input_batch
        self.num_stages, self.pick = num_stages, pick
        self.lora_slot_of = lora_slot_of  # Request -> its adapter's device slot (-1: none), with LoRA
        self.inputs_sharding = inputs_sharding
        self.page_size = config.cache.page_size
        self.max_pages = config.max_pages_per_seq
        self.window_group = bool(config.cache.num_window_pages)
        self.inv_freq = cfg.inv_freq()
        # Rows of every step's `tokens` output (padded), the next step's `prev_tokens` input.
        self.max_logits = max(b.num_logits for b in buckets) * num_stages
        self.no_prev = jax.device_put(np.zeros(self.max_logits, np.int32), inputs_sharding)
        self._buffers: dict[tuple[Bucket, int], BucketBuffers] = {}
        self._parity = 0  # which of a bucket's two sets of host buffers the next step fills
        # Per R: the side inputs' cached device arrays of -1s (no penalties, every token allowed),
        # each aliasing the start of one host buffer of -1s where it can (`_minus_ones`).
        self._no_penalty_tokens: dict[int, jax.Array] = {}
        self._all_allowed: dict[int, jax.Array] = {}
        self._minus_ones_host: np.ndarray | None = None
        # Pipeline stage-ticks that ran a micro-batch, of all (the rest is the pipeline's idle time).
        self.busy_stage_ticks = self.stage_ticks = 0

    # ----- buffers -----
    def bucket_buffers(self, bucket: Bucket, micro: int = 0) -> BucketBuffers:
        """The persistent buffers of one bucket (and micro-batch, with pipeline stages)."""
        R = bucket.num_logits
        if (bucket, micro) not in self._buffers:
            self._buffers[bucket, micro] = BucketBuffers(
                bucket,
                StepInputs.zeros(
                    bucket.num_tokens,
                    bucket.num_seqs,
                    self.max_pages,
                    len(self.inv_freq),
                    R,
                    self.window_group,
                    lora=self.lora_slot_of is not None,
                ),
                SamplingMetadata.zeros(R, self.input_batch.custom.processors),
            )
        if R not in self._no_penalty_tokens:
            # Requests without penalties share one device array of -1s (no [R, L] transfer).
            stages = (self.num_stages,) if self.num_stages > 1 else ()
            self._no_penalty_tokens[R] = self._minus_ones((*stages, R, self.config.scheduler.max_model_len))
            self._all_allowed[R] = self._minus_ones((*stages, R, mask_words(self.cfg.vocab_size)))
        return self._buffers[bucket, micro]

    def _minus_ones(self, shape: tuple[int, ...]) -> jax.Array:
        """A device array of -1s. On a CPU device it aliases the first elements of one host
        buffer of -1s (64-byte aligned: XLA:CPU then takes a host array without copying it), so
        the arrays of every R take the largest one's memory, not their sum (at a 32k context
        the penalty tokens of 136 rows are 17 MiB, of all the default buckets' R ~110 MiB).
        Elsewhere it is a copy. Nothing writes these arrays: the steps only read them."""
        if self._minus_ones_host is None:
            width = max(self.config.scheduler.max_model_len, mask_words(self.cfg.vocab_size))
            self._minus_ones_host = _aligned_minus_ones(self.max_logits * width)
        host = self._minus_ones_host[: int(np.prod(shape))].reshape(shape)
        return jax.device_put(host, self.inputs_sharding, may_alias=True)

    def demand(self, q_lens: np.ndarray, drafts: bool = False) -> tuple[int, int, int, int, bool]:
        """What a bucket must hold for sequences of these query lengths: (tokens, decodes,
        prefill rows, sequences, logits for every token: some carry drafts to verify)."""
        chunks = q_lens[q_lens > 1]
        return (
            int(q_lens.sum()),
            len(q_lens) - len(chunks),
            int(cdiv(chunks, self.attention.prefill_row_tokens).sum()),
            len(q_lens),
            drafts,
        )

    # ----- one batch -----
    def prepare(
        self, scheduled, bucket: Bucket | None = None, micro: int = 0, ahead: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, BucketBuffers]:
        """Fill the bucket's buffers for `scheduled` [(request, num_new_tokens)] (in `bucket`,
        else the smallest that holds them; into micro-batch `micro`'s buffers).

        Sequences are laid out decodes first (longest context first: the CPU kernels walk
        pages per group of consecutive rows), then prompt chunks and drafted sequences. A
        request scheduled past its tokens carries drafts (`Request.spec_token_ids`): they are
        its query's last tokens, and the step gives every token logits (an `all_logits`
        bucket). Returns `(order, first, count, buffers)`: `order[j]` is the index into
        `scheduled` of the j-th sequence; its sampled tokens are logits rows `first[j] ..
        first[j] + count[j] - 1` (none mid-prompt; the newest token's, then each draft's);
        `buffers` the bucket's filled `StepInputs` and `SamplingMetadata`.

        `ahead` (async scheduling): every request decodes the token the step in flight samples
        for it, which the device reads from that step's tokens, row `ahead[i]`.
        """
        requests = [r for r, _ in scheduled]
        seqs = self._sequences(scheduled, requests, ahead)
        bucket = bucket or self.pick(self.demand(seqs.q_lens, seqs.drafts))
        buffers = self.bucket_buffers(bucket, micro)
        self._fill_tokens(buffers.inputs, seqs)
        if self.lora_slot_of is not None:
            slots = np.fromiter((self.lora_slot_of(r) for r in requests), np.int32, len(requests))
            fill(buffers.inputs.lora_slots, slots[seqs.order][seqs.seq_of_token], -1)
        self._fill_pages(buffers.inputs, seqs, bucket)
        first, count = self._fill_sampling(buffers, seqs, requests, bucket)
        return seqs.order, first, count, buffers

    def _sequences(self, scheduled, requests, ahead) -> _Sequences:
        """The scheduled sequences in the step's order, with their lengths (see `prepare`)."""
        n = len(scheduled)
        q_lens = np.fromiter((q for _, q in scheduled), np.int32, n)
        computed = np.fromiter((r.num_computed_tokens for r in requests), np.int32, n)
        ib = self.input_batch
        rows = ib.rows_for(requests)
        known = ib.num_tokens[rows]  # tokens the requests have (drafts excluded)
        if ahead is not None:  # the newest token is in flight: one past what the host has
            computed = known.astype(np.int32)
            known = known + 1
        for i in np.flatnonzero(computed + q_lens > known):  # drafts: the query's last tokens
            k = computed[i] + q_lens[i] - known[i]
            ib.token_ids[rows[i], known[i] : known[i] + k] = requests[i].spec_token_ids[:k]
        is_decode = q_lens == 1
        order = np.lexsort((np.where(is_decode, -computed, 0), ~is_decode))
        return _Sequences(
            order,
            q_lens[order],
            computed[order],
            rows[order],
            known[order],
            ahead[order] if ahead is not None else None,
            int(is_decode.sum()),
        )

    def _fill_tokens(self, inputs: StepInputs, seqs: _Sequences) -> None:
        """Token ids, positions, sequence lengths and offsets, RoPE tables."""
        ib = self.input_batch
        fill(inputs.positions, seqs.positions, 0)
        fill(inputs.token_ids, ib.token_ids[seqs.token_rows, np.minimum(seqs.positions, ib.token_ids.shape[1] - 1)], 0)
        fill(inputs.prev_rows, seqs.prev_rows if seqs.ahead else (), -1)
        fill(inputs.seq_lens, seqs.seq_lens, 0)
        inputs.query_start_loc[0] = 0
        fill(inputs.query_start_loc[1:], seqs.ends, seqs.num_tokens)
        inputs.num_seqs[...] = len(seqs.order)
        inputs.rope_cos, inputs.rope_sin = decoder.rope_tables(inputs.positions, self.inv_freq, xp=np)

    def _fill_pages(self, inputs: StepInputs, seqs: _Sequences, bucket: Bucket) -> None:
        """Slot mapping, page tables and the attention backend's metadata, per KV cache group."""
        ib, bs = self.input_batch, self.page_size
        tables = [(inputs.slot_mapping, inputs.page_tables)]
        if self.window_group:
            tables.append((inputs.window_slot_mapping, inputs.window_page_tables))
        positions, token_rows = seqs.positions, seqs.token_rows
        for g, (slots, page_tables) in enumerate(tables):
            fill(slots, ib.page_table[token_rows, g, positions // bs] * bs + positions % bs, -1)
            fill(page_tables, ib.page_table[seqs.rows, g], 0)
        metadata = [
            self.attention.build_metadata(
                q_lens=seqs.q_lens,
                seq_lens=seqs.seq_lens,
                page_tables=page_tables[: len(seqs.order)],
                num_decodes=seqs.num_decodes,
                bucket=bucket,
            )
            for _, page_tables in tables
        ]
        inputs.attn_metadata = metadata[0]
        if self.window_group:
            inputs.window_attn_metadata = metadata[1]

    def _fill_sampling(self, buffers: BucketBuffers, seqs: _Sequences, requests, bucket: Bucket):
        """Logits rows, sampling parameters and grammar masks; returns (first, count) (`prepare`)."""
        ib, inputs, sampling = self.input_batch, buffers.inputs, buffers.sampling
        R = bucket.num_logits
        no_penalties = None if self.num_stages > 1 else self._no_penalty_tokens[R]
        count = np.maximum(seqs.seq_lens - seqs.known + 1, 0)  # the newest token's row, then each draft's
        if bucket.all_logits:  # a row per token; the one after each draft verifies it
            positions, token_rows, of_token = seqs.positions, seqs.token_rows, seqs.seq_of_token
            fill(inputs.logits_indices, np.arange(seqs.num_tokens), 0)
            nxt = np.minimum(positions + 1, ib.token_ids.shape[1] - 1)
            verifies = (positions + 1 < seqs.seq_lens[of_token]) & (positions + 1 >= seqs.known[of_token])
            ib.fill_sampling(
                sampling,
                token_rows,
                no_penalties,
                positions=positions,
                drafts=np.where(verifies, ib.token_ids[token_rows, nxt], -1),
            )
            first = seqs.ends - seqs.q_lens + (seqs.known - 1 - seqs.computed)
        else:
            fill(inputs.logits_indices, seqs.ends - 1, 0)
            ib.fill_sampling(sampling, seqs.rows, no_penalties, positions=seqs.seq_lens - 1 if seqs.ahead else None)
            first = np.arange(len(seqs.order))
        # Structured output: the constrained rows' masks, after each draft too (`count` rows).
        grammars = [
            (requests[i].grammar, int(first[j]), requests[i].spec_token_ids[: count[j] - 1])
            for j, i in enumerate(seqs.order)
            if count[j] and requests[i].grammar is not None
        ]
        sampling.flags[FLAG_GRAMMAR] = bool(grammars)
        if grammars:
            if buffers.token_masks is None:
                buffers.token_masks = TokenMasks(R, mask_words(self.cfg.vocab_size))
            sampling.token_mask = buffers.token_masks.fill(grammars)
        else:
            sampling.token_mask = None if self.num_stages > 1 else self._all_allowed[R]
        return first, count

    # ----- the step's packed inputs -----
    def prepare_step(self, scheduled, ahead: np.ndarray | None = None):
        """The step's packed inputs for `scheduled`: `(seqs, first, count, buffers, packed)`:
        scheduled[i] is the step's sequence `seqs[i]`, its sampled tokens are output rows
        `first[i] ..` (`count[i]` of them: `prepare`); `buffers` are the (first) micro-batch's,
        `packed` the step's arguments after the layout."""
        if self.num_stages > 1:
            return self._prepare_micro_batches(scheduled)
        n = len(scheduled)
        seqs, first, count = np.empty(n, np.int64), np.empty(n, np.int64), np.empty(n, np.int64)
        # Two sets of buffers, taken in turn: the step in flight may still read the other.
        order, f, c, buffers = self.prepare(scheduled, micro=self._parity, ahead=ahead)
        self._parity ^= 1
        seqs[order], first[order], count[order] = np.arange(n), f, c
        return seqs, first, count, buffers, self.pack(buffers)

    def _prepare_micro_batches(self, scheduled):
        """`prepare_step` with pipeline stages: the batch split into `num_stages` micro-batches of
        about equal tokens, all in the bucket that holds the largest; output row m * S + j is
        micro-batch m's j-th sequence (no drafts there)."""
        n = len(scheduled)
        seqs, first, count = np.empty(n, np.int64), np.empty(n, np.int64), np.empty(n, np.int64)
        q_lens = np.fromiter((q for _, q in scheduled), np.int32, n)
        groups = parallel.split_micro_batches(q_lens, self.num_stages)
        bucket = self.pick(np.max([self.demand(q_lens[g]) for g in groups], axis=0))
        micro = []
        for m, group in enumerate(groups):
            if not len(group):
                micro.append(self.ready_buffers(bucket))
                continue
            order, f, c, buffers = self.prepare([scheduled[i] for i in group], bucket, m)
            seqs[group[order]] = first[group[order]] = m * bucket.num_seqs + f
            count[group[order]] = c
            self.pack(buffers)
            micro.append(buffers)
            self.busy_stage_ticks += self.num_stages
        self.stage_ticks += self.num_stages * (2 * self.num_stages - 1)
        return seqs, first, count, micro[0], self._stack(micro)

    def pack(self, buffers: BucketBuffers):
        """The bucket's inputs packed: (ints, floats, penalty tokens, token mask)."""
        sampling = buffers.sampling
        side = sampling.penalty_tokens, sampling.token_mask
        sampling.penalty_tokens = sampling.token_mask = None  # travel apart, not packed
        tree = (buffers.inputs, sampling)
        if buffers.layout is None:
            buffers.layout = PackedLayout.of(tree)
            buffers.ints = np.zeros(buffers.layout.num_ints, np.int32)
            buffers.floats = np.zeros(buffers.layout.num_floats, np.float32)
        buffers.layout.pack(tree, buffers.ints, buffers.floats)
        sampling.penalty_tokens, sampling.token_mask = side
        return buffers.ints, buffers.floats, *side

    def _stack(self, micro: list[BucketBuffers]):
        """Micro-batches' packed inputs as the pipelined step takes them: `[M, ...]` each."""
        R = micro[0].bucket.num_logits

        def stacked(name, default, width):
            parts = [getattr(b.sampling, name) for b in micro]
            if all(p is None for p in parts):
                return default[R]
            fill = np.full((R, width), -1, np.int32)
            return np.stack([fill if p is None else p for p in parts])

        return (
            np.stack([b.ints for b in micro]),
            np.stack([b.floats for b in micro]),
            stacked("penalty_tokens", self._no_penalty_tokens, self.config.scheduler.max_model_len),
            stacked("token_mask", self._all_allowed, mask_words(self.cfg.vocab_size)),
        )

    # ----- padding -----
    def ready_buffers(self, bucket: Bucket) -> BucketBuffers:
        """The bucket's all-padding inputs, packed (they write no KV and sample nothing used)."""
        buffers = self.bucket_buffers(bucket, PADDING)
        if buffers.layout is None:
            buffers.inputs.attn_metadata = self.attention.dummy_metadata(bucket, self.max_pages)
            if self.window_group:
                buffers.inputs.window_attn_metadata = self.attention.dummy_metadata(bucket, self.max_pages)
            self.input_batch.fill_sampling(buffers.sampling, np.zeros(0, np.int64), None)
            self.pack(buffers)
        return buffers

    def padding(self, bucket: Bucket):
        """A whole step of padding in `bucket`: (layout, ints, floats, penalty tokens, token mask,
        prev tokens)."""
        buffers = self.ready_buffers(bucket)
        if self.num_stages == 1:
            R = bucket.num_logits
            return (
                buffers.layout,
                buffers.ints,
                buffers.floats,
                self._no_penalty_tokens[R],
                self._all_allowed[R],
                self.no_prev,
            )
        return (buffers.layout, *self._stack([buffers] * self.num_stages), self.no_prev)


def _aligned_minus_ones(n: int) -> np.ndarray:
    """n int32 -1s starting on a 64-byte boundary."""
    raw = np.empty(n + 16, np.int32)
    start = (-raw.ctypes.data % 64) // 4
    out = raw[start : start + n]
    out.fill(-1)
    return out


class _Sequences:
    """A batch's sequences in the step's order (`StepBuilder._sequences`), as numpy arrays [n]
    (`order`: index into the scheduled list), and what follows from them per token."""

    __slots__ = (
        "order",
        "q_lens",
        "computed",
        "rows",
        "known",
        "prev_rows",
        "ahead",
        "num_decodes",
        "seq_lens",
        "drafts",
        "ends",
        "num_tokens",
        "seq_of_token",
        "positions",
        "token_rows",
    )

    def __init__(self, order, q_lens, computed, rows, known, prev_rows, num_decodes: int):
        self.order, self.q_lens, self.computed, self.rows, self.known = order, q_lens, computed, rows, known
        self.prev_rows, self.ahead, self.num_decodes = prev_rows, prev_rows is not None, num_decodes
        self.seq_lens = computed + q_lens
        self.drafts = bool((self.seq_lens > known).any())
        self.ends = np.cumsum(q_lens, dtype=np.int32)
        self.num_tokens = int(q_lens.sum())
        self.seq_of_token = np.repeat(np.arange(len(order)), q_lens)
        self.positions = np.arange(self.num_tokens, dtype=np.int32) + np.repeat(computed - (self.ends - q_lens), q_lens)
        self.token_rows = rows[self.seq_of_token]
