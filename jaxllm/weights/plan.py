"""The weight plan: how every linear of the model is stored and which kernel applies it,
decided once from the platform, the mesh and the user's options.

    plan = resolve_weight_plan(args, platform, one_device=...)                  # what to load
    loaded = load_model(args.model, **plan.load_options())
    plan = resolve_weight_plan(args, platform.confirmed(), one_device=..., checkpoint=loaded.quantization)
    params = weights.prepare.prepare_weights(loaded.params, cfg, plan, ...)     # the plan's weights

`resolve_weight_plan` is a pure function of plain data (a table-driven test checks it:
tests/quantization/test_weight_plan.py); `prepare_weights` turns loaded arrays into the plan's weight
objects, each of which applies itself (models/linear.py). Nothing else decides a format.

The linears, by their params names (models/decoder.py):

| name                               | what                                      |
|------------------------------------|-------------------------------------------|
| `wqkv`, `wo`                       | attention's fused QKV and output          |
| `w_gate_up` (gated) / `w_up`, `w_down` | the MLP                               |
| `experts_gate_up`, `experts_down`  | routed experts' stacks (models/moe.py)    |
| `lm_head`                          | the LM head (absent when tied)            |
| `embed`                            | the table: the LM head's linear when tied, else a lookup (of kept GGUF codes) |

Storage (`LinearPlan.codes`): None (a float matrix in `WeightPlan.dtype`, packed into C++
panels where `kernel == "cpp"`), a method of quantization/ (`int8_weight_only`, `int4`, `w8a8`:
quantized on load) or a checkpoint's own (`gguf`, `awq`, `gptq`: kept where the checkpoint has
codes; its float matrices follow the float rule). Kernels: `cpp` (the C++ GEMMs of
kernels/csrc: one CPU device with the native kernels), `xla` (a dot, or codes dequantized in
the step), `pallas` (GPU, weight-only codes: kernels/quant_matmul.py).
"""

from __future__ import annotations

import dataclasses

from jaxllm.platforms import Platform
from jaxllm.quantization.weights import CHECKPOINT_METHODS, EXPERT_MATRICES, LAYER_MATRICES

# The linears a model may have (params names), in the order of a layer and then the model's.
LINEARS = (*LAYER_MATRICES, *EXPERT_MATRICES, "lm_head", "embed")
# quantization= methods that quantize float weights on load (EngineArgs' "int8" is "w8a8").
QUANTIZE_METHODS = ("int8_weight_only", "int4", "w8a8")
# `checkpoint=` before loading: what the checkpoint keeps quantized is not known yet.
UNKNOWN = "unknown"
# By default a GGUF's bf16 panels are kept beside its codes (`small_step_codes`) only while they
# take at most this share of the host's memory (`platforms.host_memory`: a container's limit
# where lower).
PANELS_MEMORY_SHARE = 1 / 16


@dataclasses.dataclass(frozen=True)
class LinearPlan:
    """One linear's storage and kernel (see the module docstring).

    codes: None, a QUANTIZE_METHODS name or a CHECKPOINT_METHODS name.
    kernel: "cpp" | "xla" | "pallas".
    activations: what the kernel rounds x to: "float" (x as it is), "bf16" (codes x bf16 dots,
        the packed bf16 GEMM's numbers), "factored" (as "bf16", but the codes' calls of up to 16
        rows factor the group scales out of their sums where the codes allow it: 4-bit ones, 8-bit
        ones in [-64, 63]; `EngineArgs.small_step_factored`), "float_factored" (x as it is, a
        GGUF's codes in the f32 GEMM, whose calls of one or two rows factor likewise), "int8"
        (W8A8, or 4-bit codes x int8 rows; under float32 also 8-bit codes that fit 6 bits),
        "int8_float_factored" (a GGUF's 4-bit codes and those 6-bit ones x int8 rows, its others
        "float_factored": `int8_activations` under float32). Applied where the
        weight's shape and bits allow it, else "float" ("factored" else "bf16").
    small_step_codes: a GGUF's codes kept beside the bf16 panels, for the steps of at most
        `quantization.SMALL_STEP_ROWS` rows.
    small_step_activations: what those codes multiply: "bf16" (the bf16 panels' numbers, bit for
        bit), "int8" (`EngineArgs.int8_activations`: 4-bit codes x int8 rows, llama.cpp's
        scheme, where the shape allows; other codes stay "bf16") or "factored"
        (`EngineArgs.small_step_factored`: codes x bf16 rows with the group scales factored out
        of the sums, as for `activations`)."""

    codes: str | None
    kernel: str
    activations: str = "float"
    small_step_codes: bool = False
    small_step_activations: str = "bf16"


_X_AS = {  # for the log line
    "bf16": "bf16",
    "int8": "int8",
    "factored": "bf16, scales factored out",
    "float_factored": "f32, scales factored out",
    "int8_float_factored": "int8 for 4- and 6-bit codes, else f32 with scales factored out",
}


@dataclasses.dataclass(frozen=True)
class WeightPlan:
    dtype: str  # float matrices' dtype ("float32" | "bfloat16")
    quantization: str | None  # the run's method (EngineConfig.quantization): None, QUANTIZE_ or CHECKPOINT_METHODS
    load: str | None  # what `load_model` keeps quantized: a CHECKPOINT_METHODS name, "auto" (a GGUF's), None
    cpp_gemm: bool  # linears multiply in the C++ GEMMs (one CPU device, the native kernels)
    pack_floats: bool  # float matrices are packed into C++ panels
    smooth: bool  # W8A8 smoothing of the float weights before quantizing (quantization/smoothing.py)
    small_step_codes: bool  # a GGUF's codes kept for small steps beside bf16 panels
    int8_activations: bool = False  # EngineArgs.int8_activations, resolved
    gemm_path: str = "auto"  # the C++ GEMMs' kernel path: one for every row count under batch_invariant
    # Speculative decoding's verification steps' path where it must differ (None: gemm_path): with
    # AMX, a check's rows would take the tiles, and a verification row must compute what its
    # decode would (greedy outputs the same with drafts and without).
    check_path: str | None = None
    int4_group: int | None = None  # rows a group of the layers' int4 codes quantized on load (None: METHODS')
    linears: dict = dataclasses.field(default_factory=dict, compare=False)  # name -> LinearPlan

    def linear(self, name: str) -> LinearPlan:
        return self.linears[name]

    def load_options(self) -> dict:
        """`load_model` keyword arguments for this plan (besides sharding and caching)."""
        return dict(dtype=self.dtype, quantization=self.load, panels=self.cpp_gemm)

    def describe(self) -> str:
        """One line per distinct (storage, kernel) of the linears, for the log."""
        rows: dict[LinearPlan, list[str]] = {}
        for name, lp in self.linears.items():
            rows.setdefault(lp, []).append(name)
        pinned = f"; the GEMMs on path {self.gemm_path} at every row count" if self.gemm_path != "auto" else ""
        pinned += f"; verification steps on path {self.check_path}" if self.check_path else ""
        return (
            "; ".join(
                f"{', '.join(names)}: {lp.codes or self.dtype} via {lp.kernel}"
                + (f" (x as {_X_AS[lp.activations]})" if lp.activations != "float" else "")
                + (f" + small-step codes (x as {_X_AS[lp.small_step_activations]})" if lp.small_step_codes else "")
                for lp, names in rows.items()
            )
            + pinned
        )


def resolve_weight_plan(
    args,
    platform: Platform,
    *,
    one_device: bool,
    checkpoint: str | None = UNKNOWN,
    tied: bool = False,
    panels_bytes: int = 0,
) -> WeightPlan:
    """The weight plan for `args` (EngineArgs with `dtype` resolved) on `platform`.

    one_device: one device of one process (no mesh, no data parallelism): only there do the
        C++ GEMMs serve. checkpoint: what the loaded checkpoint keeps quantized (None, or a
        CHECKPOINT_METHODS name; UNKNOWN before loading, when the plan says what to load).
    tied: the model ties its embeddings (the table is then the LM head's linear).
    panels_bytes: what the checkpoint's quantized matrices would take as bf16 panels (0: not known).
    Raises ValueError for options that cannot hold together here."""
    dtype, asked = args.dtype, args.quantization
    cpp_gemm = (
        one_device and platform.name == "cpu" and args.attention_backend in (None, "native") and platform.cpp_kernels
    )
    codes_bf16 = dtype == "bfloat16" and cpp_gemm and args.packed_weights and platform.cpp_bf16_dots
    # Under float32 the C++ GEMM takes a GGUF's codes as they are, for every step (below).
    codes_f32 = dtype == "float32" and cpp_gemm and asked in (None, "gguf")
    # int8_activations None (`resolve_dtypes` leaves it so where dtype "auto" picked float32: a
    # CPU without bf16 dots) is on for a GGUF's codes there: llama.cpp's scheme for its files.
    if args.int8_activations is None:
        args = dataclasses.replace(args, int8_activations=codes_f32 and checkpoint in ("gguf", UNKNOWN))
    small = _small_step_codes(args, codes_bf16, codes_f32, checkpoint)
    # By default a GGUF's blocks serve every step alone, in a third of the panels' memory: where
    # AMX multiplies them (it converts each panel once a call, into its tiles), and where the bf16
    # panels would take more than PANELS_MEMORY_SHARE of the host's memory. Without AMX the GEMM
    # over codes runs a prompt about as fast as the panels and a decode of 1-8 rows as fast or
    # faster, but one of 16 rows at about 0.8x (the conversion). int8 activations keep the
    # small-step split: its int8 GEMM would take the large steps off bf16.
    large = platform.memory_bytes > 0 and panels_bytes > PANELS_MEMORY_SHARE * platform.memory_bytes
    codes_only = small and args.small_step_codes is None and not args.int8_activations and (platform.cpp_amx or large)
    # Factored scales where a GGUF's codes serve the small steps through the bf16 GEMM, by
    # default: a decode's own numbers (closer to the dequantized weights than the bf16
    # conversion's). Not under batch_invariant, nor with speculative decoding where the
    # verification steps compute other numbers than the decodes (the split's steps of more than
    # SMALL_STEP_ROWS rows take the bf16 panels): there the small steps keep the bf16 numbers,
    # so that greedy outputs are the same with and without drafts. Codes serving alone factor
    # calls of up to 16 rows (csrc/gemm_quant_factored.h), each row's sums as it would have
    # alone: a stream's verification steps (1 + at most 15 drafts) compute its decodes' numbers.
    # Nor by default where the codes serve alone on AMX, whose tiles take them from two rows (not
    # measured factored). Under float32 the codes always serve alone, and their calls of one or
    # two rows factor likewise (csrc/gemm_quant.cc: on AVX2 a decode is bound by the codes'
    # conversions), not with speculative decoding (its checks of 3 rows and more do not). With
    # int8_activations the 4-bit codes (and 6-bit ones) multiply int8 rows and only the others factor there.
    alone = codes_only or (asked == "gguf" and codes_bf16)
    factored = args.small_step_factored
    if factored is None:
        factored = (
            ((small or alone) and not (alone and platform.cpp_amx) or codes_f32)
            and not ((args.int8_activations and not codes_f32) or args.batch_invariant)
            and not (args.speculative_config and not alone)
        )
    small = small and not codes_only
    if small or codes_only:
        load = "auto"
    elif asked is not None:  # "none" included
        load = asked if asked in CHECKPOINT_METHODS else None
    else:
        # A GGUF's blocks where they run at about the float engine's speed: the C++ GEMM under
        # float32 (faster at decodes of a few rows, within a few percent on large batches), for
        # 1/3 of the weight memory or less. Under bfloat16 the small-step codes serve.
        load = "auto" if dtype == "float32" and cpp_gemm else None
    known = checkpoint != UNKNOWN
    # The checkpoint's codes serve as they are where asked, or where they cannot be undone (AWQ,
    # GPTQ), or where a GGUF's are kept by choice ("auto"); a GGUF loaded with its blocks for a
    # plan that no longer keeps them (the C++ build failed after all) is dequantized.
    wanted = known and checkpoint is not None and (checkpoint != "gguf" or load == "auto")
    method = None if small or asked == "none" else asked or (checkpoint if wanted else None)
    pack_floats = cpp_gemm and args.packed_weights and (dtype == "float32" or platform.cpp_bf16_dots)
    gemm_path = _batch_invariant_gemm_path(args, platform, cpp_gemm, dtype)
    # Path auto computes other numbers than a one-row decode's from some row count: with AMX, bf16
    # calls on the tiles from two rows; int8 rows' calls on bf16 dots from `act8_bf16_rows` rows
    # (AVX512_BF16 CPUs). Speculative decoding's verification steps keep the AVX-512 kernels,
    # each row computing what its decode would.
    by_rows = dtype == "bfloat16" and platform.cpp_amx or args.int8_activations and platform.cpp_bf16_dots
    check_path = "avx512" if args.speculative_config and cpp_gemm and gemm_path == "auto" and by_rows else None
    linears = {
        name: _linear_plan(
            name,
            method,
            platform,
            cpp_gemm=cpp_gemm,
            pack_floats=pack_floats,
            dtype=dtype,
            int8_activations=args.int8_activations,
            factored=factored,
            small=small,
            tied=tied,
        )
        for name in LINEARS
    }
    return WeightPlan(
        dtype=dtype,
        quantization=method,
        load=load,
        cpp_gemm=cpp_gemm,
        pack_floats=pack_floats,
        smooth=method == "w8a8",
        small_step_codes=small,
        int8_activations=args.int8_activations,
        gemm_path=gemm_path,
        check_path=check_path,
        linears=linears,
    )


def _batch_invariant_gemm_path(args, platform: Platform, cpp_gemm: bool, dtype: str) -> str:
    """The GEMMs' kernel path: "auto", or under `batch_invariant` one path whatever a call's row
    count (auto takes AMX for bf16 calls of two rows or more, `vdpbf16ps` for one: their sums
    differ in the last bits), so that a row's product never depends on what else is in the step.
    XLA's dots give no such promise: the mode needs the C++ GEMMs."""
    if not args.batch_invariant:
        return "auto"
    if not (cpp_gemm and args.packed_weights):
        raise ValueError(
            "batch_invariant needs the C++ GEMMs: one CPU device, the native attention backend and packed "
            "weights (not yet on GPUs, meshes or XLA's dots)"
        )
    if dtype == "bfloat16" and platform.cpp_bf16_dots:
        return "amx" if platform.cpp_amx else "avx512"  # AMX: prompts 5-10x faster than vdpbf16ps
    if args.int8_activations and platform.cpp_amx:
        return "avx512"  # int8 rows for every call (auto takes a prompt's to AMX's bf16 tiles)
    return "auto"  # the f32 GEMMs have one path per CPU


def _small_step_codes(args, codes_bf16: bool, codes_f32: bool, checkpoint: str | None) -> bool:
    """Whether small steps may keep a GGUF's codes beside the bf16 weights (`small_step_codes`):
    bf16 weights packed for the C++ GEMM with AVX512_BF16 dots (`codes_bf16`), no quantization
    asked, and (once the checkpoint is known) a GGUF with quantized blocks. Raises ValueError
    for a checkpoint quantized otherwise than asked, and for `small_step_codes=True` or
    `small_step_factored=True` that cannot hold (the latter also holds for a GGUF's codes under
    float32 in the C++ GEMM: `codes_f32`)."""
    asked = args.quantization
    small = args.small_step_codes is not False and asked is None and codes_bf16
    if args.small_step_codes and not small:
        raise ValueError(
            "small_step_codes needs dtype bfloat16 on one CPU device with AVX512_BF16 and the C++ "
            "kernels, packed weights and no quantization asked"
        )
    if checkpoint != UNKNOWN:
        if checkpoint and asked not in (None, checkpoint):
            raise ValueError(
                f"the checkpoint is already quantized ({checkpoint}): it cannot be loaded with quantization={asked!r}"
            )
        if asked in CHECKPOINT_METHODS and checkpoint != asked:
            raise ValueError(
                f"quantization={asked!r} needs a checkpoint quantized so, and this one has no {asked} weights"
            )
        small = small and checkpoint == "gguf"
        if args.small_step_codes and not small:
            raise ValueError("small_step_codes needs a GGUF model with quantized blocks; this checkpoint has none")
    gguf_codes = small or (asked == "gguf" and codes_bf16) or (codes_f32 and checkpoint in ("gguf", UNKNOWN))
    int8_bf16 = args.int8_activations and not codes_f32
    if args.small_step_factored and (int8_bf16 or args.batch_invariant or not gguf_codes):
        raise ValueError(
            "small_step_factored needs a GGUF's codes in the C++ kernels on one CPU device: under dtype "
            "bfloat16 with AVX512_BF16 (small-step codes, or quantization='gguf'), or under float32; and "
            "neither int8_activations (but under float32) nor batch_invariant"
        )
    return small


def _linear_plan(
    name: str,
    method: str | None,
    platform: Platform,
    *,
    cpp_gemm: bool,
    pack_floats: bool,
    dtype: str,
    int8_activations: bool,
    factored: bool,
    small: bool,
    tied: bool,
) -> LinearPlan:
    float_plan = LinearPlan(None, "cpp" if pack_floats else "xla")
    if name in EXPERT_MATRICES:  # weight-only codes, dequantized in the step (models/moe.py)
        codes = {"w8a8": "int8_weight_only"}.get(method, method)
        return LinearPlan(codes, "xla")
    if name == "embed" and not tied:  # a table lookup: a GGUF's codes (rows in f32) kept, else a float table
        return LinearPlan("gguf", "cpp" if cpp_gemm else "xla") if method == "gguf" else LinearPlan(None, "xla")
    if method is None:
        kept = small and name in (*LAYER_MATRICES, "lm_head", "embed")
        int8 = kept and int8_activations and name in LAYER_MATRICES
        factor = kept and factored
        small_acts = "int8" if int8 else "factored" if factor else "bf16"
        return dataclasses.replace(float_plan, small_step_codes=kept, small_step_activations=small_acts)
    # A 4-bit LM head cost the default model 6.5% perplexity: 8-bit codes there (llama.cpp keeps its 6-8).
    codes = "int8_weight_only" if method == "int4" and name in ("lm_head", "embed") else method
    if cpp_gemm:
        kernel = "cpp"
    elif platform.name == "gpu" and codes != "w8a8":
        kernel = "pallas"
    else:
        kernel = "xla"
    if codes == "w8a8":
        activations = "int8"
    elif kernel == "cpp" and int8_activations:  # (4-bit codes only: `with_int8_activations`)
        activations = "int8_float_factored" if dtype == "float32" and factored and codes == "gguf" else "int8"
    elif kernel == "cpp" and dtype == "bfloat16" and platform.cpp_bf16_dots:
        activations = "factored" if factored else "bf16"
    elif kernel == "cpp" and dtype == "float32" and factored and codes == "gguf":
        activations = "float_factored"
    else:
        activations = "float"
    return LinearPlan(codes, kernel, activations)


__all__ = [
    "CHECKPOINT_METHODS",
    "LINEARS",
    "LinearPlan",
    "QUANTIZE_METHODS",
    "UNKNOWN",
    "WeightPlan",
    "resolve_weight_plan",
]
