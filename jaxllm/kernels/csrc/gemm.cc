// y [M, N] = x [M, K] @ w, f32, with w packed once at load time (`pack_weight` in native.py)
// into panels of 16 columns: w_packed [N / 16, K, 16], panel p holding columns 16p .. 16p + 15
// of w, row k of the panel the 16 weights that multiply x[:, k]. Quantized weights (int8 or
// int4 codes in the same panels) are below ("quantized weights").
//
// Why: XLA:CPU hands each f32 dot to YNNPACK, which repacks the whole weight matrix on every
// call. At decode batch sizes that repacking is most of the dot's time (a [8, 576] x [576,
// 3072] dot ran at 40 GFLOP/s on Zen 3 against 175 at M = 512). Here the panel is the packed
// form, read once per block of up to kRowChunk rows of x.
//
// Only the first `rows` rows of x are multiplied (a runtime scalar: the step's real tokens, or
// the rows that sample); the rest of y is zeros, so a bucket's padding costs no GEMM work.
//
// Work items are (chunk of up to kRowChunk rows, group of panels), shared over the caller and
// XLA's intra-op pool (parallel_for.h). Inside an item, each panel is swept by blocks of up to
// 6 rows: 6 x 16 accumulators in 12 AVX2 registers, one broadcast of x and two loads of the
// panel per k (the AVX2 + FMA path; AVX-512 CPUs run it too). Without AVX2 (or with `path`
// forcing it, for tests) a portable loop over the same layout runs.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "parallel_for.h"
#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxllm {
namespace {

constexpr int64_t kPanel = 16;     // columns per panel
constexpr int64_t kRowChunk = 96;  // rows of x per work item (a multiple of 6)

struct GemmArgs {
  const float* x;  // [M, K]
  const float* w;  // [N / 16, K, 16]
  float* y;        // [M, N]
  int64_t M, K, N;
};

#ifdef JAXLLM_AVX2
// y rows [r, r + R), columns [col, col + 16): R x 2 vectors of sums over all K, in registers
// (the arguments are plain locals so the compiler keeps them there).
template <int R>
inline void panel_rows(const float* __restrict x, const float* __restrict panel, float* __restrict y, int64_t K,
                       int64_t ldy) {
  // Fully unrolled over the rows: GCC otherwise mirrors the sums to the stack every k.
  __m256 acc0[R], acc1[R];
#pragma GCC unroll 6
  for (int i = 0; i < R; ++i) acc0[i] = acc1[i] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m256 b0 = _mm256_loadu_ps(panel + k * kPanel), b1 = _mm256_loadu_ps(panel + k * kPanel + 8);
#pragma GCC unroll 6
    for (int i = 0; i < R; ++i) {
      const __m256 a = _mm256_broadcast_ss(x + i * K + k);
      acc0[i] = _mm256_fmadd_ps(a, b0, acc0[i]);
      acc1[i] = _mm256_fmadd_ps(a, b1, acc1[i]);
    }
  }
#pragma GCC unroll 6
  for (int i = 0; i < R; ++i) {
    _mm256_storeu_ps(y + i * ldy, acc0[i]);
    _mm256_storeu_ps(y + i * ldy + 8, acc1[i]);
  }
}

void panel_block_avx2(const GemmArgs& g, const float* panel, int64_t p, int64_t r0, int64_t r1) {
  const int64_t K = g.K, N = g.N;
  int64_t r = r0;
  for (; r + 6 <= r1; r += 6) panel_rows<6>(g.x + r * K, panel, g.y + r * N + p * kPanel, K, N);
  const float* x = g.x + r * K;
  float* y = g.y + r * N + p * kPanel;
  switch (r1 - r) {
    case 5: panel_rows<5>(x, panel, y, K, N); break;
    case 4: panel_rows<4>(x, panel, y, K, N); break;
    case 3: panel_rows<3>(x, panel, y, K, N); break;
    case 2: panel_rows<2>(x, panel, y, K, N); break;
    case 1: panel_rows<1>(x, panel, y, K, N); break;
  }
}
#endif  // JAXLLM_AVX2

// Portable: one row at a time, the 16 sums in an array the compiler can keep in vectors.
void panel_block_portable(const GemmArgs& g, const float* panel, int64_t p, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    float acc[kPanel] = {};
    const float* x = g.x + r * g.K;
    for (int64_t k = 0; k < g.K; ++k)
      for (int64_t j = 0; j < kPanel; ++j) acc[j] += x[k] * panel[k * kPanel + j];
    for (int64_t j = 0; j < kPanel; ++j) g.y[r * g.N + p * kPanel + j] = acc[j];
  }
}

// y[r0 .. r1 - 1, panel p's columns] from `panel` (g.w's panel p, or a dequantized copy of
// it), on the widest path allowed (a KernelPath, as for attention).
void panel_block(const GemmArgs& g, const float* panel, int64_t p, int64_t r0, int64_t r1, int32_t path) {
#ifdef JAXLLM_AVX2
  if (path == kAuto || path >= kAvx2) return panel_block_avx2(g, panel, p, r0, r1);
#endif
  panel_block_portable(g, panel, p, r0, r1);
}

// ------------------------------------------------------------------ SwiGLU epilogue (swiglu = 1)
// w is a gated MLP's gate and up halves side by side ([K, 2I]: gate columns, then up columns,
// panels 0 .. I/16 - 1 and I/16 .. 2I/16 - 1), and y [M, I] = silu(x @ gate) * (x @ up): for
// each block of up to 6 rows, the gate panel's and the up panel's sums go to two small
// buffers in L1, then the epilogue writes y. No [M, 2I] intermediate, and no separate pass
// of XLA's (exp, divide) fusion over it.

// silu(g) * u, 8 wide: silu(g) = g / (1 + e^-g), computed as g * (g >= 0 ? 1 : e) / (1 + e)
// with e = e^-|g|, so that exp_f32x8 only ever sees x <= 0.
#ifdef JAXLLM_AVX2
inline __m256 swiglu_f32x8(__m256 g, __m256 u) {
  const __m256 e = exp_f32x8(_mm256_or_ps(g, _mm256_set1_ps(-0.f)));  // the sign bit set: -|g|
  const __m256 num = _mm256_blendv_ps(e, _mm256_set1_ps(1.f), _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_GE_OQ));
  return _mm256_mul_ps(_mm256_div_ps(_mm256_mul_ps(g, num), _mm256_add_ps(_mm256_set1_ps(1.f), e)), u);
}
#endif

inline float swiglu_f32(float g, float u) { return g / (1.f + std::exp(-g)) * u; }

// y[i][0 .. 15] = silu(tg[i]) * tu[i] for R rows of 16 (row stride ldy).
void swiglu_store(const float* tg, const float* tu, float* y, int64_t ldy, int64_t R, int32_t path) {
  int64_t i = 0;
#ifdef JAXLLM_AVX2
  if (path == kAuto || path >= kAvx2) {
    for (; i < R * kPanel; i += 8) {
      const __m256 out = swiglu_f32x8(_mm256_load_ps(tg + i), _mm256_load_ps(tu + i));
      _mm256_storeu_ps(y + (i / kPanel) * ldy + i % kPanel, out);
    }
  }
#endif
  for (; i < R * kPanel; ++i) y[(i / kPanel) * ldy + i % kPanel] = swiglu_f32(tg[i], tu[i]);
}

// y rows [r0, r1), output panel p's 16 columns (y [M, N / 2]), from f32 panels `gate` and `up`
// (g.w's panels p and p + N / 32, or their dequantized copies).
void swiglu_block(const GemmArgs& g, const float* gate, const float* up, int64_t p, int64_t r0, int64_t r1,
                  int32_t path) {
  const int64_t K = g.K, ldy = g.N / 2;
  alignas(64) float tg[6 * kPanel], tu[6 * kPanel];
  for (int64_t r = r0; r < r1; r += 6) {
    const int64_t R = std::min<int64_t>(6, r1 - r);
    const GemmArgs tmp_g{g.x + r * K, nullptr, tg, R, K, kPanel}, tmp_u{g.x + r * K, nullptr, tu, R, K, kPanel};
    panel_block(tmp_g, gate, 0, 0, R, path);
    panel_block(tmp_u, up, 0, 0, R, path);
    swiglu_store(tg, tu, g.y + r * ldy + p * kPanel, ldy, R, path);
  }
}

// Work items of a [M, K] x [K, N] product: (chunk of up to kRowChunk rows, group of panels),
// about 24 per thread, each at least one panel; item i covers rows [r0, r1) and panels [p0, p1).
// (24 rather than 8 took 2-4% off the model's GEMMs on family 23: a shorter tail where one
// thread waits for the other's last item; 64 was slower again.)
struct GemmItems {
  int64_t panels, row_chunks, per_item, count;
  GemmItems(int64_t M, int64_t N, int64_t threads) {
    panels = N / kPanel;
    row_chunks = (M + kRowChunk - 1) / kRowChunk;
    per_item = std::max<int64_t>(1, panels * row_chunks / (24 * std::max<int64_t>(1, threads)));
    count = (panels + per_item - 1) / per_item * row_chunks;
  }
  void bounds(int64_t item, int64_t M, int64_t& r0, int64_t& r1, int64_t& p0, int64_t& p1) const {
    const int64_t chunk = item % row_chunks, group = item / row_chunks;
    r0 = chunk * kRowChunk;
    r1 = std::min(M, r0 + kRowChunk);
    p0 = group * per_item;
    p1 = std::min(panels, p0 + per_item);
  }
};

// The rows to compute: the `rows` input clamped to [0, M]; y's rows past them are zeroed.
int64_t live_rows(ffi::Buffer<ffi::S32> rows, int64_t M, int64_t N, float* y) {
  const int64_t live = rows.element_count() ? std::clamp<int64_t>(rows.typed_data()[0], 0, M) : M;
  std::memset(y + live * N, 0, (M - live) * N * sizeof(float));
  return live;
}

ffi::Error MatmulPackedImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                            ffi::Buffer<ffi::S32> rows, ffi::ResultBuffer<ffi::F32> y, int32_t path, int32_t swiglu) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || wd[2] != kPanel || wd[1] != xd[1] || (swiglu && wd[0] % 2))
    return ffi::Error::InvalidArgument("matmul_packed: needs x [M, K] and w [N / 16, K, 16] (N / 16 even for swiglu)");
  if (path < kAuto || path > kAvx512 || (path != kAuto && !(built_paths() & (1 << path))))
    return ffi::Error::InvalidArgument("matmul_packed: this build has no such kernel path");
  GemmArgs g{x.typed_data(), w.typed_data(), y->typed_data(), xd[0], xd[1], wd[0] * kPanel};
  g.M = live_rows(rows, g.M, swiglu ? g.N / 2 : g.N, g.y);
  // With the epilogue, the items split the I / 16 panel pairs (their output panels).
  const GemmItems items(g.M, swiglu ? g.N / 2 : g.N, pool.num_threads());
  parallel_for(pool, items.count, [&](int64_t item) {
    int64_t r0, r1, p0, p1;
    items.bounds(item, g.M, r0, r1, p0, p1);
    for (int64_t p = p0; p < p1; ++p) {
      if (swiglu)
        swiglu_block(g, g.w + p * g.K * kPanel, g.w + (p + g.N / 2 / kPanel) * g.K * kPanel, p, r0, r1, path);
      else
        panel_block(g, g.w + p * g.K * kPanel, p, r0, r1, path);
    }
  });
  return ffi::Error::Success();
}


// ---------------------------------------------------------------------------- quantized weights
// y = x @ w with w stored as integer codes in the same panels, dequantized one panel at a time
// into a per-thread f32 copy that the f32 kernel above then multiplies (weight-only
// quantization: x stays f32). The copy is made once per work item, which covers up to
// kRowChunk rows, so at decode and prefill batch sizes the dequantization is a small part of
// the work, and the weights are read at 1/4 (int8) or 1/8 (int4) of the f32 bytes.
//
//   codes, 8 bits: int8 [N / 16, K, 16] (column j of panel row k at byte j);
//          4 bits: uint8 [N / 16, K, 8] (byte j: column j in the low nibble, j + 8 in the high);
//   scale, offset: f32 or f16 [G, N], G groups of K / G rows; w[k, n] = code * scale[g, n] +
//          offset[g, n] with g = k / (K / G). Without offsets (an empty array) w = code * scale.

struct QuantPanel {
  const void* codes;
  const void *scale, *offset;  // offset: nullptr when there is none
  bool half;                   // scale and offset are f16 (else f32)
  int64_t K, N, group;         // group: rows of K per scale row
  int bits;
};

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

// Panel p's 16 scales (and offsets, zeros without them) of group g, as floats.
inline void group_scales(const QuantPanel& q, int64_t g, int64_t p, float* s, float* o) {
  const int64_t at = g * q.N + p * kPanel;
  for (int64_t j = 0; j < kPanel; ++j) {
    if (q.half) {
      s[j] = half_to_f32(static_cast<const uint16_t*>(q.scale)[at + j]);
      o[j] = q.offset ? half_to_f32(static_cast<const uint16_t*>(q.offset)[at + j]) : 0.f;
    } else {
      s[j] = static_cast<const float*>(q.scale)[at + j];
      o[j] = q.offset ? static_cast<const float*>(q.offset)[at + j] : 0.f;
    }
  }
}

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
                           ffi::AnyBuffer scale, ffi::AnyBuffer offset, ffi::Buffer<ffi::S32> rows,
                           ffi::ResultBuffer<ffi::F32> y, int32_t bits, int32_t path, int32_t swiglu) {
  const auto xd = x.dimensions();
  const auto cd = codes.dimensions();
  const auto sd = scale.dimensions();
  const bool int8 = bits == 8 && codes.element_type() == ffi::DataType::S8;
  const bool int4 = bits == 4 && codes.element_type() == ffi::DataType::U8;
  if (xd.size() != 2 || cd.size() != 3 || !(int8 || int4) || cd[2] != (int8 ? kPanel : kPanel / 2) ||
      cd[1] != xd[1] || sd.size() != 2 || sd[1] != cd[0] * kPanel || sd[0] < 1 || xd[1] % sd[0] != 0 ||
      !(scale.element_type() == ffi::DataType::F32 || scale.element_type() == ffi::DataType::F16) ||
      (offset.element_count() != 0 &&
       (offset.element_count() != scale.element_count() || offset.element_type() != scale.element_type())) ||
      (swiglu && cd[0] % 2))
    return ffi::Error::InvalidArgument(
        "matmul_quantized: needs x [M, K], codes int8 [N / 16, K, 16] (bits 8) or uint8 [N / 16, K, 8] (bits 4), "
        "scale f32 or f16 [G, N] with G dividing K, offset empty or like scale (N / 16 even for swiglu)");
  if (path < kAuto || path > kAvx512 || (path != kAuto && !(built_paths() & (1 << path))))
    return ffi::Error::InvalidArgument("matmul_quantized: this build has no such kernel path");
  GemmArgs g{x.typed_data(), nullptr, y->typed_data(), xd[0], xd[1], cd[0] * kPanel};
  g.M = live_rows(rows, g.M, swiglu ? g.N / 2 : g.N, g.y);
  const QuantPanel q{codes.untyped_data(), scale.untyped_data(),
                     offset.element_count() ? offset.untyped_data() : nullptr,
                     scale.element_type() == ffi::DataType::F16, g.K, g.N, g.K / sd[0], bits};
  const GemmItems items(g.M, swiglu ? g.N / 2 : g.N, pool.num_threads());
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmMatmulPackedCpu, jaxllm::MatmulPackedImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w_packed
                                  .Arg<ffi::Buffer<ffi::S32>>()  // rows: [] or [1], or empty for all
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y
                                  .Attr<int32_t>("path")
                                  .Attr<int32_t>("swiglu"));  // 1: y = silu(gate) * up (see swiglu_block)

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmMatmulQuantCpu, jaxllm::MatmulQuantImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::AnyBuffer>()         // codes
                                  .Arg<ffi::AnyBuffer>()         // scale, f32 or f16
                                  .Arg<ffi::AnyBuffer>()         // offset (or empty), as scale
                                  .Arg<ffi::Buffer<ffi::S32>>()  // rows, as for matmul_packed
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y
                                  .Attr<int32_t>("bits")
                                  .Attr<int32_t>("path")
                                  .Attr<int32_t>("swiglu"));  // as for matmul_packed
