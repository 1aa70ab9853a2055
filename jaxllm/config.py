"""EngineArgs (what users pass, vLLM's names) -> EngineConfig (resolved against the model)."""

from __future__ import annotations

import dataclasses
import logging
import os

logger = logging.getLogger(__name__)

DTYPES = ("float32", "bfloat16")
DEFAULT_KV_CACHE_MEMORY = 2 << 30  # bytes; on CPU the pool lives in host RAM
# "native": the C++ CPU kernel (kernels/native.py); "cpu": the jnp row path (no compiler
# needed); "pallas": the GPU kernel; "reference": the dense oracle.
ATTENTION_IMPLS = ("native", "cpu", "pallas", "reference")


def default_cache_root() -> str:
    """Root of jaxllm's caches (compiled programs in xla/, converted weights in params/)."""
    xdg = os.environ.get("XDG_CACHE_HOME", os.path.join(os.path.expanduser("~"), ".cache"))
    return os.environ.get("JAXLLM_CACHE_DIR", os.path.join(xdg, "jaxllm"))


@dataclasses.dataclass
class EngineArgs:
    """Engine options. `None` means "derive from the model / machine"."""

    model: str | None = None
    dtype: str = "bfloat16"
    max_model_len: int | None = None
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 512
    block_size: int = 16
    kv_cache_memory: int | None = None
    num_gpu_blocks_override: int | None = None  # explicit page count (vLLM's name)
    seed: int = 0
    enable_prefix_caching: bool = True
    served_model_name: str | None = None
    compilation_cache_dir: str | None = None      # "" disables the persistent cache
    params_cache_dir: str | None = None           # orbax cache of converted weights
    attention_impl: str | None = None             # "native" | "cpu" | "pallas" | "reference"; None = by backend
    prefill_block: int = 16                       # query tokens per prefill attention row
    max_num_prefill_seqs: int = 8                 # prompts (chunks) per step
    warmup: bool = True
    disable_log_stats: bool = True

    def verify(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "prefill_block", "max_num_prefill_seqs"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be positive bytes, got {self.kv_cache_memory}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 2:
            raise ValueError(f"num_gpu_blocks_override must be >= 2, got {self.num_gpu_blocks_override}")
        if self.attention_impl not in (None, *ATTENTION_IMPLS):
            raise ValueError(f"attention_impl must be one of {ATTENTION_IMPLS}, got {self.attention_impl!r}")


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    max_num_prefill_seqs: int
    prefill_block: int


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    block_size: int
    num_blocks: int
    dtype: str
    enable_prefix_caching: bool


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    model_name: str
    dtype: str
    seed: int
    scheduler: SchedulerConfig
    cache: CacheConfig
    attention_impl: str
    compilation_cache_dir: str
    warmup: bool

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.scheduler.max_model_len // self.cache.block_size)


def default_attention_impl(backend: str) -> str:
    """The Pallas kernel on GPUs; on CPU the C++ kernel, or the jnp row path when it cannot be
    built here (no C++ compiler), with a warning that says why."""
    if backend != "cpu":
        return "pallas"
    from jaxllm.kernels import native

    reason = native.unavailable_reason()
    if reason is None:
        return "native"
    logger.warning("native CPU attention unavailable (%s); using the slower jnp path", reason)
    return "cpu"


def kv_bytes_per_token(spec, dtype: str) -> int:
    itemsize = 4 if dtype == "float32" else 2
    return 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * itemsize


def resolve_config(args: EngineArgs, spec, model_name: str, backend: str) -> EngineConfig:
    """Fill in what `args` leaves open from the model spec and the backend."""
    args.verify()
    max_model_len = args.max_model_len or spec.max_position_embeddings
    if max_model_len > spec.max_position_embeddings:
        raise ValueError(
            f"max_model_len={max_model_len} exceeds the model's max_position_embeddings "
            f"({spec.max_position_embeddings})")
    if args.num_gpu_blocks_override is not None:
        num_blocks = args.num_gpu_blocks_override
    else:
        budget = args.kv_cache_memory or DEFAULT_KV_CACHE_MEMORY
        num_blocks = budget // (kv_bytes_per_token(spec, args.dtype) * args.block_size)
    if num_blocks < 2:
        raise ValueError(f"KV cache budget holds {num_blocks} pages; raise kv_cache_memory")
    attention_impl = args.attention_impl or default_attention_impl(backend)
    compilation_cache_dir = args.compilation_cache_dir
    if compilation_cache_dir is None:
        compilation_cache_dir = os.path.join(default_cache_root(), "xla")
    max_batched = max(args.max_num_batched_tokens, args.max_num_seqs)
    return EngineConfig(
        model_name=args.served_model_name or model_name,
        dtype=args.dtype,
        seed=args.seed,
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=max_batched,
            max_model_len=max_model_len,
            max_num_prefill_seqs=min(args.max_num_prefill_seqs, args.max_num_seqs),
            prefill_block=args.prefill_block,
        ),
        cache=CacheConfig(block_size=args.block_size, num_blocks=int(num_blocks), dtype=args.dtype,
                          enable_prefix_caching=args.enable_prefix_caching),
        attention_impl=attention_impl,
        compilation_cache_dir=compilation_cache_dir,
        warmup=args.warmup,
    )
