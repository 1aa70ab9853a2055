"""ModelRunner: a SchedulerOutput -> typed step inputs -> one jitted call -> ModelRunnerOutput.

The jitted call is runner/device_step.py's pure `step`, with `kv_cache` donated, so the pages
are updated in place. Its shapes come from a small set of buckets (runner/compile.py), all
compiled at start-up (on one thread per core, by default in the background), each kept on
disk by the executable store (runner/executables.py), which the next start loads without
tracing. The inputs (`StepInputs`, `SamplingMetadata`) are built by
`prepare` from the persistent rows of `InputBatch` (runner/input_batch.py), packed into one
int32 and one float32 buffer (`PackedLayout`, static per bucket) and unpacked inside the step;
the penalty tokens (`[R, max_model_len]`) and the structured-output token mask (`[R, vocab /
32]`, filled by the grammar backend for the constrained rows) travel apart, each usually a
cached device array of -1s.

Layers run as an unrolled loop, not `lax.scan` (measured: ARCHITECTURE.md, section 4).
"""

from __future__ import annotations

import functools
import os
import time
import weakref
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm import kernels, parallel, quantization
from jaxllm.attention import AttentionBackend, get_attention_backend
from jaxllm.config import EngineConfig
from jaxllm.core.outputs import ModelRunnerOutput, SchedulerOutput
from jaxllm.models import decoder, layout
from jaxllm.runner import device_step
from jaxllm.runner import pages as page_moves
from jaxllm.runner.compile import Bucket, make_buckets
from jaxllm.runner.executables import CompiledSteps, ExecutableStore
from jaxllm.runner.followers import InFlight, ProcessGroupSteps
from jaxllm.runner.input_batch import (FLAG_GRAMMAR, BucketBuffers, InputBatch, PackedLayout, SamplingMetadata,
                                      StepInputs, TokenMasks, fill)
from jaxllm.runner.prompt_logprobs import PromptLogprobs
from jaxllm.sampling_params import MAX_LOGPROBS
from jaxllm.spec_decode.verify import accepted_counts
from jaxllm.structured_output import mask_words
from jaxllm.utils import cdiv


class ModelRunner(ProcessGroupSteps):
    """`params`: the weight plan's weights (models/prepare.py `prepare_weights`), on the
    device, or with `mesh` (one replica's ("data", "stage", "model") Mesh, data size 1, for
    tensor and pipeline parallelism: jaxllm/parallel.py) laid out and placed on it;
    `small_params`: the small-step codes tree, if any. With pp stages, each step's batch is
    split into pp micro-batches of one bucket (`prepare_step`) that the step pipelines through
    the stages."""

    def __init__(self, config: EngineConfig, spec: decoder.ModelSpec, params,
                 attention: AttentionBackend | None = None, mesh=None, small_params=None):
        self.config = config
        self.spec = spec
        self.attention = attention or get_attention_backend(config.attention_backend)
        self.mesh = mesh
        self.num_kv_heads = layout.kv_heads_for(spec, parallel.tp_size(mesh))
        self.num_stages = parallel.pp_size(mesh)
        # The KV cache group of each layer (slot of a stage): 1 for the windowed layers of a
        # model with a window group (core/kv_cache_manager.py), else 0.
        self.window_group = bool(config.cache.num_window_blocks)
        self.layer_groups = tuple(int(self.window_group and spec.window(i) is not None)
                                  for i in range(spec.num_layers // self.num_stages))
        # Pipeline stage-ticks that ran a micro-batch, of all (the rest is the pipeline's idle time).
        self.busy_stage_ticks = self.stage_ticks = 0
        # Where the step's inputs go: the device, or every device of the mesh (replicated).
        self._inputs_sharding = (jax.sharding.SingleDeviceSharding(jax.devices()[0]) if mesh is None
                                 else jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
        # Over several processes, process 0 announces each step to the others (`follow`).
        self.channel = parallel.StepChannel() if jax.process_count() > 1 else None
        # The pages: zeroing them (~1 s for 2 GiB, mostly page faults) runs in C++ without the GIL,
        # so a thread does it while the weights are packed and the steps load or compile.
        # On one CPU device with the C++ kernels, the pages lie on 2 MiB pages (`native.zeros`).
        huge = mesh is None and jax.devices()[0].platform == "cpu" and self.attention.name == "native"
        self._make_kv_cache = page_moves.kv_cache_maker(
            [config.cache.group_num_blocks[g] for g in self.layer_groups], self.num_kv_heads, config.cache.block_size,
            spec.head_dim, config.cache.dtype, self.num_stages,
            jax.sharding.SingleDeviceSharding(jax.devices()[0]) if mesh is None else parallel.kv_sharding(mesh),
            zeros=kernels.native.zeros if huge else jnp.zeros)
        self._kv_shapes = jax.eval_shape(self._make_kv_cache)     # (with shardings) for compiling without pages
        self._abstract_state = {}       # id(params) -> (params, KV cache) as shapes, dtypes and shardings
        pool = ThreadPoolExecutor(1, thread_name_prefix="jaxllm-kv")
        self._kv_cache, self._kv_pending = None, pool.submit(self._make_kv_cache)
        pool.shutdown(wait=False)
        # The weights come prepared (models/prepare.py): placed on the device or the mesh, as the
        # weight plan said; `small_params`: the small-step codes tree, if any (`_step_params`).
        self.params, self.small_params = params, small_params
        sched = config.scheduler
        self.block_size = config.cache.block_size
        self.max_blocks = config.max_blocks_per_seq
        drafts = config.speculative
        self.buckets = make_buckets(sched.max_num_seqs, sched.max_num_batched_tokens,
                                    self.attention.prefill_row_tokens, sched.max_num_prefill_seqs,
                                    drafts.num_speculative_tokens if drafts else 0,
                                    drafts.max_seqs(sched) if drafts else 0)
        # Rows of every step's `tokens` output (padded), the next step's `prev_tokens` input.
        self.max_logits = max(b.num_logits for b in self.buckets) * self.num_stages
        self._no_prev = jax.device_put(np.zeros(self.max_logits, np.int32), self._inputs_sharding)
        self._parity = 0    # which of a bucket's two sets of host buffers the next step fills
        kv_dtype = kernels.cache_dtype(config.cache.dtype)
        # Host pages for swapped-out requests: [layers, k/v, kv_heads, slots, block_size, row]
        # ([layer slots, k/v, stages, ...] with pipeline stages; numpy zeros: the OS commits
        # memory only for slots ever written).
        stages = (self.num_stages,) if self.num_stages > 1 else ()
        self.swap_pool = np.zeros((spec.num_layers // self.num_stages, 2, *stages, self.num_kv_heads,
                                   config.cache.num_swap_blocks, self.block_size,
                                   kernels.row_width(spec.head_dim, kv_dtype)),
                                  kernels.storage_dtype(kv_dtype))
        step = jax.jit(functools.partial(device_step.step, spec=spec, attention=self.attention, mesh=self.mesh),
                       static_argnames=("layout",), donate_argnums=(1,))
        # Each bucket's compiled step, kept in the executable store when there is one (one
        # process: over several, each would race on the files).
        cache_dir = config.compilation_cache_dir
        devices = [jax.devices()[0]] if mesh is None else list(mesh.devices.flat)
        store = (ExecutableStore(os.path.join(cache_dir, "executables"), repr((spec, self.attention, mesh)), devices)
                 if cache_dir and jax.process_count() == 1 else None)
        # The steps hold the runner weakly, and a runner dropped while its steps compile in the
        # background cancels the ones not yet started (an engine replaced in a notebook stops).
        runner = weakref.ref(self)
        self.steps = CompiledSteps(step, self.buckets, store, lambda bucket: runner()._abstract_args(bucket))
        weakref.finalize(self, self.steps.stop)
        self._inv_freq = spec.inv_freq()
        self.input_batch = InputBatch(sched.max_num_seqs, sched.max_model_len, self.max_blocks, self.block_size,
                                      spec.vocab_size, len(config.cache.group_windows))
        self.prompt_logprobs = PromptLogprobs(spec)
        self._buffers: dict[tuple[Bucket, int], BucketBuffers] = {}
        # Per R: the side inputs' cached device arrays of -1s (no penalties, every token allowed).
        self._no_penalty_tokens: dict[int, jax.Array] = {}
        self._all_allowed: dict[int, jax.Array] = {}

    # ----- host-side inputs -----
    PADDING = -1    # `_bucket_buffers` micro-batch index of the all-padding inputs (warm-up, idle micro-batches)

    def _bucket_buffers(self, bucket: Bucket, micro: int = 0) -> BucketBuffers:
        """The persistent buffers of one bucket (and micro-batch, with pipeline stages)."""
        R = bucket.num_logits
        if (bucket, micro) not in self._buffers:
            self._buffers[bucket, micro] = BucketBuffers(
                bucket, StepInputs.zeros(bucket.num_tokens, bucket.num_seqs, self.max_blocks, len(self._inv_freq), R,
                                         self.window_group),
                SamplingMetadata.zeros(R))
        if R not in self._no_penalty_tokens:
            # Requests without penalties share one device array of -1s (no [R, L] transfer).
            stages = (self.num_stages,) if self.num_stages > 1 else ()
            self._no_penalty_tokens[R] = jax.device_put(
                np.full((*stages, R, self.config.scheduler.max_model_len), -1, np.int32), self._inputs_sharding)
            self._all_allowed[R] = jax.device_put(np.full((*stages, R, mask_words(self.spec.vocab_size)), -1, np.int32),
                                                  self._inputs_sharding)
        return self._buffers[bucket, micro]

    def _demand(self, q_lens: np.ndarray, drafts: bool = False) -> tuple[int, int, int, int, bool]:
        """What a bucket must hold for sequences of these query lengths: (tokens, decodes,
        prefill rows, sequences, logits for every token: some carry drafts to verify)."""
        chunks = q_lens[q_lens > 1]
        return (int(q_lens.sum()), len(q_lens) - len(chunks),
                int(cdiv(chunks, self.attention.prefill_row_tokens).sum()), len(q_lens), drafts)

    def prepare(self, scheduled, bucket: Bucket | None = None, micro: int = 0,
                ahead: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray, BucketBuffers]:
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
        n = len(scheduled)
        requests = [r for r, _ in scheduled]
        q_lens = np.fromiter((q for _, q in scheduled), np.int32, n)
        computed = np.fromiter((r.num_computed_tokens for r in requests), np.int32, n)
        ib, bs = self.input_batch, self.block_size
        rows = ib.rows_for(requests)
        known = ib.num_tokens[rows]                      # tokens the requests have (drafts excluded)
        if ahead is not None:       # the newest token is in flight: one past what the host has
            computed = known.astype(np.int32)
            known = known + 1
        for i in np.flatnonzero(computed + q_lens > known):
            k = computed[i] + q_lens[i] - known[i]
            ib.token_ids[rows[i], known[i]:known[i] + k] = requests[i].spec_token_ids[:k]
        is_decode = q_lens == 1
        order = np.lexsort((np.where(is_decode, -computed, 0), ~is_decode))
        q_lens, computed, rows, known = q_lens[order], computed[order], rows[order], known[order]
        prev_rows = ahead[order] if ahead is not None else ()
        num_decodes = int(is_decode.sum())
        num_tokens = int(q_lens.sum())
        seq_lens = computed + q_lens
        drafts = bool((seq_lens > known).any())
        bucket = bucket or self.steps.pick(self._demand(q_lens, drafts))
        buffers = self._bucket_buffers(bucket, micro)
        inputs, sampling = buffers.inputs, buffers.sampling

        ends = np.cumsum(q_lens, dtype=np.int32)
        seq_of_token = np.repeat(np.arange(n), q_lens)
        positions = np.arange(num_tokens, dtype=np.int32) + np.repeat(computed - (ends - q_lens), q_lens)
        token_rows = rows[seq_of_token]
        fill(inputs.positions, positions, 0)
        fill(inputs.token_ids, ib.token_ids[token_rows, np.minimum(positions, ib.token_ids.shape[1] - 1)], 0)
        fill(inputs.prev_rows, prev_rows, -1)
        fill(inputs.seq_lens, seq_lens, 0)
        inputs.query_start_loc[0] = 0
        fill(inputs.query_start_loc[1:], ends, num_tokens)
        inputs.num_seqs[...] = n
        inputs.rope_cos, inputs.rope_sin = decoder.rope_tables(inputs.positions, self._inv_freq, xp=np)
        tables = [(inputs.slot_mapping, inputs.block_tables)]
        if self.window_group:
            tables.append((inputs.window_slot_mapping, inputs.window_block_tables))
        for g, (slots, block_tables) in enumerate(tables):      # per KV cache group
            fill(slots, ib.block_table[token_rows, g, positions // bs] * bs + positions % bs, -1)
            fill(block_tables, ib.block_table[rows, g], 0)
        metadata = [self.attention.build_metadata(q_lens=q_lens, seq_lens=seq_lens, block_tables=block_tables[:n],
                                                  num_decodes=num_decodes, bucket=bucket) for _, block_tables in tables]
        inputs.attn_metadata = metadata[0]
        if self.window_group:
            inputs.window_attn_metadata = metadata[1]
        R = bucket.num_logits
        no_penalties = None if self.num_stages > 1 else self._no_penalty_tokens[R]
        count = np.maximum(seq_lens - known + 1, 0)     # the newest token's row, then each draft's
        if bucket.all_logits:    # a row per token; the one after each draft verifies it
            fill(inputs.logits_indices, np.arange(num_tokens), 0)
            nxt = np.minimum(positions + 1, ib.token_ids.shape[1] - 1)
            verifies = (positions + 1 < seq_lens[seq_of_token]) & (positions + 1 >= known[seq_of_token])
            ib.fill_sampling(sampling, token_rows, no_penalties, positions=positions,
                             drafts=np.where(verifies, ib.token_ids[token_rows, nxt], -1))
            first = ends - q_lens + (known - 1 - computed)
        else:
            fill(inputs.logits_indices, ends - 1, 0)
            ib.fill_sampling(sampling, rows, no_penalties, positions=None if ahead is None else seq_lens - 1)
            first = np.arange(n)
        # Structured output: the constrained rows' masks, after each draft too (`count` rows).
        grammars = [(requests[i].grammar, int(first[j]), requests[i].spec_token_ids[:count[j] - 1])
                    for j, i in enumerate(order) if count[j] and requests[i].grammar is not None]
        sampling.flags[FLAG_GRAMMAR] = bool(grammars)
        if grammars:
            if buffers.token_masks is None:
                buffers.token_masks = TokenMasks(R, mask_words(self.spec.vocab_size))
            sampling.token_mask = buffers.token_masks.fill(grammars)
        else:
            sampling.token_mask = None if self.num_stages > 1 else self._all_allowed[R]
        return order, first, count, buffers

    def prepare_step(self, scheduled, ahead: np.ndarray | None = None):
        """The step's packed inputs for `scheduled`: `(seqs, first, count, buffers, packed)`:
        scheduled[i] is the step's sequence `seqs[i]`, its sampled tokens are output rows
        `first[i] ..` (`count[i]` of them: `prepare`); `buffers` are the (first) micro-batch's,
        `packed` the `_call` arguments after the layout.

        With pipeline stages the batch is split into `num_stages` micro-batches of about equal
        tokens, all in the bucket that holds the largest; output row m * S + j is micro-batch
        m's j-th sequence (no drafts there)."""
        n = len(scheduled)
        seqs, first, count = np.empty(n, np.int64), np.empty(n, np.int64), np.empty(n, np.int64)
        if self.num_stages == 1:
            # Two sets of buffers, taken in turn: the step in flight may still read the other.
            order, f, c, buffers = self.prepare(scheduled, micro=self._parity, ahead=ahead)
            self._parity ^= 1
            seqs[order], first[order], count[order] = np.arange(n), f, c
            return seqs, first, count, buffers, self._pack(buffers)
        q_lens = np.fromiter((q for _, q in scheduled), np.int32, n)
        groups = parallel.split_micro_batches(q_lens, self.num_stages)
        bucket = self.steps.pick(np.max([self._demand(q_lens[g]) for g in groups], axis=0))
        micro = []
        for m, group in enumerate(groups):
            if not len(group):
                micro.append(self._ready_buffers(bucket))
                continue
            order, f, c, buffers = self.prepare([scheduled[i] for i in group], bucket, m)
            seqs[group[order]] = first[group[order]] = m * bucket.num_seqs + f
            count[group[order]] = c
            self._pack(buffers)
            micro.append(buffers)
            self.busy_stage_ticks += self.num_stages
        self.stage_ticks += self.num_stages * (2 * self.num_stages - 1)
        return seqs, first, count, micro[0], self._stack(micro)

    def _stack(self, micro: list[BucketBuffers]):
        """Micro-batches' packed inputs as the pipelined step takes them: `[M, ...]` each."""
        R = micro[0].bucket.num_logits

        def stacked(name, default, width):
            parts = [getattr(b.sampling, name) for b in micro]
            if all(p is None for p in parts):
                return default[R]
            fill = np.full((R, width), -1, np.int32)
            return np.stack([fill if p is None else p for p in parts])

        return (np.stack([b.ints for b in micro]), np.stack([b.floats for b in micro]),
                stacked("penalty_tokens", self._no_penalty_tokens, self.config.scheduler.max_model_len),
                stacked("token_mask", self._all_allowed, mask_words(self.spec.vocab_size)))

    # ----- the step -----
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Move pages as the scheduler asked (swaps, copy-on-write), then run the step; rows
        of the output follow `scheduler_output.scheduled`."""
        return self.collect(self.dispatch(scheduler_output))

    def dispatch(self, scheduler_output: SchedulerOutput, ahead: np.ndarray | None = None,
                 prev: InFlight | None = None) -> InFlight:
        """`execute`'s first half: move pages, prepare and call the step, without waiting for it.
        `ahead`, `prev`: every scheduled request decodes the token step `prev` (in flight)
        samples for it, in that step's output row `ahead[i]` (see `prepare`)."""
        self.input_batch.remove(scheduler_output.finished_req_ids | scheduler_output.preempted_req_ids)
        # Before anything writes: pages freed by a swap-out may be reused in this very step.
        self.swap_out(scheduler_output.swap_out)
        self.swap_in(scheduler_output.swap_in)
        n = len(scheduler_output.scheduled)
        t0 = time.perf_counter()
        seqs, first, count, buffers, packed = (self.prepare_step(scheduler_output.scheduled, ahead) if n
                                               else (None,) * 5)
        if self.channel is not None:
            self._announce(buffers, packed, scheduler_output.block_copies)
        self.copy_pages(scheduler_output.block_copies)
        if n == 0:
            return InFlight(scheduler_output, None, None, None, None, None, t0)
        outs = self._call(buffers.bucket, *packed, None if prev is None else prev.outs[0])
        self.kv_cache = outs[-1]
        return InFlight(scheduler_output, seqs, first, count, buffers, outs[:-1], t0, time.perf_counter())

    def collect(self, step: InFlight) -> ModelRunnerOutput:
        """`execute`'s second half: wait for the step's tokens; rows follow its `scheduled`."""
        if step.outs is None:
            empty = np.zeros((0, MAX_LOGPROBS))
            return ModelRunnerOutput(np.zeros(0, np.int32), np.zeros(0, np.float32), empty, empty, np.zeros(0, int))
        scheduler_output, seqs, first, count, buffers = (step.scheduler_output, step.seqs, step.first, step.count,
                                                         step.buffers)
        tokens, logprob, top_lp, top_ids, hidden = step.outs
        t1 = time.perf_counter()
        # Waiting for every step's tokens keeps one sharded step in flight: with ~32 queued,
        # XLA:CPU's virtual devices deadlock in their collectives (docs/parallelism.md).
        tokens, logprob, top_lp, top_ids = (_fetch(x) for x in (tokens, logprob, top_lp, top_ids))
        prompt_logprobs = self.prompt_logprobs(self.params, scheduler_output.scheduled, seqs,
                                               buffers.inputs.query_start_loc, hidden)
        t2 = time.perf_counter()
        count = accepted_counts(tokens, first, count, scheduler_output.scheduled)
        out_rows = np.repeat(first - (np.cumsum(count) - count), count) + np.arange(int(count.sum()))
        return ModelRunnerOutput(tokens[out_rows].astype(np.int32), logprob[out_rows], top_lp[out_rows],
                                 top_ids[out_rows], count, prompt_logprobs,
                                 timings={"prepare": step.t1 - step.t0, "device": t2 - t1,
                                          "bucket_tokens": buffers.inputs.token_ids.shape[0] * self.num_stages})

    def _pack(self, buffers: BucketBuffers):
        """The bucket's inputs packed: (ints, floats, penalty tokens, token mask)."""
        sampling = buffers.sampling
        side = sampling.penalty_tokens, sampling.token_mask
        sampling.penalty_tokens = sampling.token_mask = None          # travel apart, not packed
        tree = (buffers.inputs, sampling)
        if buffers.layout is None:
            buffers.layout = PackedLayout.of(tree)
            buffers.ints = np.zeros(buffers.layout.num_ints, np.int32)
            buffers.floats = np.zeros(buffers.layout.num_floats, np.float32)
        buffers.layout.pack(tree, buffers.ints, buffers.floats)
        sampling.penalty_tokens, sampling.token_mask = side
        return buffers.ints, buffers.floats, *side

    def _call(self, bucket: Bucket, ints, floats, penalty_tokens, token_mask, prev=None):
        """Send the packed inputs, run the bucket's step. On one device the host arrays go to the
        step as they are: the compiled call takes them in C++, where `jax.device_put` spent
        0.4-0.5 ms a step in Python (steps of 1 and 4 rows in `jaxllm serve` at 0.965x and 0.988x
        the time, 16 rows 1.006x, alternating step by step). A bucket's two sets of buffers are
        taken in turn, so a set is refilled only once its step's tokens are back (a step ahead
        fills the other): a CPU array sharing their memory never sees a change. `prev`: the
        previous step's `tokens` (device), for async scheduling's `prev_rows`."""
        inputs = (ints, floats, penalty_tokens, token_mask, self._no_prev if prev is None else prev)
        if self.mesh is not None:   # every device of the mesh gets them (replicated)
            inputs = jax.device_put(inputs, self._inputs_sharding)
        return self.steps.get(bucket)(self._step_params(bucket), self.kv_cache, *inputs)

    def _step_params(self, bucket: Bucket):
        """The params tree the bucket's step takes: the codes one for small steps, if any."""
        small = self.small_params is not None and bucket.num_tokens <= quantization.SMALL_STEP_ROWS
        return self.small_params if small else self.params

    def _abstract_args(self, bucket: Bucket):
        """(layout, abstract step arguments) of the bucket: shapes, dtypes and shardings only, so
        compiling in the background never touches the KV cache that steps donate meanwhile."""
        layout, *packed = self._padding(bucket)
        params = self._step_params(bucket)     # (a tree many buckets share: made once, and keyed once)
        if id(params) not in self._abstract_state:
            self._abstract_state[id(params)] = _abstract((params, self._kv_shapes))
        return layout, (*self._abstract_state[id(params)], *_abstract(jax.device_put(packed, self._inputs_sharding)))

    def _ready_buffers(self, bucket: Bucket) -> BucketBuffers:
        """The bucket's all-padding inputs, packed (they write no KV and sample nothing used)."""
        buffers = self._bucket_buffers(bucket, self.PADDING)
        if buffers.layout is None:
            buffers.inputs.attn_metadata = self.attention.dummy_metadata(bucket, self.max_blocks)
            if self.window_group:
                buffers.inputs.window_attn_metadata = self.attention.dummy_metadata(bucket, self.max_blocks)
            self.input_batch.fill_sampling(buffers.sampling, np.zeros(0, np.int64), None)
            self._pack(buffers)
        return buffers

    def _padding(self, bucket: Bucket):
        """A whole step of padding in `bucket`: (layout, ints, floats, penalty tokens)."""
        buffers = self._ready_buffers(bucket)
        if self.num_stages == 1:
            R = bucket.num_logits
            return (buffers.layout, buffers.ints, buffers.floats, self._no_penalty_tokens[R], self._all_allowed[R],
                    self._no_prev)
        return (buffers.layout, *self._stack([buffers] * self.num_stages), self._no_prev)

    def warmup(self, progress: bool = True, background: bool = False) -> float:
        """Compile (or load) every bucket's step (the KV pages are allocated meanwhile). Returns
        once all are ready, or at once with `background` or when every step comes from the
        executable store (see `CompiledSteps`). Returns seconds taken."""
        start = time.perf_counter()
        stored = self.steps.start(progress)
        # The pages (on their thread since __init__): once warm-up returns, nothing compiles.
        jax.block_until_ready(self.kv_cache)
        if not (background or stored):
            self.steps.wait()
        return time.perf_counter() - start

    @property
    def kv_cache(self):
        """The KV cache's pages (waiting for their allocation if it is under way)."""
        if self._kv_pending is not None:
            self._kv_cache, self._kv_pending = self._kv_pending.result(), None
        return self._kv_cache

    @kv_cache.setter
    def kv_cache(self, value) -> None:
        self._kv_cache, self._kv_pending = value, None

    def wait_compiled(self) -> None:
        """Return once every bucket's step is ready (after `warmup(background=True)`)."""
        self.steps.wait()

    def recover(self, force: bool = False) -> bool:
        """After a failed step: reallocate the KV cache if the failure consumed it (the step
        donates it), or with `force`. Returns whether it did, i.e. whether every page's contents
        are lost."""
        if not force and not any(x.is_deleted() for x in jax.tree_util.tree_leaves(self.kv_cache)):
            return False
        self.kv_cache = self._make_kv_cache()
        return True

    # ----- moving pages -----
    def copy_pages(self, copies: list[tuple[list[int], list[int]]]) -> None:
        """Per KV cache group, copy whole pages src[i] -> dst[i] in each of its layers (copy-on-write)."""
        for g, (src, dst) in enumerate(copies):
            if len(src):
                src, dst = page_moves.pad_pow2(src, dst)
                layers = tuple(i for i, group in enumerate(self.layer_groups) if group == g)
                self.kv_cache = page_moves.copy_pages(self.kv_cache, src, dst, layers=layers)

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Save device pages to host slots: pairs of (page, slot)."""
        if pairs:
            pages, slots = page_moves.pad_pow2(*zip(*pairs))
            self.swap_pool[..., slots, :, :] = np.asarray(page_moves.gather_pages(self.kv_cache, pages))

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Restore host slots into device pages: pairs of (slot, page)."""
        if pairs:
            slots, pages = page_moves.pad_pow2(*zip(*pairs))
            saved = jnp.asarray(self.swap_pool[..., slots, :, :])
            self.kv_cache = page_moves.scatter_pages(self.kv_cache, pages, saved)


def _fetch(x) -> np.ndarray:
    """A step output on the host; over several processes the (replicated) local copy."""
    return np.asarray(x.addressable_data(0)) if not x.is_fully_addressable else np.asarray(jax.device_get(x))


__all__ = ["ModelRunner"]


def _abstract(tree):
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
