"""ModelRunner: a SchedulerOutput -> typed step inputs -> one jitted call -> ModelRunnerOutput.

The runner only executes a scheduled step; its parts are one concept each:

    KVCache        the pages, swap pool, page moves and recovery       runner/kv_cache.py
    StepBuilder    InputBatch rows -> a bucket's packed inputs          runner/step_builder.py
    CompiledSteps  each bucket's compiled step (executable store)       runner/compile.py, executables.py
    ProcessGroup   the steps over several processes                     runner/followers.py

The jitted call is runner/device_step.py's pure `step`, with the KV cache donated, so the pages
are updated in place. Its shapes come from a small set of buckets (runner/compile.py), all
compiled at start-up (on one thread per core, by default in the background), each kept on
disk by the executable store (runner/executables.py), which the next start loads without
tracing. The inputs (`StepInputs`, `SamplingMetadata`) are packed into one int32 and one
float32 buffer (`PackedLayout`, static per bucket) and unpacked inside the step; the penalty
tokens (`[R, max_model_len]`) and the structured-output token mask (`[R, vocab / 32]`) travel
apart, each usually a cached device array of -1s.

Layers run as an unrolled loop, not `lax.scan` (measured: ARCHITECTURE.md, section 4).
"""

from __future__ import annotations

import functools
import os
import time
import weakref

import jax
import numpy as np

from jaxllm import parallel, quantization
from jaxllm.attention import AttentionBackend, get_attention_backend
from jaxllm.engine_config import EngineConfig
from jaxllm.lora.slots import LoRASlots
from jaxllm.core.outputs import ModelRunnerOutput, SchedulerOutput
from jaxllm.models import decoder, layout
from jaxllm.platforms import Platform
from jaxllm.runner import device_step
from jaxllm.runner.compile import Bucket, make_buckets, make_pooling_buckets
from jaxllm.runner.executables import CompiledSteps, ExecutableStore
from jaxllm.runner.followers import InFlight, ProcessGroup
from jaxllm.runner.input_batch import InputBatch
from jaxllm.runner.kv_cache import KVCache
from jaxllm.runner.prompt_logprobs import PromptLogprobs
from jaxllm.runner.step_builder import StepBuilder
from jaxllm.sampling_params import MAX_LOGPROBS
from jaxllm.spec_decode.verify import accepted_counts
from jaxllm.weights.prepare import with_gemm_path


class ModelRunner:
    """`params`: the weight plan's weights (weights/prepare.py `prepare_weights`), on the
    device, or with `mesh` (one replica's ("data", "stage", "model") Mesh, data size 1, for
    tensor and pipeline parallelism: jaxllm/parallel.py) laid out and placed on it;
    `small_params`: the small-step codes tree, if any; `check_path`: the GEMM path of speculative
    decoding's verification steps where the plan pins one (`WeightPlan.check_path`). With pp
    stages, each step's batch is split into pp micro-batches of one bucket
    (`StepBuilder.prepare_step`) that the step pipelines through the stages."""

    def __init__(
        self,
        config: EngineConfig,
        cfg: decoder.ModelConfig,
        params,
        attention: AttentionBackend | None = None,
        mesh=None,
        small_params=None,
        catch_up_seqs: int = 0,
        check_path: str | None = None,
    ):
        """`catch_up_seqs`: a draft model's runner, for up to that many sequences (its catch-up
        buckets: `make_buckets`)."""
        self.config, self.cfg, self.mesh = config, cfg, mesh
        self.attention = attention or get_attention_backend(
            config.attention_backend, batch_invariant=config.batch_invariant
        )
        if cfg.bidirectional and not self.attention.bidirectional:
            raise ValueError(
                f"the {self.attention.name} attention backend has no bidirectional attention, which an encoder "
                "needs: use attention_backend='native' (CPU) or 'reference'"
            )
        # Norms and sampling in C++ where the platform's build of the kernels serves this run.
        self.cpp_ops = Platform.detect(use_cpp=self.attention.name == "native").confirmed().cpp_ops
        self.num_stages = parallel.pp_size(mesh)
        device = jax.devices()[0]
        # LoRA: the adaptable matrices wrapped with `max_loras` adapter slots (jaxllm/lora).
        self.lora = None
        if config.lora is not None:
            lora = config.lora
            self.lora = LoRASlots(
                cfg,
                max_loras=lora.max_loras,
                max_rank=lora.max_lora_rank,
                dtype=lora.dtype,
                device=device,
                cpp_gemm=self.cpp_ops and mesh is None,
                tp=parallel.tp_size(mesh),
                pp=self.num_stages,
                sharding_of=None
                if mesh is None
                else lambda name, field: jax.sharding.NamedSharding(
                    mesh, parallel.lora_spec(name, field, stages=self.num_stages > 1)
                ),
            )
            params, small_params = self.lora.adopt(params, small_params)
        self.params, self.small_params = params, small_params
        self.check_path = check_path
        self._on_check_path = {}  # small? -> (a params tree, it on check_path): made again when params change
        self.kv = self._kv_cache(device)
        sched, drafts = config.scheduler, config.speculative
        # A pooling engine (config.pooling) computes prompts only: its own buckets and step.
        self.pooling = config.pooling
        self.buckets = (
            make_pooling_buckets(sched.max_num_seqs, sched.max_num_batched_tokens, self.attention.prefill_row_tokens)
            if self.pooling is not None
            else make_buckets(
                sched.max_num_seqs,
                sched.max_num_batched_tokens,
                self.attention.prefill_row_tokens,
                sched.max_num_prefill_seqs,
                drafts.num_speculative_tokens if drafts else 0,
                drafts.max_seqs(sched) if drafts else 0,
                catch_up_seqs,
            )
        )
        self.input_batch = InputBatch(
            sched.max_num_seqs,
            sched.max_model_len,
            config.max_pages_per_seq,
            config.cache.page_size,
            cfg.vocab_size,
            len(config.cache.group_windows),
            config.logits_processors,
        )
        # Where the step's inputs go: the device, or every device of the mesh (replicated).
        self._inputs_sharding = (
            jax.sharding.SingleDeviceSharding(device)
            if mesh is None
            else jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        )
        self.builder = StepBuilder(
            config,
            cfg,
            self.attention,
            self.input_batch,
            self.buckets,
            num_stages=self.num_stages,
            inputs_sharding=self._inputs_sharding,
            lora_slot_of=None if self.lora is None else lambda request: self.lora.slot_of(request.lora_int_id),
        )
        self.steps = self._compiled_steps()
        self.builder.pick = self.steps.pick
        self.prompt_logprobs = PromptLogprobs(cfg)
        # Over several processes, process 0 announces each step to the others (`follow`); None
        # also once a failed step leaves nobody to announce to (engine/core.py).
        self.channel = parallel.StepChannel() if jax.process_count() > 1 else None
        # The params trees (big steps', small steps') and the KV cache as shapes, dtypes and
        # shardings, taken once: weight updates keep them (weights/update.py), and a sleeping
        # engine compiling in the background has no params to look at.
        self._abstract_state = {
            (small, checks): _abstract((self._tree(small, checks), self.kv.shapes))
            for small in (False, True)
            for checks in (False, True)
            if self._tree(small, checks) is not None
        }

    def _kv_cache(self, device) -> KVCache:
        """The KV pool on `device` or sharded by KV head over the mesh. Each layer (slot of a
        stage) is in KV cache group 1 if it is a windowed layer of a model with a window group
        (core/kv_cache_manager.py), else in group 0."""
        config, cfg, mesh = self.config, self.cfg, self.mesh
        window_group = bool(config.cache.num_window_pages)
        return KVCache(
            config.cache,
            cfg,
            num_stages=self.num_stages,
            layer_groups=tuple(
                int(window_group and cfg.window(i) is not None) for i in range(cfg.num_layers // self.num_stages)
            ),
            num_kv_heads=layout.kv_heads_for(cfg, parallel.tp_size(mesh)),
            where=jax.sharding.SingleDeviceSharding(device) if mesh is None else parallel.kv_sharding(mesh),
            huge=mesh is None and device.platform == "cpu" and self.attention.name == "native",
        )

    def _compiled_steps(self) -> CompiledSteps:
        """Each bucket's compiled step, kept in the executable store when there is one (one
        process: over several, each would race on the files). The steps hold the runner
        weakly, and a runner dropped while its steps compile in the background cancels the
        ones not yet started (an engine replaced in a notebook stops)."""
        kind = (
            functools.partial(device_step.pool_step, pooling_mode=self.pooling.mode)
            if self.pooling is not None
            else functools.partial(
                device_step.step,
                mesh=self.mesh,
                logprobs_mode=self.config.logprobs_mode,
                logits_processors=self.config.logits_processors,
            )
        )
        step = jax.jit(
            functools.partial(kind, cfg=self.cfg, attention=self.attention, cpp_ops=self.cpp_ops),
            static_argnames=("layout",),
            donate_argnums=(1,),
        )
        cache_dir = self.config.compilation_cache_dir
        devices = [jax.devices()[0]] if self.mesh is None else list(self.mesh.devices.flat)
        store = (
            ExecutableStore(
                os.path.join(cache_dir, "executables"),
                repr((self.cfg, self.attention, self.mesh, self.cpp_ops, self.config.logprobs_mode, self.pooling)),
                devices,
            )
            # (custom logits processors' code is not jaxllm's sources, which key the store)
            if cache_dir and jax.process_count() == 1 and not self.config.logits_processors
            else None
        )
        runner = weakref.ref(self)
        steps = CompiledSteps(
            step,
            self.buckets,
            store,
            lambda bucket: runner()._abstract_args(bucket),
            own_kind=self.check_path is not None,  # (a prompt must not take the checks' path)
        )
        weakref.finalize(self, steps.stop)
        return steps

    # ----- the step -----
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Move pages as the scheduler asked (swaps, copy-on-write), then run the step; rows
        of the output follow `scheduler_output.scheduled`."""
        return self.collect(self.dispatch(scheduler_output))

    def dispatch(
        self, scheduler_output: SchedulerOutput, ahead: np.ndarray | None = None, prev: InFlight | None = None
    ) -> InFlight:
        """`execute`'s first half: move pages, prepare and call the step, without waiting for it.
        `ahead`, `prev`: every scheduled request decodes the token step `prev` (in flight)
        samples for it, in that step's output row `ahead[i]` (see `StepBuilder.prepare`)."""
        self.input_batch.remove(scheduler_output.finished_req_ids | scheduler_output.preempted_req_ids)
        # Before anything writes: pages freed by a swap-out may be reused in this very step.
        self.kv.swap_out(scheduler_output.swap_out)
        self.kv.swap_in(scheduler_output.swap_in)
        n = len(scheduler_output.scheduled)
        t0 = time.perf_counter()
        if self.lora is not None:
            self.lora.activate([request.lora for request, _ in scheduler_output.scheduled])
        seqs, first, count, buffers, packed = (
            self.builder.prepare_step(scheduler_output.scheduled, ahead) if n else (None,) * 5
        )
        if self.channel is not None:
            bucket = self.buckets.index(buffers.bucket) if buffers is not None else -1
            ProcessGroup(self.channel).announce(bucket, packed, scheduler_output.page_copies)
        self.kv.copy_pages(scheduler_output.page_copies)
        if n == 0:
            return InFlight(scheduler_output, None, None, None, None, None, t0)
        outs = self.call(buffers.bucket, *packed, None if prev is None else prev.outs[0])
        self.kv.pages = outs[-1]
        return InFlight(scheduler_output, seqs, first, count, buffers, outs[:-1], t0, time.perf_counter())

    def collect(self, step: InFlight) -> ModelRunnerOutput:
        """`execute`'s second half: wait for the step's tokens; rows follow its `scheduled`."""
        if step.outs is None:
            empty = np.zeros((0, MAX_LOGPROBS))
            return ModelRunnerOutput(np.zeros(0, np.int32), np.zeros(0, np.float32), empty, empty, np.zeros(0, int))
        scheduler_output, seqs, first, count, buffers = (
            step.scheduler_output,
            step.seqs,
            step.first,
            step.count,
            step.buffers,
        )
        t1 = time.perf_counter()
        if self.pooling is not None:
            return self._collect_pooled(step, t1)
        tokens, logprob, top_lp, top_ids, hidden = step.outs
        # Waiting for every step's tokens keeps one sharded step in flight: with ~32 queued,
        # XLA:CPU's virtual devices deadlock in their collectives (docs/parallelism.md).
        tokens, logprob, top_lp, top_ids = (_fetch(x) for x in (tokens, logprob, top_lp, top_ids))
        prompt_logprobs = self.prompt_logprobs(
            self.params, scheduler_output.scheduled, seqs, buffers.inputs.query_start_loc, hidden
        )
        t2 = time.perf_counter()
        count = accepted_counts(tokens, first, count, scheduler_output.scheduled)
        out_rows = np.repeat(first - (np.cumsum(count) - count), count) + np.arange(int(count.sum()))
        return ModelRunnerOutput(
            tokens[out_rows].astype(np.int32),
            logprob[out_rows],
            top_lp[out_rows],
            top_ids[out_rows],
            count,
            prompt_logprobs,
            timings={
                "prepare": step.t1 - step.t0,
                "device": t2 - t1,
                "bucket_tokens": buffers.inputs.token_ids.shape[0] * self.num_stages,
            },
        )

    def _collect_pooled(self, step: InFlight, t1: float) -> ModelRunnerOutput:
        """`collect` for a pooling step: each scheduled request's `chunk_parts` row, nothing sampled."""
        n = len(step.scheduler_output.scheduled)
        pooled = _fetch(step.outs[0])[step.seqs]
        empty = np.zeros((0, MAX_LOGPROBS))
        timings = {
            "prepare": step.t1 - step.t0,
            "device": time.perf_counter() - t1,
            "bucket_tokens": step.buffers.inputs.token_ids.shape[0],
        }
        return ModelRunnerOutput(
            np.zeros(0, np.int32),
            np.zeros(0, np.float32),
            empty,
            empty,
            np.zeros(n, int),
            pooled=pooled,
            timings=timings,
        )

    def call(self, bucket: Bucket, ints, floats, penalty_tokens, token_mask, prev=None):
        """Send the packed inputs, run the bucket's step. On one device the host arrays go to the
        step as they are: the compiled call takes them in C++, where `jax.device_put` spent
        0.4-0.5 ms a step in Python (steps of 1 and 4 rows in `jaxllm serve` at 0.965x and 0.988x
        the time, 16 rows 1.006x, alternating step by step). A bucket's two sets of buffers are
        taken in turn, so a set is refilled only once its step's tokens are back (a step ahead
        fills the other): a CPU array sharing their memory never sees a change. `prev`: the
        previous step's `tokens` (device), for async scheduling's `prev_rows`."""
        inputs = (ints, floats, penalty_tokens, token_mask, self.builder.no_prev if prev is None else prev)
        if self.mesh is not None:  # every device of the mesh gets them (replicated)
            inputs = jax.device_put(inputs, self._inputs_sharding)
        return self.steps.get(bucket)(self.step_params(bucket), self.kv.pages, *inputs)

    def step_params(self, bucket: Bucket):
        """The params tree the bucket's step takes: the codes one for small steps, if any; for
        verification steps on `check_path`, if any."""
        return self._tree(*self._tree_kind(bucket))

    def _tree_kind(self, bucket: Bucket) -> tuple[bool, bool]:
        """(small, checks): whether the bucket takes the small-step tree, and the check path."""
        small = (True, False) in self._abstract_state and bucket.num_tokens <= quantization.SMALL_STEP_ROWS
        return small, bucket.all_logits and self.check_path is not None

    def _tree(self, small: bool, checks: bool):
        """The small-step tree or the params, on `check_path` with `checks` (the same arrays; None
        where there is no such tree), kept while the tree stays the runner's."""
        tree = self.small_params if small else self.params
        if not checks:
            return tree
        if tree is None or self.check_path is None:
            return None
        kept = self._on_check_path.get(small)
        if kept is None or kept[0] is not tree:
            kept = self._on_check_path[small] = (tree, with_gemm_path(tree, self.check_path))
        return kept[1]

    def _abstract_args(self, bucket: Bucket):
        """(layout, abstract step arguments) of the bucket: shapes, dtypes and shardings only, so
        compiling in the background never touches the KV cache that steps donate meanwhile."""
        layout, *packed = self.builder.padding(bucket)
        return layout, (
            *self._abstract_state[self._tree_kind(bucket)],
            *_abstract(jax.device_put(packed, self._inputs_sharding)),
        )

    # ----- start-up and recovery -----
    def warmup(self, progress: bool = True, background: bool = False) -> float:
        """Compile (or load) every bucket's step (the KV pages are allocated meanwhile). Returns
        once all are ready, or at once with `background` or when every step comes from the
        executable store (which then loads each step when first needed: see `CompiledSteps`).
        Returns seconds taken."""
        start = time.perf_counter()
        stored = self.steps.start(progress, hold=not background)
        # The pages (on their thread since __init__): once warm-up returns, nothing compiles.
        jax.block_until_ready(self.kv.pages)
        if not (background or stored):
            self.steps.wait()
        return time.perf_counter() - start

    def wait_compiled(self) -> None:
        """Return once every bucket's step is ready (after `warmup(background=True)`)."""
        self.steps.wait()

    @property
    def kv_cache(self):
        """The KV cache's pages (waiting for their allocation if it is under way)."""
        return self.kv.pages

    @kv_cache.setter
    def kv_cache(self, value) -> None:
        self.kv.pages = value

    def recover(self, force: bool = False) -> bool:
        """After a failed step: `KVCache.recover` (whether every page's contents are lost)."""
        return self.kv.recover(force)

    # ----- several processes -----
    def follow(self) -> None:
        """On a process other than 0: run the steps process 0 announces until it stops."""
        ProcessGroup(self.channel).follow(self)

    def stop_followers(self) -> None:
        """On process 0: let the other processes' `follow` return."""
        if self.channel is not None and self.channel.is_leader:
            ProcessGroup(self.channel).stop()
            self.channel = None


def _fetch(x) -> np.ndarray:
    """A step output on the host; over several processes the (replicated) local copy."""
    return np.asarray(x.addressable_data(0)) if not x.is_fully_addressable else np.asarray(x)


def _abstract(tree):
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


__all__ = ["ModelRunner"]
