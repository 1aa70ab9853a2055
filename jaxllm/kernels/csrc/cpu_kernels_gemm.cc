// The second translation unit of jaxllm's CPU kernel library: the GEMMs and the sampler (see
// cpu_kernels_attention.cc for the map of the files).

#include "sampling.cc"
#include "gemm.cc"
#include "gemm_quant.cc"
#include "gemm_bf16.cc"
#include "gemm_quant_bf16.cc"
#include "lora.cc"
