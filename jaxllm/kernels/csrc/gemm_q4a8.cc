// 4-bit codes x int8 activations: MatmulQuantImpl's act8 path (gemm_quant.cc).

#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "gemm.cc"
#include "gemm_quant_panel.h"
#include "parallel_for.h"
#include "simd.h"

namespace jaxllm {
namespace {

// ----------------------------------------------- 4-bit codes x int8 activations (act8 = 1)
// llama.cpp's scheme for its 4-bit formats: each row of x is quantized per group of 32 columns
// (x ~ q * d, q int8 in [-127, 127], d = max|x| / 127) and a group's products are integer sums,
// scaled once per group: y[r, n] = sum over groups b of isum(r, b, n) * scale[g, n] * d[r, b] +
// offset[g, n] * xsum[r, b], where isum sums code * q over the group and xsum sums x (as
// floats) over it. On AVX2, vpmaddubsw multiplies 32 byte pairs (unsigned codes 0..15 by signed
// q) at once, and 8 of its int16 results add up without overflow (8 * 2 * 15 * 127 < 2^15).
// Only 4-bit codes: with 8-bit ones the int16 sums could overflow.

constexpr int64_t kActGroup = 32;

struct ActQ8 {         // rows of x quantized per group of kActGroup columns
  const int8_t* q;     // [rows, K]
  const float* d;      // [rows, K / kActGroup]: the groups' scales
  const float* s;      // [rows, K / kActGroup]: x's sums over the groups
  int64_t K, groups;
  // 6-bit codes (gemm_q6a8.cc): [rows, K / 16], -16 x q's sums over 16 columns, and x's float
  // sums over them (offsets in groups of 16 rows).
  const int16_t* t = nullptr;
  const float* s16 = nullptr;
  ActQ8 at(int64_t r) const {
    const int64_t halves = r * (K / 16);
    return {q + r * K, d + r * groups, s + r * groups, K, groups, t ? t + halves : t, s16 ? s16 + halves : s16};
  }
};

template <int R, typename Run>
inline void rest_of_rows(int64_t n, const ActQ8& a, int64_t at, Run& run) {
  if constexpr (R > 0) {
    if (n == R)
      run(std::integral_constant<int, R>{}, a, at);
    else
      rest_of_rows<R - 1>(n, a, at, run);
  }
}

// Rows [r0, r1) of a's rows in blocks of N and then the rest: run(R, the block's rows, its first
// row less r0) with R a std::integral_constant (the kernels' register blocks).
template <int N, typename Run>
void in_blocks_of(const ActQ8& a, int64_t r0, int64_t r1, Run run) {
  int64_t r = r0;
  for (; r + N <= r1; r += N) run(std::integral_constant<int, N>{}, a.at(r), r - r0);
  rest_of_rows<N - 1>(r1 - r, a.at(r), r - r0, run);
}

// Rows [r0, r1) of x [M, K] quantized into q, d, s (laid out as ActQ8's).
void quantize_rows(const float* x, int64_t r0, int64_t r1, int64_t K, int8_t* q, float* d, float* s) {
  const int64_t groups = K / kActGroup;
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t b = 0; b < groups; ++b) {
      const float* xb = x + r * K + b * kActGroup;
      float amax = 0.f, sum = 0.f;
      for (int64_t j = 0; j < kActGroup; ++j) amax = std::max(amax, std::fabs(xb[j]));
      for (int64_t j = 0; j < kActGroup; ++j) sum += xb[j];
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      for (int64_t j = 0; j < kActGroup; ++j)
        q[r * K + b * kActGroup + j] = static_cast<int8_t>(std::nearbyint(xb[j] * inv));
      d[r * groups + b] = amax / 127.f;
      s[r * groups + b] = sum;
    }
  }
}

// The codes' order (`pack_codes(codes, 4, quads=True)`): a panel's 8 rows of K (8 b .. 8 b + 7) in
// 64 bytes, byte 4 c + j holding column c's code of row 8 b + j in its low nibble and of row
// 8 b + 4 + j in its high one. Masked, the low nibbles are the 16 columns' 4 codes of rows
// 8 b .. 8 b + 3 side by side, as the int8 dot instructions take them (and the high ones those
// of rows 8 b + 4 .. 8 b + 7): the kernels read the codes as they lie, with no unpacked copy.
inline uint8_t quad_code(const uint8_t* codes, int64_t k, int64_t c) {
  const uint8_t byte = codes[k / 8 * 64 + 4 * c + k % 4];
  return k % 8 < 4 ? byte & 15 : byte >> 4;
}

void q4a8_rows_portable(const QuantPanel& q, const ActQ8& a, int64_t p, float* y, int64_t ldy, int64_t R) {
  const uint8_t* codes = static_cast<const uint8_t*>(q.codes) + p * q.K * (kPanel / 2);
  float s[kPanel], o[kPanel];
  for (int64_t i = 0; i < R; ++i) std::fill(y + i * ldy, y + i * ldy + kPanel, 0.f);
  for (int64_t b = 0; b < a.groups; ++b) {
    const int64_t k0 = b * kActGroup;
    if (k0 % q.group == 0) group_scales(q, k0 / q.group, p, s, o);
    for (int64_t i = 0; i < R; ++i) {
      for (int64_t j = 0; j < kPanel; ++j) {
        int32_t isum = 0;
        for (int64_t k = k0; k < k0 + kActGroup; ++k) isum += quad_code(codes, k, j) * a.q[i * a.K + k];
        y[i * ldy + j] += isum * (s[j] * a.d[i * a.groups + b]) + o[j] * a.s[i * a.groups + b];
      }
    }
  }
}

// How far ahead in a panel's codes a line is asked for, once a 64-byte line: into L2 by the VNNI
// kernels, into L1 by the int8 tiles' (q4_group_words, q6_half_words).
constexpr int64_t kQuadsPrefetch = 2048;
// The AVX2 4-bit kernel's, farther: one row of the 1.5B's matrices took 0.93x the time at 4,096
// bytes as at 2,048 (twice, alternating; none: 1.08x). The 6-bit kernel keeps 2,048 (at 4,096
// it took 1.5x the time). benchmarks/results/zen4/RESULTS.md.
constexpr int64_t kQuadsPrefetchAvx2 = 4096;

#ifdef JAXLLM_AVX2
// 4 bytes of q broadcast to every 32-bit lane, from memory: one load. (From a memcpy of 8 bytes
// GCC made one 8-byte load, a shift and two broadcasts out of general registers, a uop more
// each on the vector pipes.)
inline __m256i broadcast4_ymm(const int8_t* q) { return _mm256_broadcastd_epi32(_mm_loadu_si32(q)); }

// R rows of y, panel p's 16 columns: per 8 rows of K, the 32 bytes of columns 0-7 and the 32 of
// columns 8-15 split into nibbles, each half meeting a broadcast of 4 bytes of q in a vpmaddubsw
// (unsigned codes 0..15 by signed q). 2R int16 sums stay in registers over a group; y is summed
// in memory once a group.
template <int R>
void q4a8_rows_avx2(const QuantPanel& q, int64_t p, const ActQ8& a, float* __restrict y, int64_t ldy) {
  const uint8_t* codes = static_cast<const uint8_t*>(q.codes) + p * q.K * (kPanel / 2);
  const __m256i ones = _mm256_set1_epi16(1), low4 = _mm256_set1_epi8(15);
  alignas(32) float s[kPanel], o[kPanel];
  ScaleCursor cursor(q, p);
#pragma GCC unroll 6
  for (int i = 0; i < R; ++i) std::fill(y + i * ldy, y + i * ldy + kPanel, 0.f);
  for (int64_t b = 0; b < a.groups; ++b) {
    const int64_t k0 = b * kActGroup;
    if (cursor.step(k0)) group_scales_at(q, cursor.at, cursor.super_at, s, o);
    __m256i i0[R], i1[R];  // int16 sums: columns 0-7 and 8-15, two per column
#pragma GCC unroll 6
    for (int i = 0; i < R; ++i) i0[i] = i1[i] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int64_t k = k0; k < k0 + kActGroup; k += 8) {
      _mm_prefetch(reinterpret_cast<const char*>(codes + k * (kPanel / 2) + kQuadsPrefetchAvx2), _MM_HINT_T1);
      const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + k * (kPanel / 2)));
      const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + k * (kPanel / 2) + 32));
      const __m256i lo0 = _mm256_and_si256(v0, low4), hi0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), low4);
      const __m256i lo1 = _mm256_and_si256(v1, low4), hi1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), low4);
#pragma GCC unroll 6
      for (int i = 0; i < R; ++i) {
        const __m256i x0 = broadcast4_ymm(a.q + i * a.K + k), x1 = broadcast4_ymm(a.q + i * a.K + k + 4);
        i0[i] = _mm256_add_epi16(i0[i], _mm256_add_epi16(_mm256_maddubs_epi16(lo0, x0), _mm256_maddubs_epi16(hi0, x1)));
        i1[i] = _mm256_add_epi16(i1[i], _mm256_add_epi16(_mm256_maddubs_epi16(lo1, x0), _mm256_maddubs_epi16(hi1, x1)));
      }
    }
    const __m256 s0 = _mm256_load_ps(s), s1 = _mm256_load_ps(s + 8), o0 = _mm256_load_ps(o), o1 = _mm256_load_ps(o + 8);
#pragma GCC unroll 6
    for (int i = 0; i < R; ++i) {
      const __m256 d = _mm256_set1_ps(a.d[i * a.groups + b]), xs = _mm256_set1_ps(a.s[i * a.groups + b]);
      float* yi = y + i * ldy;
      _mm256_storeu_ps(yi, _mm256_fmadd_ps(o0, xs, _mm256_fmadd_ps(
          _mm256_cvtepi32_ps(_mm256_madd_epi16(i0[i], ones)), _mm256_mul_ps(s0, d), _mm256_loadu_ps(yi))));
      _mm256_storeu_ps(yi + 8, _mm256_fmadd_ps(o1, xs, _mm256_fmadd_ps(
          _mm256_cvtepi32_ps(_mm256_madd_epi16(i1[i], ones)), _mm256_mul_ps(s1, d), _mm256_loadu_ps(yi + 8))));
    }
  }
}
#endif  // JAXLLM_AVX2

#ifdef JAXLLM_AVX512_VNNI
// broadcast4_ymm's 512-bit twin.
inline __m512i broadcast4_zmm(const int8_t* q) { return _mm512_broadcastd_epi32(_mm_loadu_si32(q)); }

// Activation group b's integer sums of row i into its f32 sums acc: isum * scale * d (the row's
// int8 scale) + offset * the row's float sum of x over the group.
inline __m512 add_group_sum(const ActQ8& a, int64_t b, int i, __m512i isum, __m512 scale, __m512 offset, __m512 acc) {
  const __m512 d = _mm512_set1_ps(a.d[i * a.groups + b]), xs = _mm512_set1_ps(a.s[i * a.groups + b]);
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(scale, d), acc);
  return _mm512_fmadd_ps(offset, xs, acc);
}

// The same for R rows (isum[i] and acc[i] row i's).
template <int R>
inline void add_group_sums(const ActQ8& a, int64_t b, const __m512i* isum, __m512 scale, __m512 offset,
                           __m512* acc) {
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i) acc[i] = add_group_sum(a, b, i, isum[i], scale, offset, acc[i]);
}

// q4a8_rows_avx2 with AVX512_VNNI: the 64 bytes of 8 rows of K split into nibbles are the 16
// columns' 4 codes of rows 0-3 and of rows 4-7, so two vpdpbusd multiply them by broadcasts of 4
// bytes of q each and add the products to each column's int32 sums: the same sums as AVX2's,
// with no int16 stage. P panels at a time (panel[j], into y[j]): each broadcast of q feeds P
// pairs of dot products.
// (Not inlined into its row blocks' loop: inlined there, 4 and 64 rows took 1.03-1.1x the time.)
template <int R, int P>
__attribute__((noinline)) void q4a8_rows_vnni(const QuantPanel& q, const int64_t* panel, const ActQ8& a,
                                              float* const* y, int64_t ldy) {
  const uint8_t* codes[P];
  ScaleCursor first(q, panel[0]), last(q, panel[P - 1]);
  ScaleCursor* cursor[2] = {&first, &last};
  for (int j = 0; j < P; ++j) codes[j] = static_cast<const uint8_t*>(q.codes) + panel[j] * q.K * (kPanel / 2);
  const __m512i low4 = _mm512_set1_epi8(15);
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
#pragma GCC unroll 4
    for (int64_t k = k0; k < k0 + kActGroup; k += 8) {
      __m512i lo[P], hi[P];
#pragma GCC unroll 2
      for (int j = 0; j < P; ++j) {
        _mm_prefetch(reinterpret_cast<const char*>(codes[j] + k * (kPanel / 2) + kQuadsPrefetch), _MM_HINT_T1);
        const __m512i v = _mm512_loadu_si512(codes[j] + k * (kPanel / 2));
        lo[j] = _mm512_and_si512(v, low4), hi[j] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
      }
#pragma GCC unroll 8
      for (int i = 0; i < R; ++i) {
        const __m512i x0 = broadcast4_zmm(a.q + i * a.K + k), x1 = broadcast4_zmm(a.q + i * a.K + k + 4);
#pragma GCC unroll 2
        for (int j = 0; j < P; ++j)
          isum[j][i] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(isum[j][i], lo[j], x0), hi[j], x1);
      }
    }
    // The group's scales made after its products, not kept across them: 6 rows of two panels
    // then fit the registers (kept, they spilled the sums at 5-6 rows).
#pragma GCC unroll 2
    for (int j = 0; j < P; ++j) {
      cursor[j]->step(k0);
      const __m512 s = scales_f32x16_at(q, q.scale, q.super_scale, cursor[j]->at, cursor[j]->super_at);
      const __m512 o = q.offset ? scales_f32x16_at(q, q.offset, q.super_offset, cursor[j]->at, cursor[j]->super_at)
                                : _mm512_setzero_ps();
      add_group_sums<R>(a, b, isum[j], s, o, acc[j]);
    }
  }
#pragma GCC unroll 2
  for (int j = 0; j < P; ++j)
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) _mm512_storeu_ps(y[j] + i * ldy, acc[j][i]);
}

// Rows [r0, r1) of a's rows into y[j] (row stride ldy) for P panels panel[j]: 8 rows at a time
// for one panel, 6 for two (their sums fill the registers), then the rest.
template <int P>
void q4a8_rows_vnni_blocks(const QuantPanel& q, const int64_t* panel, const ActQ8& a, int64_t r0, int64_t r1,
                           float* const* y, int64_t ldy) {
  in_blocks_of<P == 1 ? 8 : 6>(a, r0, r1, [&](auto R, const ActQ8& rows, int64_t i) {
    float* yr[P];
    for (int j = 0; j < P; ++j) yr[j] = y[j] + i * ldy;
    q4a8_rows_vnni<decltype(R)::value, P>(q, panel, rows, yr, ldy);
  });
}
#endif  // AVX512_VNNI

#ifdef JAXLLM_AMX_INT8
// The int8 rows on AMX's int8 tiles: per activation group a TDPBSUD of x's rows (signed q, one
// group's bytes a row) by the panel's codes of the group (unsigned, the quads' nibbles split into
// tile rows of 4 rows of K x 16 columns: the order VPDPBUSD takes them in), whose int32 sums are
// the VNNI kernels' own, then the same float steps (add_group_sums) in the same order: the same
// numbers for every row count. The float steps, as many as VNNI's, bound them: over the 1.5B's
// layer matrices on the Xeon kind they took 0.75x VNNI's time at 16 rows (4-bit codes; 6-bit:
// 0.87x), about the same at 8 and 1.2x at 2-4, where VNNI streams the codes at the memory's speed.
// Fewest rows a call of path auto or avx512 multiplies on them (0: never); benchmarks and tests
// change it (`native.int8_tile_rows_set`). From 17 rows over 6-bit codes and 32 over 4-bit ones
// (act8_bf16_rows_for), path auto takes the bf16 tiles instead (gemm_codes_tiles.cc), whose
// per-call conversion of the codes costs less than these float steps from there on.
inline std::atomic<int64_t> int8_tile_rows_min{8};

// The path a call of int8 rows takes: kAmx standing for the int8 tiles.
inline int32_t int8_rows_path(int32_t path, int64_t M) {
  const int64_t from = int8_tile_rows_min.load(std::memory_order_relaxed);
  const bool tiles = (path == kAuto || path == kAvx512) && from > 0 && M >= from;
  return tiles && amx_ready() ? kAmx : path;
}

// Tiles t and t + 3 for groups of even and odd numbers: 0/3 x's rows (rows x `group` bytes),
// 1/4 the codes (group / 4 rows of 64 bytes), 2/5 the int32 sums (rows x 16).
inline void int8_tiles_configure(int64_t rows, int64_t group) {
  TileConfig c;
  for (int t : {0, 3}) c.rows[t] = static_cast<uint8_t>(rows), c.colsb[t] = static_cast<uint16_t>(group);
  for (int t : {1, 4}) c.rows[t] = static_cast<uint8_t>(group / 4), c.colsb[t] = 64;
  for (int t : {2, 5}) c.rows[t] = static_cast<uint8_t>(rows), c.colsb[t] = 64;
  load_tile_config(c);
}

// Group b's codes into 8 rows of 64 bytes in `words`, each 4 rows of K x 16 columns (the
// operand tile's rows), x's group then read from a.q + b * kActGroup.
inline void q4_group_words(const uint8_t* codes, int64_t b, uint8_t (*words)[64]) {
  const __m512i low4 = _mm512_set1_epi8(15);
#pragma GCC unroll 4
  for (int c = 0; c < 4; ++c) {
    const uint8_t* at = codes + (b * kActGroup + 8 * c) * (kPanel / 2);
    // (into L1: the 1.5B's layer matrices at 8 and 16 rows took 0.94-1.00x the time of L2 here
    // and 0.93-0.97x in q6_half_words, on the Xeon kind, alternating builds)
    _mm_prefetch(reinterpret_cast<const char*>(at + kQuadsPrefetch), _MM_HINT_T0);
    const __m512i v = _mm512_loadu_si512(at);
    _mm512_store_si512(words[2 * c], _mm512_and_si512(v, low4));
    _mm512_store_si512(words[2 * c + 1], _mm512_and_si512(_mm512_srli_epi16(v, 4), low4));
  }
}

// x's rows (A) by the group's codes (B) into sums C, tiles A, B, C, with DP the product
// (_tile_dpbsud: unsigned codes, _tile_dpbssd: signed ones; numbers: GCC's tile intrinsics take
// literal tile numbers only; its tileloadd does not say it reads memory, so a barrier keeps the
// stores of `words` before it).
#define JAXLLM_INT8_TILE_PRODUCT(DP, A, B, C, x, ldx, words) \
  do {                                                       \
    __asm__ volatile("" ::: "memory");                       \
    _tile_loadd(B, words, 64);                               \
    _tile_loadd(A, x, ldx);                                  \
    _tile_zero(C);                                           \
    DP(C, A, B);                                             \
  } while (0)

// R rows (1-16) of panel p into y, software-pipelined: group b's codes are split two groups
// ahead, its product issued (tiles 0-2 for even b, 3-5 for odd) while b - 1's sums are stored
// and b - 3's scaled (four sets of sums), so that no step waits on one just before it. One
// loop body, no closures: the R f32 sums stay in registers and the int32 sums are read where the
// tile stored them (with the steps in lambdas GCC kept the f32 sums on the stack and copied the
// int32 ones there first: the 1.5B's 16-row decode step took 1.08-1.15x the time, Xeon kind).
template <int R>
__attribute__((noinline)) void q4a8_rows_tiles(const QuantPanel& q, int64_t p, const ActQ8& a, float* y,
                                               int64_t ldy) {
  const uint8_t* codes = static_cast<const uint8_t*>(q.codes) + p * q.K * (kPanel / 2);
  const int64_t G = a.groups;
  alignas(64) uint8_t words[4][8][64];      // group b's codes in words[b % 4]
  alignas(64) int32_t sums[4][16][kPanel];  // its sums in sums[b % 4]
  ScaleCursor cursor(q, p);
  __m512 acc[R], s = _mm512_setzero_ps(), o = _mm512_setzero_ps();
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < std::min<int64_t>(G, 3); ++b) q4_group_words(codes, b, words[b]);
  JAXLLM_INT8_TILE_PRODUCT(_tile_dpbsud, 0, 1, 2, a.q, a.K, words[0]);
  // Step b: group b + 3's codes split, b + 1's product issued, b's sums stored, b - 2's scaled.
  for (int64_t b = 0; b <= G + 1; ++b) {
    if (b < G) {
      const int64_t n = b + 1;
      if (n + 2 < G) q4_group_words(codes, n + 2, words[(n + 2) % 4]);
      if (n < G) {
        if (n % 2)
          JAXLLM_INT8_TILE_PRODUCT(_tile_dpbsud, 3, 4, 5, a.q + n * kActGroup, a.K, words[n % 4]);
        else
          JAXLLM_INT8_TILE_PRODUCT(_tile_dpbsud, 0, 1, 2, a.q + n * kActGroup, a.K, words[n % 4]);
      }
      if (b % 2)
        _tile_stored(5, sums[b % 4], 64);
      else
        _tile_stored(2, sums[b % 4], 64);
    }
    if (b > 1) {
      const int64_t g = b - 2;
      if (cursor.step(g * kActGroup)) {
        s = scales_f32x16_at(q, q.scale, q.super_scale, cursor.at, cursor.super_at);
        if (q.offset) o = scales_f32x16_at(q, q.offset, q.super_offset, cursor.at, cursor.super_at);
      }
      add_group_sums<R>(a, g, reinterpret_cast<const __m512i*>(sums[g % 4]), s, o, acc);
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i) _mm512_storeu_ps(y + i * ldy, acc[i]);
}

// Rows [r0, r1) of a on the int8 tiles (products over `group` columns of x), 16 at a time:
// rows(R, the block's rows, its first row less r0) with R a std::integral_constant.
template <typename Rows>
void int8_tiles_block(const ActQ8& a, int64_t r0, int64_t r1, int64_t group, Rows rows) {
  int64_t configured = 0;
  in_blocks_of<16>(a, r0, r1, [&](auto R, const ActQ8& block, int64_t i) {
    if (R.value != configured) int8_tiles_configure(configured = R.value, group);
    rows(R, block, i);
  });
  _tile_release();  // (as gemm_bf16.cc: other tile users load their own configuration)
}
#endif  // JAXLLM_AMX_INT8

struct ActQ8Scratch {
  std::vector<float> sums;  // with the SwiGLU epilogue: the item's gate and up sums
};

// Rows [r0, r1) of x (quantized in a), panel p's columns into y and panel p2's (-1: none) into
// y2 (row stride ldy): with AVX512_VNNI both at once (each broadcast of x feeds both), else one
// after the other.
void q4a8_block(const QuantPanel& q, const ActQ8& a, int64_t p, int64_t p2, int64_t r0, int64_t r1, float* y,
                float* y2, int64_t ldy, int32_t path) {
  const int64_t panels[2] = {p, p2};
  float* const outs[2] = {y, y2};
#ifdef JAXLLM_AMX_INT8
  if (path == kAmx) {  // (int8_rows_path's: the int8 tiles)
    int8_tiles_block(a, r0, r1, kActGroup, [&](auto R, const ActQ8& rows, int64_t i) {
      for (int j = 0; j < 2 && panels[j] >= 0; ++j)
        q4a8_rows_tiles<decltype(R)::value>(q, panels[j], rows, outs[j] + i * ldy, ldy);
    });
    return;
  }
#endif
#ifdef JAXLLM_AVX512_VNNI
  if (path == kAuto || path >= kAvx512) {
    if (p2 >= 0)
      q4a8_rows_vnni_blocks<2>(q, panels, a, r0, r1, outs, ldy);
    else
      q4a8_rows_vnni_blocks<1>(q, panels, a, r0, r1, outs, ldy);
    return;
  }
#endif
  for (int j = 0; j < 2 && panels[j] >= 0; ++j) {
    const int64_t pj = panels[j];
    float* const yj = outs[j];
#ifdef JAXLLM_AVX2
    if (path == kAuto || path >= kAvx2) {
      in_blocks_of<4>(a, r0, r1, [&](auto R, const ActQ8& rows, int64_t i) {
        q4a8_rows_avx2<decltype(R)::value>(q, pj, rows, yj + i * ldy, ldy);
      });
      continue;
    }
#endif
    q4a8_rows_portable(q, a.at(r0), pj, yj, ldy, r1 - r0);
  }
}

// x's rows quantized as above, in buffers of the calling thread's (grown, never shrunk: one
// allocation per thread), valid until its next call; with `sums16`, also ActQ8::t and s16
// (6-bit codes).
ActQ8 quantize_activations(ffi::ThreadPool& pool, const GemmArgs& g, bool sums16) {
  const int64_t groups = g.K / kActGroup, rows_per_item = 16, halves = sums16 ? g.M * (g.K / 16) : 0;
  thread_local AlignedVector<int8_t> xq;
  thread_local std::vector<float> xd;
  thread_local std::vector<int16_t> xt;
  xq.resize(std::max<size_t>(xq.size(), g.M * g.K));
  xd.resize(std::max<size_t>(xd.size(), 2 * g.M * groups + halves));
  xt.resize(std::max<size_t>(xt.size(), halves));
  // (Pointers, not the vectors: a worker's thread_local vectors are other ones.)
  int8_t* q8 = xq.data();
  float *d = xd.data(), *s = d + g.M * groups, *s16 = sums16 ? s + g.M * groups : nullptr;
  int16_t* t = sums16 ? xt.data() : nullptr;
  parallel_for(pool, (g.M + rows_per_item - 1) / rows_per_item, [&](int64_t i) {
    const int64_t r0 = i * rows_per_item, r1 = std::min(g.M, r0 + rows_per_item);
    quantize_rows(g.x, r0, r1, g.K, q8, d, s);
    for (int64_t j = r0 * (g.K / 16); t && j < r1 * (g.K / 16); ++j) {
      int32_t sum = 0;
      float xsum = 0.f;
      for (int64_t k = 0; k < 16; ++k) sum += q8[j * 16 + k], xsum += g.x[j * 16 + k];
      t[j] = static_cast<int16_t>(-16 * sum);
      s16[j] = xsum;
    }
  });
  return {q8, d, s, g.K, groups, t, s16};
}

}  // namespace
}  // namespace jaxllm
