// y [M, N] f32 = x [M, K] bf16 @ w bf16, with w packed once at load time (`pack_weight_bf16` in
// native.py) into panels of 16 columns holding K / 2 pairs: w_packed [N / 16, K / 2, 16, 2], the
// 32-bit word (kp, c) of panel p holding w[2 kp, 16 p + c] (low half) and w[2 kp + 1, 16 p + c]
// (high half). A row of x in bf16 is already a row of such words: x[i, 2 kp] and x[i, 2 kp + 1].
//
// Why: XLA:CPU's bf16 dot repacks its weight on every call (~10% of a bf16 run on Zen 4). With
// AVX512_BF16, VDPBF16PS multiplies 16 word pairs and adds both products to 16 f32 sums: one
// broadcast word of x against one panel load is 32 multiply-adds, twice an f32 FMA's.
//
// The products are exact (bf16 x bf16 fits in f32) and the sums f32, as in XLA's bf16 dot with
// an f32 result; only the order of the additions differs. Rows past `rows` are zeros, and
// swiglu = 1 gives silu(x @ gate) * (x @ up) from a gate panel and an up panel side by side, as
// in gemm.cc. Work items are gemm.cc's (GemmItems), over panel pairs.
//
// Paths: AVX512_BF16 (kAvx512, 12 rows x 2 panels of sums in 24 registers); elsewhere a portable
// loop over the same layout (tests, and CPUs whose models are not packed this way:
// `native.bf16_gemm_native()` says which).

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "gemm.cc"
#include "parallel_for.h"
#include "simd.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define JAXLLM_AVX512_BF16 1
#endif

namespace ffi = xla::ffi;

namespace jaxllm {
namespace {

struct Bf16GemmArgs {
  const uint32_t* x;  // [M, K / 2] words: a bf16 row of x, two elements per word
  const uint32_t* w;  // [N / 16, K / 2, 16] words (see the top of the file)
  float* y;           // [M, N]  (or [M, N / 2] with swiglu)
  int64_t M, KP, N;   // KP = K / 2
};

#ifdef JAXLLM_AVX512_BF16
// silu(g) * u, 16 wide: swiglu_f32x8's formulation (exp only sees -|g|).
inline __m512 swiglu_f32x16(__m512 g, __m512 u) {
  const __m512 e = exp_f32x16(_mm512_or_ps(g, _mm512_set1_ps(-0.f)));
  const __mmask16 pos = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_GE_OQ);
  const __m512 num = _mm512_mask_blend_ps(pos, e, _mm512_set1_ps(1.f));
  return _mm512_mul_ps(_mm512_div_ps(_mm512_mul_ps(g, num), _mm512_add_ps(_mm512_set1_ps(1.f), e)), u);
}

// R rows of x against P panels (P = 2: w0 and w1, P = 1: w0 only), every sum over K in
// registers. Stores: panel 0's 16 columns at y, panel 1's at y + 16; with SWIGLU (P = 2, w0 the
// gate panel, w1 the up panel) silu(gate) * up at y.
template <int R, int P, bool SWIGLU>
inline void bf16_rows(const uint32_t* __restrict x, int64_t ldx, const uint32_t* __restrict w0,
                      const uint32_t* __restrict w1, float* __restrict y, int64_t ldy, int64_t KP) {
  __m512 acc0[R], acc1[R];
#pragma GCC unroll 12
  for (int i = 0; i < R; ++i) acc0[i] = acc1[i] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < KP; ++kp) {
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(w0 + kp * kPanel);
    const __m512bh b1 = P == 2 ? (__m512bh)_mm512_loadu_si512(w1 + kp * kPanel) : b0;
#pragma GCC unroll 12
    for (int i = 0; i < R; ++i) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[i * ldx + kp]));
      acc0[i] = _mm512_dpbf16_ps(acc0[i], a, b0);
      if (P == 2) acc1[i] = _mm512_dpbf16_ps(acc1[i], a, b1);
    }
  }
#pragma GCC unroll 12
  for (int i = 0; i < R; ++i) {
    if (SWIGLU) {
      _mm512_storeu_ps(y + i * ldy, swiglu_f32x16(acc0[i], acc1[i]));
    } else {
      _mm512_storeu_ps(y + i * ldy, acc0[i]);
      if (P == 2) _mm512_storeu_ps(y + i * ldy + kPanel, acc1[i]);
    }
  }
}

// Rows [r0, r1) against panels w0 (and w1): blocks of 12 rows, then the remainder.
template <int P, bool SWIGLU>
void bf16_block_avx512(const Bf16GemmArgs& g, const uint32_t* w0, const uint32_t* w1, float* y, int64_t ldy,
                       int64_t r0, int64_t r1) {
  const int64_t KP = g.KP;
  int64_t r = r0;
  for (; r + 12 <= r1; r += 12) bf16_rows<12, P, SWIGLU>(g.x + r * KP, KP, w0, w1, y + r * ldy, ldy, KP);
  const uint32_t* x = g.x + r * KP;
  y += r * ldy;
  switch (r1 - r) {
#define JAXLLM_BF16_CASE(n) \
  case n: bf16_rows<n, P, SWIGLU>(x, KP, w0, w1, y, ldy, KP); break;
    JAXLLM_BF16_CASE(11) JAXLLM_BF16_CASE(10) JAXLLM_BF16_CASE(9) JAXLLM_BF16_CASE(8) JAXLLM_BF16_CASE(7)
    JAXLLM_BF16_CASE(6) JAXLLM_BF16_CASE(5) JAXLLM_BF16_CASE(4) JAXLLM_BF16_CASE(3) JAXLLM_BF16_CASE(2)
    JAXLLM_BF16_CASE(1)
#undef JAXLLM_BF16_CASE
  }
}
#endif  // JAXLLM_AVX512_BF16

// Portable: one row and one panel at a time; each product widened to f32 (exact), summed in f32.
void bf16_panel_portable(const Bf16GemmArgs& g, const uint32_t* panel, float* out, int64_t r) {
  float acc[kPanel] = {};
  const uint32_t* x = g.x + r * g.KP;
  for (int64_t kp = 0; kp < g.KP; ++kp) {
    const float x0 = to_f32(static_cast<uint16_t>(x[kp])), x1 = to_f32(static_cast<uint16_t>(x[kp] >> 16));
    for (int64_t j = 0; j < kPanel; ++j) {
      const uint32_t word = panel[kp * kPanel + j];
      acc[j] += x0 * to_f32(static_cast<uint16_t>(word)) + x1 * to_f32(static_cast<uint16_t>(word >> 16));
    }
  }
  std::memcpy(out, acc, sizeof acc);
}

// Output panel p (columns 16 p .. 16 p + 15 of y) for rows [r0, r1); with swiglu, from gate
// panel p and up panel p + N / 32.
void bf16_output_panel(const Bf16GemmArgs& g, int64_t p, int64_t r0, int64_t r1, bool swiglu, int32_t path) {
  const int64_t panel_words = g.KP * kPanel, ldy = swiglu ? g.N / 2 : g.N;
  const uint32_t* w0 = g.w + p * panel_words;
  const uint32_t* up = swiglu ? g.w + (p + g.N / 2 / kPanel) * panel_words : nullptr;
  float* y = g.y + p * kPanel;
#ifdef JAXLLM_AVX512_BF16
  if (path == kAuto || path >= kAvx512) {
    if (swiglu) return bf16_block_avx512<2, true>(g, w0, up, y, ldy, r0, r1);
    return bf16_block_avx512<1, false>(g, w0, nullptr, y, ldy, r0, r1);
  }
#endif
  for (int64_t r = r0; r < r1; ++r) {
    float gate[kPanel], u[kPanel];
    bf16_panel_portable(g, w0, gate, r);
    if (!swiglu) {
      std::memcpy(y + r * ldy, gate, sizeof gate);
      continue;
    }
    bf16_panel_portable(g, up, u, r);
    for (int64_t j = 0; j < kPanel; ++j) y[r * ldy + j] = swiglu_f32(gate[j], u[j]);
  }
}

// Output panels p and p + 1 without swiglu: one pass over x for both on the AVX-512 path.
void bf16_output_pair(const Bf16GemmArgs& g, int64_t p, int64_t r0, int64_t r1, int32_t path) {
#ifdef JAXLLM_AVX512_BF16
  if (path == kAuto || path >= kAvx512) {
    const int64_t panel_words = g.KP * kPanel;
    return bf16_block_avx512<2, false>(g, g.w + p * panel_words, g.w + (p + 1) * panel_words, g.y + p * kPanel,
                                       g.N, r0, r1);
  }
#endif
  bf16_output_panel(g, p, r0, r1, false, path);
  bf16_output_panel(g, p + 1, r0, r1, false, path);
}

ffi::Error MatmulPackedBf16Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> w,
                                ffi::Buffer<ffi::S32> rows, ffi::ResultBuffer<ffi::F32> y, int32_t path,
                                int32_t swiglu) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 4 || wd[2] != kPanel || wd[3] != 2 || 2 * wd[1] != xd[1] ||
      (swiglu && wd[0] % 2))
    return ffi::Error::InvalidArgument(
        "matmul_packed_bf16: needs x [M, K] and w [N / 16, K / 2, 16, 2] (N / 16 even for swiglu)");
  if (path < kAuto || path > kAvx512 || (path != kAuto && !(built_paths() & (1 << path))))
    return ffi::Error::InvalidArgument("matmul_packed_bf16: this build has no such kernel path");
  Bf16GemmArgs g{reinterpret_cast<const uint32_t*>(x.untyped_data()),
                 reinterpret_cast<const uint32_t*>(w.untyped_data()), y->typed_data(), xd[0], wd[1], wd[0] * kPanel};
  const int64_t out_n = swiglu ? g.N / 2 : g.N;
  g.M = live_rows(rows, g.M, out_n, g.y);
  // Items over output panels, taken two at a time where they can (both share x's loads).
  const GemmItems items(g.M, out_n, pool.num_threads());
  parallel_for(pool, items.count, [&](int64_t item) {
    int64_t r0, r1, p0, p1;
    items.bounds(item, g.M, r0, r1, p0, p1);
    int64_t p = p0;
    if (!swiglu)
      for (; p + 2 <= p1; p += 2) bf16_output_pair(g, p, r0, r1, path);
    for (; p < p1; ++p) bf16_output_panel(g, p, r0, r1, swiglu, path);
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxllm

// Whether this build multiplies bf16 panels with AVX512_BF16 (else only the portable loop).
extern "C" int32_t JaxllmBf16GemmNative() {
#ifdef JAXLLM_AVX512_BF16
  return 1;
#else
  return 0;
#endif
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmMatmulPackedBf16Cpu, jaxllm::MatmulPackedBf16Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // w_packed [N / 16, K / 2, 16, 2]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // rows: [] or [1], or empty for all
                                  .Ret<ffi::Buffer<ffi::F32>>()   // y
                                  .Attr<int32_t>("path")
                                  .Attr<int32_t>("swiglu"));
