// Quantized weights' panels: int8 or int4 codes in gemm.cc's 16-column panels, with their
// scales and offsets (shared by gemm_quant.cc and gemm_q4a8.cc).

#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <immintrin.h>
#include <vector>

#include "gemm.cc"
#include "parallel_for.h"

namespace jaxllm {
namespace {

// The layout (`pack_codes` and `pack_scales` in kernels/gemm.py):
//   codes, 8 bits: int8 [N / 16, K, 16] (column j of panel row k at byte j);
//          4 bits: uint8 [N / 16, K, 8] (byte j: column j in the low nibble, j + 8 in the high);
//   scale, offset: f32 or f16 [N / 16, G, 16], a panel's G groups of 16 side by side: w[k, n] =
//          code * scale[n / 16, g, n % 16] + offset[...] with g = k / (K / G). Without offsets
//          (an empty array) w = code * scale. Panel-major, so that a panel's scales are one
//          run of bytes: laid out [G, N] they lay N scales apart, a stride no prefetcher
//          followed (on the Xeon kind a one-row product then read its codes at half the
//          memory's speed; Zen 4's prefetchers minded it less).
//   Two-level (GGUF's K-quants): scale and offset int8 sub-scales of the f16 super_scale and
//          super_offset [N / 16, G / S, 16]: group g's scale is its sub-scale times the super-scale
//          of group g / S (exact in f32: 8 x 11 significant bits), its offset likewise.

struct QuantPanel {
  const void* codes;
  const void *scale, *offset;  // offset: nullptr when there is none
  bool half;                   // scale and offset are f16 (else f32)
  int64_t K, N, group;         // group: rows of K per scale row
  int bits;
  // Two-level scales: f16 [G / per_super, N] (super_offset nullptr without offsets); scale and
  // offset are then int8. nullptr: one level.
  const uint16_t *super_scale = nullptr, *super_offset = nullptr;
  int64_t per_super = 1;
  // W8A8 with AVX512_VNNI: int32 [K / B, N], 128 x each column's code sum over each block of B
  // rows of K (the activations' blocks), taken once at packing (nullptr: summed per call,
  // gemm_w8a8.cc).
  const int32_t* bias = nullptr;

  int64_t groups() const { return K / group; }
  // Where group g's 16 scales (offsets) of panel p start, in elements; its super-scales'.
  int64_t scale_at(int64_t g, int64_t p) const { return (p * groups() + g) * kPanel; }
  int64_t super_at(int64_t g, int64_t p) const { return (p * (groups() / per_super) + g / per_super) * kPanel; }
};

// Binds the scale buffers of codes [K rows, N columns] to q (scale, offset, their f16 flag and
// group, super-scales): false where their shapes or types are not the layout's above.
inline bool bind_scales(QuantPanel& q, ffi::AnyBuffer scale, ffi::AnyBuffer offset, ffi::AnyBuffer super_scale,
                        ffi::AnyBuffer super_offset) {
  const auto sd = scale.dimensions(), ud = super_scale.dimensions();
  const bool two_level = super_scale.element_count() != 0, with_offset = offset.element_count() != 0;
  const auto t = scale.element_type();
  if (sd.size() != 3 || sd[0] * kPanel != q.N || sd[2] != kPanel || sd[1] < 1 || q.K % sd[1] ||
      !(two_level ? t == ffi::DataType::S8 : t == ffi::DataType::F32 || t == ffi::DataType::F16) ||
      (with_offset && (offset.element_count() != scale.element_count() || offset.element_type() != t)))
    return false;
  if (two_level &&
      (ud.size() != 3 || ud[0] != sd[0] || ud[2] != kPanel || ud[1] < 1 || sd[1] % ud[1] ||
       super_scale.element_type() != ffi::DataType::F16 ||
       super_offset.element_count() != (with_offset ? super_scale.element_count() : 0) ||
       (with_offset && super_offset.element_type() != ffi::DataType::F16)))
    return false;
  if (!two_level && super_offset.element_count()) return false;
  q.scale = scale.untyped_data();
  q.offset = with_offset ? offset.untyped_data() : nullptr;
  q.half = t == ffi::DataType::F16;
  q.group = q.K / sd[1];
  if (two_level) {
    q.super_scale = static_cast<const uint16_t*>(super_scale.untyped_data());
    q.super_offset = with_offset ? static_cast<const uint16_t*>(super_offset.untyped_data()) : nullptr;
    q.per_super = sd[1] / ud[1];
  }
  return true;
}

// IEEE half -> float (normal, subnormal, zero, inf, NaN).
inline float half_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  uint32_t bits;
  if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: man * 2^-24, normalised
    uint32_t m = man, shifts = 0;
    while (!(m & 0x400)) m <<= 1, ++shifts;
    bits = sign | ((113 - shifts) << 23) | ((m & 0x3ff) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

#if defined(__F16C__) && defined(__AVX2__)
// 8 scales (or offsets) from element `at` of `scales` as f32: two-level (`supers` given) int8
// sub-scales times their f16 super-scales from `super_at` (exact in f32), else f32 or f16 ones.
inline __m256 scales_f32x8(const QuantPanel& q, const void* scales, const uint16_t* supers, int64_t at,
                           int64_t super_at) {
  if (supers) {
    const __m128i sub = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(scales) + at));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sub)),
                         _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(supers + super_at))));
  }
  if (q.half)
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(scales) + at)));
  return _mm256_loadu_ps(static_cast<const float*>(scales) + at);
}
#endif

// Panel p's 16 scales (and offsets, zeros without them) of group g, as floats (two-level: each
// int8 sub-scale times its f16 super-scale). f16 ones take F16C's conversion where the build has
// it (every AVX2 CPU we meet): converted one at a time, they were most of a decode's quantized
// GEMM (a 4-bit weight row of 16 columns costs a few instructions, and one group's 32
// conversions come every 32 rows).
inline void group_scales_at(const QuantPanel& q, int64_t at, int64_t super_at, float* s, float* o) {
#if defined(__F16C__) && defined(__AVX2__)
  for (int64_t h = 0; h < kPanel; h += 8) {
    _mm256_storeu_ps(s + h, scales_f32x8(q, q.scale, q.super_scale, at + h, super_at + h));
    _mm256_storeu_ps(o + h, q.offset ? scales_f32x8(q, q.offset, q.super_offset, at + h, super_at + h)
                                     : _mm256_setzero_ps());
  }
#else
  for (int64_t j = 0; j < kPanel; ++j) {
    if (q.super_scale) {
      s[j] = static_cast<const int8_t*>(q.scale)[at + j] * half_to_f32(q.super_scale[super_at + j]);
      o[j] = q.offset ? static_cast<const int8_t*>(q.offset)[at + j] * half_to_f32(q.super_offset[super_at + j]) : 0.f;
    } else if (q.half) {
      s[j] = half_to_f32(static_cast<const uint16_t*>(q.scale)[at + j]);
      o[j] = q.offset ? half_to_f32(static_cast<const uint16_t*>(q.offset)[at + j]) : 0.f;
    } else {
      s[j] = static_cast<const float*>(q.scale)[at + j];
      o[j] = q.offset ? static_cast<const float*>(q.offset)[at + j] : 0.f;
    }
  }
#endif
}

inline void group_scales(const QuantPanel& q, int64_t g, int64_t p, float* s, float* o) {
  group_scales_at(q, q.scale_at(g, p), q.super_scale ? q.super_at(g, p) : 0, s, o);
}

// A panel's scale and super-scale indices stepped group by group, for kernels that walk K in
// order (`scale_at` and `super_at` divide: on AVX2 CPUs a 64-bit division costs tens of cycles,
// about what a group's codes take at one row). `at(k)` moves to row k's group when k starts one.
struct ScaleCursor {
  int64_t at, super_at;  // group g's scales, its super-group's super-scales (elements)
  int64_t g_end = 0, su_end = 0, group, super_rows;
  ScaleCursor(const QuantPanel& q, int64_t p)
      : at(q.scale_at(0, p) - kPanel), super_at((q.super_scale ? q.super_at(0, p) : 0) - kPanel), group(q.group),
        super_rows(q.group * q.per_super) {}
  bool step(int64_t k) {  // true when k starts a group (k walks K in order, each group's first row met)
    if (k != g_end) return false;
    at += kPanel, g_end += group;
    if (k == su_end) super_at += kPanel, su_end += super_rows;
    return true;
  }
};

// Each row's sums of x [M, K] (f32, or bf16 bits) over each group of `group` columns, in f32:
// [M, K / group] (the offsets' terms of the GEMMs that factor their scales out of the sums).
template <typename T>
inline void group_sums(const T* x, int64_t M, int64_t K, int64_t group, std::vector<float>& out) {
  out.resize(M * (K / group));
  for (int64_t r = 0; r < M; ++r)
    for (int64_t g = 0; g < K / group; ++g) {
      float sum = 0.f;
      for (int64_t k = g * group; k < (g + 1) * group; ++k) sum += to_f32(x[r * K + k]);
      out[r * (K / group) + g] = sum;
    }
}

#ifdef __AVX512F__
// Panel p's 16 scales (or, given q.offset and q.super_offset, offsets) of group g in vector
// lanes: group_scales's numbers (an int8 sub-scale times its f16 super-scale is exact in f32),
// made in registers. A decode's 4-bit product spent a quarter of its time on the scales when
// they went through memory.
inline __m512 scales_f32x16_at(const QuantPanel& q, const void* scales, const uint16_t* supers, int64_t at,
                               int64_t super_at) {
  if (supers) {
    const __m512 sub = _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(scales) + at))));
    const auto* sup = reinterpret_cast<const __m256i*>(supers + super_at);
    return _mm512_mul_ps(sub, _mm512_cvtph_ps(_mm256_loadu_si256(sup)));
  }
  if (q.half)
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(scales) + at)));
  return _mm512_loadu_ps(static_cast<const float*>(scales) + at);
}

inline __m512 scales_f32x16(const QuantPanel& q, const void* scales, const uint16_t* supers, int64_t g, int64_t p) {
  return scales_f32x16_at(q, scales, supers, q.scale_at(g, p), supers ? q.super_at(g, p) : 0);
}
#endif

// Panel p's scales (and offsets, super-scales) into L1 ahead of use: one run of bytes each.
inline void prefetch_scales(const QuantPanel& q, int64_t p) {
  const auto run = [](const void* base, int64_t from, int64_t bytes) {
    for (int64_t at = 0; at < bytes; at += 64) _mm_prefetch(static_cast<const char*>(base) + from + at, _MM_HINT_T0);
  };
  const int64_t elem = q.super_scale ? 1 : q.half ? 2 : 4, n = q.groups() * kPanel;
  run(q.scale, q.scale_at(0, p) * elem, n * elem);
  if (q.offset) run(q.offset, q.scale_at(0, p) * elem, n * elem);
  if (q.super_scale) {
    const int64_t sn = q.groups() / q.per_super * kPanel * 2;
    run(q.super_scale, q.super_at(0, p) * 2, sn);
    if (q.super_offset) run(q.super_offset, q.super_at(0, p) * 2, sn);
  }
}

// The work items of a GEMM whose rows of x were quantized to int8 first (gemm_q4a8.cc,
// gemm_w8a8.cc): block(p, r0, r1, y, ldy, scratch) writes rows [r0, r1) of panel p's 16
// columns; with `swiglu`, gate panel p's and up panel p + N / 32's sums for the item's rows go
// through the epilogue. Scratch (per thread) has a `sums` vector beside what block needs.
// `pairs`: block is called for two panels at once instead, block(p, p2, r0, r1, y, y2, ldy,
// scratch) with p2 -1 (and y2 null) where an item's panels leave one alone: consecutive panels,
// or with swiglu a gate panel and its up panel. Each thread takes its own share of the items in
// order (parallel_for_shares): one stream of codes a thread, its prefetches running on into its
// next item. Against items handed out in turn, the 1.5B's layer GEMMs (Q4_K_M's codes) took
// 0.90-0.97x the time at 1-16 rows on the Xeon kind, and one stream decoded 1.02x faster.
template <typename Scratch, bool pairs = false, typename Block>
void int8_rows_items(ffi::ThreadPool& pool, const GemmArgs& g, int32_t swiglu, int32_t path, Block block) {
  const int64_t n_out = swiglu ? g.N / 2 : g.N;
  const GemmItems items(g.M, n_out, pool.num_threads());
  parallel_for_shares<Scratch>(pool, items.count, [&](int64_t item, Scratch& scratch) {
    int64_t r0, r1, p0, p1;
    items.bounds(item, g.M, r0, r1, p0, p1);
    // Panels p and p2 (-1: none) into y and y2.
    const auto run = [&](int64_t p, int64_t p2, float* y, float* y2, int64_t ldy) {
      if constexpr (pairs) {
        block(p, p2, r0, r1, y, y2, ldy, scratch);
      } else {
        block(p, r0, r1, y, ldy, scratch);
        if (p2 >= 0) block(p2, r0, r1, y2, ldy, scratch);
      }
    };
    if (!swiglu) {
      int64_t p = p0;
      for (; pairs && p + 2 <= p1; p += 2) run(p, p + 1, g.y + r0 * g.N + p * kPanel, g.y + r0 * g.N + (p + 1) * kPanel, g.N);
      for (; p < p1; ++p) run(p, -1, g.y + r0 * g.N + p * kPanel, nullptr, g.N);
      return;
    }
    scratch.sums.resize(2 * (r1 - r0) * kPanel);
    float *gate = scratch.sums.data(), *up = gate + (r1 - r0) * kPanel;
    for (int64_t p = p0; p < p1; ++p) {
      run(p, p + g.N / 2 / kPanel, gate, up, kPanel);
      swiglu_store(gate, up, g.y + r0 * n_out + p * kPanel, n_out, r1 - r0, path);
    }
  });
}

}  // namespace
}  // namespace jaxllm
