// jaxllm's CPU kernel library is built by kernels/native.py from two translation units compiled
// side by side, this one and cpu_kernels_gemm.cc (parsing XLA's FFI headers takes ~2.5 s, so
// not one per file; on two cores, two units cut a cold build's wait from ~16 s to ~11 s). Each
// file they include also compiles on its own.
//
//   paged_attention.h          the attention kernel's contract: arguments, work items, scratch
//   paged_attention.cc         work items, the portable path, the FFI handler
//   paged_attention_avx512.cc  the AVX-512 path (head_dim 32, 64, 128, 256)
//   paged_attention_avx2.cc    the AVX2 + FMA path (head_dim a multiple of 32)
//   kv_write.cc                a step's keys and values into their cache slots, in place; a zeroed pool on 2 MiB pages
//   norm.cc                    RMSNorm with the residual add before it
//   simd.h                     code paths (KernelPath), bf16 widening, exp, transpose, reductions
//   parallel_for.h             work sharing over XLA's intra-op thread pool
//
// and in cpu_kernels_gemm.cc:
//
//   sampling.cc                greedy sampling's argmax + logsumexp, sampled rows' draw, FFI handlers
//   gemm.cc                    matmul against f32 weights packed once into 16-column panels
//   gemm_quant_panel.h         int8 / int4 codes in those panels, with their scales and offsets
//   gemm_quant.cc              matmul against them, dequantized a panel at a time; the FFI handler
//   gemm_q4a8.cc               its act8 path: int4 codes x int8 activations (AVX2, AVX512_VNNI)
//   gemm_q6a8.cc               ... and 6-bit codes x int8 activations
//   gemm_codes_tiles.cc        ... and both codes in a prompt's calls on AMX's bf16 tiles
//   gemm_bf16.cc               bf16 weights packed once into panels of K-pairs, AVX512_BF16 dots

#include "paged_attention.cc"
#include "paged_attention_avx512.cc"
#include "paged_attention_avx2.cc"
#include "kv_write.cc"
#include "norm.cc"
