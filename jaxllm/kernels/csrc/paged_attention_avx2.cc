// The AVX2 path of paged attention (see paged_attention.h), for head_dim a multiple of 32 (up
// to 256): on CPUs with AVX2 and FMA but no AVX-512 (Zen 2, Zen 3, older Xeons) it replaces the
// portable path, and on AVX-512 CPUs it serves the items of a few query tokens (decodes; see
// attend() in paged_attention.cc), there with 16-lane vectors (Lanes16) where the cache is bf16
// or f32 and head_dim a multiple of 64.
//
// It reads K and V where they lie in the pages (no widened copy of the chunk): a chunk's rows
// are found once through the page table, as pointers. Scores take R query rows x 4 keys at a
// time, W dims per FMA (R x W: 3 x 8 on AVX2, 6 x 16 with AVX-512), and one horizontal-add tree
// per row gives its 4 scores. That suits a decode, whose few rows (the query heads of one kv
// head) could not amortise a transpose of the chunk. P @ V accumulates R rows x 4 W dims in
// registers, V rows loaded once per key and reused by the R rows. Softmax uses the 8-wide
// polynomial exp. Prefetches run one phase ahead, spread over the loops: a chunk's value rows
// while its keys are read, the next chunk's key rows while its values are. (On family 23, 128
// decodes at context 512: 12-14% off the kernel with each sequence's pages consecutive, ~2%
// with pages in random order, against one burst of the whole next chunk into L2 at each chunk's
// start, which there was no faster than no prefetch at all: the core stalls on the burst.) The
// 16 lanes and 6 rows took 0.76-0.85x the time of 8 and 3 at the 1.5B's heads (12 / 2, head_dim
// 128, bf16 pages; 1-128 decodes at contexts 256-16,384, one process, Xeon kind), where the
// transposing AVX-512 path (paged_attention_avx512.cc) took 1.2-1.5x. AVX-512 builds also keep
// this path for the head sizes their own path has no code for, and for int8 and fp8 caches:
// there a key row's scale multiplies its scores after the dot, and a value row's scale its
// softmax weights before P @ V.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "paged_attention.h"
#include "simd.h"

namespace jaxllm {

#ifdef JAXLLM_AVX2
namespace {

constexpr int kKeyBlock = 4;  // keys per score block
constexpr int kDimBlock = 4;  // vectors of W dims per P @ V block

// The f32 vectors the loops below run on: W lanes of V.
struct Lanes8 {
  static constexpr int W = 8, R = 3;  // R: query rows per register block
  using V = __m256;
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return _mm256_load_ps(p); }
  template <typename KV>
  static V load_kv(const KV* p) { return load_f32x8(p); }
  static V set1(const float* p) { return _mm256_broadcast_ss(p); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static void store(float* p, V x) { _mm256_store_ps(p, x); }
  static __m256 fold(V x) { return x; }  // (8 lanes, whose sum is x's: hsum4's input)
};

#ifdef __AVX512F__
struct Lanes16 {
  static constexpr int W = 16, R = 6;  // (a decode of 6 query heads per kv head in one block)
  using V = __m512;
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_load_ps(p); }
  template <typename KV>
  static V load_kv(const KV* p) { return load_f32x16(p); }
  static V set1(const float* p) { return _mm512_set1_ps(*p); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static void store(float* p, V x) { _mm512_store_ps(p, x); }
  static __m256 fold(V x) {
    return _mm256_add_ps(_mm512_castps512_ps256(x), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
  }
};
#endif

// Prefetches rows[j0 .. j1) (clipped to n), row_bytes each, into L2 (the rows are read a phase
// later): prefetches into L1 hold its few miss buffers, and on a Zen 4 EPYC 128 decodes at
// context 256 took 0.75-0.9x the time with L2 as the target (the same on family 23).
template <typename KV>
inline void prefetch_rows(const KV* const* rows, int j0, int j1, int n, int64_t row_bytes) {
  for (int j = j0; j < std::min(j1, n); ++j)
    for (int64_t b = 0; b < row_bytes; b += 64) _mm_prefetch(reinterpret_cast<const char*>(rows[j]) + b, _MM_HINT_T1);
}

// run(R) with R a std::integral_constant equal to `rows` (1 .. N; 0: nothing): the rows left
// after the full register blocks.
template <int N, typename Run>
inline void in_rows_of(int rows, Run run) {
  if constexpr (N > 0) {
    if (rows == N) return run(std::integral_constant<int, N>{});
    in_rows_of<N - 1>(rows, run);
  }
}

// scores[r][j0 .. j0 + 3] = q[r] . k[j0 .. j0 + 3] for rows [r0, r0 + R).
template <typename KV, int R, typename L>
inline void scores_block(const PagedAttentionArgs& a, const float (*q)[kMaxHeadDim], const KV* const* krows,
                         float (*scores)[kChunkKeys], int r0, int j0) {
  typename L::V acc[R][kKeyBlock];
  for (int rr = 0; rr < R; ++rr)
    for (int jj = 0; jj < kKeyBlock; ++jj) acc[rr][jj] = L::zero();
  // Live registers: R x 4 sums, R query vectors, one vector of K (L::R: 16 or 31, no spills).
  for (int64_t d = 0; d < a.head_dim; d += L::W) {
    typename L::V qd[R];
    for (int rr = 0; rr < R; ++rr) qd[rr] = L::load(q[r0 + rr] + d);
    for (int jj = 0; jj < kKeyBlock; ++jj) {
      const typename L::V k = L::load_kv(krows[j0 + jj] + d);
      for (int rr = 0; rr < R; ++rr) acc[rr][jj] = L::fmadd(qd[rr], k, acc[rr][jj]);
    }
  }
  for (int rr = 0; rr < R; ++rr)
    _mm_store_ps(scores[r0 + rr] + j0,
                 hsum4(L::fold(acc[rr][0]), L::fold(acc[rr][1]), L::fold(acc[rr][2]), L::fold(acc[rr][3])));
}

// scores[r][j] for M rows and the chunk's n keys (rounded up to a multiple of 4).
// The chunk's value rows (n of them) are prefetched as its keys are read: P @ V reads them next.
template <typename KV, typename L>
void chunk_scores(const PagedAttentionArgs& a, const float (*q)[kMaxHeadDim], const KV* const* krows,
                  float (*scores)[kChunkKeys], int M, int n, const KV* const* vrows, int64_t row_bytes) {
  for (int j0 = 0; j0 < n; j0 += kKeyBlock) {
    prefetch_rows(vrows, j0, j0 + kKeyBlock, n, row_bytes);
    int r = 0;
    for (; r + L::R <= M; r += L::R) scores_block<KV, L::R, L>(a, q, krows, scores, r, j0);
    in_rows_of<L::R - 1>(M - r, [&](auto R) { scores_block<KV, R.value, L>(a, q, krows, scores, r, j0); });
  }
}

// Row r's online-softmax step over the chunk's keys [first, first + n): soft-caps and masks
// its scores in srow, replaces them by weights exp(score - m_new) (zero where masked), updates
// the row's m and l, and returns alpha = exp(m_old - m_new), its accumulator's rescale factor.
inline float softmax_row_avx2(const PagedAttentionArgs& a, QueryRows& rows, int r, int64_t first, int n, float* srow) {
  const int nv = (n + 7) / 8;
  // Keys this row may see form the range [lo, hi) of the chunk.
  const int hi = static_cast<int>(std::min<int64_t>(n, rows.qpos[r] - first + 1));
  const int lo = a.sliding_window > 0
                     ? static_cast<int>(std::clamp<int64_t>(rows.qpos[r] - a.sliding_window + 1 - first, 0, n))
                     : 0;
  if (hi <= lo) {  // nothing visible in this chunk: weights zero, state unchanged
    for (int j = 0; j < n; ++j) srow[j] = 0.f;
    return 1.f;
  }
  if (a.soft_cap > 0.f)
    for (int j = lo; j < hi; ++j) srow[j] = a.soft_cap * std::tanh(srow[j] / a.soft_cap);
  // Lanes past the computed scores may hold anything (even NaN): the masks drop them.
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i vlo = _mm256_set1_epi32(lo - 1), vhi = _mm256_set1_epi32(hi);
  __m256 visible[kChunkKeys / 8];
  __m256 vmax = _mm256_set1_ps(kNegInf);
  for (int v = 0; v < nv; ++v) {
    const __m256i j = _mm256_add_epi32(lane, _mm256_set1_epi32(8 * v));
    visible[v] = _mm256_castsi256_ps(_mm256_and_si256(_mm256_cmpgt_epi32(j, vlo), _mm256_cmpgt_epi32(vhi, j)));
    vmax = _mm256_max_ps(vmax, _mm256_blendv_ps(_mm256_set1_ps(kNegInf), _mm256_load_ps(srow + 8 * v), visible[v]));
  }
  const float m_new = std::max(rows.m[r], reduce_max(vmax));
  const float alpha = std::exp(rows.m[r] - m_new);
  const __m256 vm_new = _mm256_set1_ps(m_new);
  __m256 vsum = _mm256_setzero_ps();
  for (int v = 0; v < nv; ++v) {
    const __m256 e = _mm256_and_ps(visible[v], exp_f32x8(_mm256_sub_ps(_mm256_load_ps(srow + 8 * v), vm_new)));
    _mm256_store_ps(srow + 8 * v, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  rows.l[r] = rows.l[r] * alpha + reduce_add(vsum);
  rows.m[r] = m_new;
  return alpha;
}

// acc[r][d0 .. d0 + 4 W - 1] = alpha[r] acc[r][...] + sum_j weights[r][j] v[j][...] for rows
// [r0, r0 + R), the R x 4 accumulators in registers.
template <typename KV, int R, typename L>
inline void pv_block(float (*acc)[kMaxHeadDim], const float* alpha, const float (*weights)[kChunkKeys],
                     const KV* const* vrows, int n, int r0, int64_t d0, const KV* const* next, int next_n,
                     int64_t row_bytes) {
  typename L::V s[R][kDimBlock];
  for (int rr = 0; rr < R; ++rr) {
    const typename L::V al = L::set1(&alpha[r0 + rr]);
    for (int c = 0; c < kDimBlock; ++c) s[rr][c] = L::mul(L::load(acc[r0 + rr] + d0 + L::W * c), al);
  }
  // Live registers: R x 4 sums, R weights, one vector of V (as above).
  for (int j = 0; j < n; ++j) {
    if (j < next_n) prefetch_rows(next, j, j + 1, next_n, row_bytes);
    typename L::V w[R];
    for (int rr = 0; rr < R; ++rr) w[rr] = L::set1(&weights[r0 + rr][j]);
    for (int c = 0; c < kDimBlock; ++c) {
      const typename L::V v = L::load_kv(vrows[j] + d0 + L::W * c);
      for (int rr = 0; rr < R; ++rr) s[rr][c] = L::fmadd(w[rr], v, s[rr][c]);
    }
  }
  for (int rr = 0; rr < R; ++rr)
    for (int c = 0; c < kDimBlock; ++c) L::store(acc[r0 + rr] + d0 + L::W * c, s[rr][c]);
}

// acc = acc * alpha + weights @ V for M rows and the chunk's n keys.
// The next chunk's key rows (next_n) are prefetched over the first block's keys.
template <typename KV, typename L>
void chunk_pv(const PagedAttentionArgs& a, float (*acc)[kMaxHeadDim], const float* alpha,
              const float (*weights)[kChunkKeys], const KV* const* vrows, int n, int M, const KV* const* next,
              int next_n, int64_t row_bytes) {
  for (int64_t d0 = 0; d0 < a.head_dim; d0 += L::W * kDimBlock) {
    int r = 0;
    for (; r + L::R <= M; r += L::R) {
      pv_block<KV, L::R, L>(acc, alpha, weights, vrows, n, r, d0, next, next_n, row_bytes);
      next_n = 0;  // prefetched by the first block
    }
    in_rows_of<L::R - 1>(M - r, [&](auto R) {
      pv_block<KV, R.value, L>(acc, alpha, weights, vrows, n, r, d0, next, next_n, row_bytes);
    });
    next_n = 0;
  }
}

// scores[r][j] *= the scale of quantized row rows[j] (int8 or fp8), for M rows and n keys.
template <typename KV>
inline void scale_columns(const PagedAttentionArgs& a, const KV* const* rows, float (*scores)[kChunkKeys], int M,
                          int n) {
  float scale[kChunkKeys];
  for (int j = 0; j < n; ++j) scale[j] = row_scale(a, rows[j]);
  for (int r = 0; r < M; ++r)
    for (int j = 0; j < n; ++j) scores[r][j] *= scale[j];
}

// The rows of cache positions [first, first + n) of the item's sequence, K and V, as
// pointers: found through the page table once per page, not per row.
template <typename KV>
inline void chunk_rows(const PagedAttentionArgs& a, const WorkItem& item, const QueryRows& rows, int64_t first, int n,
                       const KV** krows, const KV** vrows) {
  const KV* k_pages = static_cast<const KV*>(a.k_pages);
  const KV* v_pages = static_cast<const KV*>(a.v_pages);
  for (int j = 0; j < n;) {  // a page's run of rows at a time
    const KV* k = kv_row(a, k_pages, rows.page_table, item.kv_head, first + j);
    const KV* v = kv_row(a, v_pages, rows.page_table, item.kv_head, first + j);
    const int run = static_cast<int>(std::min<int64_t>(a.page_size - (first + j) % a.page_size, n - j));
    for (int i = 0; i < run; ++i, ++j) {
      krows[j] = k + i * a.row_stride;
      vrows[j] = v + i * a.row_stride;
    }
  }
}

template <typename KV, typename L>
void attend_avx2_item(const PagedAttentionArgs& a, const WorkItem& item, Scratch& s) {
  QueryRows rows;
  load_query_rows(a, item, s, rows, 1);
  // This chunk's rows and the next one's (found while this one is computed: double-buffered).
  const KV* krows[2][kChunkKeys];
  const KV* vrows[2][kChunkKeys];
  float alpha[kMaxRows];
  const int64_t row_bytes = a.row_stride * static_cast<int64_t>(sizeof(KV));
  int n = static_cast<int>(std::min<int64_t>(kChunkKeys, rows.last_pos + 1 - rows.begin));
  chunk_rows(a, item, rows, rows.begin, n, krows[0], vrows[0]);
  for (int64_t first = rows.begin, c = 0; first <= rows.last_pos; first += kChunkKeys, c ^= 1) {
    const KV** kr = krows[c];
    const KV** vr = vrows[c];
    // The next chunk's rows, for the prefetches: a sequence's pages lie anywhere in the pool,
    // and the hardware prefetcher stops at each page's end.
    int next_n = 0;
    if (first + kChunkKeys <= rows.last_pos) {
      next_n = static_cast<int>(std::min<int64_t>(kChunkKeys, rows.last_pos + 1 - first - kChunkKeys));
      chunk_rows(a, item, rows, first + kChunkKeys, next_n, krows[c ^ 1], vrows[c ^ 1]);
    }
    // Keys past n (up to the next multiple of kKeyBlock) re-read a valid row; softmax masks them.
    for (int j = n; j % kKeyBlock; ++j) kr[j] = kr[n - 1];
    chunk_scores<KV, L>(a, s.q, kr, s.scores, rows.M, n, vr, row_bytes);
    if constexpr (sizeof(KV) == 1) scale_columns(a, kr, s.scores, rows.M, n);
    for (int r = 0; r < rows.M; ++r) alpha[r] = softmax_row_avx2(a, rows, r, first, n, s.scores[r]);
    if constexpr (sizeof(KV) == 1) scale_columns(a, vr, s.scores, rows.M, n);
    chunk_pv<KV, L>(a, s.acc, alpha, s.scores, vr, n, rows.M, krows[c ^ 1], next_n, row_bytes);
    n = next_n;
  }
  store_output_rows(a, item, s, rows);
}

}  // namespace

bool attend_avx2(const PagedAttentionArgs& a, const WorkItem& item, Scratch& s) {
  if (a.head_dim % 32 != 0) return false;
#ifdef __AVX512F__
  // 16 lanes unless the caller asked for this path by name (its tests, on AVX-512 CPUs too).
  const bool wide = (a.path == kAuto || a.path >= kAvx512) && a.head_dim % (16 * kDimBlock) == 0;
  if (wide && (a.kv_type == kKvBf16 || a.kv_type == kKvF32)) {
    if (a.kv_type == kKvBf16)
      attend_avx2_item<uint16_t, Lanes16>(a, item, s);
    else
      attend_avx2_item<float, Lanes16>(a, item, s);
    return true;
  }
#endif
  if (a.kv_type == kKvBf16)
    attend_avx2_item<uint16_t, Lanes8>(a, item, s);
  else if (a.kv_type == kKvInt8)
    attend_avx2_item<int8_t, Lanes8>(a, item, s);
  else if (a.kv_type == kKvFp8)
    attend_avx2_item<uint8_t, Lanes8>(a, item, s);
  else
    attend_avx2_item<float, Lanes8>(a, item, s);
  return true;
}

#else  // no AVX2 + FMA

bool attend_avx2(const PagedAttentionArgs&, const WorkItem&, Scratch&) { return false; }

#endif  // JAXLLM_AVX2

}  // namespace jaxllm
