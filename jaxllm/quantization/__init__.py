"""Weight quantization: `LLM(model, quantization=...)`. Quantized checkpoints run as they are
(`gguf`: a GGUF's blocks, `gguf_blocks.py`; `awq`, `gptq`: `gptq_awq.py`; both read into
`checkpoint.QuantizedRows` by the model loaders); float checkpoints (HF or GGUF, a GGUF
dequantized first) are quantized on load by these methods:

| method                     | weights                                              | activations             |
|----------------------------|------------------------------------------------------|-------------------------|
| `w8a8` (also named `int8`) | int8, a scale per output channel, after smoothing    | int8, a scale per token |
| `int8_weight_only`         | int8, a scale per output channel                     | float (weight-only)     |
| `int4`                     | 4-bit codes, a scale and an offset per 32 input rows | float (weight-only)     |
|                            | (the LM head: int8 as for `int8_weight_only`)        |                         |

`int8` is W8A8, as vLLM's "INT8 W8A8" is: on the CPUs measured (Zen 3, Zen 4) it is faster than
the weight-only int8 codes at the same weight bytes and about the same perplexity
(benchmarks/results/zen3 and zen4 RESULTS.md).

The layer matrices (fused QKV, attention output, MLP) and the LM head are quantized (the
embedding table too when it is the LM head); norms, biases, an untied embedding table and routers
stay float; MoE experts' stacks take the method's codes, weight-only (int8 under `w8a8`),
dequantized in the step (models/moe.py). Measured on the default model (benchmarks/quantization.py;
results: benchmarks/results/zen4/RESULTS.md):
perplexity +1.1% (`int8_weight_only`), +0.1% (`int4`, whose Q4_1 layers land on nearly their own
grid; a 4-bit LM head cost 6.5%, hence 8 bits there), +0.4-1.8% (`w8a8`, mean +1.1%: rounding
every activation makes the figure move with any change in the float parts: docs/quantization.md). The model's
activations have outlier channels that one scale per token flattens (+9.6% perplexity as such),
so `w8a8` first smooths them (`smoothing.py`, SmoothQuant's folding, from a calibration run of the float model
over a text jaxllm ships: `weights/calibration.py`).

How a quantized weight is multiplied (`matmul`):

- **Packed, weight-only** (`layout="panels"`: one CPU device with the native kernels): the C++
  GEMM (kernels/csrc/gemm_quant.cc) dequantizes one 16-column panel at a time into an f32 copy
  and runs its f32 kernel on it: x stays f32, the weights take 1/4 or 1/8 of their f32 bytes,
  and the speed is the f32 GEMM's from 32 rows up.
- **Packed codes x bf16 activations** (`activations="bf16"`, `with_bf16_activations`: the
  weight-only matrices of a run under dtype bfloat16 on a CPU with AVX512_BF16): the C++ GEMM
  (kernels/csrc/gemm_quant_bf16.cc) turns each 4- or 8-bit code into bf16(code * scale +
  offset) as it reads it and multiplies with `vdpbf16ps`, in registers for up to 6 rows, else a
  panel at a time into a bf16 copy that the packed bf16 GEMM's tiles run on: the packed bf16
  GEMM's product of the dequantized weights bit for bit (embedding rows rounded to bf16 too), so
  `gguf` on the default model is the bf16 engine's outputs in 0.36x its weight memory. On Zen 4
  the layer GEMMs ran at 1.35-1.45x the bf16 GEMM at 1 row, 1.15x at 4, 0.8x at 16, 0.94-0.98x
  from 64 up, about twice the f32 path above (benchmarks/results/zen4/RESULTS.md). From two rows
  on a CPU with AMX the converted panels go through AMX tiles (the bf16 GEMM's `amx` path), and a
  GGUF under bf16 serves every step from its blocks by default (`weights.plan`), as it does
  without AMX where its bf16 panels would take over 1/16 of the host's memory.
- **Small-step codes** (`EngineArgs.small_step_codes`, on by default for a GGUF under dtype
  bfloat16 on a CPU with AVX512_BF16 and no AMX whose bf16 panels take at most 1/16 of the
  host's memory; the run is not quantized):
  `weights.prepare.small_step_params` keeps the GGUF's blocks as bf16-activation codes for the
  steps of at most SMALL_STEP_ROWS rows and makes the bf16 weights of the other steps from them
  (`gemm.codes_to_bf16_panels`, the GEMM over codes' own conversion): the same numbers both ways,
  the small steps streaming a third of the layer weights' bytes (decode steps at 1.1-1.3x the
  speed on Zen 4: benchmarks/results/zen4/RESULTS.md).
- **Packed 4-bit (and 6-bit) codes x int8 activations** (`EngineArgs.int8_activations`, by
  default on for a GGUF where dtype auto picks float32; `activations="int8"` on a panels weight,
  `with_int8_activations`): llama.cpp's scheme for its formats; under float32 8-bit codes within
  [-32, 31] (Q6_K, Q5_0, Q5_K, Q5_1) too, repacked in 6 bits (`gemm.six_bit_quads`,
  csrc/gemm_q6a8.cc). The C++ GEMM rounds each row of x to int8 per group of 32 columns (a scale per
  group) and sums code x int8 products as integers (AVX2 `vpmaddubsw`, AVX512_VNNI
  `vpdpbusd`), scaling once a group: about 1.3x the weight-only panels' speed on AVX2 from 16
  rows up, 310-510 GFLOP/s on Zen 4, at a perplexity cost (benchmarks/results/zen4/RESULTS.md).
  With small-step codes it applies to the small steps' 4-bit layer codes only
  (`LinearPlan.small_step_activations`). The codes are repacked in `quads` (`gemm.pack_codes`),
  which every kernel path reads as they lie.
  `EngineArgs.small_step_factored` instead has those 4-bit codes factor each group's scale and
  offset out of their bf16 dot products (`QuantizedWeight.factored`, csrc/gemm_quant_factored.h),
  as it has a GGUF's 4-bit codes serving alone under bf16 without AMX, in calls of up to 16 rows
  (with AVX512_VBMI, 8-bit codes within [-32, 31] such as Q6_K's are then held in 6 bits:
  `gemm.six_bit_blocks`).
- **Packed W8A8** (`activations="int8"` on a panels weight: `w8a8` on one CPU device): the C++
  GEMM (kernels/csrc/gemm_w8a8.cc) rounds each row of x to int8 with a scale per group of
  `act_group` columns (`w8a8_act_group`: up to 256; a scale per row cost 1.1-1.4% perplexity),
  sums code x int8 products over each group as exact int32 (AVX2 `vpsignb` + `vpmaddubsw`,
  AVX512_VNNI `vpdpbusd`), adds the groups' sums in f32, each times its scale, and applies the
  column scales once: 1.1-1.9x the weight-only int8 panels on AVX2
  (median 1.3x), and with VNNI (6 rows x 4 panels of sums in registers) on Zen 4 330-665
  GFLOP/s of work from 64 rows, a median 1.9x the packed bf16 GEMM (benchmarks/results/zen4/RESULTS.md). Its
  codes are stored as those instructions read them, a column's 4 codes of 4 rows side by side
  (`pack_codes(..., w8a8=True)`).
- **Plain W8A8** (`activations="int8"`, sharded runs and other backends): each row of x is
  quantized to int8 per group of `act_group` columns (within a shard's rows; a scale per row,
  over all shards, where no group fits) and XLA runs `int8 x int8 -> int32` dots (YNNPACK's
  VNNI / AMX kernels on CPUs that have them: 1.3-3.8x a bf16 dot on a Xeon with AMX, slower
  than bf16 on Zen 4's VNNI; on AVX2-only CPUs no faster than f32), then rescales.
- **Plain, weight-only**: on GPUs a Pallas (Triton) kernel reads the codes as they are and feeds
  them to bf16 dots, scaling the accumulator (`kernels/quant_matmul.py`: half or a quarter of
  the bf16 weight's bytes streamed; on an H200 int8 is 1.0-1.5x a bf16 dot at 1-16 rows,
  slower at 128 rows and more and for int4: benchmarks/results/h200/RESULTS.md); on CPUs with the other attention
  backends, and for shapes the kernel does not tile, dequantized inside the jitted step by XLA
  (memory, not time).

Sharded runs (tensor, pipeline, data parallel, a caller's mesh): `w8a8`, `int8_weight_only` and
`int4` quantize the float weights in their shard layout and each device holds its share of the codes
and scales (`sharding.make_sharded_weight`, split by `parallel.spec_for`), with the one-device weight's
values; the matmuls take the plain paths above (on CPU the C++ GEMM serves one device only).
A checkpoint's quantized weights (`gguf`, `awq`, `gptq`) shard over every axis too
(`layout.tp_layout` regroups a fused matrix's columns with `weights.permute_columns`;
`layout.shard_layout` stacks a layer slot's matrices over the pipeline stages with
`stack_stages`, in the widest of their formats when the layers' block types differ;
`shard_checkpoint_weight` packs each shard's codes); act-order GPTQ splits only along columns.
Over several processes each quantizes the weights it read, then places its own devices'
shards (the weights stay off the mesh until then: `LLMEngine`).
"""

from jaxllm.quantization.params import SMALL_STEP_ROWS, quantize_params, weight_bytes
from jaxllm.quantization.weights import (
    CHECKPOINT_METHODS,
    METHODS,
    QuantizedWeight,
    dequantize,
    matmul,
    quantize_matrix,
)

__all__ = [
    "CHECKPOINT_METHODS",
    "METHODS",
    "SMALL_STEP_ROWS",
    "QuantizedWeight",
    "dequantize",
    "matmul",
    "quantize_matrix",
    "quantize_params",
    "weight_bytes",
]
