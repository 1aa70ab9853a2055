// 6-bit codes x int8 activations: MatmulQuantImpl's act8 path for bits = 6 (gemm_quant.cc).

#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "gemm.cc"
#include "gemm_q4a8.cc"
#include "gemm_quant_panel.h"
#include "parallel_for.h"
#include "simd.h"

namespace jaxllm {
namespace {

// ----------------------------------------------- 6-bit codes x int8 activations (act8 = 1)
// Codes c in [-32, 31] (GGUF's Q6_K, Q5_0, Q5_K, Q5_1) held as u = c + 32 in 6 bits, times x
// quantized per group of 32 columns as gemm_q4a8.cc does (ActQ8), in integer sums: llama.cpp's
// scheme for these types. The layout (`gemm.six_bit_quads`): a panel's 8 rows of K in 96 bytes,
// the first 64 the low 4 bits of u in the 4-bit `quads` order (byte 4 c + j: column c, row j in
// the low nibble, row 4 + j in the high one), then 32 bytes whose byte i holds the top 2 bits of
// the codes in quad bytes i (low nibble: bits 0-1, high: 2-3) and 32 + i (bits 4-5, 6-7).
//
// A group's sums: with two-level scales the int8 sub-scale m of each weight group (16 rows or
// more) multiplies the int16 pair sums in the vpmaddwd that widens them, so the integer sum over
// an activation group is sum over k of m(k) * u * q; - 32 * m * (q's sum) takes c = u - 32 back
// (per 16 rows, from `ActQ8::t`); then y += isum * F * d + offset * xsum, F the f16 super-scale
// (constant over the 32 rows: a super-block spans a multiple of them). With one-level scales m
// is 1 and F the group's scale (groups of a multiple of 32 rows). Offsets of groups of 16 rows
// (a GGUF's Q4_K parts fused with Q6_K ones) add offset * xsum per 16 rows instead, from
// `ActQ8::s16`. Bounds: a vpmaddubsw pair sum is at most 2 * 63 * 127, two of them
// 32,004 < 2^15; |t| <= 16 * 16 * 127 = 32,512.

constexpr int64_t kSixBlock = 96;  // bytes of 8 rows of a panel's 16 columns

// Whether 6-bit codes with q's scales can multiply int8 rows (K a multiple of 32 checked apart).
inline bool six_bit_act8_ok(const QuantPanel& q) {
  if (q.super_scale)
    return q.group % 16 == 0 && (q.group * q.per_super) % kActGroup == 0;
  return q.group % kActGroup == 0;
}

inline int32_t six_code(const uint8_t* codes, int64_t k, int64_t c) {  // c's code of row k: u - 32
  const uint8_t* blk = codes + k / 8 * kSixBlock;
  const int64_t byte = 4 * c + k % 4, high = k % 8 >= 4;
  const int32_t low = high ? blk[byte] >> 4 : blk[byte] & 15;
  const int32_t top = (blk[64 + byte % 32] >> (2 * high + (byte >= 32 ? 4 : 0))) & 3;
  return (low | top << 4) - 32;
}

// Column j's integer multiplier of group g (the sub-scale; 1 with one level) and float factor
// of the activation group starting at row k0 (the super-scale, or the scale).
inline int32_t six_multiplier(const QuantPanel& q, int64_t g, int64_t p, int64_t j) {
  return q.super_scale ? static_cast<const int8_t*>(q.scale)[q.scale_at(g, p) + j] : 1;
}

inline void six_factors(const QuantPanel& q, int64_t k0, int64_t p, float* f, float* o) {
  const int64_t g = k0 / q.group;
  float s[kPanel];
  group_scales(q, g, p, s, o);
  for (int64_t j = 0; j < kPanel; ++j) {
    f[j] = q.super_scale ? half_to_f32(q.super_scale[q.super_at(g, p) + j]) : s[j];
    if (q.group % kActGroup) o[j] = 0.f;  // (offsets of 16 rows: added per 16 rows)
  }
}

void q6a8_rows_portable(const QuantPanel& q, const ActQ8& a, int64_t p, float* y, int64_t ldy, int64_t R) {
  const uint8_t* codes = static_cast<const uint8_t*>(q.codes) + p * (q.K / 8) * kSixBlock;
  float f[kPanel], o[kPanel];
  for (int64_t i = 0; i < R; ++i) std::fill(y + i * ldy, y + i * ldy + kPanel, 0.f);
  for (int64_t b = 0; b < a.groups; ++b) {
    const int64_t k0 = b * kActGroup;
    six_factors(q, k0, p, f, o);
    for (int64_t i = 0; i < R; ++i) {
      for (int64_t j = 0; j < kPanel; ++j) {
        int32_t isum = 0;
        for (int64_t k = k0; k < k0 + kActGroup; ++k)
          isum += six_multiplier(q, k / q.group, p, j) * six_code(codes, k, j) * a.q[i * a.K + k];
        y[i * ldy + j] += isum * (f[j] * a.d[i * a.groups + b]) + o[j] * a.s[i * a.groups + b];
      }
    }
    for (int64_t kh = k0; q.offset && q.group % kActGroup && kh < k0 + kActGroup; kh += 16) {
      float s[kPanel], o16[kPanel];
      group_scales(q, kh / q.group, p, s, o16);
      for (int64_t i = 0; i < R; ++i)
        for (int64_t j = 0; j < kPanel; ++j) y[i * ldy + j] += o16[j] * a.s16[i * (a.K / 16) + kh / 16];
    }
  }
}

#if defined(JAXLLM_AVX2) && defined(__F16C__)  // (F16C: every AVX2 CPU jaxllm targets)
#define JAXLLM_Q6A8_AVX2 1
// R rows of y, panel p's 16 columns: per 8 rows of K, the 96 bytes into four vectors of u (the
// 4-bit kernel's nibble halves with their top bits or-ed in), each pair meeting broadcasts of 4
// bytes of q in two vpmaddubsw; vpmaddwd by the group's multipliers widens them to int32.
template <int R>
void q6a8_rows_avx2(const QuantPanel& q, int64_t p, const ActQ8& a, float* __restrict y, int64_t ldy) {
  const uint8_t* codes = static_cast<const uint8_t*>(q.codes) + p * (q.K / 8) * kSixBlock;
  const __m256i low4 = _mm256_set1_epi8(15), top2 = _mm256_set1_epi8(0x30), ones = _mm256_set1_epi16(1);
  const bool offset16 = q.offset && q.group % kActGroup;  // (offsets of 16 rows)
  ScaleCursor cursor(q, p);
#pragma GCC unroll 4
  for (int i = 0; i < R; ++i) std::fill(y + i * ldy, y + i * ldy + kPanel, 0.f);
  for (int64_t b = 0; b < a.groups; ++b) {
    const int64_t k0 = b * kActGroup;
    __m256i i0[R], i1[R];  // int32 sums: columns 0-7 and 8-15
#pragma GCC unroll 4
    for (int i = 0; i < R; ++i) i0[i] = i1[i] = _mm256_setzero_si256();
    for (int64_t kh = k0; kh < k0 + kActGroup; kh += 16) {
      cursor.step(kh);
      __m256i m0 = ones, m1 = ones;  // the multipliers, each column's twice (vpmaddwd's int16 pairs)
      if (q.super_scale) {
        const auto* sub = static_cast<const int8_t*>(q.scale) + cursor.at;
        const __m128i s = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sub));
        m0 = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(s, s));
        m1 = _mm256_cvtepi8_epi16(_mm_unpackhi_epi8(s, s));
      }
#pragma GCC unroll 2
      for (int64_t k = kh; k < kh + 16; k += 8) {
        const uint8_t* blk = codes + k / 8 * kSixBlock;
        _mm_prefetch(reinterpret_cast<const char*>(blk + kQuadsPrefetch), _MM_HINT_T1);
        const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk));
        const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32));
        const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64));
        const __m256i lo0 = _mm256_or_si256(_mm256_and_si256(v0, low4), _mm256_and_si256(_mm256_slli_epi16(h, 4), top2));
        const __m256i hi0 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v0, 4), low4),
                                            _mm256_and_si256(_mm256_slli_epi16(h, 2), top2));
        const __m256i lo1 = _mm256_or_si256(_mm256_and_si256(v1, low4), _mm256_and_si256(h, top2));
        const __m256i hi1 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v1, 4), low4),
                                            _mm256_and_si256(_mm256_srli_epi16(h, 2), top2));
#pragma GCC unroll 4
        for (int i = 0; i < R; ++i) {
          const __m256i x0 = broadcast4_ymm(a.q + i * a.K + k), x1 = broadcast4_ymm(a.q + i * a.K + k + 4);
          const __m256i s0 = _mm256_add_epi16(_mm256_maddubs_epi16(lo0, x0), _mm256_maddubs_epi16(hi0, x1));
          const __m256i s1 = _mm256_add_epi16(_mm256_maddubs_epi16(lo1, x0), _mm256_maddubs_epi16(hi1, x1));
          i0[i] = _mm256_add_epi32(i0[i], _mm256_madd_epi16(s0, m0));
          i1[i] = _mm256_add_epi32(i1[i], _mm256_madd_epi16(s1, m1));
        }
      }
#pragma GCC unroll 4
      for (int i = 0; i < R; ++i) {  // - 32 * m * (q's sum over the 16 rows)
        const __m256i t = _mm256_set1_epi16(a.t[i * (a.K / 16) + kh / 16]);
        i0[i] = _mm256_add_epi32(i0[i], _mm256_madd_epi16(m0, t));
        i1[i] = _mm256_add_epi32(i1[i], _mm256_madd_epi16(m1, t));
      }
      if (offset16) {  // offset * xsum over the 16 rows, into y
        const __m256 o0 = scales_f32x8(q, q.offset, q.super_offset, cursor.at, cursor.super_at),
                     o1 = scales_f32x8(q, q.offset, q.super_offset, cursor.at + 8, cursor.super_at + 8);
        for (int i = 0; i < R; ++i) {
          const __m256 xs = _mm256_set1_ps(a.s16[i * (a.K / 16) + kh / 16]);
          float* yi = y + i * ldy;
          _mm256_storeu_ps(yi, _mm256_fmadd_ps(o0, xs, _mm256_loadu_ps(yi)));
          _mm256_storeu_ps(yi + 8, _mm256_fmadd_ps(o1, xs, _mm256_loadu_ps(yi + 8)));
        }
      }
    }
    // The float factors (offsets of groups of 32 rows or more: the cursor's group is k0's).
    const int64_t at = cursor.at, sat = cursor.super_at;
    __m256 f[2], o[2];
    for (int h = 0; h < 2; ++h) {
      f[h] = q.super_scale
                 ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q.super_scale + sat + 8 * h)))
                 : scales_f32x8(q, q.scale, nullptr, at + 8 * h, 0);
      o[h] = q.offset && !offset16 ? scales_f32x8(q, q.offset, q.super_offset, at + 8 * h, sat + 8 * h)
                                   : _mm256_setzero_ps();
    }
#pragma GCC unroll 4
    for (int i = 0; i < R; ++i) {
      const __m256 d = _mm256_set1_ps(a.d[i * a.groups + b]), xs = _mm256_set1_ps(a.s[i * a.groups + b]);
      float* yi = y + i * ldy;
      _mm256_storeu_ps(yi, _mm256_fmadd_ps(o[0], xs, _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0[i]), _mm256_mul_ps(f[0], d),
                                                                     _mm256_loadu_ps(yi))));
      _mm256_storeu_ps(yi + 8, _mm256_fmadd_ps(o[1], xs, _mm256_fmadd_ps(_mm256_cvtepi32_ps(i1[i]),
                                                                         _mm256_mul_ps(f[1], d), _mm256_loadu_ps(yi + 8))));
    }
  }
}
#endif  // JAXLLM_AVX2 && __F16C__

#ifdef JAXLLM_AVX512_VNNI
// A block's (8 rows of K, kSixBlock bytes) u of the 16 columns as VPDPBUSD takes them: rows 0-3
// into lo, rows 4-7 into hi. The top bits are read once into both halves of a register, and a
// rotate per 64-bit lane brings each quad byte's two bits to bits 4-5 (the first 32 bytes' bits
// 0-1 and 2-3, the last 32's 4-5 and 6-7), where a bit select puts them beside the low nibble.
inline void six_bit_u(const uint8_t* blk, __m512i& lo, __m512i& hi) {
  const __m512i nibble = _mm512_set1_epi8(15), low_tops = _mm512_set1_epi8(0x33),
                high_tops = _mm512_set1_epi8(static_cast<char>(0xCC));
  const __m512i turn_low = _mm512_set_epi64(0, 0, 0, 0, 4, 4, 4, 4),
                turn_high = _mm512_set_epi64(62, 62, 62, 62, 2, 2, 2, 2);
  const __m512i v = _mm512_loadu_si512(blk);
  const __m512i h = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64)));
  // (Masked to their two bits before the rotate, bits 6-7 of each byte come out clear.)
  const __m512i t_lo = _mm512_rolv_epi64(_mm512_and_si512(h, low_tops), turn_low);
  const __m512i t_hi = _mm512_rolv_epi64(_mm512_and_si512(h, high_tops), turn_high);
  lo = _mm512_ternarylogic_epi32(nibble, v, t_lo, 0xCA);  // nibble ? v : t
  hi = _mm512_ternarylogic_epi32(nibble, _mm512_srli_epi16(v, 4), t_hi, 0xCA);
}

// Where q6a8_rows_vnni asks for its codes ahead: on the AMX Xeon kind into L1 from 1,024 bytes
// ahead (the 1.5B's Q6_K-like layer matrices at one and four rows in 0.91-0.93x the time of L2 from
// 2,048, alternating builds; the 4-bit kernel level either way), elsewhere into L2 from 2,048
// as before (kQuadsPrefetch; not measured on Zen 4). benchmarks/results/xeon-amx/RESULTS.md.
#ifdef JAXLLM_AMX_INT8
constexpr int64_t kSixPrefetch = 1024;
constexpr auto kSixPrefetchHint = _MM_HINT_T0;
#else
constexpr int64_t kSixPrefetch = kQuadsPrefetch;
constexpr auto kSixPrefetchHint = _MM_HINT_T1;
#endif

// The float factors of an activation group's integer sums, at the cursor of its last 16 rows:
// the super-scale (or one-level scale) f, and the offset o (zero where offsets come per 16 rows).
inline void six_group_factors(const QuantPanel& q, const ScaleCursor& c, bool offset16, __m512& f, __m512& o) {
  f = q.super_scale ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q.super_scale + c.super_at)))
                    : scales_f32x16_at(q, q.scale, nullptr, c.at, 0);
  o = q.offset && !offset16 ? scales_f32x16_at(q, q.offset, q.super_offset, c.at, c.super_at) : _mm512_setzero_ps();
}

// The int8 sub-scales of the 16 columns at the cursor, widened to int32 (two-level scales only).
inline __m512i six_sub_scales(const QuantPanel& q, const ScaleCursor& c) {
  const auto* sub = static_cast<const int8_t*>(q.scale) + c.at;
  return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sub)));
}

// q6a8_rows_avx2 with AVX512_VNNI: per 8 rows of K the 64 quad bytes and the 32 of top bits
// make the 16 columns' u of rows 0-3 and of rows 4-7 (six_bit_u), two vpdpbusd a row sum them in
// int32 over each 16 rows of K, and the group's multiplier m scales those sums once (vpmulld),
// with the -32 x q term added first: m (sum u q - 32 sum q). P panels at a time (panel[j], into
// y[j]): each broadcast of q feeds P panels' dot products, and the rows' sums make 2 P R
// independent chains of vpdpbusd. (Not inlined into its row blocks' loops, as the 4-bit kernel.)
template <int R, int P>
__attribute__((noinline)) void q6a8_rows_vnni(const QuantPanel& q, const int64_t* panel, const ActQ8& a,
                                              float* const* y, int64_t ldy) {
  const uint8_t* codes[P];
  ScaleCursor first(q, panel[0]), last(q, panel[P - 1]);
  ScaleCursor* cursor[2] = {&first, &last};
  for (int j = 0; j < P; ++j) codes[j] = static_cast<const uint8_t*>(q.codes) + panel[j] * (q.K / 8) * kSixBlock;
  const bool offset16 = q.offset && q.group % kActGroup;  // (offsets of 16 rows)
  __m512 acc[P][R];
#pragma GCC unroll 2
  for (int j = 0; j < P; ++j)
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) acc[j][i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < a.groups; ++b) {
    const int64_t k0 = b * kActGroup;
    __m512i isum[P][R];
#pragma GCC unroll 2
    for (int j = 0; j < P; ++j)
#pragma GCC unroll 8
      for (int i = 0; i < R; ++i) isum[j][i] = _mm512_setzero_si512();
    for (int64_t kh = k0; kh < k0 + kActGroup; kh += 16) {
      __m512i part[P][R];
#pragma GCC unroll 8
      for (int i = 0; i < R; ++i) {
        const __m512i t = _mm512_set1_epi32(2 * a.t[i * (a.K / 16) + kh / 16]);  // -32 sum q
#pragma GCC unroll 2
        for (int j = 0; j < P; ++j) part[j][i] = t;
      }
#pragma GCC unroll 2
      for (int64_t k = kh; k < kh + 16; k += 8) {
        __m512i lo[P], hi[P];
#pragma GCC unroll 2
        for (int j = 0; j < P; ++j) {
          const uint8_t* blk = codes[j] + k / 8 * kSixBlock;
          _mm_prefetch(reinterpret_cast<const char*>(blk + kSixPrefetch), kSixPrefetchHint);
          six_bit_u(blk, lo[j], hi[j]);
        }
#pragma GCC unroll 8
        for (int i = 0; i < R; ++i) {
          const __m512i x0 = broadcast4_zmm(a.q + i * a.K + k), x1 = broadcast4_zmm(a.q + i * a.K + k + 4);
#pragma GCC unroll 2
          for (int j = 0; j < P; ++j)
            part[j][i] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(part[j][i], lo[j], x0), hi[j], x1);
        }
      }
#pragma GCC unroll 2
      for (int j = 0; j < P; ++j) {
        cursor[j]->step(kh);
        if (offset16) {  // offset * xsum over the 16 rows
          const __m512 o = scales_f32x16_at(q, q.offset, q.super_offset, cursor[j]->at, cursor[j]->super_at);
#pragma GCC unroll 8
          for (int i = 0; i < R; ++i)
            acc[j][i] = _mm512_fmadd_ps(o, _mm512_set1_ps(a.s16[i * (a.K / 16) + kh / 16]), acc[j][i]);
        }
        if (q.super_scale) {
          const __m512i m = six_sub_scales(q, *cursor[j]);
#pragma GCC unroll 8
          for (int i = 0; i < R; ++i) isum[j][i] = _mm512_add_epi32(isum[j][i], _mm512_mullo_epi32(part[j][i], m));
        } else {
#pragma GCC unroll 8
          for (int i = 0; i < R; ++i) isum[j][i] = _mm512_add_epi32(isum[j][i], part[j][i]);
        }
      }
    }
    // The float factors (offsets of groups of 32 rows or more: the cursor's group is k0's).
#pragma GCC unroll 2
    for (int j = 0; j < P; ++j) {
      __m512 f, o;
      six_group_factors(q, *cursor[j], offset16, f, o);
      add_group_sums<R>(a, b, isum[j], f, o, acc[j]);
    }
  }
#pragma GCC unroll 2
  for (int j = 0; j < P; ++j)
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) _mm512_storeu_ps(y[j] + i * ldy, acc[j][i]);
}
#endif  // AVX512_VNNI

#ifdef JAXLLM_AMX_INT8
// The 6-bit codes on AMX's int8 tiles (gemm_q4a8.cc's q4a8_rows_tiles): a TDPBSSD per 16 rows of
// K (the signed codes c by x's q: the sum of c q that q6a8_rows_vnni makes of u q - 32 q; the
// sub-scales change every 16 rows), both halves' sums of an activation group then taken as
// q6a8_rows_vnni takes its parts (times the sub-scale), and the float steps in its order: its
// numbers exactly.

// The codes c = u - 32 of rows kh .. kh + 15 (two blocks, six_bit_u) into 4 rows of 64 bytes in
// `words`: signed, so that TDPBSSD sums c q itself and no -32 x q term is added per row.
inline void q6_half_words(const uint8_t* codes, int64_t kh, uint8_t (*words)[64]) {
  const __m512i bias = _mm512_set1_epi8(32);
#pragma GCC unroll 2
  for (int c = 0; c < 2; ++c) {
    const uint8_t* blk = codes + (kh / 8 + c) * kSixBlock;
    _mm_prefetch(reinterpret_cast<const char*>(blk + kQuadsPrefetch), _MM_HINT_T0);  // (q4_group_words')
    __m512i lo, hi;
    six_bit_u(blk, lo, hi);
    _mm512_store_si512(words[2 * c], _mm512_sub_epi8(lo, bias));
    _mm512_store_si512(words[2 * c + 1], _mm512_sub_epi8(hi, bias));
  }
}

// Activation group b's two halves' sums (stored in sums[2b % 4], sums[(2b + 1) % 4]) into R
// rows' f32 sums acc, in q6a8_rows_vnni's steps and order; a row at a time, so that only the R
// sums stay in registers (the int32 sums of all rows beside them spilled at R = 16).
template <int R>
inline void q6_tiles_group(const QuantPanel& q, const ActQ8& a, ScaleCursor& cursor, bool offset16,
                           const int32_t (*sums)[16][kPanel], int64_t b, __m512* acc) {
  const int64_t H = a.K / 16, h0 = 2 * b;
  __m512i m[2];
  __m512 o16[2];
#pragma GCC unroll 2
  for (int k = 0; k < 2; ++k) {
    cursor.step(16 * (h0 + k));
    o16[k] = offset16 ? scales_f32x16_at(q, q.offset, q.super_offset, cursor.at, cursor.super_at)
                      : _mm512_setzero_ps();  // offset * xsum over the 16 rows
    m[k] = q.super_scale ? six_sub_scales(q, cursor) : _mm512_set1_epi32(1);
  }
  __m512 f, o;
  six_group_factors(q, cursor, offset16, f, o);
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i) {
    __m512i isum = _mm512_setzero_si512();
#pragma GCC unroll 2
    for (int k = 0; k < 2; ++k) {
      const int64_t h = h0 + k;
      if (offset16) acc[i] = _mm512_fmadd_ps(o16[k], _mm512_set1_ps(a.s16[i * H + h]), acc[i]);
      const __m512i part = _mm512_load_si512(sums[h % 4][i]);
      isum = _mm512_add_epi32(isum, q.super_scale ? _mm512_mullo_epi32(part, m[k]) : part);
    }
    acc[i] = add_group_sum(a, b, i, isum, f, o, acc[i]);
  }
}

// R rows (1-16) of panel p into y, pipelined by halves of an activation group (half h: rows
// 16 h .. 16 h + 15 of K, tiles 0-2 for even h, 3-5 for odd): h + 1's product issued while h's
// sums are stored, and a group scaled once its halves' sums have been stored a step before. One
// loop body, no closures (as q4a8_rows_tiles).
template <int R>
__attribute__((noinline)) void q6a8_rows_tiles(const QuantPanel& q, int64_t p, const ActQ8& a, float* y,
                                               int64_t ldy) {
  const uint8_t* codes = static_cast<const uint8_t*>(q.codes) + p * (q.K / 8) * kSixBlock;
  const int64_t H = a.K / 16, G = a.groups;
  const bool offset16 = q.offset && q.group % kActGroup;
  alignas(64) uint8_t words[4][4][64];      // half h's u in words[h % 4]
  alignas(64) int32_t sums[4][16][kPanel];  // its sums in sums[h % 4]
  ScaleCursor cursor(q, p);
  __m512 acc[R];
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t h = 0; h < std::min<int64_t>(H, 3); ++h) q6_half_words(codes, 16 * h, words[h]);
  JAXLLM_INT8_TILE_PRODUCT(_tile_dpbssd, 0, 1, 2, a.q, a.K, words[0]);
  // Step h: half h + 3's codes split, h + 1's product issued, h's sums stored.
  for (int64_t h = 0; h < H; ++h) {
    const int64_t n = h + 1;
    if (n < H) {
      if (n + 2 < H) q6_half_words(codes, 16 * (n + 2), words[(n + 2) % 4]);
      if (n % 2)
        JAXLLM_INT8_TILE_PRODUCT(_tile_dpbssd, 3, 4, 5, a.q + 16 * n, a.K, words[n % 4]);
      else
        JAXLLM_INT8_TILE_PRODUCT(_tile_dpbssd, 0, 1, 2, a.q + 16 * n, a.K, words[n % 4]);
    }
    if (h % 2)
      _tile_stored(5, sums[h % 4], 64);
    else
      _tile_stored(2, sums[h % 4], 64);
    if (h % 2 && h >= 3) q6_tiles_group<R>(q, a, cursor, offset16, sums, h / 2 - 1, acc);
  }
  q6_tiles_group<R>(q, a, cursor, offset16, sums, G - 1, acc);
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i) _mm512_storeu_ps(y + i * ldy, acc[i]);
}
#endif  // JAXLLM_AMX_INT8

// Rows [r0, r1) of x (quantized in a), panel p's columns into y and panel p2's (-1: none) into
// y2 (row stride ldy): with AVX512_VNNI both at once, else one after the other.
void q6a8_block(const QuantPanel& q, const ActQ8& a, int64_t p, int64_t p2, int64_t r0, int64_t r1, float* y,
                float* y2, int64_t ldy, int32_t path) {
  const int64_t panels[2] = {p, p2};
  float* const outs[2] = {y, y2};
#ifdef JAXLLM_AMX_INT8
  if (path == kAmx) {  // (int8_rows_path's: the int8 tiles)
    int8_tiles_block(a, r0, r1, 16, [&](auto R, const ActQ8& rows, int64_t i) {
      for (int j = 0; j < 2 && panels[j] >= 0; ++j)
        q6a8_rows_tiles<decltype(R)::value>(q, panels[j], rows, outs[j] + i * ldy, ldy);
    });
    return;
  }
#endif
#ifdef JAXLLM_AVX512_VNNI
  if (path == kAuto || path >= kAvx512) {
    if (p2 >= 0) {
      in_blocks_of<4>(a, r0, r1, [&](auto R, const ActQ8& rows, int64_t i) {
        float* const yr[2] = {y + i * ldy, y2 + i * ldy};
        q6a8_rows_vnni<decltype(R)::value, 2>(q, panels, rows, yr, ldy);
      });
      return;
    }
    in_blocks_of<8>(a, r0, r1, [&](auto R, const ActQ8& rows, int64_t i) {
      float* const yr[1] = {y + i * ldy};
      q6a8_rows_vnni<decltype(R)::value, 1>(q, panels, rows, yr, ldy);
    });
    return;
  }
#endif
  for (int j = 0; j < 2 && panels[j] >= 0; ++j) {
    const int64_t pj = panels[j];
    float* const yj = outs[j];
#ifdef JAXLLM_Q6A8_AVX2
    if (path == kAuto || path >= kAvx2) {
      in_blocks_of<4>(a, r0, r1, [&](auto R, const ActQ8& rows, int64_t i) {
        q6a8_rows_avx2<decltype(R)::value>(q, pj, rows, yj + i * ldy, ldy);
      });
      continue;
    }
#endif
    q6a8_rows_portable(q, a.at(r0), pj, yj, ldy, r1 - r0);
  }
}

// y = x @ w for 4- or 6-bit codes x int8 rows (MatmulQuantImpl's act8 path for them).
void matmul_int8_rows(ffi::ThreadPool& pool, const GemmArgs& g, const QuantPanel& q, int32_t path, int32_t swiglu) {
  const ActQ8 a = quantize_activations(pool, g, q.bits == 6);
#ifdef JAXLLM_AMX_INT8
  path = int8_rows_path(path, g.M);
#endif
  int8_rows_items<ActQ8Scratch, true>(pool, g, swiglu, path, [&](int64_t p, int64_t p2, int64_t r0, int64_t r1,
                                                                  float* y, float* y2, int64_t ldy, ActQ8Scratch&) {
    if (q.bits == 6)  // two panels at a time
      q6a8_block(q, a, p, p2, r0, r1, y, y2, ldy, path);
    else
      q4a8_block(q, a, p, p2, r0, r1, y, y2, ldy, path);
  });
}

}  // namespace
}  // namespace jaxllm
