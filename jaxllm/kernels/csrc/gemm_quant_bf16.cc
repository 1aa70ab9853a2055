// y [M, N] f32 = x [M, K] bf16 @ w, w given by integer codes in panels of 16 columns with
// group scales and offsets (gemm_quant_panel.h's QuantPanel: one level f32/f16, or GGUF's
// two-level K-quant scales): 4-bit codes 0..15 (weight-only int4, GGUF Q4_0/Q4_1/Q4_K, AWQ,
// GPTQ) or 8-bit codes (weight-only int8, GGUF Q8_0, the int4 method's LM head). Each weight is
// turned into the bf16 number bf16(code * scale + offset) as it is read and multiplied by
// AVX512_BF16's VDPBF16PS with the sums in f32 over k in order.
//
// So the product is the packed bf16 GEMM's (gemm_bf16.cc) of the same weights dequantized in
// f32 and rounded to bf16, bit for bit: one FMA rounds code * scale + offset once, as the
// loader's multiply-then-add does when the product is exact (a 4- or 8-bit code times an f16 or
// int8 x f16 scale) and as its multiply does without an offset, and VCVTNE2PS2BF16 rounds to
// nearest even as ml_dtypes does. What changes is the bytes: 4 or 8 bits a weight and the
// group's scales instead of 16 bits.
//
// Why: a decode step's few rows leave the bf16 GEMM waiting on memory for its weights (on Zen 4
// about 27 GB/s of reads with two cores), and the f32 weight-only kernel (gemm_quant.cc) ran at
// about half the bf16 GEMM's speed. From a few rows up the conversion is the larger cost, so an
// item of more than kCodesDirectRows rows converts each panel once into a bf16 panel
// (gemm_bf16.cc's layout, in a per-thread buffer) and runs the bf16 GEMM's tiles on it.
//
// Layouts: 8-bit codes as `pack_codes` lays them out ([N / 16, K, 16]: a row of a panel's 16
// codes after another); 4-bit codes with `pack_codes(..., pairs=True)`: uint8 [N / 16, K / 4,
// 32] per panel and block b of 4 rows, byte 2 c + t holding in its low nibble the code of row
// 4 b + t, column c, and in its high nibble row 4 b + 2 + t's. Widened, bytes 0-15 are columns
// 0-7 of the row pair (4 b, 4 b + 1) in the order of a bf16 panel's words, bytes 16-31 columns
// 8-15; the high nibbles likewise for rows 4 b + 2, 4 b + 3. Groups must be a multiple of 4 rows.
//
// Paths: AVX512_BF16, and a portable loop (the same numbers: weights rounded to bf16, f32 sums).

#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "gemm.cc"
#include "gemm_bf16.cc"
#include "gemm_quant_factored.h"
#include "gemm_quant_panel.h"
#include "parallel_for.h"
#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace jaxllm {
namespace {

constexpr int64_t kCodesDirectRows = 6;  // up to this many rows an item converts weights in registers

// Whether this build reads 6-bit codes (AVX512_VBMI beside AVX512_BF16: gemm_quant_factored.h).
constexpr bool has_six_bit_codes() {
#ifdef JAXLLM_SIX_BIT_CODES
  return true;
#else
  return false;
#endif
}

struct CodesBf16Args {
  const uint16_t* x;  // [M, K] bf16 bits
  const uint8_t* w;   // the codes (see the top of the file)
  float* y;           // [M, N] (or [M, N / 2] with swiglu)
  int64_t M, K, N;
  const LoraTerm* lora = nullptr;  // AMX only (gemm_bf16.cc's LoraTerm)
  bool factored = false;           // scales factored out (gemm_quant_factored.h; 8-bit codes in [-64, 63])
  const float* xsums = nullptr;    // factored: [M, G], `group_sums`
};

// Code c of row k, column col, of a panel's codes.
template <int BITS>
inline int code_at(const uint8_t* w, int64_t k, int64_t col) {
  if (BITS == 8) return static_cast<int8_t>(w[k * kPanel + col]);
  if (BITS == 6) {  // word 2 col + t of the block's panel row k % 4 / 2 (gemm_quant_factored.h)
    const int64_t word = 2 * col + k % 2, second = k % 4 / 2;
    const uint8_t* run = w + (k / 4) * kBlockBytesOf(6) + 6 * (word / 4);
    const uint64_t bits = run[0] | run[1] << 8 | run[2] << 16 | uint64_t{run[3]} << 24 | uint64_t{run[4]} << 32 |
                          uint64_t{run[5]} << 40;
    return static_cast<int>((bits >> (24 * second + 6 * (word % 4))) & 63) - 32;
  }
  const uint8_t byte = w[(k / 4) * kBlockBytesOf(4) + 2 * col + k % 2];
  return k % 4 < 2 ? byte & 15 : byte >> 4;
}

#ifdef JAXLLM_AVX512_BF16
// Group g's scales and offsets of panel p as convert_block takes them: for 4-bit codes spread
// over a pair's lanes (lane l of s[0] is column l / 2's, of s[1] column 8 + l / 2's), for 8-bit
// ones a column a lane (s[0]).
template <int BITS>
inline void block_scales(const QuantPanel& q, int64_t g, int64_t p, __m512 s[2], __m512 o[2]) {
  const __m512 sv = scales_f32x16(q, q.scale, q.super_scale, g, p);
  const __m512 ov = q.offset ? scales_f32x16(q, q.offset, q.super_offset, g, p) : _mm512_setzero_ps();
  if (BITS == 8) {
    s[0] = s[1] = sv, o[0] = o[1] = ov;
    return;
  }
  const __m512i lo = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
  s[0] = _mm512_permutexvar_ps(lo, sv), s[1] = _mm512_permutexvar_ps(hi, sv);
  o[0] = _mm512_permutexvar_ps(lo, ov), o[1] = _mm512_permutexvar_ps(hi, ov);
}

// The two bf16 panel rows (32 words each: row pairs 2 b, 2 b + 1) of block `bytes`.
template <int BITS>
inline void convert_block(const uint8_t* bytes, const __m512 s[2], const __m512 o[2], __m512bh& kp0, __m512bh& kp1) {
  if constexpr (BITS == 6) {
#ifdef JAXLLM_SIX_BIT_CODES
    // Words 0-15 of a panel row are columns 0-7 (lanes as the 4-bit scales spread them), 16-31
    // columns 8-15; each code c + 32 made c exactly, then scaled as the 8-bit codes are.
    __m512i w[2];
    six_bit_words(bytes, _mm512_setzero_si512(), w[0], w[1]);
    const __m512 bias = _mm512_set1_ps(32.f);
    auto weights = [&](__m256i words, int half) {
      return _mm512_fmadd_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(words)), bias), s[half], o[half]);
    };
    __m512bh kp[2];
    for (int r = 0; r < 2; ++r)
      kp[r] = _mm512_cvtne2ps_pbh(weights(_mm512_extracti64x4_epi64(w[r], 1), 1),
                                  weights(_mm512_castsi512_si256(w[r]), 0));
    kp0 = kp[0], kp1 = kp[1];
#endif
  } else if constexpr (BITS == 8) {
    // Four rows of 16 codes in f32, then rows 4 b, 4 b + 1 (and 4 b + 2, 4 b + 3) interleaved
    // column by column into the pairs' order.
    __m512 r[4];
    for (int j = 0; j < 4; ++j)
      r[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                 _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + 16 * j)))),
                             s[0], o[0]);
    const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
    kp0 = _mm512_cvtne2ps_pbh(_mm512_permutex2var_ps(r[0], hi, r[1]), _mm512_permutex2var_ps(r[0], lo, r[1]));
    kp1 = _mm512_cvtne2ps_pbh(_mm512_permutex2var_ps(r[2], hi, r[3]), _mm512_permutex2var_ps(r[2], lo, r[3]));
  } else {
    const __m512i a = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + 16)));
    // A code's f32 value by a table lookup on the lane's low 4 bits (VPERMPS ignores the rest):
    // one instruction for the mask and the conversion.
    const __m512 values = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    auto weights = [&](__m512i codes, int half) {
      return _mm512_fmadd_ps(_mm512_permutexvar_ps(codes, values), s[half], o[half]);
    };
    kp0 = _mm512_cvtne2ps_pbh(weights(b, 1), weights(a, 0));
    kp1 = _mm512_cvtne2ps_pbh(weights(_mm512_srli_epi32(b, 4), 1), weights(_mm512_srli_epi32(a, 4), 0));
  }
}

// R rows (R <= kCodesDirectRows) against P panels, the weights converted in registers: y (or,
// with SWIGLU, silu(gate) * up of the first P / 2 panels and the rest) at y + 16 p.
template <int BITS, int R, int P, bool SWIGLU>
__attribute__((noinline)) void codes_bf16_rows(const QuantPanel& q, const uint32_t* __restrict x, int64_t ldx,
                                               const uint8_t* const* w, const int64_t* panel, float* __restrict y,
                                               int64_t ldy) {
  const int64_t G = q.K / q.group, blocks = q.group / 4;
  __m512 acc[P][R];
#pragma GCC unroll 16
  for (int p = 0; p < P; ++p)
#pragma GCC unroll 4
    for (int i = 0; i < R; ++i) acc[p][i] = _mm512_setzero_ps();
  for (int p = 0; p < P; ++p) prefetch_scales(q, panel[p]);
  for (int64_t g = 0; g < G; ++g) {
    __m512 s[P][2], o[P][2];
#pragma GCC unroll 4
    for (int p = 0; p < P; ++p) {
      block_scales<BITS>(q, g, panel[p], s[p], o[p]);
    }
    const uint32_t* xg = x + g * q.group / 2;
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t at = (g * blocks + b) * kBlockBytesOf(BITS);
      // Every panel's sums take this block's pairs in turn: P chains of dependent dot
      // products side by side (the sums' order over k stays the bf16 GEMM's).
#pragma GCC unroll 4
      for (int p = 0; p < P; ++p) {
        if (BITS == 8 || !(b & 1))   // a cache line a block (8-bit codes) or two (4-bit)
          _mm_prefetch(reinterpret_cast<const char*>(w[p] + at + 1024), _MM_HINT_T0);
        __m512bh kp0, kp1;
        convert_block<BITS>(w[p] + at, s[p], o[p], kp0, kp1);
#pragma GCC unroll 8
        for (int i = 0; i < R; ++i) {
          acc[p][i] = _mm512_dpbf16_ps(acc[p][i], (__m512bh)_mm512_set1_epi32(xg[i * ldx + 2 * b]), kp0);
          acc[p][i] = _mm512_dpbf16_ps(acc[p][i], (__m512bh)_mm512_set1_epi32(xg[i * ldx + 2 * b + 1]), kp1);
        }
      }
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
    for (int p = 0; p < (SWIGLU ? P / 2 : P); ++p)
      _mm512_storeu_ps(y + i * ldy + p * kPanel, SWIGLU ? swiglu_f32x16(acc[p][i], acc[p + P / 2][i]) : acc[p][i]);
}

// R rows of P_OUT output panels in registers (with swiglu the first P_OUT of w are the gate
// panels, the next P_OUT their up panels). From 3 rows two panels at a time (with swiglu a gate
// panel and its up panel): four panels' scales and sums would not fit the 32 registers.
template <int BITS, int R, int P_OUT>
void codes_bf16_direct(const QuantPanel& q, const uint32_t* x, int64_t ldx, const uint8_t* const* w,
                       const int64_t* panel, float* y, int64_t ldy, bool swiglu) {
  if (!swiglu) {
    if constexpr (R >= 3 && P_OUT == 4) {
      codes_bf16_rows<BITS, R, 2, false>(q, x, ldx, w, panel, y, ldy);
      codes_bf16_rows<BITS, R, 2, false>(q, x, ldx, w + 2, panel + 2, y + 2 * kPanel, ldy);
    } else {
      codes_bf16_rows<BITS, R, P_OUT, false>(q, x, ldx, w, panel, y, ldy);
    }
  } else if constexpr (P_OUT <= 2) {
    if (R >= 3 && P_OUT == 2) {
      for (int i = 0; i < 2; ++i) {
        const uint8_t* wi[2] = {w[i], w[2 + i]};
        const int64_t pi[2] = {panel[i], panel[2 + i]};
        codes_bf16_rows<BITS, R, 2, true>(q, x, ldx, wi, pi, y + i * kPanel, ldy);
      }
    } else {
      codes_bf16_rows<BITS, R, 2 * P_OUT, true>(q, x, ldx, w, panel, y, ldy);
    }
  }
}

// Panel p as a bf16 panel [K / 2, 16] of words (gemm_bf16.cc's layout) in `out`.
template <int BITS>
void convert_panel(const QuantPanel& q, const uint8_t* w, int64_t p, uint32_t* out) {
  const int64_t blocks = q.group / 4;
  for (int64_t g = 0; g < q.K / q.group; ++g) {
    __m512 s[2], o[2];
    block_scales<BITS>(q, g, p, s, o);
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t block = g * blocks + b;
      __m512bh kp0, kp1;
      convert_block<BITS>(w + block * kBlockBytesOf(BITS), s, o, kp0, kp1);
      _mm512_storeu_si512(out + (2 * block) * kPanel, (__m512i)kp0);
      _mm512_storeu_si512(out + (2 * block + 1) * kPanel, (__m512i)kp1);
    }
  }
}
#endif  // JAXLLM_AVX512_BF16

// Portable: panel p as bf16 words, as convert_panel writes them.
template <int BITS>
void convert_panel_portable(const QuantPanel& q, const uint8_t* w, int64_t p, uint32_t* out) {
  for (int64_t g = 0; g < q.K / q.group; ++g) {
    float s[kPanel], o[kPanel];
    group_scales(q, g, p, s, o);
    for (int64_t k = g * q.group; k < (g + 1) * q.group; ++k)
      for (int64_t c = 0; c < kPanel; ++c) {
        const float code = static_cast<float>(code_at<BITS>(w, k, c));
        const uint32_t bits = to_bf16_bits(std::fma(code, s[c], o[c]));
        uint32_t& word = out[(k / 2) * kPanel + c];
        word = k % 2 ? (word & 0xffffu) | (bits << 16) : bits;
      }
  }
}

struct CodesBf16Scratch {
  AlignedVector<uint32_t> panels;  // converted bf16 panels, up to 4 of [K / 2, 16] words
};

// Rows [r0, r1) of P_OUT output panels from p (with swiglu: gate panels p .. and their up
// panels p + N / 32 ..), into y.
template <int BITS, int P_OUT>
void codes_bf16_output_panels(const CodesBf16Args& a, const QuantPanel& q, int64_t p, int64_t r0, int64_t r1,
                              bool swiglu, int32_t path, CodesBf16Scratch& scratch) {
  const int np = swiglu ? 2 * P_OUT : P_OUT;
  const int64_t panel_bytes = a.K / 4 * kBlockBytesOf(BITS), ldy = swiglu ? a.N / 2 : a.N;
  const uint8_t* w[2 * P_OUT];
  int64_t panel[2 * P_OUT];
  for (int i = 0; i < np; ++i) {
    panel[i] = i < P_OUT ? p + i : p + (i - P_OUT) + a.N / 2 / kPanel;
    w[i] = a.w + panel[i] * panel_bytes;
  }
  const uint32_t* x = reinterpret_cast<const uint32_t*>(a.x) + r0 * a.K / 2;
  float* y = a.y + r0 * ldy + p * kPanel;
#ifdef JAXLLM_AVX512_BF16
  const bool tiles = path == kAmx && a.K % 32 == 0;  // every row on AMX, as bf16_panels takes them
  if (a.factored) {  // (AVX-512 path only) rows kFactoredMaxRows at a time over the same panels
    for (int64_t r = r0; r < r1; r += kFactoredMaxRows) {
      const uint32_t* xr = x + (r - r0) * a.K / 2;
      const float* xs = a.xsums + r * q.groups();
      float* yr = y + (r - r0) * ldy;
      switch (std::min<int64_t>(kFactoredMaxRows, r1 - r)) {
        case 1: codes_factored_direct<BITS, 1, P_OUT>(q, xr, a.K / 2, xs, w, panel, yr, ldy, swiglu); break;
        case 2: codes_factored_direct<BITS, 2, P_OUT>(q, xr, a.K / 2, xs, w, panel, yr, ldy, swiglu); break;
        case 3: codes_factored_direct<BITS, 3, P_OUT>(q, xr, a.K / 2, xs, w, panel, yr, ldy, swiglu); break;
        case 4: codes_factored_direct<BITS, 4, P_OUT>(q, xr, a.K / 2, xs, w, panel, yr, ldy, swiglu); break;
        case 5: codes_factored_direct<BITS, 5, P_OUT>(q, xr, a.K / 2, xs, w, panel, yr, ldy, swiglu); break;
        case 6: codes_factored_direct<BITS, 6, P_OUT>(q, xr, a.K / 2, xs, w, panel, yr, ldy, swiglu); break;
        case 7: codes_factored_direct<BITS, 7, P_OUT>(q, xr, a.K / 2, xs, w, panel, yr, ldy, swiglu); break;
        case 8: codes_factored_direct<BITS, 8, P_OUT>(q, xr, a.K / 2, xs, w, panel, yr, ldy, swiglu); break;
      }
    }
    return;
  }
  if ((path == kAuto || path >= kAvx512) && !tiles && r1 - r0 <= kCodesDirectRows) {
    switch (r1 - r0) {
      case 1: codes_bf16_direct<BITS, 1, P_OUT>(q, x, a.K / 2, w, panel, y, ldy, swiglu); break;
      case 2: codes_bf16_direct<BITS, 2, P_OUT>(q, x, a.K / 2, w, panel, y, ldy, swiglu); break;
      case 3: codes_bf16_direct<BITS, 3, P_OUT>(q, x, a.K / 2, w, panel, y, ldy, swiglu); break;
      case 4: codes_bf16_direct<BITS, 4, P_OUT>(q, x, a.K / 2, w, panel, y, ldy, swiglu); break;
      case 5: codes_bf16_direct<BITS, 5, P_OUT>(q, x, a.K / 2, w, panel, y, ldy, swiglu); break;
      case 6: codes_bf16_direct<BITS, 6, P_OUT>(q, x, a.K / 2, w, panel, y, ldy, swiglu); break;
    }
    return;
  }
#endif
  const int64_t words = a.K / 2 * kPanel;
  scratch.panels.resize(np * words);
  const uint32_t* converted[2 * P_OUT];
  for (int i = 0; i < np; ++i) {
    uint32_t* out = scratch.panels.data() + i * words;
#ifdef JAXLLM_AVX512_BF16
    if (path == kAuto || path >= kAvx512)
      convert_panel<BITS>(q, w[i], panel[i], out);
    else
#endif
      convert_panel_portable<BITS>(q, w[i], panel[i], out);
    converted[i] = out;
  }
  const Bf16GemmArgs g{reinterpret_cast<const uint32_t*>(a.x), nullptr, a.y, a.M, a.K / 2, a.N, a.lora};
  bf16_panels<P_OUT>(g, converted, a.y + p * kPanel, ldy, r0, r1, swiglu, path, nullptr, panel);
}

ffi::Error MatmulQuantBf16Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x, ffi::AnyBuffer codes,
                               ffi::AnyBuffer scale, ffi::AnyBuffer offset, ffi::AnyBuffer super_scale,
                               ffi::AnyBuffer super_offset, ffi::AnyBuffer lora_xa, ffi::AnyBuffer lora_b,
                               ffi::AnyBuffer lora_part, ffi::Buffer<ffi::S32> rows, ffi::ResultBuffer<ffi::F32> y,
                               int32_t bits, int32_t path, int32_t swiglu, int32_t factored) {
  const auto xd = x.dimensions();
  const auto cd = codes.dimensions();
  const bool codes_ok = cd.size() == 3 && xd.size() == 2 && xd[1] % 4 == 0 &&
                        (bits == 4 || bits == 6
                             ? codes.element_type() == ffi::DataType::U8 && cd[2] == kBlockBytesOf(bits) &&
                                   4 * cd[1] == xd[1] && (bits == 4 || has_six_bit_codes())
                             : bits == 8 && codes.element_type() == ffi::DataType::S8 && cd[2] == kPanel &&
                                   cd[1] == xd[1]);
  QuantPanel q{nullptr, nullptr, nullptr, false, codes_ok ? xd[1] : 0, codes_ok ? cd[0] * kPanel : 0, 1, bits};
  if (!codes_ok || !bind_scales(q, scale, offset, super_scale, super_offset) || q.group % 4 || (swiglu && cd[0] % 2))
    return ffi::Error::InvalidArgument(
        "matmul_quantized_bf16: needs x [M, K] bf16 with K a multiple of 4, codes uint8 [N / 16, K / 4, 32] (bits 4, "
        "pairs), uint8 [N / 16, K / 4, 48] (bits 6, AVX512_VBMI builds) or int8 [N / 16, K, 16] (bits 8), "
        "scale [N / 16, G, 16] (groups of a multiple of 4 rows), offset empty or like scale, and for two-level "
        "scales int8 ones with f16 supers");
  if (!path_ok(path))
    return ffi::Error::InvalidArgument("matmul_quantized_bf16: this build has no such kernel path");
  CodesBf16Args a{reinterpret_cast<const uint16_t*>(x.untyped_data()),
                  static_cast<const uint8_t*>(codes.untyped_data()), y->typed_data(), xd[0], xd[1], cd[0] * kPanel};
  const int64_t out_n = swiglu ? a.N / 2 : a.N;
  a.M = live_rows(rows, a.M, out_n, a.y);
  path = bf16_gemm_path(path, a.M);  // AMX for every row of a call, or for none (gemm_bf16.cc)
  // Factored sums for calls of up to kFactoredCallRows rows on the AVX-512 path (gemm_quant_factored.h).
  std::vector<float> xsums;
#ifdef JAXLLM_AVX512_BF16
  a.factored = factored && a.M <= kFactoredCallRows && (path == kAuto || path >= kAvx512) && path != kAmx;
  if (a.factored) {
    group_sums(a.x, a.M, a.K, q.group, xsums);
    a.xsums = xsums.data();
  }
#endif
  LoraTerm lora;
  const int lora_given = lora_term(lora_xa, lora_b, lora_part, xd[0], a.N, lora);
  if (lora_given < 0) return ffi::Error::InvalidArgument("matmul_quantized_bf16: the LoRA term's shapes do not fit");
  // Up to kCodesDirectRows rows, gemm.cc's items (row chunks x panel groups); beyond, items of
  // whole panel groups with every row, so that each panel is converted once a call rather than
  // once a row chunk (about 8 items a thread, at most 4 panels each).
  const auto run_all = [&](bool sw) {
    const int64_t cols = sw ? a.N / 2 : a.N;
    const GemmItems items(a.M, cols, pool.num_threads(), sw ? 2 : 4);
    const bool direct = a.M <= kCodesDirectRows;
    const int64_t panels = cols / kPanel, threads = std::max<int64_t>(1, pool.num_threads());
    const int64_t per_item = std::clamp<int64_t>(panels / (8 * threads), 1, sw ? 2 : 4);
    const int64_t count = direct ? items.count : (panels + per_item - 1) / per_item;
    auto run = [&](auto bits_tag) {
      constexpr int BITS = decltype(bits_tag)::value;
      parallel_for<CodesBf16Scratch>(pool, count, [&](int64_t item, CodesBf16Scratch& scratch) {
        int64_t r0 = 0, r1 = a.M, p0 = item * per_item, p1 = std::min(panels, p0 + per_item);
        if (direct) items.bounds(item, a.M, r0, r1, p0, p1);
        int64_t p = p0;
        if (!sw)
          for (; p + 4 <= p1; p += 4) codes_bf16_output_panels<BITS, 4>(a, q, p, r0, r1, false, path, scratch);
        for (; p + 2 <= p1; p += 2) codes_bf16_output_panels<BITS, 2>(a, q, p, r0, r1, sw, path, scratch);
        for (; p < p1; ++p) codes_bf16_output_panels<BITS, 1>(a, q, p, r0, r1, sw, path, scratch);
      });
    };
    if (bits == 4)
      run(std::integral_constant<int, 4>());
#ifdef JAXLLM_SIX_BIT_CODES
    else if (bits == 6)
      run(std::integral_constant<int, 6>());
#endif
    else
      run(std::integral_constant<int, 8>());
  };
  with_lora(lora, lora_given, path == kAmx && a.K % 32 == 0, a.lora, a.y, a.M, a.N, swiglu, path, run_all);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxllm

// The bf16 panels [N / 16, K / 2, 16] of words (gemm_bf16.cc's layout: what `pack_weight`
// gives for the weights dequantized and rounded to bf16) of codes laid out as for
// JaxllmMatmulQuantBf16Cpu, converted as that GEMM converts them: a small-step codes run's bf16
// weights for its large steps (quantization/params.py), without numpy's passes over every weight.
// scale, offset: f32 or f16 (`half`) [N / 16, G, 16], offset may be null; two-level scales: int8
// scale and offset with f16 super_scale / super_offset [N / 16, G / per_super, 16] (else null). Returns 0, or -1
// for shapes the layout cannot have.
extern "C" int32_t JaxllmCodesToBf16Panels(const uint8_t* codes, int32_t bits, int64_t K, int64_t N, int64_t groups,
                                           const void* scale, const void* offset, int32_t half,
                                           const uint16_t* super_scale, const uint16_t* super_offset,
                                           int64_t per_super, uint32_t* out) {
  using namespace jaxllm;
  const bool bits_ok = bits == 4 || bits == 8 || (bits == 6 && has_six_bit_codes());
  if (!bits_ok || K % 4 || N % kPanel || groups < 1 || K % groups || (K / groups) % 4 ||
      (super_scale && (per_super < 1 || groups % per_super)))
    return -1;
  QuantPanel q{codes, scale, offset, half != 0, K, N, K / groups, bits};
  if (super_scale) {
    q.super_scale = super_scale;
    q.super_offset = super_offset;
    q.per_super = per_super;
  }
  const int64_t panel_bytes = K / 4 * kBlockBytesOf(bits), words = K / 2 * kPanel;
  for (int64_t p = 0; p < N / kPanel; ++p) {
    const uint8_t* w = codes + p * panel_bytes;
#ifdef JAXLLM_AVX512_BF16
    if (bits == 4)
      convert_panel<4>(q, w, p, out + p * words);
#ifdef JAXLLM_SIX_BIT_CODES
    else if (bits == 6)
      convert_panel<6>(q, w, p, out + p * words);
#endif
    else
      convert_panel<8>(q, w, p, out + p * words);
#else
    if (bits == 4)
      convert_panel_portable<4>(q, w, p, out + p * words);
    else
      convert_panel_portable<8>(q, w, p, out + p * words);
#endif
  }
  return 0;
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmMatmulQuantBf16Cpu, jaxllm::MatmulQuantBf16Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // x [M, K]
                                  .Arg<ffi::AnyBuffer>()          // codes (see the top of the file)
                                  .Arg<ffi::AnyBuffer>()          // scale, as matmul_quantized's
                                  .Arg<ffi::AnyBuffer>()          // offset (or empty)
                                  .Arg<ffi::AnyBuffer>()          // super_scale f16 (or empty)
                                  .Arg<ffi::AnyBuffer>()          // super_offset f16 (or empty)
                                  .Arg<ffi::AnyBuffer>()          // lora_xa, lora_b, lora_part (gemm_bf16.cc's
                                  .Arg<ffi::AnyBuffer>()          //   lora_term), or empty
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()   // rows, as for matmul_packed
                                  .Ret<ffi::Buffer<ffi::F32>>()   // y
                                  .Attr<int32_t>("bits")
                                  .Attr<int32_t>("path")
                                  .Attr<int32_t>("swiglu")
                                  .Attr<int32_t>("factored"));  // gemm_quant_factored.h (8-bit codes: in [-64, 63])

// 8-bit panels [P, K, 16] (`pack_codes`) whose codes lie in [-32, 31] as 6-bit blocks [P, K / 4,
// 48] (gemm_quant_factored.h's `six_bit_words` reads them): word 2 c + t of a block's run r is
// row 2 r + t, column c; bytes 6 j + 3 r .. + 2 hold run r's words 4 j .. 4 j + 3, c + 32 six bits
// a word. Returns 0, or -1 where K is not a multiple of 4 or a code lies outside [-32, 31].
extern "C" int32_t JaxllmSixBitBlocks(const int8_t* panels, int64_t P, int64_t K, uint8_t* out) {
  using jaxllm::kPanel;
  if (K % 4) return -1;
  for (int64_t block = 0; block < P * (K / 4); ++block) {  // (panels are K rows apart: block 4 rows)
    const int8_t* rows = panels + 4 * block * kPanel;
    uint8_t* o = out + 48 * block;
    for (int j = 0; j < 8; ++j)
      for (int r = 0; r < 2; ++r) {
        uint32_t bits = 0;
        for (int word = 0; word < 4; ++word) {
          const int w = 4 * j + word, code = rows[(2 * r + w % 2) * kPanel + w / 2];
          if (code < -32 || code > 31) return -1;
          bits |= static_cast<uint32_t>(code + 32) << (6 * word);
        }
        for (int i = 0; i < 3; ++i) o[6 * j + 3 * r + i] = static_cast<uint8_t>(bits >> (8 * i));
      }
  }
  return 0;
}

// 1 where matmul_quantized_bf16 takes 6-bit codes (`pack_codes(codes, 6)`), else 0.
extern "C" int32_t JaxllmHasSixBitCodes() { return jaxllm::has_six_bit_codes(); }
