// 4- and 6-bit codes laid out for int8 activations (gemm_q4a8.cc's quads, gemm_q6a8.cc's 6-bit
// quads) in calls of many rows, on bf16 dots: MatmulQuantImpl's act8 path for a prompt.
//
// The int8 rows' VNNI kernels stream a decode's codes at the memory's speed, but a prompt's
// hundreds of rows slower than bf16 dots over the same codes: on AMX's bf16 tiles (the 1.5B's
// layer matrices at 512 rows on a 2-vCPU Xeon: 607 against 1,795 GFLOP/s, `weight_stream.py`),
// and over 6-bit codes on VDPBF16PS too (Zen 5: about 600 against 860). So from act8_bf16_rows rows
// (path auto; every row with path amx) each panel of codes is converted once a call into
// gemm_bf16.cc's bf16 words (each weight code * scale + offset, one FMA in f32, rounded to
// bf16), x is rounded to bf16, and bf16_panels multiplies them, on the tiles where the process
// has AMX, else with VDPBF16PS. The numbers are then the bf16 weights' (gemm_quant_bf16.cc's
// GEMM over codes computes the same ones from its own layout), not the int8 rows': a call takes
// one or the other for all its rows, by their count, as gemm_bf16.cc's calls choose AMX.

#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

#include "gemm.cc"
#include "gemm_bf16.cc"
#include "gemm_q6a8.cc"
#include "gemm_quant_panel.h"
#include "parallel_for.h"
#include "simd.h"

namespace jaxllm {
namespace {

#if defined(JAXLLM_AVX512_BF16) && defined(JAXLLM_AVX512_VBMI)
#define JAXLLM_CODES_BF16 1

// Whether this process multiplies the converted codes on AMX's tiles (else with VDPBF16PS).
inline bool codes_on_tiles() {
#ifdef JAXLLM_AMX_BF16
  return amx_ready();
#else
  return false;
#endif
}

// Fewest rows a call of path auto takes to bf16 dots, by the codes' bits (0: never). On AMX, over
// the 1.5B's layer matrices on the Xeon kind, the VNNI kernels took 0.91x the tiles' time at 16
// rows (the conversion of every panel costs about what 16 rows of int8 products do) and 2x at
// 64; AMX's int8 tiles (gemm_q4a8.cc, from 8 rows) took 0.82-0.85x the bf16 tiles' time over
// 4-bit codes at 17-24 rows, the same at 32 and 1.2x at 48, over 6-bit codes 1.3x from 17 rows.
// With VDPBF16PS on the Zen 5 kind, 6-bit codes took 0.91-1.01x the VNNI kernel's time at 32 rows
// and 0.69-0.82x at 64-512, 4-bit ones 1.06-1.24x at 64-512 and more below (never); on Zen 4,
// whose 512-bit dots take two passes, gemm_quant_bf16.cc's 6-bit kernel was level with VNNI at 64.
constexpr int64_t kAct8TileRows = 17, kAct8TileRowsFourBits = 32, kAct8DotRowsSixBits = 64;

// Where set (>= 0, `native.act8_bf16_rows_set`: benchmarks, tests), the rows for 4- and 6-bit codes.
inline std::atomic<int64_t> act8_bf16_rows_set_to[2] = {-1, -1};

inline int64_t act8_bf16_rows_for(int32_t bits) {
  const int64_t set = act8_bf16_rows_set_to[bits == 6].load(std::memory_order_relaxed);
  if (set >= 0) return set;
  if (codes_on_tiles()) return bits == 4 ? kAct8TileRowsFourBits : kAct8TileRows;
  return bits == 4 ? 0 : kAct8DotRowsSixBits;
}

inline bool act8_on_bf16(int32_t path, int64_t M, int64_t K, int32_t bits) {
  const int64_t from = act8_bf16_rows_for(bits);
  return K % 32 == 0 && (path == kAuto ? from > 0 && M >= from : path == kAmx && codes_on_tiles());
}

// A block's bytes (8 rows of a panel) permuted for a pair of rows: vector 2 i + h holds rows
// 2 i and 2 i + 1 of columns 8 h .. 8 h + 7, column c's in dword lanes 2 c and 2 c + 1 (as
// cvtne2ps_pbh then makes bf16 words of them), each lane's bytes all from quad byte 4 c + row % 4
// (the row's nibble in it: low for rows 0-3, high for 4-7).
struct PairOrder {
  alignas(64) uint8_t idx[8][64];
};

inline const PairOrder& pair_order() {
  static const PairOrder order = [] {
    PairOrder o{};
    for (int v = 0; v < 8; ++v)
      for (int lane = 0; lane < 16; ++lane)
        for (int b = 0; b < 4; ++b) o.idx[v][4 * lane + b] = 4 * (8 * (v % 2) + lane / 2) + (v / 2 * 2 + lane % 2) % 4;
    return o;
  }();
  return order;
}

// Panel p of q (quads or 6-bit quads) as bf16 words [K / 2, 16] (gemm_bf16.cc's layout) in out.
template <int BITS>
void tile_words(const QuantPanel& q, int64_t p, uint32_t* out) {
  constexpr int64_t block = BITS == 6 ? kSixBlock : 64;
  const uint8_t* codes = static_cast<const uint8_t*>(q.codes) + p * (q.K / 8) * block;
  const PairOrder& order = pair_order();
  __m512i idx[8];
  for (int v = 0; v < 8; ++v) idx[v] = _mm512_load_si512(order.idx[v]);
  // The group's scales and offsets spread as the pairs' lanes: columns 0-7 twice each, then 8-15.
  const __m512i spread_lo = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  const __m512i spread_hi = _mm512_add_epi32(spread_lo, _mm512_set1_epi32(8));
  const __m512 values = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), bias = _mm512_set1_ps(32.f);
  const __m512i byte0 = _mm512_set1_epi32(0xff);
  ScaleCursor cursor(q, p);
  __m512 s[2] = {}, o[2] = {};
  for (int64_t k = 0; k < q.K; k += 8) {
    if (cursor.step(k)) {
      const __m512 sv = scales_f32x16_at(q, q.scale, q.super_scale, cursor.at, cursor.super_at);
      const __m512 ov = q.offset ? scales_f32x16_at(q, q.offset, q.super_offset, cursor.at, cursor.super_at)
                                 : _mm512_setzero_ps();
      s[0] = _mm512_permutexvar_ps(spread_lo, sv), s[1] = _mm512_permutexvar_ps(spread_hi, sv);
      o[0] = _mm512_permutexvar_ps(spread_lo, ov), o[1] = _mm512_permutexvar_ps(spread_hi, ov);
    }
    const uint8_t* blk = codes + k / 8 * block;
    // (a call's codes come from memory, one panel's stream at a time: asked for 48 blocks ahead,
    // the 1.5B's layer matrices took 0.86x the time at 32 rows, where converting is a third)
    _mm_prefetch(reinterpret_cast<const char*>(blk) + 48 * block, _MM_HINT_T0);
    const __m512i raw = _mm512_loadu_si512(blk);
    __m512i lo = raw, hi = raw;
    if constexpr (BITS == 6) six_bit_u(blk, lo, hi);  // (rows 0-3's u, rows 4-7's: the VNNI kernel's)
    for (int i = 0; i < 4; ++i) {  // rows 2 i, 2 i + 1: word row k / 2 + i
      __m512 w[2];
      for (int h = 0; h < 2; ++h) {
        if constexpr (BITS == 6) {
          const __m512i u = _mm512_and_si512(_mm512_permutexvar_epi8(idx[2 * i + h], i < 2 ? lo : hi), byte0);
          w[h] = _mm512_fmadd_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(u), bias), s[h], o[h]);
        } else {  // (VPERMPS reads a lane's low 4 bits: the code, once the high nibble is shifted down)
          __m512i c = _mm512_permutexvar_epi8(idx[2 * i + h], raw);
          if (i >= 2) c = _mm512_srli_epi32(c, 4);
          w[h] = _mm512_fmadd_ps(_mm512_permutexvar_ps(c, values), s[h], o[h]);
        }
      }
      _mm512_storeu_si512(out + (k / 2 + i) * kPanel, (__m512i)_mm512_cvtne2ps_pbh(w[1], w[0]));
    }
  }
}

struct TileWordsScratch {
  AlignedVector<uint32_t> panels;  // an item's converted panels, [K / 2, 16] words each
};

// The most output panels an item converts: the tiles' K chunks' (with swiglu half, and their up
// panels), or VDPBF16PS's block of 4 (gemm_bf16.cc's items).
inline int64_t widest_item(int64_t K, bool swiglu) {
#ifdef JAXLLM_AMX_BF16
  if (codes_on_tiles() && K / 2 >= kAmxChunkFrom) return kAmxChunkPanels / (swiglu ? 2 : 1);
#endif
  return swiglu ? 2 : 4;
}

// n output panels from p (with swiglu: gate panels p .. and their up panels p + N / 32 ..), every
// row of x (bf16 words xb): the panels converted, then multiplied on the tiles or with VDPBF16PS.
template <int BITS>
void codes_output_panels(const GemmArgs& g, const QuantPanel& q, const uint32_t* xb, int64_t p, int64_t n,
                         bool swiglu, TileWordsScratch& scratch) {
  constexpr int64_t kMost = 32;  // (widest_item's panels, their up panels included)
  const int64_t np = swiglu ? 2 * n : n, words = g.K / 2 * kPanel, ldy = swiglu ? g.N / 2 : g.N;
  scratch.panels.resize(np * words);
  const uint32_t* w[kMost];
  int64_t ids[kMost];
  for (int64_t i = 0; i < np; ++i) {
    ids[i] = i < n ? p + i : p + (i - n) + g.N / 2 / kPanel;
    tile_words<BITS>(q, ids[i], scratch.panels.data() + i * words);
    w[i] = scratch.panels.data() + i * words;
  }
  const Bf16GemmArgs b{xb, nullptr, g.y, g.M, g.K / 2, g.N};
#ifdef JAXLLM_AMX_BF16
  if (codes_on_tiles()) {
    const int64_t chunk = b.KP >= kAmxChunkFrom ? kAmxChunk : b.KP;
    return bf16_block_amx(b, w, n, g.y + p * kPanel, ldy, 0, g.M, swiglu, ids, chunk);
  }
#endif
  int64_t i = 0;
  const auto block = [&](auto width) {  // panels i .. i + P (and their up panels) on VDPBF16PS
    constexpr int P = decltype(width)::value;
    const uint32_t* sel[2 * P];
    for (int j = 0; j < P; ++j) sel[j] = w[i + j], sel[P + j] = swiglu ? w[n + i + j] : nullptr;
    bf16_panels<P>(b, sel, g.y + (p + i) * kPanel, ldy, 0, g.M, swiglu, kAvx512);
    i += P;
  };
  while (!swiglu && n - i >= 4) block(std::integral_constant<int, 4>());
  while (n - i >= 2) block(std::integral_constant<int, 2>());
  while (i < n) block(std::integral_constant<int, 1>());
}

// y = x @ the codes (4 bits: quads; 6 bits: 6-bit quads) on bf16 dots (act8_on_bf16). Items of
// up to 4 output panels (2 with swiglu, and their up panels), or on the tiles of
// kAmxChunkPanels (half with swiglu) where they walk K in chunks: x's rows are then read once
// for so many panels. Each thread converts its own share of the items in order
// (parallel_for_shares): prompt steps of the 1.5B of 48-512 tokens took 0.85-0.98x the time of
// items handed out in turn (Xeon kind).
void matmul_codes_bf16(ffi::ThreadPool& pool, const GemmArgs& g, const QuantPanel& q, int32_t swiglu) {
  thread_local AlignedVector<uint16_t> xbits;  // (the calling thread's: workers read it through xb)
  xbits.resize(std::max<size_t>(xbits.size(), g.M * g.K));
  uint16_t* xb = xbits.data();
  parallel_for(pool, (g.M + 15) / 16, [&](int64_t item) {
    for (int64_t i = item * 16 * g.K, end = std::min(g.M, (item + 1) * 16) * g.K; i < end; i += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xb + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(g.x + i)));
  });
  const int64_t panels = (swiglu ? g.N / 2 : g.N) / kPanel, threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t widest = widest_item(g.K, swiglu);
  const int64_t per_item = std::clamp<int64_t>(panels / ((widest > 4 ? 3 : 8) * threads), 1, widest);
  auto run = [&](auto bits_tag) {
    constexpr int BITS = decltype(bits_tag)::value;
    const uint32_t* x = reinterpret_cast<const uint32_t*>(xb);
    parallel_for_shares<TileWordsScratch>(pool, (panels + per_item - 1) / per_item, [&](int64_t item, TileWordsScratch& s) {
      const int64_t p = item * per_item;
      codes_output_panels<BITS>(g, q, x, p, std::min(panels, p + per_item) - p, swiglu, s);
    });
  };
  if (q.bits == 6)
    run(std::integral_constant<int, 6>());
  else
    run(std::integral_constant<int, 4>());
}
#endif  // JAXLLM_AVX512_BF16 && JAXLLM_AVX512_VBMI

// Rows from which path auto multiplies act8's codes of `bits` (4 or 6) on bf16 dots (0: never,
// here), set to `rows` first where rows >= 0 (and this build has the path); returns the value before.
inline int64_t act8_bf16_rows(int32_t bits, int64_t rows) {
#ifdef JAXLLM_CODES_BF16
  const int64_t before = act8_bf16_rows_for(bits);
  if (rows >= 0) act8_bf16_rows_set_to[bits == 6].store(rows, std::memory_order_relaxed);
  return before;
#else
  static_cast<void>(bits), static_cast<void>(rows);
  return 0;
#endif
}

}  // namespace
}  // namespace jaxllm
