"""EngineArgs: what users pass (vLLM's names), checked; engine_config.py resolves them against
the model into an EngineConfig.

`EngineArgs` is the one definition of the engine's options: the CLI builds its flags from its
fields (each field's `metadata["help"]`), `LLM(...)` and `AsyncLLM(...)` take them as keywords.
`SpeculativeConfig` (speculative_config.py) is the parsed `speculative_config` option.
"""

from __future__ import annotations

import dataclasses
import logging

from jaxllm.sampling_params import MAX_LOGPROBS
from jaxllm.speculative_config import SpeculativeConfig
from jaxllm.utils import DTYPE_CHOICES, QUANTIZATION_ALIASES, QUANTIZATION_METHODS, json_object

logger = logging.getLogger(__name__)

DEFAULT_KV_CACHE_MEMORY = 2 << 30  # bytes; on CPU the pool lives in host RAM
# The names of jaxllm.attention.BACKENDS, listed here so that checking a config imports no kernels.
ATTENTION_BACKENDS = ("native", "cpu", "mosaic", "pallas", "reference")
PREEMPTION_MODES = ("recompute", "swap")
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")
RUNNERS = ("auto", "generate", "pooling")
SCHEDULING_POLICIES = ("fcfs", "priority")  # jaxllm.core.request_queue's (config checks import no engine code)
KV_CACHE_DTYPES = ("auto", "bfloat16", "float32", "int8", "fp8_e4m3", "fp8")  # "fp8": fp8_e4m3, as vLLM has it


def option(default, help: str, **metadata):
    """A field with its CLI help, and optionally a `metavar`, `choices`, `size=True` (the flag takes
    sizes such as 4GiB) or `cli=False` (no flag). The CLI ends the help with "(default: <value>)"
    unless the help names the default itself, as it should where the value alone says little (None)."""
    return dataclasses.field(default=default, metadata={"help": help, **metadata})


@dataclasses.dataclass
class EngineArgs:
    """Engine options. `None` means "derive from the model / machine"."""

    model: str | None = option(
        None,
        "an HF model directory, a .gguf file, or a hub id such as Qwen/Qwen2.5-0.5B-Instruct (the families "
        "of docs/models.md). Default: the bundled SmolLM2-135M-Instruct",
        metavar="PATH_OR_ID",
    )
    dtype: str = option(
        "auto",
        "weight and KV-cache dtype; 'auto' picks bfloat16 on accelerators and on CPUs with hardware bf16 "
        "dots (AVX512_BF16 or AMX), float32 on other CPUs; and float32 for a GGUF whose matrices are all 4- to "
        "6-bit codes on a CPU with AVX512_VNNI (its codes then multiply int8 activations: int8_activations; "
        "with AMX a prompt's calls take them to its bf16 tiles)",
        choices=DTYPE_CHOICES,
    )
    quantization: str | None = option(
        None,
        "quantize the weights on load: 'w8a8' or 'int8' (int8 weights and per-token int8 activations, "
        "smoothed from a calibration run at load: fast with VNNI/AMX); 'int8_weight_only' (int8 per "
        "output channel), 'int4' (4-bit in groups of 32, the LM head int8), both weight-only; "
        "'gguf' (a GGUF's own quantized blocks, kept), 'awq', 'gptq' (read from the checkpoint's "
        "quantization_config); 'none' (a GGUF dequantized to the dtype). "
        "Default: an AWQ/GPTQ checkpoint as it is; a GGUF kept quantized where the dtype is float32 "
        "on a CPU with the C++ kernels, or bfloat16 on one with AMX, else dequantized (its blocks kept "
        "beside for small steps: small_step_codes; see jaxllm/quantization)",
        choices=QUANTIZATION_METHODS,
    )
    kv_cache_dtype: str = option(
        "auto",
        "KV cache dtype: 'auto' (the dtype; but bfloat16 where dtype 'auto' picked float32 on a CPU), "
        "'bfloat16' or 'float32' (pages of that dtype whatever the compute dtype), 'int8' (int8 codes "
        "with an f32 scale per token and head: about half a bf16 cache, twice the sequences in the same "
        "memory) or 'fp8_e4m3' ('fp8': float8 E4M3 codes, same layout and size)",
        choices=KV_CACHE_DTYPES,
    )
    max_model_len: int | None = option(
        None, "context length, prompt plus output (default: the model's)", metavar="TOKENS"
    )
    max_num_seqs: int = option(128, "most sequences in one batch", metavar="N")
    max_num_batched_tokens: int = option(512, "most tokens computed in one step", metavar="N")
    max_num_prefill_seqs: int = option(8, "most prompts (or prompt chunks) in one step", metavar="N")
    block_size: int | None = option(
        None,
        "tokens per KV-cache page (block), a power of two. Default: 64 on CPU (the attention kernel reads "
        "each page as one run of memory, and longer runs stream faster from RAM), 16 on accelerators",
        metavar="TOKENS",
    )
    kv_cache_memory: int | None = option(
        None,
        "bytes for the KV cache, e.g. 4GiB (default: 2GiB unless --gpu-memory-utilization is given)",
        metavar="SIZE",
        size=True,
    )
    gpu_memory_utilization: float | None = option(
        None,
        "the KV cache's share of the memory left after loading the weights (device memory on an "
        "accelerator, available RAM on CPU), in (0, 1] (default: unset, --kv-cache-memory sizes the cache)",
        metavar="FRACTION",
    )
    num_gpu_blocks_override: int | None = option(
        None,
        "exact number of KV pages, overriding the memory options (default: unset, the memory options size the cache)",
        metavar="N",
    )
    swap_space: float = option(
        4.0,
        "GiB of host memory for KV pages swapped out by preemption (used with --preemption-mode swap)",
        metavar="GiB",
    )
    preemption_mode: str = option(
        "recompute",
        "what a preempted request's KV pages become: 'recompute' frees them (recomputed on "
        "resume), 'swap' copies them to host memory and back",
        choices=PREEMPTION_MODES,
    )
    enable_prefix_caching: bool = option(True, "reuse the KV cache of shared prompt prefixes")
    scheduling_policy: str = option(
        "fcfs",
        "which waiting request runs next: 'fcfs' (first come, first served) or 'priority' (a request's "
        "`priority`, lower first, then arrival; a waiting request preempts running ones it outranks "
        "when it lacks room)",
        choices=SCHEDULING_POLICIES,
    )
    async_scheduling: bool = option(
        True,
        "dispatch the next decode step before the last one's tokens reach the host (its tokens read on "
        "the device), so the host's work overlaps the step's; on one device, for batches without "
        "grammars, penalties, drafts, beams or prompt logprobs (others step synchronously)",
    )
    tensor_parallel_size: int = option(
        1, "devices the model is split over (Megatron tensor parallelism on a jax.sharding.Mesh)", metavar="N"
    )
    pipeline_parallel_size: int = option(
        1,
        "pipeline stages the decoder layers are split into (each stage on its own tensor-parallel devices; "
        "each step's batch flows through them in micro-batches)",
        metavar="N",
    )
    data_parallel_size: int = option(
        1,
        "engine replicas, each with its own scheduler and KV pool on its own devices; requests go to the least loaded",
        metavar="N",
    )
    distributed_coordinator: str | None = option(
        None,
        "HOST:PORT of process 0, to run over several processes (hosts) with jax.distributed; process 0 "
        "schedules and serves, the others follow its steps (default: one process, or JAX's environment "
        "variables)",
        metavar="HOST:PORT",
    )
    num_processes: int = option(1, "processes taking part (with --distributed-coordinator)", metavar="N")
    process_id: int = option(
        0, "this process's rank, 0 for the leader (with --distributed-coordinator)", metavar="RANK"
    )
    mesh: object = option(
        None,
        "a jax.sharding.Mesh with axes 'data', 'model' and (for pipeline stages) 'stage' "
        "to run on, for JAX users who have one (default: built from jax.devices())",
        cli=False,
    )
    max_logprobs: int = option(20, "most log-probabilities a request may ask for per token (at most 20)", metavar="N")
    logits_processors: list | None = option(
        None,
        "custom logits processors (jaxllm.LogitsProcessor subclasses) applied inside the step, each a "
        "'module:Class' name (or, from Python, a class or an instance); requests opt in through "
        "SamplingParams.extra_args. Default: none",
        metavar="MODULE:CLASS",
        nargs="+",
        type=str,
    )
    batch_invariant: bool = option(
        False,
        "a request's tokens and logprobs bit-identical whatever shares its steps, however its prompt is "
        "chunked and whether its prefix comes from the cache (one GEMM and one attention code path for "
        "every row count; one CPU device with the C++ kernels)",
    )
    logprobs_mode: str = option(
        "raw_logprobs",
        "what sampled tokens' logprobs (and top logprobs) are of: 'raw_logprobs' the model's distribution; "
        "'processed_logprobs' the one sampled from, after penalties, bans, grammar, temperature, min_p, "
        "top_k and top_p (vLLM's modes; prompt logprobs stay raw)",
        choices=LOGPROBS_MODES,
    )
    runner: str = option(
        "auto",
        "'generate' (text out) or 'pooling' (embeddings out: LLM.embed, /v1/embeddings); 'auto': pooling for "
        "encoders (BERT) and sentence-transformers directories, else generate",
        choices=RUNNERS,
    )
    pooler_config: dict | str | None = option(
        None,
        'a pooling engine\'s pooling, a JSON object as in vLLM: {"pooling_type": "MEAN" | "CLS" | "LAST", '
        '"normalize": true | false} (default: what a sentence-transformers directory declares, else CLS for '
        "encoders and LAST for decoders, normalized)",
        metavar="JSON",
        type=json_object,
    )
    seed: int = option(0, "engine random seed (draws the seeds of unseeded requests)")
    served_model_name: str | None = option(
        None, "the model name clients send and /v1/models lists (default: from --model)", metavar="NAME"
    )
    compilation_cache_dir: str | None = option(
        None,
        "where compiled programs are kept between runs ('' disables; default: $JAXLLM_CACHE_DIR/xla or "
        "~/.cache/jaxllm/xla)",
        metavar="DIR",
    )
    params_cache_dir: str | None = option(
        None, "where converted weights are kept between runs (default: $JAXLLM_CACHE_DIR/params)", metavar="DIR"
    )
    attention_backend: str | None = option(
        None,
        "paged attention implementation: 'native' (C++ CPU kernel), 'cpu' (jnp rows), 'mosaic' (GPU, "
        "Mosaic GPU kernel), 'pallas' (GPU, Triton kernel), 'reference' (dense oracle); default: by "
        "platform",
        choices=ATTENTION_BACKENDS,
    )
    warmup: bool = option(True, "compile every step shape at start-up (off: compile on first use)")
    background_compile: bool = option(
        True,
        "with warmup, start at once and compile the step shapes in the background: a batch runs in "
        "the smallest compiled shape that holds it, or compiles its own (one process only; off: every "
        "shape is compiled before the engine returns)",
    )
    int8_activations: bool | None = option(
        None,
        "4-bit weight codes (a GGUF's Q4_0 / Q4_1 / Q4_K, int4) multiply activations quantized to int8 per "
        "group of 32, as llama.cpp does: integer dot products; under bfloat16 with small-step codes, the "
        "decode steps' 4-bit codes do; under float32 every step's 4-bit codes and the 8-bit ones that fit 6 "
        "bits (Q6_K, Q5_0, Q5_K, Q5_1: repacked so; with AMX a prompt's calls take them to its bf16 tiles), "
        "the other codes then factoring their scales "
        "(small_step_factored) (one CPU device with the C++ kernels; elsewhere the activations stay float). "
        "Default: on for a GGUF where dtype auto picks float32 (a CPU without bf16 dots: AVX2; or a GGUF of "
        "4- to 6-bit codes on an AVX512_VNNI CPU), llama.cpp's "
        "own scheme for these files (faster there on every measure, perplexity within 1%: docs/quantization.md); "
        "off where a dtype is asked for",
    )
    packed_weights: bool = option(
        True,
        "on one CPU device with the native kernels: pack each float32 weight matrix (and bf16 ones where "
        "the CPU has AVX512_BF16) once for jaxllm's C++ GEMMs (XLA's dot repacks it on every call)",
    )
    small_step_codes: bool | None = option(
        None,
        "a GGUF's quantized layer and tied LM-head blocks kept beside the bf16 weights, for steps of at "
        "most 4 rows: the same numbers (the codes become the bf16 weights as they are read) from about a "
        "third of the bytes, which a decode step of a few rows waits on; on one CPU device with AVX512_BF16 "
        "under dtype bfloat16. Default: on where it applies, the CPU has no AMX and the bf16 weights take at "
        "most 1/16 of the host's memory (1.36x the weights' memory on the default model); elsewhere the "
        "blocks serve every step alone (quantization 'gguf'); False: the GGUF dequantized to bf16",
    )
    small_step_factored: bool | None = option(
        None,
        "a GGUF's layer codes under bf16, in the small-step codes or alone: factor each group's scale and "
        "offset out of its sums in steps of up to 4 rows (codes alone: 16) (exact products, f32 sums) "
        "instead of rounding each weight to bf16 first: fewer instructions a weight where the conversion, "
        "not memory, bounds a decode, and the decodes' numbers are no longer the bf16 weights' bit for bit; "
        "under float32 (the codes alone, AVX2) likewise in steps of one or two rows, instead of dequantizing "
        "each weight. Default: on wherever such codes serve without AMX (with AMX: in the small-step codes), "
        "unless batch_invariant, int8_activations (but under float32, for the codes it leaves float) or "
        "speculative decoding with the small-step split or under float32 (whose larger verification steps "
        "compute other numbers: outputs the same with drafts or without)",
    )
    speculative_config: dict | str | None = option(
        None,
        'speculative decoding, a JSON object as in vLLM: {"method": "ngram", "num_speculative_tokens": '
        'K, "prompt_lookup_min": N, "prompt_lookup_max": N, "disable_by_batch_size": B}, or a draft '
        'model with the same vocabulary: {"model": PATH_OR_ID, "num_speculative_tokens": K} (default: '
        "off)",
        metavar="JSON",
        type=json_object,
    )
    enable_lora: bool = option(
        False, "serve LoRA adapters (PEFT's format) over the base model, requests of different adapters sharing steps"
    )
    max_loras: int = option(1, "adapters a step can mix (device slots, with --enable-lora)", metavar="N")
    max_lora_rank: int = option(16, "the highest adapter rank accepted (with --enable-lora)", metavar="R")
    max_cpu_loras: int | None = option(
        None, "adapters kept read in host memory (with --enable-lora; default: --max-loras)", metavar="N"
    )

    def __post_init__(self):
        if isinstance(self.quantization, str):  # (anything else is verify's to refuse)
            self.quantization = QUANTIZATION_ALIASES.get(self.quantization, self.quantization)

    def verify(self) -> None:
        """Raise ValueError, naming the option, for a value or a combination that cannot run."""
        self._verify_types()
        self._verify_processes_and_mesh()
        self._verify_cache()
        self._verify_methods()
        self._verify_lora()

    def _verify_types(self) -> None:
        for field in dataclasses.fields(self):  # "False" from a config file would read as on
            value = getattr(self, field.name)
            if field.type == "bool" and not isinstance(value, bool):
                raise ValueError(f"{field.name} must be True or False, got {value!r}")
            if field.type == "bool | None" and not isinstance(value, (bool, type(None))):
                raise ValueError(f"{field.name} must be True, False or None, got {value!r}")
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype must be one of {DTYPE_CHOICES}, got {self.dtype!r}")
        for name in (
            "max_num_seqs",
            "max_num_batched_tokens",
            "block_size",
            "max_num_prefill_seqs",
            "tensor_parallel_size",
            "pipeline_parallel_size",
            "data_parallel_size",
            "max_loras",
            "max_lora_rank",
        ):
            value = getattr(self, name)
            if name == "block_size" and value is None:
                continue
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

    def _verify_processes_and_mesh(self) -> None:
        if not isinstance(self.num_processes, int) or not 0 <= self.process_id < self.num_processes:
            raise ValueError(f"process_id must be in [0, num_processes), got {self.process_id} of {self.num_processes}")
        if self.num_processes > 1 and self.preemption_mode == "swap":
            raise ValueError("preemption_mode='swap' is not supported over several processes; use 'recompute'")
        if self.num_processes > 1 and not self.warmup:
            # A step compiled on first use puts its inputs on the global devices while the other
            # processes wait in the step broadcast: the processes would wait on each other.
            raise ValueError(
                "warmup=False is not supported over several processes: they compile every step together at start-up"
            )
        if self.mesh is not None:
            shape = dict(self.mesh.shape)
            want = (self.data_parallel_size, self.pipeline_parallel_size, self.tensor_parallel_size)
            if (shape.get("data"), shape.get("stage", 1), shape.get("model")) != want:
                raise ValueError(
                    f"the mesh must have axes 'data' = data_parallel_size ({self.data_parallel_size}), "
                    f"'stage' = pipeline_parallel_size ({self.pipeline_parallel_size}; may be left out "
                    f"when 1) and 'model' = tensor_parallel_size ({self.tensor_parallel_size}); "
                    f"got {shape}"
                )

    def _verify_cache(self) -> None:
        if not isinstance(self.max_logprobs, int) or not 0 <= self.max_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"max_logprobs must be in [0, {MAX_LOGPROBS}], got {self.max_logprobs!r}")
        if self.block_size is not None and self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be positive bytes, got {self.kv_cache_memory}")
        if self.gpu_memory_utilization is not None:
            if not 0 < self.gpu_memory_utilization <= 1:
                raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
            if self.kv_cache_memory is not None:
                raise ValueError("give kv_cache_memory or gpu_memory_utilization, not both")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 2:
            raise ValueError(f"num_gpu_blocks_override must be >= 2, got {self.num_gpu_blocks_override}")
        if not self.swap_space >= 0:
            raise ValueError(f"swap_space must be >= 0 GiB, got {self.swap_space}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}")
        if self.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {RUNNERS}, got {self.runner!r}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {self.logprobs_mode!r}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        if self.preemption_mode == "swap" and self.swap_space <= 0:
            raise ValueError("preemption_mode='swap' needs swap_space > 0 GiB")

    def _verify_methods(self) -> None:
        if self.attention_backend not in (None, *ATTENTION_BACKENDS):
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        if self.quantization not in (None, *QUANTIZATION_METHODS):
            raise ValueError(f"quantization must be one of {QUANTIZATION_METHODS}, got {self.quantization!r}")
        speculative = SpeculativeConfig.parse(self.speculative_config)
        if speculative is not None and self.pipeline_parallel_size > 1:
            raise ValueError("speculative decoding is not supported with pipeline_parallel_size > 1 yet")
        if (
            speculative is not None
            and speculative.method == "draft_model"
            and self.tensor_parallel_size * self.data_parallel_size * self.num_processes > 1
        ):
            raise ValueError(
                "a draft model runs on one device: not with tensor or data parallelism or several processes yet"
            )

    def _verify_lora(self) -> None:
        cpu = self.max_cpu_loras
        if cpu is not None and (isinstance(cpu, bool) or not isinstance(cpu, int) or cpu < self.max_loras):
            raise ValueError(f"max_cpu_loras must be an integer >= max_loras ({self.max_loras}), got {cpu!r}")
        if not self.enable_lora:
            return
        not_yet = [
            (self.speculative_config is not None, "speculative decoding"),
            (self.runner == "pooling", "a pooling runner"),
            (self.data_parallel_size > 1, "data parallelism"),
            (self.num_processes > 1, "several processes"),
        ]
        for bad, what in not_yet:
            if bad:
                raise ValueError(f"enable_lora is not supported with {what} yet")
