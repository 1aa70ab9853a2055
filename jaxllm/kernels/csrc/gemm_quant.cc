// Matmul against quantized weights: int8 or int4 codes in gemm.cc's 16-column panels.

#pragma once

#include "gemm.cc"
#include "gemm_codes_tiles.cc"
#include "gemm_q4a8.cc"
#include "gemm_q6a8.cc"
#include "gemm_quant_panel.h"
#include "gemm_w8a8.cc"
#include "parallel_for.h"
#include "simd.h"

namespace jaxllm {
namespace {

// ---------------------------------------------------------------------------- quantized weights
// y = x @ w with w stored as integer codes in the panels (gemm_quant_panel.h), dequantized one
// panel at a time into a per-thread f32 copy that gemm.cc's f32 kernel then multiplies
// (weight-only quantization: x stays f32). The copy is made once per work item, which covers
// up to kRowChunk rows, so at decode and prefill batch sizes the dequantization is a small part
// of the work, and the weights are read at 1/4 (int8) or 1/8 (int4) of the f32 bytes. With
// act8, 4-bit codes multiply x rounded to int8 per block of 32 instead (gemm_q4a8.cc), 6-bit
// ones likewise (gemm_q6a8.cc), 8-bit ones x rounded to int8 per row (W8A8: gemm_w8a8.cc).

void dequantize_panel_portable(const QuantPanel& q, int64_t p, float* out) {
  float s[kPanel], o[kPanel];
  for (int64_t k = 0; k < q.K; ++k) {
    if (k % q.group == 0) group_scales(q, k / q.group, p, s, o);
    for (int64_t j = 0; j < kPanel; ++j) {
      float code;
      if (q.bits == 8) {
        code = static_cast<const int8_t*>(q.codes)[(p * q.K + k) * kPanel + j];
      } else {
        const uint8_t byte = static_cast<const uint8_t*>(q.codes)[(p * q.K + k) * (kPanel / 2) + j % 8];
        code = j < 8 ? (byte & 15) : (byte >> 4);
      }
      out[k * kPanel + j] = code * s[j] + o[j];
    }
  }
}

#ifdef JAXLLM_AVX2
// Panel row k's 16 weights, dequantized into two vectors (columns 0-7, 8-15) with the group's
// scales s0, s1 and offsets o0, o1.
inline void dequantize_row_avx2(const QuantPanel& q, int64_t p, int64_t k, __m256 s0, __m256 s1, __m256 o0,
                                __m256 o1, __m256& w0, __m256& w1) {
  __m256i c0, c1;
  if (q.bits == 8) {
    const __m128i bytes = _mm_loadu_si128(
        reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(q.codes) + (p * q.K + k) * kPanel));
    c0 = _mm256_cvtepi8_epi32(bytes);
    c1 = _mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8));
  } else {
    const __m128i bytes = _mm_loadl_epi64(
        reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(q.codes) + (p * q.K + k) * (kPanel / 2)));
    const __m256i wide = _mm256_cvtepu8_epi32(bytes);
    c0 = _mm256_and_si256(wide, _mm256_set1_epi32(15));
    c1 = _mm256_srli_epi32(wide, 4);
  }
  w0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(c0), s0, o0);
  w1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(c1), s1, o1);
}

// Calls fn(k0, k1, s0, s1, o0, o1) for each scale group [k0, k1) of panel p.
template <typename Fn>
inline void for_each_group_avx2(const QuantPanel& q, int64_t p, Fn fn) {
  float s[kPanel], o[kPanel];
  for (int64_t k0 = 0; k0 < q.K; k0 += q.group) {
    group_scales(q, k0 / q.group, p, s, o);
    fn(k0, std::min(q.K, k0 + q.group), _mm256_loadu_ps(s), _mm256_loadu_ps(s + 8), _mm256_loadu_ps(o),
       _mm256_loadu_ps(o + 8));
  }
}

void dequantize_panel_avx2(const QuantPanel& q, int64_t p, float* out) {
  for_each_group_avx2(q, p, [&](int64_t k0, int64_t k1, __m256 s0, __m256 s1, __m256 o0, __m256 o1) {
    for (int64_t k = k0; k < k1; ++k) {
      __m256 w0, w1;
      dequantize_row_avx2(q, p, k, s0, s1, o0, o1, w0, w1);
      _mm256_storeu_ps(out + k * kPanel, w0);
      _mm256_storeu_ps(out + k * kPanel + 8, w1);
    }
  });
}

// For a few rows (decoding small batches) a panel copy costs more than the product: y rows
// [r, r + R), panel p's columns, with each row of weights dequantized into registers as used.
// The register block repeats panel_rows' on purpose: the f32 GEMM (the engine's default path)
// keeps the code it was tuned and measured with; a version sharing one block through a lambda
// could not be told apart from it in timings on a noisy 2-vCPU machine, so it was not taken.
template <int R>
void quant_panel_rows_avx2(const QuantPanel& q, const float* __restrict x, int64_t p, float* __restrict y,
                           int64_t ldy) {
  __m256 acc0[R], acc1[R];
#pragma GCC unroll 6
  for (int i = 0; i < R; ++i) acc0[i] = acc1[i] = _mm256_setzero_ps();
  for_each_group_avx2(q, p, [&](int64_t k0, int64_t k1, __m256 s0, __m256 s1, __m256 o0, __m256 o1) {
    for (int64_t k = k0; k < k1; ++k) {
      __m256 b0, b1;
      dequantize_row_avx2(q, p, k, s0, s1, o0, o1, b0, b1);
#pragma GCC unroll 6
      for (int i = 0; i < R; ++i) {
        const __m256 a = _mm256_broadcast_ss(x + i * q.K + k);
        acc0[i] = _mm256_fmadd_ps(a, b0, acc0[i]);
        acc1[i] = _mm256_fmadd_ps(a, b1, acc1[i]);
      }
    }
  });
#pragma GCC unroll 6
  for (int i = 0; i < R; ++i) {
    _mm256_storeu_ps(y + i * ldy, acc0[i]);
    _mm256_storeu_ps(y + i * ldy + 8, acc1[i]);
  }
}

// Panel p's columns of R rows of y (from row x, into y with row stride ldy), in registers.
void quant_panel_block_avx2(const QuantPanel& q, const float* x, int64_t p, float* y, int64_t ldy, int64_t R) {
  int64_t r = 0;
  for (; r + 4 <= R; r += 4) quant_panel_rows_avx2<4>(q, x + r * q.K, p, y + r * ldy, ldy);
  x += r * q.K;
  y += r * ldy;
  switch (R - r) {
    case 3: quant_panel_rows_avx2<3>(q, x, p, y, ldy); break;
    case 2: quant_panel_rows_avx2<2>(q, x, p, y, ldy); break;
    case 1: quant_panel_rows_avx2<1>(q, x, p, y, ldy); break;
  }
}
#endif  // JAXLLM_AVX2

// ------------------------------------------------ the group scales factored out (factored = 1)
// For calls of one or two rows (decodes of one or two streams): each group's scale and offset
// come out of its sums,
//
//   y[r, n] = sum over groups g of s[g, n] sum_k x[r, k] c[k, n] + o[g, n] sum_k x[r, k],
//
// so a weight costs its code's conversion to f32 (exact) and one FMA, where dequantizing it costs
// a second FMA. Each row and column half sums in kChains chains over k % kChains, added at each
// group's end, and one row takes two panels at once: eight chains hide the FMAs' latency (one
// chain a row and half left the dequantizing kernel waiting on it: at one row about half the
// memory's speed on Zen 4 with AVX2). A row's numbers are the same alone or beside another.
// From three rows the FMAs with x outnumber the conversions, and four rows' sixteen chains would
// not fit AVX2's registers: the dequantizing kernel is as fast there or faster. Not the
// dequantized panel's numbers: within f32 rounding of the group sums.
constexpr int64_t kF32FactoredCallRows = 2;
constexpr int kChains = 2;

#if defined(JAXLLM_AVX2) && defined(__F16C__)  // (F16C: every AVX2 CPU jaxllm targets)
#define JAXLLM_F32_FACTORED 1
// A panel row's codes (at `row`) for columns 0-7 (half 0) or 8-15 (half 1) as f32.
template <int BITS>
inline __m256 codes_f32(const uint8_t* row, int half) {
  if (BITS == 8)
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + 8 * half))));
  const __m256i wide = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row)));
  return _mm256_cvtepi32_ps(half ? _mm256_srli_epi32(wide, 4) : _mm256_and_si256(wide, _mm256_set1_epi32(15)));
}

// R rows of x (row stride K) against both column halves of P panels (P R <= 2), kChains sums
// each: eight chains, with the codes and x's broadcasts within AVX2's 16 registers (the running
// totals go through y). xsums: the rows' group sums ([R][G] at stride G). Writes panel
// panels[j]'s 16 columns at ys[j] (row stride ldy).
template <int BITS, int R, int P>
__attribute__((noinline)) void factored_rows_avx2(const QuantPanel& q, const float* __restrict x,
                                                  const float* __restrict xsums, const int64_t* panels,
                                                  float* const* ys, int64_t ldy) {
  static_assert(kChains == 2, "the group's sums add two chains");
  constexpr int64_t kRowBytes = BITS == 8 ? kPanel : kPanel / 2;
  const int64_t G = q.groups(), ldx = q.K;
  const uint8_t* codes[P];
  for (int j = 0; j < P; ++j) {
    codes[j] = static_cast<const uint8_t*>(q.codes) + panels[j] * q.K * kRowBytes;
    for (int i = 0; i < R; ++i)
      for (int h = 0; h < 2; ++h) _mm256_storeu_ps(ys[j] + i * ldy + 8 * h, _mm256_setzero_ps());
  }
  // g / q.per_super, g % q.per_super, stepped: QuantPanel::super_at's division in each group cost
  // one 4-bit row 1.12x the time.
  int64_t super_g = 0, in_super = 0;
  for (int64_t g = 0; g < G; ++g) {
    __m256 part[P][R][2][kChains];
#pragma GCC unroll 2
    for (int j = 0; j < P; ++j)
#pragma GCC unroll 8
      for (int i = 0; i < R; ++i)
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h)
#pragma GCC unroll 2
          for (int c = 0; c < kChains; ++c) part[j][i][h][c] = _mm256_setzero_ps();
    const float* xg = x + g * q.group;
    for (int64_t k = 0; k < q.group; k += kChains) {
#pragma GCC unroll 2
      for (int c = 0; c < kChains; ++c)
#pragma GCC unroll 2
        for (int j = 0; j < P; ++j)
#pragma GCC unroll 2
          for (int h = 0; h < 2; ++h) {
            const __m256 w = codes_f32<BITS>(codes[j] + (g * q.group + k + c) * kRowBytes, h);
#pragma GCC unroll 2
            for (int i = 0; i < R; ++i)
              part[j][i][h][c] = _mm256_fmadd_ps(_mm256_broadcast_ss(xg + i * ldx + k + c), w, part[j][i][h][c]);
          }
    }
    const int64_t supers_a_panel = (G / q.per_super) * kPanel, sg = super_g * kPanel;
    if (++in_super == q.per_super) in_super = 0, ++super_g;
#pragma GCC unroll 2
    for (int j = 0; j < P; ++j)
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        const int64_t col = 8 * h, at = (panels[j] * G + g) * kPanel + col;
        const int64_t sat = panels[j] * supers_a_panel + sg + col;
        const __m256 s = scales_f32x8(q, q.scale, q.super_scale, at, sat);
        const __m256 o = q.offset ? scales_f32x8(q, q.offset, q.super_offset, at, sat) : _mm256_setzero_ps();
#pragma GCC unroll 8
        for (int i = 0; i < R; ++i) {
          const __m256 sum = _mm256_add_ps(part[j][i][h][0], part[j][i][h][1]);
          const __m256 off = _mm256_mul_ps(o, _mm256_broadcast_ss(xsums + i * G + g));
          float* y = ys[j] + i * ldy + col;
          _mm256_storeu_ps(y, _mm256_add_ps(_mm256_loadu_ps(y), _mm256_fmadd_ps(s, sum, off)));
        }
      }
  }
}

// Panels panels[0 .. P) (P 1 or 2) of R rows (1 or 2) into ys[j] (row stride ldy): one row two
// panels at a time, two rows a panel at a time.
template <int BITS>
void factored_panels_avx2(const QuantPanel& q, const float* x, const float* xsums, const int64_t* panels,
                          float* const* ys, int P, int64_t ldy, int64_t R) {
  if (R == 2) {
    for (int j = 0; j < P; ++j) factored_rows_avx2<BITS, 2, 1>(q, x, xsums, panels + j, ys + j, ldy);
  } else if (P == 2) {
    factored_rows_avx2<BITS, 1, 2>(q, x, xsums, panels, ys, ldy);
  } else {
    factored_rows_avx2<BITS, 1, 1>(q, x, xsums, panels, ys, ldy);
  }
}

void factored_block_avx2(const QuantPanel& q, const float* x, const float* xsums, const int64_t* panels,
                         float* const* ys, int P, int64_t ldy, int64_t R) {
  if (q.bits == 8)
    factored_panels_avx2<8>(q, x, xsums, panels, ys, P, ldy, R);
  else
    factored_panels_avx2<4>(q, x, xsums, panels, ys, P, ldy, R);
}
#endif  // JAXLLM_F32_FACTORED

void dequantize_panel(const QuantPanel& q, int64_t p, float* out, int32_t path) {
#ifdef JAXLLM_AVX2
  if (path == kAuto || path >= kAvx2) return dequantize_panel_avx2(q, p, out);
#endif
  dequantize_panel_portable(q, p, out);
}

// Up to this many rows in a work item, the AVX2 path dequantizes in registers, not a panel copy.
constexpr int64_t kDirectRows = 4;

struct PanelScratch {
  std::vector<float> panel;
};

ffi::Error MatmulQuantImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer codes,
                           ffi::AnyBuffer scale, ffi::AnyBuffer offset, ffi::AnyBuffer super_scale,
                           ffi::AnyBuffer super_offset, ffi::Buffer<ffi::S32> bias, ffi::Buffer<ffi::S32> rows,
                           ffi::ResultBuffer<ffi::F32> y, int32_t bits, int32_t path, int32_t swiglu, int32_t act8,
                           int32_t act_group, int32_t factored) {
  const auto xd = x.dimensions();
  const auto cd = codes.dimensions();
  const bool int8 = bits == 8 && codes.element_type() == ffi::DataType::S8;
  const bool int4 = bits == 4 && codes.element_type() == ffi::DataType::U8;
  const bool six = bits == 6 && codes.element_type() == ffi::DataType::U8;  // act8 only: [N / 16, K / 8, 96]
  const bool shapes_ok = xd.size() == 2 && cd.size() == 3 && (int8 || int4 || six) &&
                         (six ? cd[2] == kSixBlock && cd[1] * 8 == xd[1]
                              : cd[2] == (int8 ? kPanel : kPanel / 2) && cd[1] == xd[1]);
  QuantPanel q{codes.untyped_data(), nullptr, nullptr, false, shapes_ok ? xd[1] : 0, shapes_ok ? cd[0] * kPanel : 0,
               1, bits};
  if (!shapes_ok || !bind_scales(q, scale, offset, super_scale, super_offset) || (swiglu && cd[0] % 2) ||
      (bias.element_count() && (!act8 || !int8 || act_group < 0 || (act_group && xd[1] % act_group) ||
                                bias.element_count() != cd[0] * kPanel * (act_group ? xd[1] / act_group : 1))))
    return ffi::Error::InvalidArgument(
        "matmul_quantized: needs x [M, K], codes int8 [N / 16, K, 16] (bits 8), uint8 [N / 16, K, 8] (bits 4) or "
        "uint8 [N / 16, K / 8, 96] (bits 6), "
        "scale f32 or f16 [N / 16, G, 16] with G dividing K, offset empty or like scale (N / 16 even for swiglu); "
        "two-level: scale and offset int8, super_scale f16 [N / 16, G / S, 16], super_offset like it or empty; bias "
        "int32 [K / act_group or 1, N] for 8-bit codes x int8 activations only");
  if (!path_ok(path))
    return ffi::Error::InvalidArgument("matmul_quantized: this build has no such kernel path");
  const int64_t groups = q.groups();
  if (six && !(act8 && !act_group && xd[1] % kActGroup == 0 && six_bit_act8_ok(q)))
    return ffi::Error::InvalidArgument("matmul_quantized: 6-bit codes multiply int8 activations only (act8, "
                                       "act_group 0), K a multiple of 32, groups of a multiple of 32 rows (two-level "
                                       "scales: of 16, super-groups of 32, offsets in groups of 32)");
  if (act8 && !six && !(int4 && !act_group && xd[1] % kActGroup == 0 && q.group % kActGroup == 0) &&
      !(int8 && groups == 1 && !q.offset && !q.super_scale && xd[1] % 4 == 0 && xd[1] <= kW8A8MaxK &&
        (!act_group || (act_group > 0 && act_group % 4 == 0 && xd[1] % act_group == 0))))
    return ffi::Error::InvalidArgument("matmul_quantized: int8 activations need 4-bit codes in groups of a multiple "
                                       "of 32 rows of K (act_group 0), or 8-bit codes with one scale per column, no "
                                       "offset, K a multiple of 4 up to 131072, and act_group 0 or a multiple of 4 "
                                       "dividing K");
  if (!act8 && act_group) return ffi::Error::InvalidArgument("matmul_quantized: act_group needs act8");
  GemmArgs g{x.typed_data(), nullptr, y->typed_data(), xd[0], xd[1], cd[0] * kPanel};
  g.M = live_rows(rows, g.M, swiglu ? g.N / 2 : g.N, g.y);
  if (bias.element_count()) q.bias = bias.typed_data();
  if (act8) {
#ifdef JAXLLM_CODES_BF16
    if (g.M && (int4 || six) && act8_on_bf16(path, g.M, g.K, six ? 6 : 4)) {  // a prompt's rows (gemm_codes_tiles.cc)
      matmul_codes_bf16(pool, g, q, swiglu);
      return ffi::Error::Success();
    }
#endif
    if (g.M && (int4 || six)) matmul_int8_rows(pool, g, q, path, swiglu);
    if (g.M && int8) matmul_w8a8(pool, g, q, path, swiglu, act_group);
    return ffi::Error::Success();
  }
  const GemmItems items(g.M, swiglu ? g.N / 2 : g.N, pool.num_threads());
#ifdef JAXLLM_F32_FACTORED
  if (factored && g.M <= kF32FactoredCallRows && q.group % kChains == 0 && (path == kAuto || path >= kAvx2)) {
    std::vector<float> xsums;
    group_sums(g.x, g.M, g.K, q.group, xsums);
    parallel_for(pool, items.count, [&](int64_t item) {
      int64_t r0, r1, p0, p1;
      items.bounds(item, g.M, r0, r1, p0, p1);
      const float* x = g.x + r0 * g.K;
      const float* xs = xsums.data() + r0 * q.groups();
      if (!swiglu) {
        for (int64_t p = p0; p < p1; p += 2) {
          const int64_t panels[2] = {p, p + 1};
          float* ys[2] = {g.y + r0 * g.N + p * kPanel, g.y + r0 * g.N + (p + 1) * kPanel};
          factored_block_avx2(q, x, xs, panels, ys, p + 1 < p1 ? 2 : 1, g.N, r1 - r0);
        }
        return;
      }
      alignas(64) float tg[kF32FactoredCallRows * kPanel], tu[kF32FactoredCallRows * kPanel];
      for (int64_t p = p0; p < p1; ++p) {  // gate panel p and up panel p + N / 32, then the epilogue
        const int64_t panels[2] = {p, p + g.N / 2 / kPanel};
        float* ys[2] = {tg, tu};
        factored_block_avx2(q, x, xs, panels, ys, 2, kPanel, r1 - r0);
        swiglu_store(tg, tu, g.y + r0 * (g.N / 2) + p * kPanel, g.N / 2, r1 - r0, path);
      }
    });
    return ffi::Error::Success();
  }
#endif
  parallel_for<PanelScratch>(pool, items.count, [&](int64_t item, PanelScratch& scratch) {
    int64_t r0, r1, p0, p1;
    items.bounds(item, g.M, r0, r1, p0, p1);
    if (swiglu) {  // gate panel p and up panel p + N / 32, then the epilogue
#ifdef JAXLLM_AVX2
      if (r1 - r0 <= kDirectRows && (path == kAuto || path >= kAvx2)) {
        alignas(64) float tg[kDirectRows * kPanel], tu[kDirectRows * kPanel];
        for (int64_t p = p0; p < p1; ++p) {
          quant_panel_block_avx2(q, g.x + r0 * g.K, p, tg, kPanel, r1 - r0);
          quant_panel_block_avx2(q, g.x + r0 * g.K, p + g.N / 2 / kPanel, tu, kPanel, r1 - r0);
          swiglu_store(tg, tu, g.y + r0 * (g.N / 2) + p * kPanel, g.N / 2, r1 - r0, path);
        }
        return;
      }
#endif
      scratch.panel.resize(2 * g.K * kPanel);
      float* gate = scratch.panel.data();
      float* up = gate + g.K * kPanel;
      for (int64_t p = p0; p < p1; ++p) {
        dequantize_panel(q, p, gate, path);
        dequantize_panel(q, p + g.N / 2 / kPanel, up, path);
        swiglu_block(g, gate, up, p, r0, r1, path);
      }
      return;
    }
#ifdef JAXLLM_AVX2
    if (r1 - r0 <= kDirectRows && (path == kAuto || path >= kAvx2)) {
      for (int64_t p = p0; p < p1; ++p)
        quant_panel_block_avx2(q, g.x + r0 * g.K, p, g.y + r0 * g.N + p * kPanel, g.N, r1 - r0);
      return;
    }
#endif
    scratch.panel.resize(g.K * kPanel);
    for (int64_t p = p0; p < p1; ++p) {
      dequantize_panel(q, p, scratch.panel.data(), path);
      panel_block(g, scratch.panel.data(), p, r0, r1, path);
    }
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxllm

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmMatmulQuantCpu, jaxllm::MatmulQuantImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::AnyBuffer>()         // codes
                                  .Arg<ffi::AnyBuffer>()         // scale, f32 or f16 (int8 two-level)
                                  .Arg<ffi::AnyBuffer>()         // offset (or empty), as scale
                                  .Arg<ffi::AnyBuffer>()         // super_scale f16 (or empty: one level)
                                  .Arg<ffi::AnyBuffer>()         // super_offset f16 (or empty)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // bias (W8A8: 128 x column code sums) or empty
                                  .Arg<ffi::Buffer<ffi::S32>>()  // rows, as for matmul_packed
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y
                                  .Attr<int32_t>("bits")
                                  .Attr<int32_t>("path")
                                  .Attr<int32_t>("swiglu")  // as for matmul_packed
                                  .Attr<int32_t>("act8")        // 1: x quantized to int8 (see matmul_int8_rows, matmul_w8a8)
                                  .Attr<int32_t>("act_group")  // 8-bit codes x int8: columns per scale (0: a row)
                                  .Attr<int32_t>("factored"));  // 1: group scales factored out (calls of <= 16 rows)

// Rows from which matmul_quantized's act8 calls over codes of `bits` (4 or 6) take bf16 dots with
// path auto (0: never in this build and process), set to `rows` where rows >= 0; returns the
// value before: `native.act8_bf16_rows`, `native.act8_bf16_rows_set`.
extern "C" int32_t JaxllmAct8Bf16Rows(int32_t bits, int32_t rows) {
  return static_cast<int32_t>(jaxllm::act8_bf16_rows(bits, rows));
}

// Fewest rows from which the int8 rows' calls (4- and 6-bit codes) of path auto or avx512 run on
// AMX's int8 tiles (0: never), set to `rows` where rows >= 0; returns the value before (0 where
// this build or process has no int8 tiles): `native.int8_tile_rows`, `native.int8_tile_rows_set`.
extern "C" int32_t JaxllmInt8TileRows(int32_t rows) {
#ifdef JAXLLM_AMX_INT8
  if (!jaxllm::amx_ready()) return 0;
  const auto before = static_cast<int32_t>(rows >= 0 ? jaxllm::int8_tile_rows_min.exchange(rows)
                                                     : jaxllm::int8_tile_rows_min.load());
  return before;
#else
  (void)rows;
  return 0;
#endif
}
