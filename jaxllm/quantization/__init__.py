"""Weight quantization: `LLM(model, quantization=...)`. Quantized checkpoints run as they are
(`gguf`: a GGUF's blocks, `gguf_blocks.py`; `awq`, `gptq`: `gptq_awq.py`; both read into
`checkpoint.QuantizedRows` by the model loaders); float checkpoints (HF or GGUF, a GGUF
dequantized first) are quantized on load by these methods:

| method | weights                                              | activations              |
|--------|------------------------------------------------------|--------------------------|
| `int8` | int8, a scale per output channel                     | float (weight-only)      |
| `int4` | 4-bit codes, a scale and an offset per 32 input rows | float (weight-only)      |
|        | (the LM head: int8 as for `int8`)                    |                          |
| `w8a8` | int8, a scale per output channel                     | int8, a scale per token  |

The layer matrices (fused QKV, attention output, MLP) and the LM head are quantized (the
embedding table too when it is the LM head); norms, biases, an untied embedding table, routers
and experts stay float. Measured on the default model (benchmarks/quantization.py, README):
perplexity +1.1% (`int8`), +0.1% (`int4`, whose Q4_1 layers land on nearly their own grid;
a 4-bit LM head cost 6.5%, hence 8 bits there), +9.6% (`w8a8`: the model's activations have
outlier channels that one scale per token flattens; a scale per 32 input rows brought it to
+2.2%, but needs an int8 dot per group).

How a quantized weight is multiplied (`matmul`):

- **Packed, weight-only** (`layout="panels"`: one CPU device with the native kernels): the C++
  GEMM (kernels/csrc/gemm.cc) dequantizes one 16-column panel at a time into an f32 copy and
  runs its f32 kernel on it: x stays f32, the weights take 1/4 or 1/8 of their f32 bytes, and
  the speed is the f32 GEMM's from 32 rows up.
- **W8A8** (`activations="int8"`): each row of x is quantized to int8 with its own scale and
  XLA runs an `int8 x int8 -> int32` dot (YNNPACK's VNNI / AMX kernels on CPUs that have them,
  1.3-3.8x a bf16 dot there; on AVX2-only CPUs no faster than f32), then rescales.
- **Plain, weight-only**: on GPUs a Pallas (Triton) kernel reads the codes as they are and
  dequantizes them tile by tile in registers (`kernels/quant_matmul.py`: a quarter or an eighth
  of the f32 weight's bytes streamed); on CPUs with the other attention backends, and for shapes
  the kernel does not tile, dequantized inside the jitted step by XLA (memory, not time).

Sharded runs (tensor, pipeline or data parallel) do not take quantized weights yet: `EngineArgs`
and the loader refuse the combination.
"""

from jaxllm.quantization.weights import (
    CHECKPOINT_METHODS,
    METHODS,
    QuantizedWeight,
    dequantize,
    matmul,
    quantize_matrix,
    quantize_params,
    weight_bytes,
)

__all__ = ["CHECKPOINT_METHODS", "METHODS", "QuantizedWeight", "dequantize", "matmul", "quantize_matrix",
           "quantize_params", "weight_bytes"]
