"""EngineCore: the scheduler, the KV cache manager and the model runner behind one step.

    step():  Scheduler.schedule() -> ModelRunner.dispatch()
             [-> Scheduler.schedule_ahead() -> ModelRunner.dispatch(): async scheduling]
             -> ModelRunner.collect() -> Scheduler.update_from_output()

With async scheduling the next call's step is then already in flight (ARCHITECTURE.md,
section 2). Requests go in as `Request`s (token ids, sampling params); each step returns
`EngineCoreOutputs` (new token ids, logprobs, finish reasons). A step that raises ends only its
own requests (finish reason "error", traceback logged once; a step ahead failing ends its
requests once the step before it is out); if it took the donated KV cache with it (or a step
ahead ran on what it left), the cache is reallocated and the other running requests are
recomputed. Over several processes a failed step stops the engine instead
(`ProcessGroupError`). Text, choices and output kinds are the `OutputProcessor`'s business
(engine/output_processor.py), on the LLMEngine side.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable

import numpy as np

from jaxllm.engine_config import EngineConfig
from jaxllm.core.kv_cache_manager import KVCacheManager
from jaxllm.core.outputs import EngineCoreOutputs, ModelRunnerOutput, SchedulerOutput
from jaxllm.core.request import Request, RequestStatus
from jaxllm.core.scheduler import Scheduler
from jaxllm.runner.model_runner import ModelRunner
from jaxllm.spec_decode import DraftModelProposer, NgramProposer
from jaxllm.weights.prepare import PreparedModel

logger = logging.getLogger("jaxllm")


class EngineCore:
    """One replica: a scheduler and KV pool over one model runner (on one device, or on the
    tensor-parallel `mesh`). `stats` may be shared with other replicas."""

    def __init__(
        self,
        config: EngineConfig,
        model: PreparedModel,
        mesh=None,
        stats: EngineStats | None = None,
        draft: PreparedModel | None = None,
    ):
        """`model`: its model config and prepared weights (weights/prepare.py); `draft`: the draft model's,
        for draft-model speculative decoding."""
        cache = config.cache
        self.kv_cache_manager = KVCacheManager(
            cache.group_num_pages,
            cache.page_size,
            enable_prefix_caching=cache.enable_prefix_caching,
            num_swap_pages=cache.num_swap_pages,
            windows=cache.group_windows,
        )
        spec_decode, proposer = config.speculative, None
        if spec_decode is not None and spec_decode.method == "ngram":
            proposer = NgramProposer(
                spec_decode.num_speculative_tokens, spec_decode.prompt_lookup_min, spec_decode.prompt_lookup_max
            )
        elif spec_decode is not None:
            runner = ModelRunner(
                dataclasses.replace(config, speculative=None),
                draft.cfg,
                draft.params,
                small_params=draft.small_params,
                catch_up_seqs=spec_decode.max_seqs(config.scheduler),
            )
            proposer = DraftModelProposer(
                config, runner, spec_decode.num_speculative_tokens, spec_decode.draft_confidence_threshold
            )
        self.scheduler = Scheduler(
            config.scheduler,
            self.kv_cache_manager,
            proposer,
            spec_decode.max_seqs(config.scheduler) if spec_decode is not None else 0,
            pooler=config.pooling,
        )
        self.runner = ModelRunner(
            config, model.cfg, model.params, mesh=mesh, small_params=model.small_params, check_path=model.check_path
        )
        self.stats = stats or EngineStats()
        # Async scheduling (`schedule_ahead`) on one device of one process, without sliding windows,
        # for generation.
        self.async_scheduling = (
            config.scheduler.async_scheduling
            and config.pooling is None
            and mesh is None
            and self.runner.channel is None
            and not any(config.cache.group_windows)
        )
        self._ahead = None  # (SchedulerOutput, InFlight): the step dispatched ahead, not yet collected
        self.weight_version = 0  # what each step's outputs are tagged with (LLMEngine.update_weights)

    @property
    def load(self) -> int:
        return self.scheduler.num_running + self.scheduler.num_waiting

    def add_request(self, request: Request, replica: int | None = None) -> int:
        """Queue `request`; returns the replica it went to (always 0 here; see DataParallelEngineCore)."""
        self.scheduler.add_request(request)
        return 0

    def abort_requests(self, request_ids: str | Iterable[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> None:
        self.scheduler.finish_requests(request_ids, status)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def settle(self) -> EngineCoreOutputs | None:
        """Collect the step dispatched ahead, if any, without dispatching another: afterwards no
        step is in flight (before the weights or the KV pool change). None when none was."""
        return None if self._ahead is None else self.step(dispatch_ahead=False)

    def step(self, dispatch_ahead: bool = True) -> EngineCoreOutputs:
        """One step's outputs, tagged with the weight version that computed them. With async
        scheduling the step may already be in flight (dispatched by the last call), and the next
        one is dispatched before this one's tokens are read (not with `dispatch_ahead` False)."""
        outputs = self._step(dispatch_ahead)
        outputs.weight_version = self.weight_version
        return outputs

    def _step(self, dispatch_ahead: bool) -> EngineCoreOutputs:
        t0 = time.perf_counter()
        if self._ahead is not None and not any(r.status is RequestStatus.RUNNING for r, _ in self._ahead[0].scheduled):
            self.runner.collect(self._ahead[1])  # every request of it has ended (EOS, abort): drop it
            self._ahead = None
        scheduler_output, in_flight = self._ahead or (self.scheduler.schedule(), None)
        self._ahead = ahead_failed = None
        t1 = time.perf_counter()
        try:
            in_flight = in_flight or self.runner.dispatch(scheduler_output)
            ahead = (
                self.scheduler.schedule_ahead(scheduler_output) if self.async_scheduling and dispatch_ahead else None
            )
            if ahead is not None:
                row_of = {r.request_id: in_flight.first[i] for i, (r, _) in enumerate(scheduler_output.scheduled)}
                rows = np.array([row_of[r.request_id] for r, _ in ahead.scheduled], np.int64)
                try:
                    self._ahead = ahead, self.runner.dispatch(ahead, rows, in_flight)
                except Exception:  # the requests fail once this step's outputs are out (below)
                    logger.exception("engine step failed; its %d request(s) end with an error", len(ahead.scheduled))
                    ahead_failed = ahead
            runner_output = self.runner.collect(in_flight)
        except Exception as e:
            if self.runner.channel is not None:
                # Over several processes the others may or may not have run this step (or may be
                # gone: a collective failed): nothing can be trusted, so the engine stops.
                self.runner.channel = None  # nobody to release: shutdown() sends nothing
                raise ProcessGroupError(
                    "an engine step failed over several processes (if a process died, its "
                    f"collectives fail); the engine cannot go on: {type(e).__name__}: {e}"
                ) from e
            # Only this step's requests fail; the engine goes on serving the others.
            logger.exception(
                "engine step failed; its %d request(s) end with an error: %s",
                len(scheduler_output.scheduled),
                [r.request_id for r, _ in scheduler_output.scheduled],
            )
            # A step dispatched ahead ran on what this one left: its requests are among these,
            # and the pages it returned cannot be trusted.
            self._ahead, lost = None, self._ahead is not None
            return self.scheduler.fail_step(scheduler_output, cache_lost=self.runner.recover(force=lost))
        t2 = time.perf_counter()
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        if ahead_failed is not None:
            failed = self.scheduler.fail_step(ahead_failed, cache_lost=self.runner.recover())
            outputs.outputs += failed.outputs
        if not scheduler_output.is_empty:
            self.stats.record_step(scheduler_output, runner_output, outputs, t1 - t0, time.perf_counter() - t2)
        return outputs


class ProcessGroupError(RuntimeError):
    """A step over several processes failed (e.g. one of them died): the engine is unusable."""


class DataParallelEngineCore:
    """`data_parallel_size` replicas (`EngineCore`s, each with its own scheduler and KV pool on
    its row of the mesh) behind the EngineCore interface. A request goes to the least loaded
    replica (running + waiting), or to `replica` (a request's other choices join the first, to
    share its prompt's pages); a step steps every replica that has work."""

    def __init__(self, cores: list[EngineCore]):
        self.cores = cores
        self.stats = cores[0].stats

    def add_request(self, request: Request, replica: int | None = None) -> int:
        if replica is None:
            replica = min(range(len(self.cores)), key=lambda i: self.cores[i].load)
        self.cores[replica].add_request(request)
        return replica

    def abort_requests(self, request_ids: str | Iterable[str]) -> None:
        self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> None:
        request_ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for core in self.cores:  # ids a replica does not hold are ignored
            core.finish_requests(request_ids, status)

    def has_unfinished_requests(self) -> bool:
        return any(core.has_unfinished_requests() for core in self.cores)

    def step(self) -> EngineCoreOutputs:
        merged = EngineCoreOutputs(outputs=[])
        for core in self.cores:
            if core.has_unfinished_requests():
                out = core.step()
                merged.outputs += out.outputs
                merged.num_prompt_tokens += out.num_prompt_tokens
                merged.num_generated_tokens += out.num_generated_tokens
                merged.num_draft_tokens += out.num_draft_tokens
                merged.num_accepted_tokens += out.num_accepted_tokens
                merged.timestamp = max(merged.timestamp, out.timestamp)
                merged.weight_version = out.weight_version
        return merged


@dataclasses.dataclass
class EngineStats:
    """Counters the server's /metrics and the benchmarks read."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    num_steps: int = 0
    num_preemptions: int = 0
    num_draft_tokens: int = 0  # speculative decoding: drafts verified
    num_accepted_tokens: int = 0  # and accepted
    finished: dict = dataclasses.field(default_factory=dict)
    time_schedule: float = 0.0
    time_prepare: float = 0.0
    time_device: float = 0.0
    time_update: float = 0.0

    def record_step(
        self,
        scheduler_output: SchedulerOutput,
        runner_output: ModelRunnerOutput,
        outputs: EngineCoreOutputs,
        t_schedule: float,
        t_update: float,
    ) -> None:
        self.num_steps += 1
        self.num_preemptions += scheduler_output.num_preempted
        self.generation_tokens += outputs.num_generated_tokens
        self.prompt_tokens += outputs.num_prompt_tokens
        self.num_draft_tokens += outputs.num_draft_tokens
        self.num_accepted_tokens += outputs.num_accepted_tokens
        self.time_schedule += t_schedule
        self.time_prepare += runner_output.timings["prepare"]
        self.time_device += runner_output.timings["device"]
        self.time_update += t_update

    def record_finished(self, reason: str) -> None:
        """Count a finished request (all its `n` choices), by the first choice's reason."""
        self.finished[reason] = self.finished.get(reason, 0) + 1
