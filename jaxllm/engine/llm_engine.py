"""LLMEngine: requests in, RequestOutputs out. `step()` is schedule -> run -> update."""

from __future__ import annotations

import dataclasses
import logging
import random
import time

import jax

from jaxllm.config import EngineArgs, EngineConfig, resolve_config
from jaxllm.core.kv_cache_manager import KVCacheManager
from jaxllm.core.request import Request, RequestStatus
from jaxllm.core.scheduler import Scheduler
from jaxllm.engine.detokenizer import IncrementalDetokenizer
from jaxllm.outputs import CompletionOutput, Logprob, RequestOutput
from jaxllm.runner import compile as compile_mod
from jaxllm.runner.model_runner import ModelRunner
from jaxllm.sampling_params import SamplingParams

logger = logging.getLogger("jaxllm")

OUTPUT_KINDS = ("cumulative", "delta", "final")


@dataclasses.dataclass(slots=True, eq=False)
class _Sequence:
    """One choice of a request group: the scheduler's Request plus its text state."""

    request: Request
    detok: IncrementalDetokenizer | None
    sent_tokens: int = 0
    sent_text: int = 0
    final_sent: bool = False


@dataclasses.dataclass(slots=True, eq=False)
class _RequestGroup:
    """A user request: `n` sequences sharing a prompt (children wait until the first has
    computed the prompt, then reuse its pages through the prefix cache)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    output_kind: str
    seqs: list[_Sequence]
    pending: list[Request]          # children not yet handed to the scheduler
    arrival_time: float

    @property
    def finished(self) -> bool:
        return not self.pending and all(s.request.status.finished for s in self.seqs)


class LLMEngine:
    def __init__(self, engine_args: EngineArgs | None = None, *, progress: bool = True, **kwargs):
        from jaxllm.models.loader import load_model

        args = engine_args or EngineArgs(**kwargs)
        args.verify()
        loaded = load_model(args.model, dtype=args.dtype, cache_dir=args.params_cache_dir, progress=progress)
        self.config: EngineConfig = resolve_config(args, loaded.spec, loaded.name)
        compile_mod.enable_persistent_cache(self.config.compilation_cache_dir)
        self.spec = loaded.spec
        self.tokenizer = loaded.tokenizer
        self.model_name = self.config.model_name
        eos = set(loaded.spec.eos_token_ids)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = tuple(sorted(eos))
        self.kv_cache_manager = KVCacheManager(self.config.cache.num_blocks, self.config.cache.block_size,
                                               enable_prefix_caching=self.config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(self.config.scheduler, self.kv_cache_manager)
        self.runner = ModelRunner(self.config, loaded.spec, loaded.params)
        self.warmup_seconds = self.runner.warmup(progress) if self.config.warmup else 0.0
        self._rng = random.Random(self.config.seed)
        self.groups: dict[str, _RequestGroup] = {}
        self.stats = EngineStats()
        # Called with every StepResult (raw sampler outputs), for callers that drive detached
        # requests themselves (beam search reads its beams' top logprobs here).
        self.step_listeners: list = []

    # ----- requests -----
    def tokenize(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt, add_special_tokens=True)

    def add_request(self, request_id: str, prompt: str | list[int] | None = None,
                    params: SamplingParams | None = None, *, prompt_token_ids: list[int] | None = None,
                    output_kind: str = "cumulative", arrival_time: float | None = None) -> None:
        """Queue a request. Raises ValueError (nothing queued) for a bad prompt or params."""
        params = params or SamplingParams()
        params.verify()
        if output_kind not in OUTPUT_KINDS:
            raise ValueError(f"output_kind must be one of {OUTPUT_KINDS}, got {output_kind!r}")
        if request_id in self.groups:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if isinstance(prompt, list):
            prompt, prompt_token_ids = None, prompt
        if prompt_token_ids is None:
            if prompt is None:
                raise ValueError("give a prompt or prompt_token_ids")
            prompt_token_ids = self.tokenize(prompt)
        prompt_token_ids = [int(t) for t in prompt_token_ids]
        self._check_prompt(prompt_token_ids, params)
        params = dataclasses.replace(params)
        max_len = self.config.scheduler.max_model_len
        if params.max_tokens is None:
            params.max_tokens = max_len - len(prompt_token_ids)
        banned = len(params.stop_token_ids) + len(self.eos_token_ids)
        if params.min_tokens and banned > 32:
            raise ValueError(f"at most 32 stop token ids can be held back by min_tokens, got {banned}")
        now = time.monotonic() if arrival_time is None else arrival_time
        seqs, children = [], []
        for i in range(params.n):
            seed = params.seed if params.seed is not None else self._rng.getrandbits(32)
            if params.seed is not None and i:
                seed = hash((params.seed, i)) & 0xFFFFFFFF
            req = Request(
                request_id=request_id if params.n == 1 else f"{i}_{request_id}", prompt_token_ids=prompt_token_ids,
                sampling_params=params, eos_token_ids=self.eos_token_ids, seed=seed,
                parent_id=request_id, index=i, prompt=prompt, arrival_time=now)
            detok = None
            if params.detokenize:
                detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids,
                                               skip_special_tokens=params.skip_special_tokens, stop=params.stop,
                                               include_stop_str_in_output=params.include_stop_str_in_output)
            seqs.append(_Sequence(req, detok))
            children.append(req)
        self.groups[request_id] = _RequestGroup(request_id, prompt, prompt_token_ids, params, output_kind,
                                                seqs, children[1:], now)
        self.scheduler.add_request(children[0])

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True,
                            **template_kwargs) -> list[int]:
        """Token ids of a conversation rendered by the model's chat template."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"model {self.model_name!r} has no chat template")
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                                 **template_kwargs)
        if hasattr(ids, "keys"):  # transformers >= 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    def _check_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        max_len = self.config.scheduler.max_model_len
        if len(prompt_token_ids) >= max_len:
            raise ValueError(
                f"the prompt has {len(prompt_token_ids)} tokens; this model's context (max_model_len) is "
                f"{max_len}, leaving no room to generate")
        vocab = self.spec.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
        if any(not 0 <= t < vocab for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be in [0, {vocab})")
        if params.n > self.config.scheduler.max_num_seqs:
            raise ValueError(f"n={params.n} exceeds max_num_seqs ({self.config.scheduler.max_num_seqs})")
        # A sequence that cannot fit in the whole pool would preempt itself forever.
        max_tokens = params.max_tokens or max_len - len(prompt_token_ids)
        need = self.kv_cache_manager.blocks_needed(min(len(prompt_token_ids) + max_tokens, max_len))
        if need > self.kv_cache_manager.num_blocks:
            raise ValueError(
                f"prompt + max_tokens needs {need} KV pages but the pool only has "
                f"{self.kv_cache_manager.num_blocks}; lower max_tokens or raise kv_cache_memory")

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Stop requests now and free their pages. Unknown ids are ignored."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for request_id in request_ids:
            group = self.groups.pop(request_id, None)
            if group is None:
                continue
            for seq in group.seqs:
                if not seq.request.status.finished:
                    self.scheduler.finish(seq.request, RequestStatus.FINISHED_ABORTED)
            self.stats.record_finished("abort")

    def add_detached_request(self, request: Request) -> None:
        """Schedule a Request that belongs to no output group (a beam): `step()` computes it
        but appends no token; the caller reads the sampler's output through `step_listeners`,
        extends the request itself and finishes it with `scheduler.finish`. A request that
        already holds computed pages (see `KVCacheManager.fork`) joins the running batch
        directly; any other waits for admission like a new one."""
        if request.block_ids:
            request.status = RequestStatus.RUNNING
            self.scheduler.running.append(request)
        else:
            self.scheduler.add_request(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    def get_num_unfinished_requests(self) -> int:
        return len(self.groups)

    # ----- the step -----
    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch; return outputs of the requests that progressed."""
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        t1 = time.perf_counter()
        if not sched.scheduled:
            return []
        self.runner.copy_pages(*self.kv_cache_manager.take_pending_copies())   # copy-on-write first
        result = self.runner.execute(sched.scheduled)
        t2 = time.perf_counter()
        now = time.monotonic()
        touched: dict[str, _RequestGroup] = {}
        num_prompt_tokens = 0
        for i, ((req, num_new), token) in enumerate(zip(result.scheduled, result.tokens)):
            num_prompt_tokens += max(0, min(num_new, req.num_prompt_tokens - req.num_computed_tokens))
            req.num_computed_tokens += num_new
            self.kv_cache_manager.cache_full_blocks(req)
            group = self.groups.get(req.parent_id)
            if group is None or token is None:
                continue
            if not req.output_token_ids:
                req.first_token_time = now
                self._release_children(group)
            req.last_token_time = now
            self._append_token(group, req, token, result, i)
            touched[group.request_id] = group
        for listener in self.step_listeners:
            listener(result)
        t3 = time.perf_counter()
        self.stats.record_step(sched, result, num_prompt_tokens, t1 - t0, t3 - t2)
        outputs = []
        for group in touched.values():
            out = self._make_output(group)
            if out is not None:
                outputs.append(out)
            if group.finished:
                del self.groups[group.request_id]
                self.stats.record_finished(group.seqs[0].request.finish_reason)
        return outputs

    def _release_children(self, group: _RequestGroup) -> None:
        for child in group.pending:
            self.scheduler.add_request(child)
        group.pending = []

    def _append_token(self, group: _RequestGroup, req: Request, token: int, result, i: int) -> None:
        params = req.sampling_params
        req.output_token_ids.append(token)
        lp = float(result.logprobs[i])
        req.cumulative_logprob += lp
        if params.logprobs is not None:
            k = params.logprobs
            req.output_logprobs.append(lp)
            req.top_logprobs.append((result.top_ids[i, :k].tolist(), result.top_logprobs[i, :k].tolist()))
        seq = next(s for s in group.seqs if s.request is req)
        stop_str = seq.detok.add_token(token) if seq.detok is not None else None
        num_out = len(req.output_token_ids)
        status = None
        if stop_str is not None and num_out >= params.min_tokens:
            status, req.stop_reason = RequestStatus.FINISHED_STOPPED, stop_str
        elif num_out >= params.min_tokens and (
                (not params.ignore_eos and token in req.eos_token_ids) or token in params.stop_token_ids):
            status = RequestStatus.FINISHED_STOPPED
            req.stop_reason = token if token in params.stop_token_ids else None
        elif num_out >= params.max_tokens or req.num_tokens >= self.config.scheduler.max_model_len:
            status = RequestStatus.FINISHED_LENGTH
        if status is not None:
            self.scheduler.finish(req, status)

    def _make_output(self, group: _RequestGroup) -> RequestOutput | None:
        finished = group.finished
        if group.output_kind == "final" and not finished:
            return None
        completions = []
        for seq in group.seqs:
            req = seq.request
            done = req.status.finished
            text = ""
            if seq.detok is not None:
                end = seq.detok.streamable_len(done)
                text = seq.detok.text[seq.sent_text:end] if group.output_kind == "delta" else seq.detok.text[:end]
            token_ids = req.output_token_ids
            logprobs = self._logprobs(req) if req.sampling_params.logprobs is not None else None
            if group.output_kind == "delta":
                if seq.final_sent or (len(token_ids) == seq.sent_tokens and not text and not done):
                    continue
                if logprobs is not None:
                    logprobs = logprobs[seq.sent_tokens:]
                token_ids = token_ids[seq.sent_tokens:]
                seq.sent_tokens = len(req.output_token_ids)
                if seq.detok is not None:
                    seq.sent_text = seq.detok.streamable_len(done)
                seq.final_sent = done
            completions.append(CompletionOutput(
                index=req.index, text=text, token_ids=list(token_ids),
                cumulative_logprob=req.cumulative_logprob, logprobs=logprobs,
                finish_reason=req.finish_reason, stop_reason=req.stop_reason))
        if not completions:
            return None
        first = group.seqs[0].request
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, completions, finished,
                             num_cached_tokens=first.num_cached_tokens,
                             metrics={"arrival_time": group.arrival_time, "first_token_time": first.first_token_time,
                                      "scheduled_time": first.scheduled_time,
                                      "last_token_time": max((s.request.last_token_time or 0) for s in group.seqs)})

    def _logprobs(self, req: Request) -> list[dict[int, Logprob]]:
        out = []
        for token, lp, (ids, lps) in zip(req.output_token_ids, req.output_logprobs, req.top_logprobs):
            entry = {tid: Logprob(tlp, rank + 1, self._token_text(tid)) for rank, (tid, tlp) in enumerate(zip(ids, lps))}
            if token not in entry:
                entry[token] = Logprob(lp, None, self._token_text(token))
            out.append(entry)
        return out

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    # ----- introspection -----
    @property
    def kv_cache_usage(self) -> float:
        return self.kv_cache_manager.usage


@dataclasses.dataclass
class EngineStats:
    """Counters the server's /metrics and the benchmarks read."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    num_steps: int = 0
    num_preemptions: int = 0
    finished: dict = dataclasses.field(default_factory=dict)
    time_schedule: float = 0.0
    time_prepare: float = 0.0
    time_device: float = 0.0
    time_update: float = 0.0

    def record_step(self, sched, result, num_prompt_tokens: int, t_schedule: float, t_update: float) -> None:
        self.num_steps += 1
        self.num_preemptions += sched.num_preempted
        self.generation_tokens += sum(1 for t in result.tokens if t is not None)
        self.prompt_tokens += num_prompt_tokens
        self.time_schedule += t_schedule
        self.time_prepare += result.timings["prepare"]
        self.time_device += result.timings["device"]
        self.time_update += t_update

    def record_finished(self, reason: str) -> None:
        """Count a finished request (all its `n` choices), by the first choice's reason."""
        self.finished[reason] = self.finished.get(reason, 0) + 1
