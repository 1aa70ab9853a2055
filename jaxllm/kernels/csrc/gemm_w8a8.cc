// 8-bit codes x int8 activations, a scale per token (W8A8, `quantization="w8a8"`):
// MatmulQuantImpl's act8 path for 8-bit codes with one scale per column (gemm_quant.cc).

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "gemm.cc"
#include "gemm_quant_panel.h"
#include "parallel_for.h"
#include "simd.h"

namespace jaxllm {
namespace {

// Each row r of x is quantized per group of B columns (B = K: the row whole), x ~ q * d[r, b] for
// its group b, q int8 in [-127, 127], d = max|x| / 127 over the group (1 for a zero group), as
// kv_write.py's int8_rows does for the plain path; then y[r, n] = scale[n] * sum over groups b in
// order of isum(r, b, n) * d[r, b] (an f32 product, then f32 fmas), isum the exact int32 sum of
// q * code over the group (|isum| <= K * 127^2 fits int32 for K up to kW8A8MaxK). Groups of 192
// and 256 columns took back most of the 1.1-1.4% perplexity a scale per row cost the default
// model (README, Quantization). The codes must lie in [-127, 127] (the AVX2 path negates them) and are
// stored for these paths (`pack_codes(..., w8a8=True)`): per 4
// rows of K 64 bytes, each column's 4 codes side by side, in column order, so a 32-byte load is
// 8 columns' 4 codes (interleaving them on every work item instead, as before 2026-11-27, took a
// median 1.25-1.4x the time at 1-4 rows on an AVX2 CPU, the same within noise from 16 rows:
// benchmarks/dots.py).
//   AVX2: vpmaddubsw takes an unsigned and a signed operand and saturates at 2^15, so |q| is
//     the unsigned one and the codes take q's sign (vpsignb): a pair sums to at most
//     2 * 127^2 < 2^15. vpmaddwd with ones then widens the pairs to int32 sums.
//   AVX512_VNNI: vpdpbusd multiplies 4 unsigned bytes by 4 signed ones into an int32 sum with
//     no int16 stage; q + 128 (q's sign bit flipped) is the unsigned operand, and 128 times
//     each column's code sum over the group (`QuantPanel::bias`, [groups, N]) is taken off.

constexpr int64_t kW8A8MaxK = 131072;

struct ActGroups {  // x's rows quantized per group of B columns
  const int8_t* q;  // [M, K]
  const float* d;   // [M, groups]
  int64_t K, B, groups;
  ActGroups at(int64_t r) const { return {q + r * K, d + r * groups, K, B, groups}; }
};

// Rows [r0, r1) of x [M, K] quantized per group of B columns into q [M, K] and d [M, K / B];
// each code stored XOR `flip` (0x80 for the VNNI path: q + 128 as an unsigned byte).
void quantize_token_rows(const float* x, int64_t r0, int64_t r1, int64_t K, int64_t B, int8_t* q, float* d,
                         uint8_t flip) {
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t b = 0; b < K / B; ++b) {
      const float* xb = x + r * K + b * B;
      float amax = 0.f;
      for (int64_t k = 0; k < B; ++k) amax = std::max(amax, std::fabs(xb[k]));
      const float scale = amax * (1.f / 127.f);
      const float db = scale > 0.f ? scale : 1.f;
      d[r * (K / B) + b] = db;
      const float inv = 1.f / db;  // x times it, as XLA computes int8_rows' x / scale
      for (int64_t k = 0; k < B; ++k)
        q[r * K + b * B + k] = static_cast<int8_t>(
            static_cast<int8_t>(std::clamp(std::nearbyint(xb[k] * inv), -127.f, 127.f)) ^ flip);
    }
  }
}

void w8a8_rows_portable(const QuantPanel& w, const ActGroups& a, int64_t p, float* y, int64_t ldy, int64_t R) {
  const int8_t* codes = static_cast<const int8_t*>(w.codes) + p * w.K * kPanel;
  float s[kPanel], o[kPanel];
  group_scales(w, 0, p, s, o);
  for (int64_t i = 0; i < R; ++i)
    for (int64_t j = 0; j < kPanel; ++j) {
      float acc = 0.f;
      for (int64_t b = 0; b < a.groups; ++b) {
        int32_t isum = 0;
        for (int64_t k = b * a.B; k < (b + 1) * a.B; ++k)
          isum += codes[(k / 4) * 4 * kPanel + j * 4 + k % 4] * a.q[i * a.K + k];
        const float part = static_cast<float>(isum);
        acc = b ? std::fma(part, a.d[i * a.groups + b], acc) : part * a.d[i * a.groups];
      }
      y[i * ldy + j] = acc * s[j];
    }
}

#ifdef JAXLLM_AVX2
// R rows of y, the panel's 16 columns: int32 sums in registers over a group of K, their f32
// sum over the groups in y (then scaled by the column scales s).
template <int R>
void w8a8_rows_avx2(const int8_t* __restrict panel, const float* __restrict s, const ActGroups& a,
                    float* __restrict y, int64_t ldy) {
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t grp = 0; grp < a.groups; ++grp) {
    __m256i acc0[R], acc1[R];  // columns 0-7 and 8-15
#pragma GCC unroll 4
    for (int i = 0; i < R; ++i) acc0[i] = acc1[i] = _mm256_setzero_si256();
    for (int64_t k = grp * a.B; k < (grp + 1) * a.B; k += 4) {
      const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + k * kPanel));
      const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + k * kPanel + 32));
#pragma GCC unroll 4
      for (int i = 0; i < R; ++i) {
        int32_t four;
        std::memcpy(&four, a.q + i * a.K + k, sizeof four);
        const __m256i xq = _mm256_set1_epi32(four), xa = _mm256_abs_epi8(xq);
        const __m256i p0 = _mm256_maddubs_epi16(xa, _mm256_sign_epi8(w0, xq));
        const __m256i p1 = _mm256_maddubs_epi16(xa, _mm256_sign_epi8(w1, xq));
        acc0[i] = _mm256_add_epi32(acc0[i], _mm256_madd_epi16(p0, ones));
        acc1[i] = _mm256_add_epi32(acc1[i], _mm256_madd_epi16(p1, ones));
      }
    }
#pragma GCC unroll 4
    for (int i = 0; i < R; ++i) {
      const __m256 di = _mm256_set1_ps(a.d[i * a.groups + grp]);
      const __m256 p0 = _mm256_cvtepi32_ps(acc0[i]), p1 = _mm256_cvtepi32_ps(acc1[i]);
      float* yi = y + i * ldy;
      _mm256_storeu_ps(yi, grp ? _mm256_fmadd_ps(p0, di, _mm256_loadu_ps(yi)) : _mm256_mul_ps(p0, di));
      _mm256_storeu_ps(yi + 8, grp ? _mm256_fmadd_ps(p1, di, _mm256_loadu_ps(yi + 8)) : _mm256_mul_ps(p1, di));
    }
  }
  const __m256 s0 = _mm256_loadu_ps(s), s1 = _mm256_loadu_ps(s + 8);
#pragma GCC unroll 4
  for (int i = 0; i < R; ++i) {
    _mm256_storeu_ps(y + i * ldy, _mm256_mul_ps(_mm256_loadu_ps(y + i * ldy), s0));
    _mm256_storeu_ps(y + i * ldy + 8, _mm256_mul_ps(_mm256_loadu_ps(y + i * ldy + 8), s1));
  }
}
#endif  // JAXLLM_AVX2

#ifdef JAXLLM_AVX512_VNNI
// R rows x P panels of y with AVX512_VNNI, every int32 sum over a group of K in registers (P x R
// of them), as bf16_rows does for bf16: per 4 rows of K, P panel loads and R broadcasts of qb
// feed R x P vpdpbusd. qb: the rows' q + 128 as unsigned bytes (row stride K), d their group
// scales (row stride `groups`); bias[p]: 128 times panel p's column code sums per group (group
// stride `bias_stride`), where a group's sums start; as a group ends its sums join the f32 ones
// (in `part`, L1: no registers are left for them); scale[p]: its column scales. SWIGLU: the first P / 2
// panels are gate panels, the rest their up panels, and y gets silu(gate) * up. Never inlined,
// for the reason bf16_rows is not. (One panel against 8 rows, as before 2026-11-27, spent a load
// per vpdpbusd and ran the layer GEMMs at ~0.6x this.) `pf`: gemm.cc's Prefetcher, pf->lines
// lines every kPrefetchSegment steps of 4 rows of K.
template <int R, int P, bool SWIGLU>
__attribute__((noinline)) void w8a8_tile_vnni(const int8_t* const* w, const int32_t* const* bias,
                                              int64_t bias_stride, const __m512* scale, const uint8_t* __restrict qb,
                                              const float* __restrict d, int64_t groups, int64_t K,
                                              float* __restrict y, int64_t ldy, Prefetcher* pf) {
  const int8_t* wp[P];
  for (int p = 0; p < P; ++p) wp[p] = w[p];
  const int64_t B = K / groups;
  alignas(64) float part[R][P][kPanel];
  PrefetchStream next_weights(pf);
  for (int64_t grp = 0; grp < groups; ++grp) {
    __v16si acc[P][R];  // (as __m512i, GCC kept these in memory and reloaded them every k)
    for (int p = 0; p < P; ++p) {
      const __m512i off = _mm512_loadu_si512(bias[p] + grp * bias_stride);
      const __v16si start = (__v16si)_mm512_sub_epi32(_mm512_setzero_si512(), off);
#pragma GCC unroll 24
      for (int i = 0; i < R; ++i) acc[p][i] = start;
    }
    for (int64_t k0 = grp * B; k0 < (grp + 1) * B; k0 += 4 * kPrefetchSegment) {
      next_weights.next();
      for (int64_t k = k0, k1 = std::min((grp + 1) * B, k0 + 4 * kPrefetchSegment); k < k1; k += 4) {
        __m512i b[P];
#pragma GCC unroll 4
        for (int p = 0; p < P; ++p) b[p] = _mm512_loadu_si512(wp[p] + k * kPanel);
#pragma GCC unroll 24
        for (int i = 0; i < R; ++i) {
          int32_t four;
          std::memcpy(&four, qb + i * K + k, sizeof four);
          const __m512i a = _mm512_set1_epi32(four);
#pragma GCC unroll 4
          for (int p = 0; p < P; ++p) acc[p][i] = (__v16si)_mm512_dpbusd_epi32((__m512i)acc[p][i], a, b[p]);
        }
      }
    }
#pragma GCC unroll 24
    for (int i = 0; i < R; ++i) {
      const __m512 di = _mm512_set1_ps(d[i * groups + grp]);
      for (int p = 0; p < P; ++p) {
        const __m512 sum = _mm512_cvtepi32_ps((__m512i)acc[p][i]);
        _mm512_store_ps(part[i][p],
                        grp ? _mm512_fmadd_ps(sum, di, _mm512_load_ps(part[i][p])) : _mm512_mul_ps(sum, di));
      }
    }
  }
  next_weights.done(pf);
#pragma GCC unroll 24
  for (int i = 0; i < R; ++i) {
    __m512 v[P];
    for (int p = 0; p < P; ++p) v[p] = _mm512_mul_ps(_mm512_load_ps(part[i][p]), scale[p]);
    if (SWIGLU) {
      for (int p = 0; p < P / 2; ++p) _mm512_storeu_ps(y + i * ldy + p * kPanel, swiglu_f32x16(v[p], v[p + P / 2]));
    } else {
      for (int p = 0; p < P; ++p) _mm512_storeu_ps(y + i * ldy + p * kPanel, v[p]);
    }
  }
}

// Rows [0, R) of qb against P panels: blocks of 6 rows, then the remainder. `pf`: the next
// group's Prefetcher, spread over the blocks from two full blocks on (as bf16_block_avx512's).
template <int P, bool SWIGLU>
void w8a8_rows_vnni(const int8_t* const* w, const int32_t* const* bias, int64_t bias_stride, const __m512* scale,
                    const uint8_t* qb, const float* d, int64_t groups, int64_t K, float* y, int64_t ldy, int64_t R,
                    Prefetcher* pf) {
  if (R < 12) pf = nullptr;
  const int64_t steps = K / groups / 4;  // per group
  if (pf) pf->spread((R + 5) / 6 * groups * ((steps + kPrefetchSegment - 1) / kPrefetchSegment));
  int64_t r = 0;
  for (; r + 6 <= R; r += 6)
    w8a8_tile_vnni<6, P, SWIGLU>(w, bias, bias_stride, scale, qb + r * K, d + r * groups, groups, K, y + r * ldy, ldy,
                                 pf);
  switch (R - r) {
#define JAXLLM_W8A8_VNNI_CASE(n)                                                                                   \
  case n:                                                                                                          \
    w8a8_tile_vnni<n, P, SWIGLU>(w, bias, bias_stride, scale, qb + r * K, d + r * groups, groups, K, y + r * ldy, \
                                 ldy, pf);                                                                         \
    break;
    JAXLLM_W8A8_VNNI_CASE(5) JAXLLM_W8A8_VNNI_CASE(4) JAXLLM_W8A8_VNNI_CASE(3) JAXLLM_W8A8_VNNI_CASE(2)
    JAXLLM_W8A8_VNNI_CASE(1)
#undef JAXLLM_W8A8_VNNI_CASE
  }
}

// y = x @ w on the VNNI path, x already quantized (qb, d: `groups` groups a row). Work items as
// the bf16 GEMM's: output panels four at a time (two gate and two up panels with swiglu), rows
// in chunks; while a group runs, the next one this thread runs comes into L2 (gemm.cc's
// Prefetcher).
void matmul_w8a8_vnni(ffi::ThreadPool& pool, const GemmArgs& g, const QuantPanel& wq, const uint8_t* qb,
                      const float* d, int64_t groups, int32_t swiglu) {
  const int64_t K = g.K, B = K / groups, n_out = swiglu ? g.N / 2 : g.N;
  const GemmItems items(g.M, n_out, pool.num_threads(), swiglu ? 2 : 4);
  const auto run_group = [&](int64_t p, int64_t take, int64_t r0, int64_t r1, Prefetcher* use) {
    const int np = static_cast<int>(swiglu ? 2 * take : take);
    const int8_t* w[4];
    const int32_t* bias[4];
    int64_t bias_stride = g.N;  // taken at packing: [groups, N]
    thread_local std::vector<int32_t> sums;  // else summed here: at a few rows as long as the product
    if (!wq.bias) {
      sums.resize(np * groups * kPanel);
      bias_stride = kPanel * np;
    }
    __m512 scale[4];
    for (int j = 0; j < np; ++j) {
      const int64_t pj = swiglu && j >= take ? p + (j - take) + g.N / 2 / kPanel : p + j;
      w[j] = static_cast<const int8_t*>(wq.codes) + pj * K * kPanel;
      if (wq.bias) {
        bias[j] = wq.bias + pj * kPanel;
      } else {
        bias[j] = sums.data() + j * kPanel;
        for (int64_t grp = 0; grp < groups; ++grp) {
          __m512i sum = _mm512_setzero_si512();
          for (int64_t k = grp * B; k < (grp + 1) * B; k += 4)
            sum = _mm512_dpbusd_epi32(sum, _mm512_set1_epi8(1), _mm512_loadu_si512(w[j] + k * kPanel));
          _mm512_storeu_si512(sums.data() + grp * bias_stride + j * kPanel, _mm512_slli_epi32(sum, 7));
        }
      }
      float s[kPanel], o[kPanel];
      group_scales(wq, 0, pj, s, o);
      scale[j] = _mm512_loadu_ps(s);
    }
    const uint8_t* q = qb + r0 * K;
    const float* dr = d + r0 * groups;
    float* y = g.y + r0 * n_out + p * kPanel;
    const int64_t R = r1 - r0;
    const auto rows = [&](auto run) { run(w, bias, bias_stride, scale, q, dr, groups, K, y, n_out, R, use); };
    if (swiglu && np == 4) rows(w8a8_rows_vnni<4, true>);
    else if (swiglu) rows(w8a8_rows_vnni<2, true>);
    else if (np == 4) rows(w8a8_rows_vnni<4, false>);
    else if (np == 2) rows(w8a8_rows_vnni<2, false>);
    else rows(w8a8_rows_vnni<1, false>);
  };
  run_panel_groups(pool, items, g.M, g.N, swiglu, 4, wq.codes, K * kPanel, run_group);
}
#endif  // AVX512_VNNI

struct W8A8Scratch {
  std::vector<float> sums;  // with the SwiGLU epilogue: the item's gate and up sums
};

// Rows [r0, r1) of x (quantized in a), panel p's columns, into y (row stride ldy).
void w8a8_block(const QuantPanel& w, const ActGroups& a, int64_t p, int64_t r0, int64_t r1, float* y, int64_t ldy,
                int32_t path) {
#ifdef JAXLLM_AVX2
  if (path == kAuto || path >= kAvx2) {
    const int8_t* panel = static_cast<const int8_t*>(w.codes) + p * w.K * kPanel;
    float s[kPanel], o[kPanel];
    group_scales(w, 0, p, s, o);
    int64_t r = 0;
    const int64_t R = r1 - r0;
    for (; r + 4 <= R; r += 4) w8a8_rows_avx2<4>(panel, s, a.at(r0 + r), y + r * ldy, ldy);
    switch (R - r) {
      case 3: w8a8_rows_avx2<3>(panel, s, a.at(r0 + r), y + r * ldy, ldy); break;
      case 2: w8a8_rows_avx2<2>(panel, s, a.at(r0 + r), y + r * ldy, ldy); break;
      case 1: w8a8_rows_avx2<1>(panel, s, a.at(r0 + r), y + r * ldy, ldy); break;
    }
    return;
  }
#endif
  w8a8_rows_portable(w, a.at(r0), p, y, ldy, r1 - r0);
}

// y = x @ w for 8-bit codes with x quantized per group of `act_group` columns of a row (0: the
// row whole), as above.
void matmul_w8a8(ffi::ThreadPool& pool, const GemmArgs& g, const QuantPanel& w, int32_t path, int32_t swiglu,
                 int64_t act_group) {
  const int64_t rows_per_item = 16, B = act_group ? act_group : g.K, groups = g.K / B;
  thread_local std::vector<int8_t> xq;  // grown, never shrunk: one allocation per calling thread
  thread_local std::vector<float> xd;
  xq.resize(std::max<size_t>(xq.size(), g.M * g.K));
  xd.resize(std::max<size_t>(xd.size(), g.M * groups));
  int8_t* q = xq.data();
  float* d = xd.data();
#ifdef JAXLLM_AVX512_VNNI
  const bool vnni = path == kAuto || path >= kAvx512;
#else
  const bool vnni = false;
#endif
  parallel_for(pool, (g.M + rows_per_item - 1) / rows_per_item, [&](int64_t i) {
    quantize_token_rows(g.x, i * rows_per_item, std::min(g.M, (i + 1) * rows_per_item), g.K, B, q, d,
                        vnni ? 0x80 : 0);
  });
#ifdef JAXLLM_AVX512_VNNI
  if (vnni) return matmul_w8a8_vnni(pool, g, w, reinterpret_cast<const uint8_t*>(q), d, groups, swiglu);
#endif
  const ActGroups a{q, d, g.K, B, groups};
  int8_rows_items<W8A8Scratch>(pool, g, swiglu, path, [&](int64_t p, int64_t r0, int64_t r1, float* y, int64_t ldy,
                                                         W8A8Scratch&) {
    w8a8_block(w, a, p, r0, r1, y, ldy, path);
  });
}

}  // namespace
}  // namespace jaxllm
