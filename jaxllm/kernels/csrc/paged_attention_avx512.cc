// The AVX-512 path of paged attention (see paged_attention.h), for head_dim = 16 * DV with
// DV = 2, 4, 8 or 16. Per chunk of up to 64 keys: K is transposed into keys_t[head_dim][64] f32
// (16x16 word transposes; a bf16 word holds two adjacent dims), which makes the scores of a
// row a broadcast-FMA over 16 keys per vector with no horizontal sums; V is widened to f32
// rows; softmax uses a polynomial exp; P @ V accumulates a few rows at a time in registers.
// Without AVX-512, attend_avx512 declines every item and the portable path runs.

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "paged_attention.h"
#include "simd.h"

namespace jaxllm {

#ifdef __AVX512F__
namespace {

// Widens cache positions [first, first + n) (n <= 64) of one sequence and kv head: K into
// keys_t[d * 64 + j], V into values[j * head_dim + d].
template <typename KV, int DV>
void widen_chunk_avx512(const PagedAttentionArgs& a, const int32_t* page_table, int64_t kv_head, int64_t first,
                        int n, float* keys_t, float* values) {
  constexpr int D = 16 * DV;
  // A row of head_dim elements is read as vectors of 16 32-bit words.
  constexpr int kWordVectors = sizeof(KV) == 2 ? DV / 2 : DV;
  const KV* k_pages = static_cast<const KV*>(a.k_pages);
  const KV* v_pages = static_cast<const KV*>(a.v_pages);
  for (int kvec = 0; kvec * 16 < n; ++kvec) {  // keys 16 * kvec .. 16 * kvec + 15 of the chunk
    const KV* rows[16];
    for (int j = 0; j < 16; ++j)  // keys past n re-read a valid row; their scores are masked
      rows[j] = kv_row(a, k_pages, page_table, kv_head, first + kvec * 16 + std::min(j, n - 1 - kvec * 16));
    for (int w = 0; w < kWordVectors; ++w) {
      __m512i r[16];
      for (int j = 0; j < 16; ++j) r[j] = _mm512_loadu_si512(reinterpret_cast<const int32_t*>(rows[j]) + 16 * w);
      transpose16x16(r);  // r[i]: word i of the 16 keys' rows
      for (int i = 0; i < 16; ++i) {
        if constexpr (sizeof(KV) == 2) {
          const int d = 32 * w + 2 * i;
          _mm512_store_ps(keys_t + d * kChunkKeys + kvec * 16, even_bf16_to_f32(r[i]));
          _mm512_store_ps(keys_t + (d + 1) * kChunkKeys + kvec * 16, odd_bf16_to_f32(r[i]));
        } else {
          _mm512_store_ps(keys_t + (16 * w + i) * kChunkKeys + kvec * 16, _mm512_castsi512_ps(r[i]));
        }
      }
    }
  }
  for (int j = 0; j < n; ++j) {
    const KV* src = kv_row(a, v_pages, page_table, kv_head, first + j);
    for (int c = 0; c < DV; ++c) _mm512_store_ps(values + j * D + 16 * c, load_f32x16(src + 16 * c));
  }
}

// scores[r][j] = q[r] . k[j] for rows [r0, r0 + R) and NV vectors of 16 keys, the R x NV
// accumulators in registers.
template <int DV, int R, int NV>
inline void scores_of_rows(const float (*q)[kMaxHeadDim], const float* keys_t, float (*scores)[kChunkKeys], int r0) {
  __m512 acc[R][NV];
  for (int rr = 0; rr < R; ++rr)
    for (int kvec = 0; kvec < NV; ++kvec) acc[rr][kvec] = _mm512_setzero_ps();
  for (int d = 0; d < 16 * DV; ++d) {
    __m512 k[NV];
    for (int kvec = 0; kvec < NV; ++kvec) k[kvec] = _mm512_load_ps(keys_t + d * kChunkKeys + 16 * kvec);
    for (int rr = 0; rr < R; ++rr) {
      const __m512 qd = _mm512_set1_ps(q[r0 + rr][d]);
      for (int kvec = 0; kvec < NV; ++kvec) acc[rr][kvec] = _mm512_fmadd_ps(qd, k[kvec], acc[rr][kvec]);
    }
  }
  for (int rr = 0; rr < R; ++rr)
    for (int kvec = 0; kvec < NV; ++kvec) _mm512_store_ps(scores[r0 + rr] + 16 * kvec, acc[rr][kvec]);
}

// scores[r][j] for all M rows, four at a time.
template <int DV, int NV>
void chunk_scores_nv(const float (*q)[kMaxHeadDim], const float* keys_t, float (*scores)[kChunkKeys], int M) {
  int r = 0;
  for (; r + 4 <= M; r += 4) scores_of_rows<DV, 4, NV>(q, keys_t, scores, r);
  switch (M - r) {
    case 3: scores_of_rows<DV, 3, NV>(q, keys_t, scores, r); break;
    case 2: scores_of_rows<DV, 2, NV>(q, keys_t, scores, r); break;
    case 1: scores_of_rows<DV, 1, NV>(q, keys_t, scores, r); break;
  }
}

// scores[r][j] for all M rows and the chunk's n keys (rounded up to a multiple of 16).
template <int DV>
inline void chunk_scores(const float (*q)[kMaxHeadDim], const float* keys_t, float (*scores)[kChunkKeys], int M,
                         int n) {
  switch ((n + 15) / 16) {
    case 1: return chunk_scores_nv<DV, 1>(q, keys_t, scores, M);
    case 2: return chunk_scores_nv<DV, 2>(q, keys_t, scores, M);
    case 3: return chunk_scores_nv<DV, 3>(q, keys_t, scores, M);
    default: return chunk_scores_nv<DV, 4>(q, keys_t, scores, M);
  }
}

// Row r's online-softmax step over the chunk's keys [first, first + n): soft-caps and masks
// its scores in srow, replaces them by weights exp(score - m_new) (zero where masked, up to the
// chunk's last vector of 16), updates the row's m and l, and returns alpha = exp(m_old - m_new),
// the factor its accumulator is rescaled by.
inline float softmax_row(const PagedAttentionArgs& a, QueryRows& rows, int r, int64_t first, int n, float* srow) {
  const int nv = (n + 15) / 16;
  // Keys this row may see form the range [lo, hi) of the chunk.
  const int64_t hi = std::min<int64_t>(n, rows.qpos[r] - first + 1);
  const int64_t lo = a.sliding_window > 0 ? std::max<int64_t>(0, rows.qpos[r] - a.sliding_window + 1 - first) : 0;
  if (hi <= lo) {  // nothing visible in this chunk: weights zero, state unchanged
    for (int j = 0; j < nv * 16; ++j) srow[j] = 0.f;
    return 1.f;
  }
  if (a.soft_cap > 0.f)
    for (int64_t j = lo; j < hi; ++j) srow[j] = a.soft_cap * std::tanh(srow[j] / a.soft_cap);
  __m512 vmax = _mm512_set1_ps(kNegInf);
  __mmask16 visible[4];
  for (int kvec = 0; kvec < nv; ++kvec) {
    const int64_t from = std::clamp<int64_t>(lo - 16 * kvec, 0, 16), to = std::clamp<int64_t>(hi - 16 * kvec, 0, 16);
    visible[kvec] = static_cast<__mmask16>(((1u << to) - 1) & ~((1u << from) - 1));
    vmax = _mm512_mask_max_ps(vmax, visible[kvec], vmax, _mm512_load_ps(srow + 16 * kvec));
  }
  const float m_new = std::max(rows.m[r], _mm512_reduce_max_ps(vmax));
  const float alpha = std::exp(rows.m[r] - m_new);
  const __m512 vm_new = _mm512_set1_ps(m_new);
  __m512 vsum = _mm512_setzero_ps();
  for (int kvec = 0; kvec < nv; ++kvec) {
    const __m512 e =
        _mm512_maskz_mov_ps(visible[kvec], exp_f32x16(_mm512_sub_ps(_mm512_load_ps(srow + 16 * kvec), vm_new)));
    _mm512_store_ps(srow + 16 * kvec, e);
    vsum = _mm512_add_ps(vsum, e);
  }
  rows.l[r] = rows.l[r] * alpha + _mm512_reduce_add_ps(vsum);
  rows.m[r] = m_new;
  return alpha;
}

// acc[r] = acc[r] * alpha[r] + sum_j weights[r][j] values[j] for rows [r0, r0 + R), the R x DV
// accumulators in registers.
template <int DV, int R>
inline void pv_of_rows(float (*acc)[kMaxHeadDim], const float* alpha, const float (*weights)[kChunkKeys],
                       const float* values, int n, int r0) {
  __m512 a[R][DV];
  for (int rr = 0; rr < R; ++rr) {
    const __m512 al = _mm512_set1_ps(alpha[r0 + rr]);
    for (int c = 0; c < DV; ++c) a[rr][c] = _mm512_mul_ps(_mm512_load_ps(acc[r0 + rr] + 16 * c), al);
  }
  for (int j = 0; j < n; ++j) {
    __m512 vj[DV];
    for (int c = 0; c < DV; ++c) vj[c] = _mm512_load_ps(values + j * 16 * DV + 16 * c);
    for (int rr = 0; rr < R; ++rr) {
      const __m512 w = _mm512_set1_ps(weights[r0 + rr][j]);
      for (int c = 0; c < DV; ++c) a[rr][c] = _mm512_fmadd_ps(w, vj[c], a[rr][c]);
    }
  }
  for (int rr = 0; rr < R; ++rr)
    for (int c = 0; c < DV; ++c) _mm512_store_ps(acc[r0 + rr] + 16 * c, a[rr][c]);
}

// The last `rows` (< R) rows in one pass, so a decode's few rows (query heads per kv head)
// still give the FMAs independent chains.
template <int DV, int R>
inline void pv_of_last_rows(float (*acc)[kMaxHeadDim], const float* alpha, const float (*weights)[kChunkKeys],
                            const float* values, int n, int r0, int rows) {
  if constexpr (R > 0) {
    if (rows == R) return pv_of_rows<DV, R>(acc, alpha, weights, values, n, r0);
    pv_of_last_rows<DV, R - 1>(acc, alpha, weights, values, n, r0, rows);
  }
}

// acc = acc * alpha + weights @ values for all M rows, as many rows at a time as the
// registers hold (R x DV accumulators).
template <int DV>
void chunk_pv(float (*acc)[kMaxHeadDim], const float* alpha, const float (*weights)[kChunkKeys], const float* values,
              int n, int M) {
  constexpr int R = DV >= 16 ? 1 : 16 / DV;
  int r = 0;
  for (; r + R <= M; r += R) pv_of_rows<DV, R>(acc, alpha, weights, values, n, r);
  pv_of_last_rows<DV, R - 1>(acc, alpha, weights, values, n, r, M - r);
}

template <typename KV, int DV>
void attend_avx512_item(const PagedAttentionArgs& a, const WorkItem& item, Scratch& s) {
  QueryRows rows;
  load_query_rows(a, item, s, rows, 16);
  float alpha[kMaxRows];
  for (int64_t first = rows.begin; first <= rows.last_pos; first += kChunkKeys) {
    const int n = static_cast<int>(std::min<int64_t>(kChunkKeys, rows.last_pos + 1 - first));
    const int64_t next = first + kChunkKeys;
    if (next <= rows.last_pos)
      prefetch_keys<KV, 3>(a, rows.page_table, item.kv_head, next,
                           std::min<int64_t>(kChunkKeys, rows.last_pos + 1 - next));
    widen_chunk_avx512<KV, DV>(a, rows.page_table, item.kv_head, first, n, s.keys_t, s.values);
    chunk_scores<DV>(s.q, s.keys_t, s.scores, rows.M, n);
    for (int r = 0; r < rows.M; ++r) alpha[r] = softmax_row(a, rows, r, first, n, s.scores[r]);
    chunk_pv<DV>(s.acc, alpha, s.scores, s.values, n, rows.M);
  }
  store_output_rows(a, item, s, rows);
}

template <int DV>
bool attend_avx512_head_dim(const PagedAttentionArgs& a, const WorkItem& item, Scratch& s) {
  if (a.kv_type == kKvBf16)
    attend_avx512_item<uint16_t, DV>(a, item, s);
  else
    attend_avx512_item<float, DV>(a, item, s);
  return true;
}

}  // namespace

bool attend_avx512(const PagedAttentionArgs& a, const WorkItem& item, Scratch& s) {
  if (a.kv_type == kKvInt8 || a.kv_type == kKvFp8) return false;  // the AVX2 path reads quantized rows
  switch (a.head_dim) {
    case 32: return attend_avx512_head_dim<2>(a, item, s);
    case 64: return attend_avx512_head_dim<4>(a, item, s);
    case 128: return attend_avx512_head_dim<8>(a, item, s);
    case 256: return attend_avx512_head_dim<16>(a, item, s);
  }
  return false;
}

#else   // no AVX-512

bool attend_avx512(const PagedAttentionArgs&, const WorkItem&, Scratch&) { return false; }

#endif  // __AVX512F__

}  // namespace jaxllm
