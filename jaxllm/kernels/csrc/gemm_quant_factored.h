// Codes x bf16 rows with each group's scale and offset factored out of its sums
// (`matmul_quantized_bf16(factored=True)`), for calls of up to kFactoredCallRows rows:
//
//   sum_k x_k (s c_k + o) = s sum_k x_k (A + c_k) + (o - A s) sum_k x_k   over a group's k.
//
// A + c is a bf16 number whose mantissa holds the code: 4-bit codes as 128 + c (0x4300 | c),
// 8-bit codes in [-64, 63] (GGUF's Q5 and Q6 types, 4-bit codes widened to 8) as 192 + c, exact,
// so one bit operation makes a code a bf16 weight and VDPBF16PS takes it as it is: a block of 4
// rows x 16 columns costs a widening load, a shift (or a word permute), two VPTERNLOGs and two
// dot products, against sixteen to eighteen instructions where each weight is scaled and rounded
// to bf16 first (convert_block). On two Zen 4 cores that conversion, not memory, bounded a
// one-row product (about 19 GB/s of 4-bit codes against 33 GB/s of reads). The numbers are not
// the bf16 GEMM's: products are exact and the sums f32, without the weights' rounding to bf16
// (closer to the dequantized weights, within f32 rounding of the two group sums). From 3 rows an
// item takes up to 8 rows at a time over two panels (two sums a row in registers), so that each
// code is widened once for 8 rows: at 8 rows
// about 1.1-1.3x a bf16 panel's speed on Zen 4 (one panel at a time ran 5 rows at 0.75x the
// speed of two), at 16 rows about 0.8x, the extra instructions then weighing more than the bytes saved.
//
// 6-bit codes (`pack_codes(codes, 6)`: codes c in [-32, 31], GGUF's Q6_K and Q5 types, in
// three quarters of their 8-bit bytes) are 160 + c: each group of 4 words of a block's two panel
// rows is 24 bits (c + 32 six bits at a time), and one VPERMB and two VPMULTISHIFTQB (AVX512_VBMI)
// put them in place, a VPTERNLOG each masks them and sets the exponent.
//
// Layout: the 4-bit `pairs` panels, 8-bit codes as `pack_codes` lays them out, 6-bit ones as
// `six_bit_words` reads them, and QuantPanel's scales (gemm_quant_bf16.cc, gemm_quant_panel.h).
// 8-bit codes outside [-64, 63] give wrong sums: the caller checks
// (`quantization.activations.with_factored`).

#pragma once

#include <cstdint>
#include <immintrin.h>
#include <vector>

#include "gemm_quant_panel.h"
#include "simd.h"

namespace jaxllm {
namespace {

// A panel's block of 4 rows of K: 32 bytes of 4-bit codes, 48 of 6-bit ones, 64 of 8-bit ones.
constexpr int64_t kBlockBytesOf(int bits) { return bits == 4 ? 32 : bits == 6 ? 48 : 64; }

#if defined(JAXLLM_AVX512_BF16) && defined(JAXLLM_AVX512_VBMI)
#define JAXLLM_SIX_BIT_CODES 1  // 6-bit codes (JaxllmHasSixBitCodes)

// A block of 6-bit codes (48 bytes: 4 rows x 16 columns) as the two panel rows' 32 words each,
// (c + 32) | bias a word. Bytes 6 j .. 6 j + 5 hold words 4 j .. 4 j + 3 of the first row
// (bits 0-23, six a word) and of the second (bits 24-47); VPERMB moves each such run to qword j,
// where VPMULTISHIFTQB takes each word's bits to its low byte.
inline void six_bit_words(const uint8_t* bytes, __m512i bias, __m512i& w0, __m512i& w1) {
  alignas(64) static const uint8_t kSpread[64] = {
      0,  1,  2,  3,  4,  5,  0,  0,  6,  7,  8,  9,  10, 11, 0,  0,  12, 13, 14, 15, 16, 17,
      0,  0,  18, 19, 20, 21, 22, 23, 0,  0,  24, 25, 26, 27, 28, 29, 0,  0,  30, 31, 32, 33,
      34, 35, 0,  0,  36, 37, 38, 39, 40, 41, 0,  0,  42, 43, 44, 45, 46, 47, 0,  0};
  const __m512i block = _mm512_maskz_loadu_epi8(0xFFFFFFFFFFFFull, bytes);  // 48 bytes (no read past them)
  const __m512i runs = _mm512_permutexvar_epi8(_mm512_load_si512(kSpread), block);
  const __m512i first = _mm512_set1_epi64(0x0012000C00060000ll), second = _mm512_set1_epi64(0x002A0024001E0018ll);
  const __m512i six = _mm512_set1_epi16(0x3F);
  w0 = _mm512_ternarylogic_epi32(_mm512_multishift_epi64_epi8(first, runs), six, bias, 0xEA);  // (a & b) | c
  w1 = _mm512_ternarylogic_epi32(_mm512_multishift_epi64_epi8(second, runs), six, bias, 0xEA);
}
#endif

#ifdef JAXLLM_AVX512_BF16
// Rows an item takes at once over two panels (two sums a row and panel: 32 registers at 8 rows).
constexpr int kFactoredMaxRows = 8;
constexpr int kFactoredCallRows = 16;  // calls of up to this many rows factor, kFactoredMaxRows at a time

// A block of 4 rows x 16 columns as two bf16 panel rows of A + m (row pairs (4 b, 4 b + 1) and
// (4 b + 2, 4 b + 3), a column's two words side by side): 4-bit codes c (the `pairs` layout) as
// 128 + c, 8-bit codes c in [-64, 63] (four rows of 16 bytes) as 192 + c (m = c + 64, the low
// seven bits with bit 6 flipped: one VPTERNLOG sets the exponent, flips bit 6 and clears bit 7).
template <int BITS>
inline void factored_block(const uint8_t* bytes, __m512bh& kp0, __m512bh& kp1) {
  if constexpr (BITS == 6) {
#ifdef JAXLLM_SIX_BIT_CODES
    __m512i w0, w1;
    six_bit_words(bytes, _mm512_set1_epi16(0x4300), w0, w1);
    kp0 = (__m512bh)w0, kp1 = (__m512bh)w1;
#endif
  } else if constexpr (BITS == 4) {
    const __m512i low = _mm512_set1_epi16(0x000F), bias = _mm512_set1_epi16(0x4300);
    const __m512i words = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes)));
    kp0 = (__m512bh)_mm512_ternarylogic_epi32(words, low, bias, 0xEA);  // (a & b) | c
    kp1 = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(words, 4), low, bias, 0xEA);
  } else {
    // Per bit, b = 0 c = 0: a; b = 1 c = 0: not a; b = 0 c = 1: 1; b = 1 c = 1: 0.
    const __m512i flip = _mm512_set1_epi16(static_cast<int16_t>(0xBCC0)), set = _mm512_set1_epi16(static_cast<int16_t>(0xFF80));
    alignas(64) static const int16_t kPairs[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                                   8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    const __m512i pairs = _mm512_load_si512(kPairs);  // rows 4 b + t and 4 b + 1 + t, column by column
    const __m512i r01 = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes)));
    const __m512i r23 = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes + 32)));
    kp0 = (__m512bh)_mm512_ternarylogic_epi32(_mm512_permutexvar_epi16(pairs, r01), flip, set, 0x36);
    kp1 = (__m512bh)_mm512_ternarylogic_epi32(_mm512_permutexvar_epi16(pairs, r23), flip, set, 0x36);
  }
}

// How far ahead in each panel's codes a line is asked into L2 (prefetcht1, once a 64-byte line).
// On two Zen 4 cores, the 1.5B's 28 layers of codes (4-bit Q4_K-like, 6-bit), against none,
// alternating call by call: 0.93-0.95x the time at 1-2 rows, 0.82-0.87x at 4, 0.94-1.01x at 8
// (1 KiB ahead gained less, 3-6 KiB as much or less; into L1, prefetcht0, 1.09x at one row).
constexpr int64_t kCodesPrefetch = 2048;

// R rows against P panels (with SWIGLU the first P / 2 are gate panels, the rest their up
// panels): y (or silu(gate) * up) at y + 16 p. xsums: each row's sums of x over each group
// ([R][G], `group_sums`). Each panel's codes are asked into L2 kCodesPrefetch bytes ahead.
template <int BITS, int R, int P, bool SWIGLU>
__attribute__((noinline)) void codes_factored_rows(const QuantPanel& q, const uint32_t* __restrict x, int64_t ldx,
                                                   const float* __restrict xsums, const uint8_t* const* w,
                                                   const int64_t* panel, float* __restrict y, int64_t ldy) {
  constexpr int64_t kBytes = kBlockBytesOf(BITS);
  constexpr float kBase = BITS == 4 ? 128.f : BITS == 6 ? 160.f : 192.f;  // the weights' bf16 numbers less the codes
  const int64_t G = q.groups(), blocks = q.group / 4;
  __m512 acc[P][R];
#pragma GCC unroll 16
  for (int p = 0; p < P; ++p)
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) acc[p][i] = _mm512_setzero_ps();
  for (int p = 0; p < P; ++p) prefetch_scales(q, panel[p]);
  // Each panel's scale and super-scale indices, stepped group by group (QuantPanel's divisions
  // in every group cost a one-row call measurably).
  int64_t at[P], super_at[P], in_super = 0;
  for (int p = 0; p < P; ++p) at[p] = q.scale_at(0, panel[p]), super_at[p] = q.super_at(0, panel[p]);
  for (int64_t g = 0; g < G; ++g) {
    __m512 part[P][R];
#pragma GCC unroll 16
    for (int p = 0; p < P; ++p)
#pragma GCC unroll 8
      for (int i = 0; i < R; ++i) part[p][i] = _mm512_setzero_ps();
    const uint32_t* xg = x + g * q.group / 2;
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t at = (g * blocks + b) * kBytes;
      if ((at & 63) < kBytes)  // (the block that starts a line, or the one that crosses into it)
#pragma GCC unroll 4
        for (int p = 0; p < P; ++p)
          _mm_prefetch(reinterpret_cast<const char*>(w[p] + at + kCodesPrefetch), _MM_HINT_T1);
      __m512bh xp0[R], xp1[R];
#pragma GCC unroll 8
      for (int i = 0; i < R; ++i) {
        xp0[i] = (__m512bh)_mm512_set1_epi32(xg[i * ldx + 2 * b]);
        xp1[i] = (__m512bh)_mm512_set1_epi32(xg[i * ldx + 2 * b + 1]);
      }
#pragma GCC unroll 4
      for (int p = 0; p < P; ++p) {
        __m512bh kp0, kp1;
        factored_block<BITS>(w[p] + at, kp0, kp1);
#pragma GCC unroll 8
        for (int i = 0; i < R; ++i) part[p][i] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(part[p][i], xp0[i], kp0), xp1[i], kp1);
      }
    }
#pragma GCC unroll 4
    for (int p = 0; p < P; ++p) {
      const __m512 s = scales_f32x16_at(q, q.scale, q.super_scale, at[p], super_at[p]);
      const __m512 o = q.offset ? scales_f32x16_at(q, q.offset, q.super_offset, at[p], super_at[p]) : _mm512_setzero_ps();
      const __m512 base = _mm512_fnmadd_ps(_mm512_set1_ps(kBase), s, o);  // o - kBase s
#pragma GCC unroll 8
      for (int i = 0; i < R; ++i)
        acc[p][i] = _mm512_fmadd_ps(base, _mm512_set1_ps(xsums[i * G + g]), _mm512_fmadd_ps(s, part[p][i], acc[p][i]));
    }
    const bool next_super = ++in_super == q.per_super;
    in_super = next_super ? 0 : in_super;
#pragma GCC unroll 4
    for (int p = 0; p < P; ++p) at[p] += kPanel, super_at[p] += next_super ? kPanel : 0;
  }
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
    for (int p = 0; p < (SWIGLU ? P / 2 : P); ++p)
      _mm512_storeu_ps(y + i * ldy + p * kPanel, SWIGLU ? swiglu_f32x16(acc[p][i], acc[p + P / 2][i]) : acc[p][i]);
}

// R rows of P_OUT output panels (as codes_bf16_direct takes them), two panels at a time from 3
// rows up (with swiglu a gate panel and its up panel).
template <int BITS, int R, int P_OUT>
void codes_factored_direct(const QuantPanel& q, const uint32_t* x, int64_t ldx, const float* xsums,
                            const uint8_t* const* w, const int64_t* panel, float* y, int64_t ldy, bool swiglu) {
  if (!swiglu) {
    if constexpr (R >= 3 && P_OUT == 4) {
      codes_factored_rows<BITS, R, 2, false>(q, x, ldx, xsums, w, panel, y, ldy);
      codes_factored_rows<BITS, R, 2, false>(q, x, ldx, xsums, w + 2, panel + 2, y + 2 * kPanel, ldy);
    } else {
      codes_factored_rows<BITS, R, P_OUT, false>(q, x, ldx, xsums, w, panel, y, ldy);
    }
  } else if constexpr (P_OUT <= 2) {
    if (R >= 3 && P_OUT == 2) {
      for (int i = 0; i < 2; ++i) {
        const uint8_t* wi[2] = {w[i], w[2 + i]};
        const int64_t pi[2] = {panel[i], panel[2 + i]};
        codes_factored_rows<BITS, R, 2, true>(q, x, ldx, xsums, wi, pi, y + i * kPanel, ldy);
      }
    } else {
      codes_factored_rows<BITS, R, 2 * P_OUT, true>(q, x, ldx, xsums, w, panel, y, ldy);
    }
  }
}
#endif  // JAXLLM_AVX512_BF16

}  // namespace
}  // namespace jaxllm
