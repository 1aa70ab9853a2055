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
// Paths: AVX512_BF16 (kAvx512, 6 rows x 4 panels of sums in 24 registers, or 12 x 2 for fewer
// panels); AMX (kAmx: auto takes it for calls of kAmxRows rows or more), where 16 k-pairs of a
// panel are already a B tile; elsewhere a portable loop over the same layout (tests, and CPUs
// whose models are not packed this way: `native.has_bf16_dots()` says which). AMX's dot sums the
// same exact products in f32 in another order (its results differ from VDPBF16PS's in the last
// bits), so a call takes one or the other for all its rows, by their count (`bf16_gemm_path`),
// and the GEMM over codes (gemm_quant_bf16.cc) chooses as this one does: over codes or over
// their bf16 panels, a step computes the same numbers.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

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

// Multi-LoRA's second product, added to the sums before they are stored (lora.cc's
// `lora_shrink` makes xa): output panel p gains xa's rows of part part[p] @ b's panel p. With
// AMX the tiles add it to the base product's tiles; elsewhere `add_lora_rows` after the product.
struct LoraTerm {
  const uint32_t* xa;    // [parts, M, KL / 2] words: each row's x a, of its slot's columns only
  const uint32_t* b;     // [N / 16, KL / 2, 16] words: every slot's b, stacked along K
  const int32_t* part;   // [N / 16]
  int64_t M, KLP;        // the call's rows; KL / 2 (a multiple of 16)
  const uint32_t* rows(int64_t p) const { return xa + part[p] * M * KLP; }
  const uint32_t* panel(int64_t p) const { return b + p * KLP * kPanel; }
};

struct Bf16GemmArgs {
  const uint32_t* x;  // [M, K / 2] words: a bf16 row of x, two elements per word
  const uint32_t* w;  // [N / 16, K / 2, 16] words (see the top of the file)
  float* y;           // [M, N]  (or [M, N / 2] with swiglu)
  int64_t M, KP, N;   // KP = K / 2
  const LoraTerm* lora = nullptr;  // AMX only: added to the tiles (see LoraTerm)
};

#ifdef JAXLLM_AVX512_BF16
// R rows of x against P panels w[0 .. P - 1], every sum over K in registers (P x R of them).
// Stores panel p's 16 columns at y + 16 p; with SWIGLU (the first P / 2 panels gate panels,
// the rest their up panels) silu(gate p) * (up p) at y + 16 p for p < P / 2. Never inlined:
// inlined into the work-item lambda, GCC spilled the panels' vectors and pointers to the stack
// and reloaded them every k (perf annotate on Zen 4); on its own the loop keeps all in
// registers, and the layer GEMMs ran 1.1-1.25x faster from 64 to 256 rows. `pf`: gemm.cc's
// Prefetcher, pf->lines lines every kPrefetchSegment k-pairs.
template <int R, int P, bool SWIGLU>
__attribute__((noinline)) void bf16_rows(const uint32_t* __restrict x, int64_t ldx, const uint32_t* const* w,
                                         float* __restrict y, int64_t ldy, int64_t KP, Prefetcher* pf) {
  const uint32_t* wp[P];
  for (int p = 0; p < P; ++p) wp[p] = w[p];
  __m512 acc[P][R];
#pragma GCC unroll 12
  for (int i = 0; i < R; ++i)
    for (int p = 0; p < P; ++p) acc[p][i] = _mm512_setzero_ps();
  PrefetchStream next_weights(pf);
  for (int64_t k0 = 0; k0 < KP; k0 += kPrefetchSegment) {
    next_weights.next();
    for (int64_t kp = k0, k1 = std::min(KP, k0 + kPrefetchSegment); kp < k1; ++kp) {
      __m512bh b[P];
      for (int p = 0; p < P; ++p) b[p] = (__m512bh)_mm512_loadu_si512(wp[p] + kp * kPanel);
#pragma GCC unroll 12
      for (int i = 0; i < R; ++i) {
        const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[i * ldx + kp]));
        for (int p = 0; p < P; ++p) acc[p][i] = _mm512_dpbf16_ps(acc[p][i], a, b[p]);
      }
    }
  }
  next_weights.done(pf);
#pragma GCC unroll 12
  for (int i = 0; i < R; ++i) {
    if (SWIGLU) {
      for (int p = 0; p < P / 2; ++p)
        _mm512_storeu_ps(y + i * ldy + p * kPanel, swiglu_f32x16(acc[p][i], acc[p + P / 2][i]));
    } else {
      for (int p = 0; p < P; ++p) _mm512_storeu_ps(y + i * ldy + p * kPanel, acc[p][i]);
    }
  }
}

// Rows [r0, r1) against panels w[0 .. P - 1]: blocks of RB rows (RB x P sums in 24 of the 32
// registers), then the remainder. Four panels a block read x half as often as two: 6-9% faster
// in a C++ harness on Zen 4 (two threads, 12-180 rows against 30 [576, 3072] weights), within
// noise over the whole model. `pf`: the next group's Prefetcher, spread over the blocks from
// two full blocks on; with fewer rows its reads compete with the first block's own (at 8 rows
// it took 1.05-1.1x the time, at 1-6 about the same).
template <int P, bool SWIGLU>
void bf16_block_avx512(const Bf16GemmArgs& g, const uint32_t* const* w, float* y, int64_t ldy, int64_t r0,
                       int64_t r1, Prefetcher* pf) {
  constexpr int RB = P == 4 ? 6 : 12;
  const int64_t KP = g.KP;
  if (r1 - r0 < 2 * RB) pf = nullptr;
  if (pf) pf->spread((r1 - r0 + RB - 1) / RB * ((KP + kPrefetchSegment - 1) / kPrefetchSegment));
  int64_t r = r0;
  for (; r + RB <= r1; r += RB) bf16_rows<RB, P, SWIGLU>(g.x + r * KP, KP, w, y + r * ldy, ldy, KP, pf);
  const uint32_t* x = g.x + r * KP;
  y += r * ldy;
  switch (r1 - r) {
#define JAXLLM_BF16_CASE(n) \
  case n: if constexpr (n < RB) bf16_rows<n, P, SWIGLU>(x, KP, w, y, ldy, KP, pf); break;
    JAXLLM_BF16_CASE(11) JAXLLM_BF16_CASE(10) JAXLLM_BF16_CASE(9) JAXLLM_BF16_CASE(8) JAXLLM_BF16_CASE(7)
    JAXLLM_BF16_CASE(6) JAXLLM_BF16_CASE(5) JAXLLM_BF16_CASE(4) JAXLLM_BF16_CASE(3) JAXLLM_BF16_CASE(2)
    JAXLLM_BF16_CASE(1)
#undef JAXLLM_BF16_CASE
  }
}
#endif  // JAXLLM_AVX512_BF16

// Fewest rows a call must have for path auto to take AMX. One row streams its weights through
// VDPBF16PS as fast (bf16 panels) or faster (codes converted in registers, 0.8x AMX's time); from
// two rows the tiles are as fast or faster, and from four, over codes, 0.45-0.76x VDPBF16PS's time.
constexpr int64_t kAmxRows = 2;

// The path a call of M rows takes (`path` auto: AMX from kAmxRows rows where the process may).
inline int32_t bf16_gemm_path(int32_t path, int64_t M) {
#ifdef JAXLLM_AMX_BF16
  if (path == kAuto && M >= kAmxRows && amx_ready()) return kAmx;
#endif
  (void)M;
  return path;
}

#ifdef JAXLLM_AMX_BF16

// Tiles 0-3: the sums C[b][j] of row block b (16 rows) and panel j of a pair, tile 2 b + j;
// 4-5: x's row blocks (16 rows x 16 k-pairs); 6-7: the pair's panels (16 k-pairs x 16 columns).
// `m` rows (1-32): tiles of the second block exist only from 17 rows.
inline void amx_configure(int64_t m) {
  TileConfig c;
  const uint8_t m0 = static_cast<uint8_t>(std::min<int64_t>(m, 16)), m1 = static_cast<uint8_t>(m - m0);
  for (int t : {0, 1, 4}) c.rows[t] = m0;
  for (int t : {2, 3, 5}) c.rows[t] = m1;
  for (int t : {6, 7}) c.rows[t] = 16;
  for (int t = 0; t < 8; ++t) c.colsb[t] = c.rows[t] ? 64 : 0;
  load_tile_config(c);
}

// Rows x[0 .. 16 or 32) (TWO: both blocks; row stride KP k-pairs) against panels w0 and w1 over
// k-pairs [k0, k1), summed in tiles 0-3 (see amx_configure) from zero at k0 = 0, else from the
// sums at `kept`, and stored back there unless k1 = KP (then the tiles hold the product).
template <bool TWO>
void amx_pair(const uint32_t* x, int64_t KP, int64_t k0, int64_t k1, const uint32_t* w0, const uint32_t* w1,
              float* kept) {
  __asm__ volatile("" ::: "memory");  // (GCC's tileloadd names no memory read: operands written before)
  if (k0 == 0) {
    _tile_zero(0);
    _tile_zero(1);
    if (TWO) _tile_zero(2);
    if (TWO) _tile_zero(3);
  } else {
    _tile_loadd(0, kept, 64);
    _tile_loadd(1, kept + 256, 64);
    if (TWO) _tile_loadd(2, kept + 512, 64);
    if (TWO) _tile_loadd(3, kept + 768, 64);
  }
  const int64_t stride = KP * 4;  // bytes from one row of x to the next
  for (int64_t kp = k0; kp < k1; kp += 16) {
    _tile_loadd(6, w0 + kp * kPanel, 64);
    _tile_loadd(7, w1 + kp * kPanel, 64);
    _tile_loadd(4, x + kp, stride);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (TWO) {
      _tile_loadd(5, x + 16 * KP + kp, stride);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  if (k1 == KP) return;
  _tile_stored(0, kept, 64);
  _tile_stored(1, kept + 256, 64);
  if (TWO) _tile_stored(2, kept + 512, 64);
  if (TWO) _tile_stored(3, kept + 768, 64);
}

// LoRA's share of rows x[r .. r + 16 or 32) of panels p0 and p1 added to the sums in tiles 0-3
// (amx_pair's), through the same operand tiles.
template <bool TWO>
void amx_lora_pair(const LoraTerm& l, int64_t r, int64_t p0, int64_t p1) {
  __asm__ volatile("" ::: "memory");  // (as amx_pair)
  const int64_t stride = l.KLP * 4;
  const uint32_t* x0 = l.rows(p0) + r * l.KLP;
  const uint32_t* x1 = l.rows(p1) + r * l.KLP;
  for (int64_t kp = 0; kp < l.KLP; kp += 16) {
    _tile_loadd(6, l.panel(p0) + kp * kPanel, 64);
    _tile_loadd(7, l.panel(p1) + kp * kPanel, 64);
    _tile_loadd(4, x0 + kp, stride);
    if (TWO) _tile_loadd(5, x0 + 16 * l.KLP + kp, stride);
    _tile_dpbf16ps(0, 4, 6);
    if (TWO) _tile_dpbf16ps(2, 5, 6);
    if (x1 != x0) {  // (panels of two parts of a fused matrix)
      _tile_loadd(4, x1 + kp, stride);
      if (TWO) _tile_loadd(5, x1 + 16 * l.KLP + kp, stride);
    }
    _tile_dpbf16ps(1, 4, 7);
    if (TWO) _tile_dpbf16ps(3, 5, 7);
  }
}

// Where the codes' tiles path (gemm_codes_tiles.cc) walks K in chunks of kAmxChunk k-pairs over
// items of kAmxChunkPanels panels: from kAmxChunkFrom k-pairs, where a block of 32 rows of x is
// past a quarter of L2 and x's rows would be read from L3 again for every item of 4 panels (the
// 1.5B's down projection, K = 8,960, at 512 rows: 0.76 TFLOP/s a core a pair at a time over all
// of K, 1.17 in chunks over 16 panels, in a C++ harness on the Xeon kind). The bf16 panels'
// items of 4 panels stay in one pass (chunked, their layer GEMMs took 1.03-1.06x the time).
constexpr int64_t kAmxChunkFrom = 2048, kAmxChunk = 128, kAmxChunkPanels = 16;

// Rows [r0, r1) of n output panels, as bf16_panels (KP a multiple of 16): panels in pairs (with
// swiglu a gate panel w[i] and its up panel w[n + i]), rows in blocks of 32, each block against
// every pair while its rows of x are in cache; K in chunks of `chunk` k-pairs (a multiple of 16;
// KP: one pass), the sums kept between them (exact: the same additions in the same order).
void bf16_block_amx(const Bf16GemmArgs& g, const uint32_t* const* w, int64_t n, float* y, int64_t ldy, int64_t r0,
                    int64_t r1, bool swiglu, const int64_t* ids, int64_t chunk) {
  const int64_t KP = g.KP, pairs = swiglu ? n : (n + 1) / 2;
  static thread_local AlignedVector<float> kept_;  // [row block][pair][4 tiles]
  if (chunk < KP) kept_.resize(std::max<size_t>(kept_.size(), (r1 - r0 + 31) / 32 * pairs * 4 * 16 * kPanel));
  alignas(64) float sums[2][2][16][kPanel];  // [block][panel of the pair][row][column], for swiglu
  int64_t configured = 0;
  for (int64_t k0 = 0; k0 < KP; k0 += chunk) {
    const int64_t k1 = std::min(KP, k0 + chunk);
    for (int64_t r = r0; r < r1; r += 32) {
      const int64_t m = std::min<int64_t>(32, r1 - r), m0 = std::min<int64_t>(m, 16);
      if (m != configured) amx_configure(configured = m);
      const uint32_t* x = g.x + r * KP;
      float* out = y + r * ldy;
      for (int64_t i = 0; i < pairs; ++i) {
        const int64_t j0 = swiglu ? i : 2 * i, j1 = swiglu ? n + i : std::min(2 * i + 1, n - 1);
        float* kept = chunk < KP ? kept_.data() + ((r - r0) / 32 * pairs + i) * 4 * 16 * kPanel : nullptr;
        if (m > 16) {
          amx_pair<true>(x, KP, k0, k1, w[j0], w[j1], kept);
        } else {
          amx_pair<false>(x, KP, k0, k1, w[j0], w[j1], kept);
        }
        if (k1 < KP) continue;
        if (g.lora) {  // ids: the panels' own numbers (w's order)
          if (m > 16) {
            amx_lora_pair<true>(*g.lora, r, ids[j0], ids[j1]);
          } else {
            amx_lora_pair<false>(*g.lora, r, ids[j0], ids[j1]);
          }
        }
        if (!swiglu) {  // straight into y, 16 columns a tile row
          _tile_stored(0, out + j0 * kPanel, ldy * 4);
          if (m > 16) _tile_stored(2, out + 16 * ldy + j0 * kPanel, ldy * 4);
          if (j1 != j0) {
            _tile_stored(1, out + j1 * kPanel, ldy * 4);
            if (m > 16) _tile_stored(3, out + 16 * ldy + j1 * kPanel, ldy * 4);
          }
          continue;
        }
        _tile_stored(0, sums[0][0], 64);
        _tile_stored(1, sums[0][1], 64);
        if (m > 16) {
          _tile_stored(2, sums[1][0], 64);
          _tile_stored(3, sums[1][1], 64);
        }
        for (int64_t row = 0; row < m; ++row) {
          const int b = row >= m0, t = static_cast<int>(row - b * 16);
          _mm512_storeu_ps(out + row * ldy + i * kPanel,
                           swiglu_f32x16(_mm512_load_ps(sums[b][0][t]), _mm512_load_ps(sums[b][1][t])));
        }
      }
    }
  }
  _tile_release();  // (XLA's own AMX GEMMs on this thread load their own configuration)
}
#endif  // JAXLLM_AMX_BF16

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

// Rows [r0, r1) of P_OUT output panels at y (row stride ldy) from the bf16 panels w: w[0 ..
// P_OUT), or with swiglu gate panels w[0 .. P_OUT) and their up panels w[P_OUT .. 2 P_OUT).
// Also the tail of the GEMM over quantized codes (gemm_quant_bf16.cc), on its converted panels.
// `ids`: the panels' numbers in the weight (w's order), for g.lora.
template <int P_OUT>
void bf16_panels(const Bf16GemmArgs& g, const uint32_t* const* w, float* y, int64_t ldy, int64_t r0, int64_t r1,
                 bool swiglu, int32_t path, Prefetcher* pf = nullptr, const int64_t* ids = nullptr) {
#ifdef JAXLLM_AMX_BF16
  if (path == kAmx && g.KP % 16 == 0)  // (kAmx passes path_ok only where amx_ready)
    return bf16_block_amx(g, w, P_OUT, y, ldy, r0, r1, swiglu, ids, g.KP);
#endif
#ifdef JAXLLM_AVX512_BF16
  if (path == kAuto || path >= kAvx512) {
    if constexpr (P_OUT <= 2) {  // the callers take swiglu panels at most two at a time
      if (swiglu) return bf16_block_avx512<2 * P_OUT, true>(g, w, y, ldy, r0, r1, pf);
    }
    return bf16_block_avx512<P_OUT, false>(g, w, y, ldy, r0, r1, pf);
  }
#endif
  for (int i = 0; i < P_OUT; ++i)
    for (int64_t r = r0; r < r1; ++r) {
      float gate[kPanel], up[kPanel];
      bf16_panel_portable(g, w[i], gate, r);
      float* out = y + r * ldy + i * kPanel;
      if (!swiglu) {
        std::memcpy(out, gate, sizeof gate);
        continue;
      }
      bf16_panel_portable(g, w[P_OUT + i], up, r);
      for (int64_t j = 0; j < kPanel; ++j) out[j] = swiglu_f32(gate[j], up[j]);
    }
}

// Output panels [p, p + P_OUT) of y for rows [r0, r1): from the same panels of w, or with
// swiglu from gate panels [p, p + P_OUT) and up panels [p + N / 32, ...); `pf` as in bf16_block_avx512.
template <int P_OUT>
void bf16_output_panels(const Bf16GemmArgs& g, int64_t p, int64_t r0, int64_t r1, bool swiglu, int32_t path,
                        Prefetcher* pf = nullptr) {
  const int64_t panel_words = g.KP * kPanel, ldy = swiglu ? g.N / 2 : g.N;
  const uint32_t* w[2 * P_OUT];
  int64_t ids[2 * P_OUT];
  for (int i = 0; i < P_OUT; ++i) {
    ids[i] = p + i, ids[P_OUT + i] = p + i + g.N / 2 / kPanel;
    w[i] = g.w + ids[i] * panel_words;
    w[P_OUT + i] = swiglu ? g.w + ids[P_OUT + i] * panel_words : nullptr;
  }
  bf16_panels<P_OUT>(g, w, g.y + p * kPanel, ldy, r0, r1, swiglu, path, pf, ids);
}

// The LoRA term of a call from its three arguments (lora_xa [parts, M, KL] bf16, lora_b [N / 16,
// KL / 2, 16, 2] bf16, lora_part [N / 16] int32; all empty: none): 1 and `l` set, 0 for none, -1
// for shapes or parts that do not fit.
inline int lora_term(ffi::AnyBuffer xa, ffi::AnyBuffer b, ffi::AnyBuffer part, int64_t M, int64_t N, LoraTerm& l) {
  if (!xa.element_count() && !b.element_count() && !part.element_count()) return 0;
  const auto xd = xa.dimensions(), bd = b.dimensions();
  if (xa.element_type() != ffi::DataType::BF16 || b.element_type() != ffi::DataType::BF16 ||
      part.element_type() != ffi::DataType::S32 || xd.size() != 3 || bd.size() != 4 || bd[0] * kPanel != N ||
      bd[2] != kPanel || bd[3] != 2 || bd[1] % 16 || xd[1] != M || xd[2] != 2 * bd[1] ||
      part.element_count() != bd[0])
    return -1;
  l = LoraTerm{reinterpret_cast<const uint32_t*>(xa.untyped_data()), reinterpret_cast<const uint32_t*>(b.untyped_data()),
               static_cast<const int32_t*>(part.untyped_data()), M, bd[1]};
  for (int64_t p = 0; p < bd[0]; ++p)
    if (l.part[p] < 0 || l.part[p] >= xd[0]) return -1;
  return 1;
}

// y [live, N] += the LoRA term, row by row: for the calls the tiles do not take (one row; K not
// a multiple of 32).
void add_lora_rows(const LoraTerm& l, float* y, int64_t live, int64_t N, int32_t path) {
  for (int64_t p = 0; p < N / kPanel; ++p)
    for (int64_t r = 0; r < live; ++r) {
      const uint32_t *x = l.rows(p) + r * l.KLP, *w = l.panel(p);
      float* out = y + r * N + p * kPanel;
#ifdef JAXLLM_AVX512_BF16
      if (path == kAuto || path >= kAvx512) {
        __m512 acc = _mm512_loadu_ps(out);
        for (int64_t kp = 0; kp < l.KLP; ++kp)
          acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32(static_cast<int>(x[kp])),
                                 (__m512bh)_mm512_loadu_si512(w + kp * kPanel));
        _mm512_storeu_ps(out, acc);
        continue;
      }
#endif
      for (int64_t kp = 0; kp < l.KLP; ++kp) {
        const float x0 = to_f32(static_cast<uint16_t>(x[kp])), x1 = to_f32(static_cast<uint16_t>(x[kp] >> 16));
        for (int64_t j = 0; j < kPanel; ++j) {
          const uint32_t word = w[kp * kPanel + j];
          out[j] += x0 * to_f32(static_cast<uint16_t>(word)) + x1 * to_f32(static_cast<uint16_t>(word >> 16));
        }
      }
    }
}

// A GEMM call with a LoRA term (`given`: lora_term's 1) whose output is y [M, N] (or [M, N / 2]
// with swiglu), M its live rows. Where the call runs on AMX's tiles (`tiles`) the term is added
// as the sums are made: `fused` (the GEMM's LoraTerm pointer) is set. Elsewhere run(false)
// writes the plain product (into a scratch when the call has the SwiGLU epilogue, which then
// follows) and add_lora_rows adds the term. run(swiglu) runs the GEMM into y as it is then.
template <typename Run>
void with_lora(const LoraTerm& lora, int given, bool tiles, const LoraTerm*& fused, float*& y, int64_t M, int64_t N,
               bool swiglu, int32_t path, Run run) {
  if (!given) return run(swiglu);
  if (tiles) {
    fused = &lora;
    return run(swiglu);
  }
  if (!swiglu) {
    run(false);
    return add_lora_rows(lora, y, M, N, path);
  }
  static thread_local std::vector<float> full_;
  full_.resize(M * N);
  float* out = y;
  y = full_.data();
  run(false);
  add_lora_rows(lora, y, M, N, path);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t j = 0; j < N / 2; ++j) out[r * N / 2 + j] = swiglu_f32(y[r * N + j], y[r * N + N / 2 + j]);
  y = out;
}

ffi::Error MatmulPackedBf16Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> w,
                                ffi::Buffer<ffi::S32> rows, ffi::AnyBuffer lora_xa, ffi::AnyBuffer lora_b,
                                ffi::AnyBuffer lora_part, ffi::ResultBuffer<ffi::F32> y, int32_t path,
                                int32_t swiglu) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 4 || wd[2] != kPanel || wd[3] != 2 || 2 * wd[1] != xd[1] ||
      (swiglu && wd[0] % 2))
    return ffi::Error::InvalidArgument(
        "matmul_packed_bf16: needs x [M, K] and w [N / 16, K / 2, 16, 2] (N / 16 even for swiglu)");
  if (!path_ok(path))
    return ffi::Error::InvalidArgument("matmul_packed_bf16: this build has no such kernel path");
  Bf16GemmArgs g{reinterpret_cast<const uint32_t*>(x.untyped_data()),
                 reinterpret_cast<const uint32_t*>(w.untyped_data()), y->typed_data(), xd[0], wd[1], wd[0] * kPanel};
  LoraTerm lora;
  const int lora_given = lora_term(lora_xa, lora_b, lora_part, xd[0], g.N, lora);
  if (lora_given < 0) return ffi::Error::InvalidArgument("matmul_packed_bf16: the LoRA term's shapes do not fit");
  const int64_t out_n = swiglu ? g.N / 2 : g.N;
  g.M = live_rows(rows, g.M, out_n, g.y);
  path = bf16_gemm_path(path, g.M);
  // Items over output panels, taken four (two with swiglu: their gate and up make four) at a
  // time: the panels of a block share x's loads, and at decode sizes four weight streams keep
  // more of memory's bandwidth busy than one (on Zen 4, the model's layer GEMMs took 0.8x the
  // time at 1-16 rows with items of whole blocks than with items of single panels).
  with_lora(lora, lora_given, path == kAmx && g.KP % 16 == 0, g.lora, g.y, g.M, g.N, swiglu, path, [&](bool sw) {
    const GemmItems items(g.M, sw ? g.N / 2 : g.N, pool.num_threads(), sw ? 2 : 4);
    const auto run_group = [&](int64_t p, int64_t width, int64_t r0, int64_t r1, Prefetcher* pf) {
      if (width == 4) {
        bf16_output_panels<4>(g, p, r0, r1, false, path, pf);
      } else if (width == 2) {
        bf16_output_panels<2>(g, p, r0, r1, sw, path, pf);
      } else {
        bf16_output_panels<1>(g, p, r0, r1, sw, path, pf);
      }
    };
    run_panel_groups(pool, items, g.M, g.N, sw, 4, g.w, g.KP * kPanel * 4, run_group);
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxllm

// Whether this build multiplies bf16 panels with AVX512_BF16 (else only the portable loop).
extern "C" int32_t JaxllmBf16GemmHasDots() {
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
                                  .Arg<ffi::AnyBuffer>()          // lora_xa (see lora_term), or empty
                                  .Arg<ffi::AnyBuffer>()          // lora_b, or empty
                                  .Arg<ffi::AnyBuffer>()          // lora_part, or empty
                                  .Ret<ffi::Buffer<ffi::F32>>()   // y
                                  .Attr<int32_t>("path")
                                  .Attr<int32_t>("swiglu"));
