// 4- and 6-bit codes laid out for int8 activations (gemm_q4a8.cc's quads, gemm_q6a8.cc's 6-bit
// quads) in calls of many rows, on AMX's bf16 tiles: MatmulQuantImpl's act8 path for a prompt.
//
// The int8 rows' VNNI kernels stream a decode's codes at the memory's speed, but a prompt's
// hundreds of rows at a third of what AMX's bf16 tiles reach over the same codes (the 1.5B's
// layer matrices at 512 rows on a 2-vCPU Xeon: 607 against 1,795 GFLOP/s, `weight_stream.py`).
// So from kAct8TileRows rows (path auto; every row with path amx) each panel of codes is
// converted once a call into gemm_bf16.cc's bf16 words (each weight code * scale + offset, one
// FMA in f32, rounded to bf16), x is rounded to bf16, and bf16_panels multiplies them on the
// tiles. The numbers are then the bf16 weights' (gemm_quant_bf16.cc's GEMM over codes computes
// the same ones from its own layout), not the int8 rows': a call takes one or the other for all
// its rows, by their count, as gemm_bf16.cc's calls choose AMX.

#pragma once

#include <algorithm>
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

#if defined(JAXLLM_AMX_BF16) && defined(JAXLLM_AVX512_VBMI)
#define JAXLLM_CODES_TILES 1

// Fewest rows a call of path auto takes to the tiles, by the codes' bits. Over the 1.5B's layer
// matrices on the Xeon kind the VNNI kernels took 0.91x the tiles' time at 16 rows (the
// conversion of every panel costs about what 16 rows of int8 products do) and 2x at 64; AMX's
// int8 tiles (gemm_q4a8.cc, from 8 rows) took 0.82-0.85x the bf16 tiles' time over 4-bit codes
// at 17-24 rows, the same at 32 and 1.2x at 48, over 6-bit codes 1.3x from 17 rows.
constexpr int64_t kAct8TileRows = 17, kAct8TileRowsFourBits = 32;

inline int64_t act8_tile_rows_for(int32_t bits) { return bits == 4 ? kAct8TileRowsFourBits : kAct8TileRows; }

inline bool act8_on_tiles(int32_t path, int64_t M, int64_t K, int32_t bits) {
  return K % 32 == 0 && (path == kAmx || (path == kAuto && M >= act8_tile_rows_for(bits))) && amx_ready();
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
  AlignedVector<uint32_t> panels;  // converted panels, up to 2 kAmxChunkPanels of [K / 2, 16] words
};

// n output panels from p (with swiglu: gate panels p .. and their up panels p + N / 32 ..), every
// row of x (bf16 words xb), on the tiles.
template <int BITS>
void tiles_output_panels(const GemmArgs& g, const QuantPanel& q, const uint32_t* xb, int64_t p, int64_t n,
                         bool swiglu, TileWordsScratch& scratch) {
  const int64_t np = swiglu ? 2 * n : n, words = g.K / 2 * kPanel;
  scratch.panels.resize(np * words);
  const uint32_t* w[2 * kAmxChunkPanels];
  int64_t ids[2 * kAmxChunkPanels];
  for (int64_t i = 0; i < np; ++i) {
    ids[i] = i < n ? p + i : p + (i - n) + g.N / 2 / kPanel;
    tile_words<BITS>(q, ids[i], scratch.panels.data() + i * words);
    w[i] = scratch.panels.data() + i * words;
  }
  const Bf16GemmArgs b{xb, nullptr, g.y, g.M, g.K / 2, g.N};
  const int64_t chunk = b.KP >= kAmxChunkFrom ? kAmxChunk : b.KP;
  bf16_block_amx(b, w, n, g.y + p * kPanel, swiglu ? g.N / 2 : g.N, 0, g.M, swiglu, ids, chunk);
}

// y = x @ the codes (4 bits: quads; 6 bits: 6-bit quads), on the tiles (act8_on_tiles). Items of
// up to 4 output panels (2 with swiglu, and their up panels), or of kAmxChunkPanels (half with
// swiglu) where K is walked in chunks: x's rows are then read once for so many panels. Each
// thread converts its own share of the items in order (parallel_for_shares): prompt steps of the
// 1.5B of 48-512 tokens took 0.85-0.98x the time of items handed out in turn (Xeon kind).
void matmul_codes_tiles(ffi::ThreadPool& pool, const GemmArgs& g, const QuantPanel& q, int32_t swiglu) {
  thread_local AlignedVector<uint16_t> xbits;  // (the calling thread's: workers read it through xb)
  xbits.resize(std::max<size_t>(xbits.size(), g.M * g.K));
  uint16_t* xb = xbits.data();
  parallel_for(pool, (g.M + 15) / 16, [&](int64_t item) {
    for (int64_t i = item * 16 * g.K, end = std::min(g.M, (item + 1) * 16) * g.K; i < end; i += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xb + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(g.x + i)));
  });
  const int64_t panels = (swiglu ? g.N / 2 : g.N) / kPanel, threads = std::max<int64_t>(1, pool.num_threads());
  const bool chunked = g.K / 2 >= kAmxChunkFrom;
  const int64_t widest = (chunked ? kAmxChunkPanels : 4) / (swiglu ? 2 : 1);
  const int64_t per_item = std::clamp<int64_t>(panels / ((chunked ? 3 : 8) * threads), 1, widest);
  auto run = [&](auto bits_tag) {
    constexpr int BITS = decltype(bits_tag)::value;
    const uint32_t* x = reinterpret_cast<const uint32_t*>(xb);
    parallel_for_shares<TileWordsScratch>(pool, (panels + per_item - 1) / per_item, [&](int64_t item, TileWordsScratch& s) {
      const int64_t p = item * per_item;
      tiles_output_panels<BITS>(g, q, x, p, std::min(panels, p + per_item) - p, swiglu, s);
    });
  };
  if (q.bits == 6)
    run(std::integral_constant<int, 6>());
  else
    run(std::integral_constant<int, 4>());
}
#endif  // JAXLLM_AMX_BF16 && JAXLLM_AVX512_VBMI

// Rows from which path auto multiplies act8's codes of `bits` (4 or 6) on the tiles (0: never, here).
inline int64_t act8_tile_rows(int32_t bits) {
#ifdef JAXLLM_CODES_TILES
  if (amx_ready()) return act8_tile_rows_for(bits);
#endif
  static_cast<void>(bits);
  return 0;
}

}  // namespace
}  // namespace jaxllm
