"""EngineConfig: EngineArgs (config.py) resolved against the model (`resolve_config`): the
scheduler's limits, the KV cache's pages and pools, and what the runner needs.

Resolving never builds or loads anything: the attention backend is chosen from its name later
(`jaxllm.attention.get_attention_backend`).
"""

from __future__ import annotations

import dataclasses
import logging
import os

from jaxllm.config import DEFAULT_KV_CACHE_MEMORY, EngineArgs
from jaxllm.speculative_config import SpeculativeConfig
from jaxllm.platforms import Platform
from jaxllm.sampling_params import resolve_logits_processors
from jaxllm.utils import DTYPES, check_dtype, default_cache_root, resolve_kv_cache_dtype

logger = logging.getLogger("jaxllm")


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    max_num_prefill_seqs: int
    preemption_mode: str = "recompute"
    async_scheduling: bool = False
    chunked_prefill: bool = True  # False: a prompt runs whole in one step (an encoder's)
    scheduling_policy: str = "fcfs"  # or "priority" (core/request_queue.py)
    max_loras: int = 0  # > 0: at most this many adapters among running requests (jaxllm/lora)


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    page_size: int
    num_pages: int
    dtype: str  # the pages' dtype: float32, bfloat16, int8 or fp8_e4m3 (kernels/kv_write.py)
    enable_prefix_caching: bool
    num_swap_pages: int = 0  # host pages for swapped-out requests (preemption_mode="swap")
    # Sliding windows (core/kv_cache_manager.py): pages before every query's window are freed
    # when `sliding_window` > 0; with `num_window_pages` > 0 the windowed layers have their
    # own pool of that many pages (a model that mixes windowed and global layers).
    sliding_window: int = 0
    num_window_pages: int = 0

    @property
    def group_windows(self) -> tuple[int, ...]:
        """Per KV cache group, its window (0: none); the windowed layers are group 1, if any."""
        return (0, self.sliding_window) if self.num_window_pages else (self.sliding_window,)

    @property
    def group_num_pages(self) -> tuple[int, ...]:
        return (self.num_pages, self.num_window_pages) if self.num_window_pages else (self.num_pages,)


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA serving (jaxllm/lora): `max_loras` device slots of rank `max_lora_rank` in
    `dtype`, and `max_cpu_loras` adapters kept read in host memory."""

    max_loras: int
    max_lora_rank: int
    max_cpu_loras: int
    dtype: str


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    model_name: str
    dtype: str
    seed: int
    max_logprobs: int
    scheduler: SchedulerConfig
    cache: CacheConfig
    attention_backend: str | None  # None: the platform's default (jaxllm.attention)
    tensor_parallel_size: int
    pipeline_parallel_size: int
    compilation_cache_dir: str
    warmup: bool
    background_compile: bool
    packed_weights: bool
    int8_activations: bool = False
    # The checkpoint's codes kept for steps of at most SMALL_STEP_ROWS rows beside the float
    # weights (EngineArgs.small_step_codes, as resolved by LLMEngine); quantization stays None.
    small_step_codes: bool = False
    speculative: SpeculativeConfig | None = None
    quantization: str | None = None
    logprobs_mode: str = "raw_logprobs"
    logits_processors: tuple = ()  # LogitsProcessor instances (EngineArgs.logits_processors)
    batch_invariant: bool = False
    # A pooling engine's `models.pooling.PoolingConfig` (EngineArgs.runner): it embeds, it does not generate.
    pooling: object | None = None
    lora: LoRAConfig | None = None  # EngineArgs.enable_lora

    @property
    def max_pages_per_seq(self) -> int:
        return -(-self.scheduler.max_model_len // self.cache.page_size)


def kv_bytes_per_token(cfg, dtype: str, tensor_parallel_size: int = 1) -> int:
    """KV bytes per token over all devices, for a cache of `dtype` (a float dtype, or "int8" /
    "fp8_e4m3": head_dim codes and a 4-byte scale per token and head): with fewer KV heads than
    devices, each device keeps a copy of the head its query heads use."""
    kv_heads = max(cfg.num_kv_heads, tensor_parallel_size)
    row = cfg.head_dim + 4 if dtype in ("int8", "fp8_e4m3") else cfg.head_dim * DTYPES[check_dtype(dtype)]
    return 2 * cfg.num_layers * kv_heads * row


def sliding_window(cfg, max_model_len: int, speculative: SpeculativeConfig | None) -> tuple[int, int]:
    """(the window past which KV pages are freed, 0 for none; how many layers have a window).
    The largest of the layers' windows, and none when it spans max_model_len or a draft model
    shares the page tables (it attends over every page)."""
    windows = [cfg.window(i) or 0 for i in range(cfg.num_layers)]
    window = max(windows)
    if not window or window >= max_model_len or (speculative is not None and speculative.method == "draft_model"):
        return 0, 0
    return window, sum(1 for w in windows if w)


def kv_cache_budget(args: EngineArgs, available_memory: int | None) -> int:
    """Bytes for the KV pool: `kv_cache_memory`, else `gpu_memory_utilization` of
    `available_memory` (what the device has left once the weights are loaded), else 2 GiB."""
    if args.kv_cache_memory is not None:
        if available_memory and args.kv_cache_memory > available_memory:
            raise ValueError(
                f"kv_cache_memory ({args.kv_cache_memory / 2**30:.2f} GiB) exceeds the "
                f"{available_memory / 2**30:.2f} GiB of memory available"
            )
        return args.kv_cache_memory
    if args.gpu_memory_utilization is None:
        return DEFAULT_KV_CACHE_MEMORY
    if not available_memory:
        raise ValueError(
            "gpu_memory_utilization needs the device's free memory, which this platform does "
            "not report; give kv_cache_memory instead"
        )
    return int(args.gpu_memory_utilization * available_memory)


def resolve_config(
    args: EngineArgs,
    cfg,
    model_name: str,
    *,
    available_memory: int | None = None,
    platform: Platform | str = "cpu",
    pooling=None,
) -> EngineConfig:
    """Fill in what `args` leaves open from the model config (and, for `gpu_memory_utilization`,
    the device memory left after the weights; for dtype "auto" and the page size, the `platform`
    it runs on: a `Platform`, or a name for this host's). `pooling`: a pooling engine's
    `PoolingConfig` (engine/pooling.py `resolve_runner`)."""
    args.verify()
    platform = Platform.named(platform) if isinstance(platform, str) else platform
    dtype, _ = platform.resolve_dtype(args.dtype)
    kv_dtype, _ = resolve_kv_cache_dtype(args.kv_cache_dtype, args.dtype, dtype)
    max_model_len = _max_model_len(args, cfg)
    speculative = SpeculativeConfig.parse(args.speculative_config)
    max_batched = max(args.max_num_batched_tokens, args.max_num_seqs)
    whole_prompts = pooling is not None and cfg.bidirectional  # an encoder's prompt runs in one step
    if whole_prompts:
        max_batched = max(max_batched, max_model_len)
    window, windowed_layers = sliding_window(cfg, max_model_len, speculative)
    page_size = args.block_size or platform.default_page_size
    page_bytes = kv_bytes_per_token(cfg, kv_dtype, args.tensor_parallel_size) * page_size
    num_pages, num_window_pages = _kv_pool_pages(
        args, cfg, page_bytes, page_size, max_model_len, max_batched, window, windowed_layers, available_memory
    )
    if pooling is not None:  # no page outlives its prompt: a step's pages and one long prompt chunked
        num_pages = min(num_pages, -(-(max_batched + max_model_len) // page_size) + args.max_num_seqs)
    num_swap_pages = int(args.swap_space * 2**30) // page_bytes if args.preemption_mode == "swap" else 0
    return EngineConfig(
        model_name=args.served_model_name or model_name,
        dtype=dtype,
        seed=args.seed,
        max_logprobs=args.max_logprobs,
        logprobs_mode=args.logprobs_mode,
        logits_processors=resolve_logits_processors(args.logits_processors),
        batch_invariant=args.batch_invariant,
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=max_batched,
            max_model_len=max_model_len,
            max_num_prefill_seqs=min(args.max_num_prefill_seqs, args.max_num_seqs),
            preemption_mode=args.preemption_mode,
            async_scheduling=args.async_scheduling,
            chunked_prefill=not whole_prompts,
            scheduling_policy=args.scheduling_policy,
            max_loras=args.max_loras if args.enable_lora else 0,
        ),
        cache=CacheConfig(
            page_size=page_size,
            num_pages=int(num_pages),
            dtype=kv_dtype,
            enable_prefix_caching=args.enable_prefix_caching,
            num_swap_pages=num_swap_pages,
            sliding_window=window,
            num_window_pages=num_window_pages,
        ),
        attention_backend=args.attention_backend,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        compilation_cache_dir=(
            os.path.join(default_cache_root(), "xla")
            if args.compilation_cache_dir is None
            else args.compilation_cache_dir
        ),
        warmup=args.warmup,
        background_compile=args.background_compile,
        packed_weights=args.packed_weights,
        int8_activations=args.int8_activations,
        small_step_codes=bool(args.small_step_codes),
        speculative=speculative,
        quantization=args.quantization,
        pooling=pooling,
        lora=(
            LoRAConfig(args.max_loras, args.max_lora_rank, args.max_cpu_loras or args.max_loras, dtype)
            if args.enable_lora
            else None
        ),
    )


def _max_model_len(args: EngineArgs, cfg) -> int:
    max_model_len = args.max_model_len or cfg.max_position_embeddings
    if max_model_len > cfg.max_position_embeddings:
        raise ValueError(
            f"max_model_len={max_model_len} exceeds the model's max_position_embeddings ({cfg.max_position_embeddings})"
        )
    return max_model_len


def _kv_pool_pages(
    args: EngineArgs,
    cfg,
    page_bytes: int,
    page_size: int,
    max_model_len: int,
    max_batched: int,
    window: int,
    windowed_layers: int,
    available_memory: int | None,
) -> tuple[int, int]:
    """(pages of the global pool, pages of the window pool: 0 without a window group) for the
    KV budget (`kv_cache_budget`), or as `num_gpu_blocks_override` says."""
    two_pools = 0 < windowed_layers < cfg.num_layers
    if args.num_gpu_blocks_override is not None:
        return args.num_gpu_blocks_override, args.num_gpu_blocks_override if two_pools else 0
    budget = kv_cache_budget(args, available_memory)
    num_pages, num_window_pages = budget // page_bytes, 0
    if two_pools:
        # Two pools, in the proportion a request of max_model_len holds at its peak in each:
        # every page in the global layers, a window and a chunk in the windowed ones.
        layer_page_bytes = page_bytes // cfg.num_layers
        full = -(-max_model_len // page_size)
        windowed = min(full, -(-(window - 1 + max_batched) // page_size) + 1)
        requests = budget / (
            layer_page_bytes * (full * (cfg.num_layers - windowed_layers) + windowed * windowed_layers)
        )
        num_pages, num_window_pages = int(requests * full), int(requests * windowed)
    if min(num_pages, num_window_pages or num_pages) < 2:
        raise ValueError(
            f"the KV cache budget ({budget / 2**20:.1f} MiB) holds {num_pages} pages of "
            f"{page_bytes / 2**10:.0f} KiB; raise kv_cache_memory or gpu_memory_utilization"
        )
    return num_pages, num_window_pages


def resolve_dtypes(args: EngineArgs, platform: Platform, many_processes: bool, int8_codes: bool = False) -> EngineArgs:
    """`args` with `dtype` and `kv_cache_dtype` resolved for the platform (each "auto" logged with
    why; `int8_codes`: see `Platform.auto_dtype`). Over several processes every process takes
    process 0's dtype (their CPUs may differ)."""
    dtype, why = platform.resolve_dtype(args.dtype, int8_codes)
    if args.dtype == "auto" and many_processes:
        import numpy as np
        from jax.experimental import multihost_utils

        names = list(DTYPES)
        leader = names[int(multihost_utils.broadcast_one_to_all(np.int32(names.index(dtype))))]
        if leader != dtype:
            dtype, why = leader, f"process 0 picked it (here: {dtype}, as {why})"
    if args.dtype == "auto":
        logger.info("dtype auto: %s (%s)", dtype, why)
    kv_dtype, why = resolve_kv_cache_dtype(args.kv_cache_dtype, args.dtype, dtype)
    if args.kv_cache_dtype == "auto" and kv_dtype != dtype:
        logger.info("kv_cache_dtype auto: %s (%s)", kv_dtype, why)
    # int8_activations' default stays open (for the weight plan) only where the dtype was picked.
    int8 = False if args.int8_activations is None and args.dtype != "auto" else args.int8_activations
    return dataclasses.replace(args, dtype=dtype, kv_cache_dtype=kv_dtype, int8_activations=int8)


def available_memory(args: EngineArgs) -> int | None:
    """Bytes the KV cache may take from (for gpu_memory_utilization): free device memory once
    the weights are loaded, or on CPU the RAM the OS reports available."""
    if args.gpu_memory_utilization is None and args.kv_cache_memory is None:
        return None
    import jax

    stats = jax.devices()[0].memory_stats() if jax.default_backend() != "cpu" else None
    if stats and "bytes_limit" in stats:
        return stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
