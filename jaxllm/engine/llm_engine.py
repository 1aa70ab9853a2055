"""LLMEngine: requests in, RequestOutputs out.

add_request()  validate, tokenize, make one `Request` per choice    (this file)
step()         EngineCore.step(): schedule -> run -> update         (engine/core.py)
               OutputProcessor.process_outputs(): text, logprobs    (engine/output_processor.py)
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time

import jax

from jaxllm import parallel
from jaxllm.chat_template import MAX_OUTPUT_CHARS, render_chat_template
from jaxllm.config import EngineArgs
from jaxllm.engine_config import EngineConfig, available_memory, resolve_config, resolve_dtypes
from jaxllm.core.request import Request, RequestStatus
from jaxllm.engine.core import DataParallelEngineCore, EngineCore, EngineStats
from jaxllm.engine.output_processor import OUTPUT_KINDS, OutputProcessor
from jaxllm.weights.prepare import PreparedModel, int8_dot_checkpoint, load_with_plan, prepare_weights
from jaxllm.spec_decode.draft_model import load_draft
from jaxllm.outputs import RequestOutput
from jaxllm.platforms import Platform
from jaxllm.quantization.activations import int8_activation_weights
from jaxllm.runner import compile as compile_mod
from jaxllm.sampling_params import SamplingParams
from jaxllm.structured_output import Matcher, StructuredOutputManager, token_filters
from jaxllm.engine.pooling import PoolingMixin, resolve_runner
from jaxllm.engine.lora import LoRAMixin
from jaxllm.engine.trainer import TrainerMixin
from jaxllm.pooling_params import PoolingParams
from jaxllm.weights.update import UpdatePlan

logger = logging.getLogger("jaxllm")


class LLMEngine(TrainerMixin, PoolingMixin, LoRAMixin):
    def __init__(self, engine_args: EngineArgs | None = None, *, progress: bool = True, **kwargs):
        """Resolve the options and the weight plan, load the model, prepare its weights, build
        the replicas (scheduler, KV pool, runner each), warm up, then the tokenizer's parts."""
        args = engine_args or EngineArgs(**kwargs)
        args.verify()
        parallel.initialize_distributed(args.distributed_coordinator, args.num_processes, args.process_id)
        many_processes = jax.process_count() > 1
        if many_processes and args.data_parallel_size > 1:
            raise ValueError("data_parallel_size > 1 is not supported over several processes yet")
        mesh = parallel.engine_mesh(
            args.mesh, args.tensor_parallel_size, args.data_parallel_size, args.pipeline_parallel_size
        )
        platform = Platform.detect(
            None if mesh is None else mesh.devices.flat[0], use_cpp=args.attention_backend in (None, "native")
        )
        one_device = mesh is None and not many_processes and args.data_parallel_size == 1
        args = resolve_dtypes(args, platform, many_processes, int8_dot_checkpoint(args, platform, one_device))
        loaded, plan = load_with_plan(
            args, platform, mesh, one_device=one_device, progress=progress, use_cache=not many_processes
        )
        args, self.pooling = resolve_runner(args, loaded, one_device)
        if self.pooling is not None and args.enable_lora:
            raise ValueError("enable_lora is not supported for a pooling (embedding) engine yet")
        asked = args  # (the draft model's plan starts from what was asked, not the target's outcome)
        args = dataclasses.replace(
            args,
            quantization=plan.quantization,
            small_step_codes=plan.small_step_codes,
            int8_activations=plan.int8_activations,
        )
        self.config: EngineConfig = resolve_config(
            args,
            loaded.cfg,
            loaded.name,
            available_memory=available_memory(args),
            platform=platform,
            pooling=self.pooling,
        )
        if many_processes:
            # One process keeps its compiled steps in the runner's executable store, which a warm
            # start loads without tracing (runner/executables.py); JAX's persistent cache stays
            # off there, as an executable loaded from it cannot be serialized again.
            compile_mod.enable_persistent_cache(self.config.compilation_cache_dir)
        self.cfg, self.model_name = loaded.cfg, self.config.model_name
        model = PreparedModel(
            loaded.cfg,
            *prepare_weights(
                loaded.params,
                loaded.cfg,
                plan,
                mesh=mesh,
                tokenizer=loaded.resolve_tokenizer() if plan.smooth else None,
            ),
            check_path=plan.check_path,
        )
        draft = load_draft(
            self.config.speculative,
            asked,
            self.cfg,
            self.config.scheduler.max_model_len,
            platform,
            progress=progress,
            int8_activations=plan.int8_activations,
        )
        self._build_cores(model, mesh, draft)
        self._init_lora()
        self._params = model.params  # the whole tree (data parallel replicas step with views of it)
        self._updates = UpdatePlan.for_engine(loaded.cfg, plan, mesh, model.params)
        # What the compiled steps take (shapes, dtypes, shardings): every update must match it.
        self._form = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), (model.params, model.small_params)
        )
        self.weight_version: int | str = 0
        self.num_weight_updates = 0
        self.sleep_level = 0  # 0 awake; 1 KV pool freed; 2 weights dropped too (see `sleep`)
        if asked.int8_activations and not int8_activation_weights((self.runner.params, self.runner.small_params)):
            logger.warning(
                "int8_activations: no weight of this run has 4- or 6-bit codes in the C++ GEMM "
                "(quantization=%s, %s backend); the activations stay float",
                self.config.quantization,
                self.runner.attention.name,
            )
        self._warm_up(progress, background=self.config.background_compile and not many_processes)
        # The tokenizer may still be loading on its thread: only now (the steps load meanwhile).
        self.tokenizer = loaded.resolve_tokenizer()
        eos = set(loaded.cfg.eos_token_ids)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = tuple(sorted(eos))
        self.structured_output = StructuredOutputManager(self.tokenizer, loaded.cfg.vocab_size, self.eos_token_ids)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._rng = random.Random(self.config.seed)
        # n > 1: the other choices wait until the first has computed the prompt, then reuse
        # its pages through the prefix cache (first choice's id -> its replica, the others).
        self._pending_choices: dict[str, tuple[int, list[Request]]] = {}

    def _build_cores(self, model: PreparedModel, mesh, draft: PreparedModel | None) -> None:
        """One EngineCore per data-parallel replica (a row of the mesh), sharing the stats."""
        stats = EngineStats()
        self.replicas = [
            EngineCore(
                self.config,
                model if row is None else model._replace(params=parallel.replica_params(model.params, row)),
                mesh=row,
                stats=stats,
                draft=draft,
            )
            for row in parallel.replica_meshes(mesh)
        ]
        self.engine_core = self.replicas[0] if len(self.replicas) == 1 else DataParallelEngineCore(self.replicas)
        # The (first) replica's parts, for tests and benchmarks; metrics use the totals below.
        first = self.replicas[0]
        self.scheduler, self.kv_cache_manager, self.runner, self.stats = (
            first.scheduler,
            first.kv_cache_manager,
            first.runner,
            stats,
        )

    def _warm_up(self, progress: bool, background: bool) -> None:
        """Compile (or load) every step shape, the draft model's too (`warmup_seconds`)."""
        self.warmup_seconds = 0.0
        if not self.config.warmup:
            return
        self.warmup_seconds = sum(r.runner.warmup(progress, background) for r in self.replicas)
        if self.scheduler.proposer is not None:
            self.warmup_seconds += self.scheduler.proposer.warmup(progress, background)

    # ----- requests -----
    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(f"model {self.model_name!r} has no tokenizer: give prompt_token_ids")
        return self.tokenizer.encode(prompt, add_special_tokens=True)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | None = None,
        params: SamplingParams | PoolingParams | None = None,
        *,
        prompt_token_ids: list[int] | None = None,
        output_kind: str = "cumulative",
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request=None,
    ) -> None:
        """Queue a request: with SamplingParams to generate, with PoolingParams to embed (a
        pooling engine); `priority` (lower first) under scheduling_policy "priority";
        `lora_request` (a LoRARequest) runs it under that adapter. Raises ValueError (nothing
        queued) for a bad prompt, params or adapter."""
        self._check_awake()
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        if priority != 0 and self.config.scheduler.scheduling_policy != "priority":
            raise ValueError(f"priority={priority!r} needs scheduling_policy='priority' (this engine's is fcfs)")
        if request_id in self.output_processor.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        adapter = self._lora_adapter(lora_request)
        if self.pooling is not None or isinstance(params, PoolingParams):
            return self._add_pooling_request(
                request_id, prompt, params or PoolingParams(), prompt_token_ids, arrival_time, priority
            )
        params = params or SamplingParams()
        params.verify()
        if output_kind not in OUTPUT_KINDS:
            raise ValueError(f"output_kind must be one of {OUTPUT_KINDS}, got {output_kind!r}")
        prompt, prompt_token_ids = self._prompt_token_ids(prompt, prompt_token_ids)
        self.check_prompt(prompt_token_ids, params)
        params = self._resolve_params(params, len(prompt_token_ids))
        # Compiled (or taken from the cache) before anything is queued: an invalid one raises here.
        grammar = self.structured_output.compile(params.structured_outputs) if params.structured_outputs else None
        grammar = token_filters.wrap(grammar, params, self.cfg.vocab_size, self.tokenizer)  # (allowed ids, bad words)
        now = time.monotonic() if arrival_time is None else arrival_time
        choices = self._make_choices(request_id, prompt, prompt_token_ids, params, grammar, now)
        for choice in choices:
            choice.priority, choice.lora = priority, adapter
        if any(self.output_processor.is_tracked(c.request_id) for c in choices):
            raise ValueError(f"request_id {request_id!r} clashes with a running request's choice ids")
        replica = self.engine_core.add_request(choices[0])  # raises (nothing kept) if the scheduler refuses it
        self.output_processor.add_request(
            request_id, prompt, prompt_token_ids, params, output_kind, now, [c.request_id for c in choices]
        )
        if len(choices) > 1:
            self._pending_choices[choices[0].request_id] = (replica, choices[1:])

    def _prompt_token_ids(
        self, prompt: str | list[int] | None, prompt_token_ids: list[int] | None, truncate: int | None = None
    ) -> tuple[str | None, list[int]]:
        """The prompt's text (None if given as token ids) and its token ids, tokenized if need be;
        with `truncate`, at most that many (on the tokenizer's truncation side, a text's special
        tokens kept)."""
        if isinstance(prompt, list):
            prompt, prompt_token_ids = None, prompt
        if prompt_token_ids is None:
            if prompt is None:
                raise ValueError("give a prompt or prompt_token_ids")
            if truncate is not None and self.tokenizer is not None:
                prompt_token_ids = self.tokenizer.encode(prompt, truncation=True, max_length=truncate)
            else:
                prompt_token_ids = self.tokenize(prompt)
        prompt_token_ids = [int(t) for t in prompt_token_ids]
        if truncate is not None and len(prompt_token_ids) > truncate:
            left = getattr(self.tokenizer, "truncation_side", "right") == "left"
            prompt_token_ids = prompt_token_ids[-truncate:] if left else prompt_token_ids[:truncate]
        return prompt, prompt_token_ids

    def _resolve_params(self, params: SamplingParams, num_prompt_tokens: int) -> SamplingParams:
        """A copy of `params` with what follows from this model and prompt filled in (no
        detokenizing without a tokenizer, `max_tokens` up to the context); raises ValueError for
        what they cannot do here."""
        params = dataclasses.replace(params)
        if self.tokenizer is None:  # token ids in, token ids out (vLLM's skip_tokenizer_init)
            if params.stop:
                raise ValueError(f"model {self.model_name!r} has no tokenizer: stop strings need one")
            params.detokenize = False
        if params.max_tokens is None:
            params.max_tokens = self.config.scheduler.max_model_len - num_prompt_tokens
            if params.min_tokens > params.max_tokens:
                raise ValueError(
                    f"min_tokens={params.min_tokens} exceeds the {params.max_tokens} tokens left in "
                    f"the context (max_model_len)"
                )
        if params.logit_bias and max(params.logit_bias) >= self.cfg.vocab_size:
            raise ValueError(
                f"logit_bias has token id {max(params.logit_bias)}, past the vocabulary ({self.cfg.vocab_size} tokens)"
            )
        banned = len(params.stop_token_ids) + len(self.eos_token_ids)
        if params.min_tokens and banned > 32:
            raise ValueError(f"at most 32 stop token ids can be held back by min_tokens, got {banned}")
        return params

    def _make_choices(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        grammar: Matcher | None,
        now: float,
    ) -> list[Request]:
        """One Request per choice (`params.n`), each with its own seed and grammar state; with
        n > 1 their ids are `{i}_{request_id}`."""
        choices = []
        for i in range(params.n):
            seed = params.seed if params.seed is not None else self._rng.getrandbits(32)
            if params.seed is not None and i:
                seed = hash((params.seed, i)) & 0xFFFFFFFF
            choices.append(
                Request(
                    request_id=request_id if params.n == 1 else f"{i}_{request_id}",
                    prompt_token_ids=prompt_token_ids,
                    sampling_params=params,
                    eos_token_ids=self.eos_token_ids,
                    seed=seed,
                    parent_id=request_id,
                    index=i,
                    prompt=prompt,
                    arrival_time=now,
                    grammar=grammar.copy() if grammar is not None else None,
                )
            )
        if params.prompt_logprobs is not None:
            choices[0].prompt_logprobs = []  # the request's prompt logprobs come from its first choice
        return choices

    @property
    def chat_template(self) -> str | None:
        """The model's own chat template (its tokenizer's; the "default" of named ones), if any."""
        template = getattr(self.tokenizer, "chat_template", None)
        return template.get("default") if isinstance(template, dict) else template

    def apply_chat_template(
        self,
        messages: list[dict],
        *,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        **template_kwargs,
    ) -> list[int]:
        """Token ids of a conversation rendered by `chat_template` (default: the model's) in the
        bounded sandbox of jaxllm/chat_template.py; any template variable may be passed (a server
        checks a client's with `check_template_kwargs` first). Raises ValueError
        (ChatTemplateError for a template that fails)."""
        template = chat_template or self.chat_template
        if self.tokenizer is None:
            raise ValueError(f"model {self.model_name!r} has no tokenizer")
        if not template:
            raise ValueError(f"model {self.model_name!r} has no chat template")
        # Room for any prompt that fits the context, however long its tokens (whitespace runs).
        max_chars = max(MAX_OUTPUT_CHARS, 16 * self.config.scheduler.max_model_len)
        text = render_chat_template(
            template,
            messages,
            add_generation_prompt=add_generation_prompt,
            special_tokens=self.tokenizer.special_tokens_map,
            template_kwargs=template_kwargs,
            max_chars=max_chars,
        )
        # The template writes the special tokens (BOS included) itself, as transformers assumes.
        return self.tokenizer.encode(text, add_special_tokens=False)

    def check_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError if the prompt or params cannot run on this engine."""
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        max_len = self.config.scheduler.max_model_len
        if len(prompt_token_ids) >= max_len:
            raise ValueError(
                f"the prompt has {len(prompt_token_ids)} tokens; this model's context (max_model_len) is "
                f"{max_len}, leaving no room to generate"
            )
        vocab = self.cfg.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
        if any(not 0 <= t < vocab for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be in [0, {vocab})")
        if params.logprobs is not None and params.logprobs > self.config.max_logprobs:
            raise ValueError(f"logprobs={params.logprobs} exceeds max_logprobs ({self.config.max_logprobs})")
        if params.prompt_logprobs is not None:
            if params.prompt_logprobs > self.config.max_logprobs:
                raise ValueError(
                    f"prompt_logprobs={params.prompt_logprobs} exceeds max_logprobs ({self.config.max_logprobs})"
                )
            if self.runner.mesh is not None:
                raise ValueError("prompt_logprobs is not supported with tensor, pipeline or data parallelism yet")
        if params.n > self.config.scheduler.max_num_seqs:
            raise ValueError(f"n={params.n} exceeds max_num_seqs ({self.config.scheduler.max_num_seqs})")
        # A sequence that cannot fit in the whole pool would preempt itself forever.
        max_tokens = params.max_tokens or max_len - len(prompt_token_ids)
        self.kv_cache_manager.check_fits(
            min(len(prompt_token_ids) + max_tokens, max_len), self.config.scheduler.max_num_batched_tokens
        )

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Stop requests now and free their pages. Unknown ids are ignored."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for request_id in request_ids:
            state = self.output_processor.remove_request(request_id)
            if state is None:
                continue
            for core_id in state.seqs:
                self._pending_choices.pop(core_id, None)
            self.engine_core.abort_requests(state.seqs)
            self.stats.record_finished("abort")

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.requests)

    # ----- the step -----
    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch; return outputs of the requests that progressed."""
        return self._process(self.engine_core.step())

    def _process(self, core_outputs) -> list[RequestOutput]:
        t0 = time.perf_counter()
        for out in core_outputs.outputs:  # the prompt is computed: release the other choices
            replica, choices = self._pending_choices.pop(out.request_id, (None, ()))
            for choice in choices:
                self.engine_core.add_request(choice, replica)
        processed = self.output_processor.process_outputs(core_outputs)
        self.engine_core.finish_requests(processed.reqs_to_abort, RequestStatus.FINISHED_STOPPED)
        for state in processed.finished:
            self.stats.record_finished(next(iter(state.seqs.values())).finish_reason)
        self.stats.time_update += time.perf_counter() - t0
        return processed.request_outputs

    # ----- several processes -----
    @property
    def is_leader(self) -> bool:
        """Process 0 (or the only one): it schedules; the others `follow()`."""
        return self.runner.channel is None or self.runner.channel.is_leader

    def follow(self) -> None:
        """On a process other than 0: run the steps process 0's engine announces, until it shuts down."""
        self.runner.follow()

    def wait_compiled(self) -> None:
        """Return once every step shape is compiled (or loaded): the engine compiles them in the
        background by default (`background_compile`), and a benchmark that times steady steps
        waits for that first."""
        for replica in self.replicas:
            replica.runner.wait_compiled()
        draft = getattr(self.scheduler.proposer, "runner", None)  # a draft model's steps
        if draft is not None:
            draft.wait_compiled()

    def shutdown(self) -> None:
        """Stop compiling step shapes in the background, and on process 0 over several
        processes, release the followers (their `follow()` returns)."""
        for replica in self.replicas:
            replica.runner.steps.stop()
        self.runner.stop_followers()

    # ----- introspection -----
    @property
    def kv_cache_usage(self) -> float:
        """Pages in use over all replicas' pools, 0..1."""
        return sum(r.kv_cache_manager.usage for r in self.replicas) / len(self.replicas)

    @property
    def num_running_requests(self) -> int:
        return sum(r.scheduler.num_running for r in self.replicas)

    @property
    def num_waiting_requests(self) -> int:
        return sum(r.scheduler.num_waiting for r in self.replicas)

    @property
    def prefix_cache_tokens(self) -> tuple[int, int]:
        """(queried, hit) prompt tokens of the prefix caches, over all replicas."""
        return (
            sum(r.kv_cache_manager.prefix_queries for r in self.replicas),
            sum(r.kv_cache_manager.prefix_hits for r in self.replicas),
        )
