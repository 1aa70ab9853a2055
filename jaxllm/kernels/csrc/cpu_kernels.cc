// jaxllm's CPU kernels as XLA FFI custom calls: ragged paged attention, and the greedy
// sampler's row argmax + logsumexp.
//
// Paged attention:
//
// Same contract as kernels.ragged_paged_attention_reference (see reference.py):
//   q            [T, num_q_heads, head_dim] f32
//   k_pages      [num_kv_heads, num_pages, page_size, head_dim] u16 (bf16 bits) or f32
//   v_pages      same as k_pages
//   kv_lens      [S] s32, block_tables [S, pages_per_seq] s32, cu_q_lens [S + 1] s32,
//   num_seqs     [] s32
//   out          [T, num_q_heads, head_dim] f32 (padding rows are zeros)
// Attributes: sm_scale (f32), sliding_window (s32, 0 = none), soft_cap (f32, 0 = none).
//
// Why a custom call: on XLA:CPU the same computation written in jnp becomes hundreds of
// tiny batched dots and page gathers per layer (about 20x off the memory roofline). Here one
// work item is (sequence, kv head, tile of up to 16 query tokens): its query rows
// (tile tokens x query heads of the kv head) stay in registers/L1 while the sequence's pages
// stream through once, converted to f32 a chunk at a time, with an online softmax. Items are
// handed out longest first from an atomic counter to the caller thread and XLA's intra-op
// thread pool. Built at run time by kernels/native.py with -O3 -march=native -ffast-math.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;





namespace {

constexpr int kMaxTileTokens = 16;  // query tokens per work item (prefill)
constexpr int kChunkKeys = 64;      // keys converted to f32 at a time
constexpr int kMaxHeadDim = 256;
constexpr int kMaxRows = 64;        // tile tokens x query heads per kv head, at most
constexpr float kNegInf = -1e30f;

inline float to_f32(uint16_t bits) {
  uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline float to_f32(float x) { return x; }

struct Problem {
  const float* q;
  const void* k_pages;
  const void* v_pages;
  const int32_t* kv_lens;
  const int32_t* block_tables;
  const int32_t* cu_q_lens;
  float* out;
  int64_t num_q_heads, num_kv_heads, num_pages, page_size, head_dim, pages_per_seq;
  int64_t tile_tokens;  // min(16, kMaxRows / query heads per kv head)
  float sm_scale, soft_cap;
  int32_t sliding_window;
};

// Per-thread working memory of a work item (heap: too large for a pool thread's stack).
struct alignas(64) Scratch {
  float qrow[kMaxRows][kMaxHeadDim];  // row r = (token r / G, query head kv_head * G + r % G)
  float acc[kMaxRows][kMaxHeadDim];
  float sc[kMaxRows][kChunkKeys];     // scores, then softmax weights
  float kbuf[kChunkKeys * kMaxHeadDim];
  float kt[kChunkKeys * kMaxHeadDim];
  float vbuf[kChunkKeys * kMaxHeadDim];
};

struct Item {
  int32_t seq, kv_head, tile;
  int64_t cost;
};

// Converts up to kChunkKeys keys of one sequence and kv head (starting at key `first`, a
// page boundary) from the pages to f32 rows [n, head_dim].
template <typename KV>
void load_chunk(const Problem& p, const KV* pages, const int32_t* table, int64_t kv_head,
                int64_t first, int n, float* dst) {
  const int64_t P = p.page_size, D = p.head_dim;
  for (int done = 0; done < n;) {
    const int64_t key = first + done;
    const int64_t page = table[key / P];
    const int64_t in_page = key % P;
    const int take = static_cast<int>(std::min<int64_t>(P - in_page, n - done));
    const KV* src = pages + ((kv_head * p.num_pages + page) * P + in_page) * D;
    float* d = dst + static_cast<int64_t>(done) * D;
    for (int64_t i = 0; i < take * D; ++i) d[i] = to_f32(src[i]);
    done += take;
  }
}

// The query rows of one work item, row r = (token r / G, query head kv_head * G + r % G),
// loaded scaled into w.qrow with w.acc zeroed, and their online-softmax state.
struct Rows {
  int M;
  int64_t G, first_token;  // G query heads per kv head; q row of the tile's first token
  const int32_t* table;    // the sequence's block table
  int64_t qpos[kMaxRows];  // cache position of each row's token
  float m[kMaxRows], l[kMaxRows];
  int64_t begin, last_pos;  // keys to visit: begin (a multiple of `align`) .. last_pos
};

inline void start_rows(const Problem& p, const Item& item, Scratch& w, Rows& r, int64_t align) {
  const int64_t D = p.head_dim;
  r.G = p.num_q_heads / p.num_kv_heads;
  const int32_t s = item.seq;
  const int64_t q_start = p.cu_q_lens[s], q_len = p.cu_q_lens[s + 1] - q_start;
  const int64_t t0 = static_cast<int64_t>(item.tile) * p.tile_tokens;
  r.first_token = q_start + t0;
  r.M = static_cast<int>(std::min<int64_t>(p.tile_tokens, q_len - t0) * r.G);
  r.table = p.block_tables + static_cast<int64_t>(s) * p.pages_per_seq;
  for (int i = 0; i < r.M; ++i) {
    const int64_t tok = r.first_token + i / r.G, head = item.kv_head * r.G + i % r.G;
    const float* src = p.q + (tok * p.num_q_heads + head) * D;
    for (int64_t d = 0; d < D; ++d) w.qrow[i][d] = src[d] * p.sm_scale;
    for (int64_t d = 0; d < D; ++d) w.acc[i][d] = 0.f;
    r.m[i] = kNegInf;
    r.l[i] = 0.f;
    r.qpos[i] = p.kv_lens[s] - q_len + t0 + i / r.G;
  }
  r.last_pos = r.qpos[r.M - 1];
  r.begin = p.sliding_window > 0 ? std::max<int64_t>(0, r.qpos[0] - p.sliding_window + 1) : 0;
  r.begin -= r.begin % align;
}

// out rows = acc / l (a row that saw no key, impossible for a causal row, gives zeros).
inline void finish_rows(const Problem& p, const Item& item, const Scratch& w, const Rows& r) {
  for (int i = 0; i < r.M; ++i) {
    const int64_t tok = r.first_token + i / r.G, head = item.kv_head * r.G + i % r.G;
    float* dst = p.out + (tok * p.num_q_heads + head) * p.head_dim;
    const float inv = r.l[i] > 0.f ? 1.f / r.l[i] : 0.f;
    for (int64_t d = 0; d < p.head_dim; ++d) dst[d] = w.acc[i][d] * inv;
  }
}

// Portable path: any head_dim, any CPU (the compiler vectorizes what it can).
template <typename KV>
void run_item_scalar(const Problem& p, const Item& item, Scratch& w) {
  float* kbuf = w.kbuf;
  float* kt = w.kt;
  float* vbuf = w.vbuf;
  auto& qrow = w.qrow;
  auto& acc = w.acc;
  auto& sc = w.sc;
  const int64_t D = p.head_dim;
  const KV* kp = static_cast<const KV*>(p.k_pages);
  const KV* vp = static_cast<const KV*>(p.v_pages);
  Rows rows;
  start_rows(p, item, w, rows, p.page_size);
  const int M = rows.M;
  const int32_t* table = rows.table;
  const int64_t* qpos = rows.qpos;
  float* m = rows.m;
  float* l = rows.l;
  const int64_t begin = rows.begin, last_pos = rows.last_pos;

  for (int64_t first = begin; first <= last_pos; first += kChunkKeys) {
    const int n = static_cast<int>(std::min<int64_t>(kChunkKeys, last_pos + 1 - first));
    load_chunk(p, kp, table, item.kv_head, first, n, kbuf);
    load_chunk(p, vp, table, item.kv_head, first, n, vbuf);
    // Scores [M, n]. Few rows (decodes): one dot per (row, key). Many rows (prompt tiles):
    // transpose the chunk once so each row's scores are a broadcast-FMA over the keys.
    if (M < 8) {
      for (int r = 0; r < M; ++r)
        for (int j = 0; j < n; ++j) {
          const float* k = kbuf + static_cast<int64_t>(j) * D;
          float dot = 0.f;
          for (int64_t d = 0; d < D; ++d) dot += qrow[r][d] * k[d];
          sc[r][j] = dot;
        }
    } else {
      for (int j = 0; j < n; ++j)
        for (int64_t d = 0; d < D; ++d) kt[d * kChunkKeys + j] = kbuf[j * D + d];
      for (int r = 0; r < M; ++r) {
        float row[kChunkKeys] = {};
        for (int64_t d = 0; d < D; ++d) {
          const float qd = qrow[r][d];
          const float* kd = kt + d * kChunkKeys;
          for (int j = 0; j < kChunkKeys; ++j) row[j] += qd * kd[j];
        }
        for (int j = 0; j < n; ++j) sc[r][j] = row[j];
      }
    }
    for (int r = 0; r < M; ++r) {
      float* srow = sc[r];
      float cmax = kNegInf;
      for (int j = 0; j < n; ++j) {
        const int64_t pos = first + j;
        float x = srow[j];
        if (p.soft_cap > 0.f) x = p.soft_cap * std::tanh(x / p.soft_cap);
        bool ok = pos <= qpos[r];
        if (p.sliding_window > 0) ok = ok && pos > qpos[r] - p.sliding_window;
        x = ok ? x : kNegInf;
        srow[j] = x;
        cmax = std::max(cmax, x);
      }
      if (cmax <= kNegInf) continue;  // every key of this chunk is masked for this row
      const float m_new = std::max(m[r], cmax);
      const float alpha = std::exp(m[r] - m_new);
      float sum = 0.f;
      for (int j = 0; j < n; ++j) {
        const float e = srow[j] <= kNegInf ? 0.f : std::exp(srow[j] - m_new);
        srow[j] = e;
        sum += e;
      }
      l[r] = l[r] * alpha + sum;
      m[r] = m_new;
      float* a = acc[r];
      for (int64_t d = 0; d < D; ++d) a[d] *= alpha;
      for (int j = 0; j < n; ++j) {
        const float w = srow[j];
        const float* v = vbuf + static_cast<int64_t>(j) * D;
        for (int64_t d = 0; d < D; ++d) a[d] += w * v[d];
      }
    }
  }
  finish_rows(p, item, w, rows);
}


#ifdef __AVX512F__
// AVX-512 path for head_dim = 16 * DV. Per chunk of up to 64 keys: K is transposed into
// kT[head_dim][64] f32 (16x16 word transposes; a bf16 word holds two adjacent dims, so the
// even dim is `word << 16` and the odd one `word & 0xffff0000`), which makes the scores of a
// row a broadcast-FMA over 16 keys per vector with no horizontal sums; V is widened to f32
// rows; softmax uses a polynomial exp; P @ V accumulates a block of rows in registers.

inline void transpose16x16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i + 0] = _mm512_unpacklo_epi64(t[4 * i + 0], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i + 0], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 4; ++j) {
      t[8 * i + j] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + 4 + j], 0x88);
      t[8 * i + 4 + j] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + 4 + j], 0xdd);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0x88);  // r[k] = column k of the input
    r[8 + j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0xdd);
  }
}

// e^x for x <= 0 (and -1e30 -> 0): Cephes-style range reduction and a degree-6 polynomial.
inline __m512 exp_ps(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-88.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(y, n);
}

template <typename KV>
inline const KV* key_row(const Problem& p, const KV* pages, const int32_t* table, int64_t kv_head,
                         int64_t key) {
  const int64_t P = p.page_size;
  return pages + ((kv_head * p.num_pages + table[key / P]) * P + key % P) * p.head_dim;
}

// Keys [first, first + n) (n <= 64) of one kv head: K into kT[d * 64 + j], V into v[j * D + d].
template <typename KV, int DV>
void load_chunk_avx512(const Problem& p, const int32_t* table, int64_t kv_head, int64_t first, int n,
                       float* kT, float* v) {
  constexpr int D = 16 * DV;
  const KV* kp = static_cast<const KV*>(p.k_pages);
  const KV* vp = static_cast<const KV*>(p.v_pages);
  for (int g = 0; g * 16 < n; ++g) {
    const KV* rows[16];
    for (int j = 0; j < 16; ++j)  // keys past n re-read a valid row; their scores are masked
      rows[j] = key_row(p, kp, table, kv_head, first + g * 16 + std::min(j, n - 1 - g * 16));
    constexpr int kWords = sizeof(KV) == 2 ? DV / 2 : DV;  // 16-word blocks per row
    for (int b = 0; b < kWords; ++b) {
      __m512i r[16];
      for (int j = 0; j < 16; ++j) r[j] = _mm512_loadu_si512(reinterpret_cast<const int32_t*>(rows[j]) + 16 * b);
      transpose16x16(r);
      for (int i = 0; i < 16; ++i) {
        if constexpr (sizeof(KV) == 2) {
          const int d = 32 * b + 2 * i;
          _mm512_store_ps(kT + d * 64 + g * 16, _mm512_castsi512_ps(_mm512_slli_epi32(r[i], 16)));
          _mm512_store_ps(kT + (d + 1) * 64 + g * 16,
                          _mm512_castsi512_ps(_mm512_and_si512(r[i], _mm512_set1_epi32(int(0xffff0000u)))));
        } else {
          _mm512_store_ps(kT + (16 * b + i) * 64 + g * 16, _mm512_castsi512_ps(r[i]));
        }
      }
    }
  }
  for (int j = 0; j < n; ++j) {
    const KV* src = key_row(p, vp, table, kv_head, first + j);
    for (int c = 0; c < DV; ++c) {
      __m512 x;
      if constexpr (sizeof(KV) == 2)
        x = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 16 * c))), 16));
      else
        x = _mm512_loadu_ps(reinterpret_cast<const float*>(src) + 16 * c);
      _mm512_store_ps(v + j * D + 16 * c, x);
    }
  }
}

// Asks for keys [first, first + n) of K and V to be brought into cache: the pages of a
// sequence are scattered over the pool, so the hardware prefetcher cannot guess the next one.
template <typename KV>
inline void prefetch_chunk(const Problem& p, const int32_t* table, int64_t kv_head, int64_t first, int n) {
  const KV* kp = static_cast<const KV*>(p.k_pages);
  const KV* vp = static_cast<const KV*>(p.v_pages);
  const int64_t row_bytes = p.head_dim * sizeof(KV);
  for (int j = 0; j < n; ++j) {
    const char* k = reinterpret_cast<const char*>(key_row(p, kp, table, kv_head, first + j));
    const char* v = reinterpret_cast<const char*>(key_row(p, vp, table, kv_head, first + j));
    for (int64_t b = 0; b < row_bytes; b += 64) {
      _mm_prefetch(k + b, _MM_HINT_T0);
      _mm_prefetch(v + b, _MM_HINT_T0);
    }
  }
}

// Scores of rows [r0, r0 + RB) against NG groups of 16 keys: sc[r][j] = q[r] . k[j].
template <int DV, int RB, int NG>
inline void scores_block(const float (*q)[kMaxHeadDim], const float* kT, float (*sc)[kChunkKeys], int r0) {
  __m512 acc[RB][NG];
  for (int rr = 0; rr < RB; ++rr)
    for (int g = 0; g < NG; ++g) acc[rr][g] = _mm512_setzero_ps();
  for (int d = 0; d < 16 * DV; ++d) {
    __m512 k[NG];
    for (int g = 0; g < NG; ++g) k[g] = _mm512_load_ps(kT + d * 64 + 16 * g);
    for (int rr = 0; rr < RB; ++rr) {
      const __m512 qd = _mm512_set1_ps(q[r0 + rr][d]);
      for (int g = 0; g < NG; ++g) acc[rr][g] = _mm512_fmadd_ps(qd, k[g], acc[rr][g]);
    }
  }
  for (int rr = 0; rr < RB; ++rr)
    for (int g = 0; g < NG; ++g) _mm512_store_ps(sc[r0 + rr] + 16 * g, acc[rr][g]);
}

template <int DV, int NG>
void scores(const float (*q)[kMaxHeadDim], const float* kT, float (*sc)[kChunkKeys], int M) {
  int r = 0;
  for (; r + 4 <= M; r += 4) scores_block<DV, 4, NG>(q, kT, sc, r);
  switch (M - r) {
    case 3: scores_block<DV, 3, NG>(q, kT, sc, r); break;
    case 2: scores_block<DV, 2, NG>(q, kT, sc, r); break;
    case 1: scores_block<DV, 1, NG>(q, kT, sc, r); break;
  }
}

// acc[r] = acc[r] * alpha[r] + sum_j p[r][j] v[j] for rows [r0, r0 + RB).
template <int DV, int RB>
inline void pv_block(float (*acc)[kMaxHeadDim], const float* alpha, const float (*pr)[kChunkKeys],
                     const float* v, int n, int r0) {
  __m512 a[RB][DV];
  for (int rr = 0; rr < RB; ++rr) {
    const __m512 al = _mm512_set1_ps(alpha[r0 + rr]);
    for (int c = 0; c < DV; ++c) a[rr][c] = _mm512_mul_ps(_mm512_load_ps(acc[r0 + rr] + 16 * c), al);
  }
  for (int j = 0; j < n; ++j) {
    __m512 vj[DV];
    for (int c = 0; c < DV; ++c) vj[c] = _mm512_load_ps(v + j * 16 * DV + 16 * c);
    for (int rr = 0; rr < RB; ++rr) {
      const __m512 w = _mm512_set1_ps(pr[r0 + rr][j]);
      for (int c = 0; c < DV; ++c) a[rr][c] = _mm512_fmadd_ps(w, vj[c], a[rr][c]);
    }
  }
  for (int rr = 0; rr < RB; ++rr)
    for (int c = 0; c < DV; ++c) _mm512_store_ps(acc[r0 + rr] + 16 * c, a[rr][c]);
}

// The last `rows` (< RB) rows in one block, so a decode's few rows (query heads per kv head)
// still give the FMAs independent chains.
template <int DV, int RB>
inline void pv_tail(float (*acc)[kMaxHeadDim], const float* alpha, const float (*pr)[kChunkKeys], const float* v,
                    int n, int r0, int rows) {
  if constexpr (RB > 0) {
    if (rows == RB) return pv_block<DV, RB>(acc, alpha, pr, v, n, r0);
    pv_tail<DV, RB - 1>(acc, alpha, pr, v, n, r0, rows);
  }
}

template <int DV>
void pv(float (*acc)[kMaxHeadDim], const float* alpha, const float (*pr)[kChunkKeys], const float* v, int n,
        int M) {
  constexpr int RB = DV >= 16 ? 1 : 16 / DV;
  int r = 0;
  for (; r + RB <= M; r += RB) pv_block<DV, RB>(acc, alpha, pr, v, n, r);
  pv_tail<DV, RB - 1>(acc, alpha, pr, v, n, r, M - r);
}

template <typename KV, int DV>
void run_item_avx512(const Problem& p, const Item& item, Scratch& w) {
  float* kT = w.kt;
  float* vbuf = w.vbuf;
  auto& qrow = w.qrow;
  auto& acc = w.acc;
  auto& sc = w.sc;
  Rows rows;
  start_rows(p, item, w, rows, 16);
  const int M = rows.M;
  const int32_t* table = rows.table;
  const int64_t* qpos = rows.qpos;
  float* m = rows.m;
  float* l = rows.l;
  float alpha[kMaxRows];
  const int64_t begin = rows.begin, last_pos = rows.last_pos;

  for (int64_t first = begin; first <= last_pos; first += kChunkKeys) {
    const int n = static_cast<int>(std::min<int64_t>(kChunkKeys, last_pos + 1 - first));
    const int64_t next = first + kChunkKeys;
    if (next <= last_pos)
      prefetch_chunk<KV>(p, table, item.kv_head, next, static_cast<int>(std::min<int64_t>(kChunkKeys, last_pos + 1 - next)));
    load_chunk_avx512<KV, DV>(p, table, item.kv_head, first, n, kT, vbuf);
    switch ((n + 15) / 16) {
      case 1: scores<DV, 1>(qrow, kT, sc, M); break;
      case 2: scores<DV, 2>(qrow, kT, sc, M); break;
      case 3: scores<DV, 3>(qrow, kT, sc, M); break;
      default: scores<DV, 4>(qrow, kT, sc, M); break;
    }
    const int ng = (n + 15) / 16;
    for (int r = 0; r < M; ++r) {
      // Keys this row may see form the range [lo, hi) of the chunk.
      const int64_t hi = std::min<int64_t>(n, qpos[r] - first + 1);
      const int64_t lo = p.sliding_window > 0 ? std::max<int64_t>(0, qpos[r] - p.sliding_window + 1 - first) : 0;
      float* srow = sc[r];
      if (hi <= lo) {  // nothing visible in this chunk: weights zero, state unchanged
        alpha[r] = 1.f;
        for (int j = 0; j < ng * 16; ++j) srow[j] = 0.f;
        continue;
      }
      if (p.soft_cap > 0.f)
        for (int64_t j = lo; j < hi; ++j) srow[j] = p.soft_cap * std::tanh(srow[j] / p.soft_cap);
      __m512 vmax = _mm512_set1_ps(kNegInf);
      __mmask16 valid[4];
      for (int g = 0; g < ng; ++g) {
        const int64_t a = std::clamp<int64_t>(lo - 16 * g, 0, 16), b = std::clamp<int64_t>(hi - 16 * g, 0, 16);
        valid[g] = static_cast<__mmask16>(((1u << b) - 1) & ~((1u << a) - 1));
        vmax = _mm512_mask_max_ps(vmax, valid[g], vmax, _mm512_load_ps(srow + 16 * g));
      }
      const float m_new = std::max(m[r], _mm512_reduce_max_ps(vmax));
      alpha[r] = std::exp(m[r] - m_new);
      const __m512 mn = _mm512_set1_ps(m_new);
      __m512 vsum = _mm512_setzero_ps();
      for (int g = 0; g < ng; ++g) {
        const __m512 e = _mm512_maskz_mov_ps(valid[g], exp_ps(_mm512_sub_ps(_mm512_load_ps(srow + 16 * g), mn)));
        _mm512_store_ps(srow + 16 * g, e);
        vsum = _mm512_add_ps(vsum, e);
      }
      l[r] = l[r] * alpha[r] + _mm512_reduce_add_ps(vsum);
      m[r] = m_new;
    }
    pv<DV>(acc, alpha, sc, vbuf, n, M);
  }
  finish_rows(p, item, w, rows);
}
#endif  // __AVX512F__

template <typename KV>
void run_item(const Problem& p, const Item& item, Scratch& w) {
#ifdef __AVX512F__
  switch (p.head_dim) {
    case 32: return run_item_avx512<KV, 2>(p, item, w);
    case 64: return run_item_avx512<KV, 4>(p, item, w);
    case 128: return run_item_avx512<KV, 8>(p, item, w);
    case 256: return run_item_avx512<KV, 16>(p, item, w);
  }
#endif
  run_item_scalar<KV>(p, item, w);
}

// Runs fn(i, scratch) for every i in [0, n) on the calling thread and XLA's intra-op pool,
// handing out indices from an atomic counter (callers order them costliest first). Pool tasks
// may start after this returns (XLA promises neither parallelism nor timing), so they share
// only this ref-counted state, and late ones find no index left.
struct ParallelFor {
  std::function<void(int64_t, Scratch&)> fn;
  int64_t n = 0;
  bool scratch = false;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::mutex mu;
  std::condition_variable cv;

  void drain() {
    std::unique_ptr<Scratch> w(scratch ? new Scratch : nullptr);
    for (int64_t i; (i = next.fetch_add(1)) < n;) {
      fn(i, *w);
      if (done.fetch_add(1) + 1 == n) {
        std::lock_guard<std::mutex> lock(mu);
        cv.notify_all();
      }
    }
  }
};

void parallel_for(ffi::ThreadPool& pool, int64_t n, bool scratch, std::function<void(int64_t, Scratch&)> fn) {
  if (n <= 0) return;
  auto work = std::make_shared<ParallelFor>();
  work->fn = std::move(fn);
  work->n = n;
  work->scratch = scratch;
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), n) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { work->drain(); });
  work->drain();
  std::unique_lock<std::mutex> lock(work->mu);
  work->cv.wait(lock, [&] { return work->done.load() == n; });
}

ffi::Error PagedAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_pages,
                              ffi::AnyBuffer v_pages, ffi::Buffer<ffi::S32> kv_lens,
                              ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> cu_q_lens,
                              ffi::Buffer<ffi::S32> num_seqs, ffi::ResultBuffer<ffi::F32> out,
                              float sm_scale, int32_t sliding_window, float soft_cap) {
  const auto qd = q.dimensions();
  const auto kd = k_pages.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || block_tables.dimensions().size() != 2)
    return ffi::Error::InvalidArgument("paged attention: bad ranks");
  if (k_pages.element_type() != v_pages.element_type() ||
      (k_pages.element_type() != ffi::U16 && k_pages.element_type() != ffi::F32))
    return ffi::Error::InvalidArgument("paged attention: pages must both be u16 (bf16 bits) or f32");
  Problem p;
  std::vector<Item> items;
  p.q = q.typed_data();
  p.k_pages = k_pages.untyped_data();
  p.v_pages = v_pages.untyped_data();
  p.kv_lens = kv_lens.typed_data();
  p.block_tables = block_tables.typed_data();
  p.cu_q_lens = cu_q_lens.typed_data();
  p.out = out->typed_data();
  p.num_q_heads = qd[1];
  p.head_dim = qd[2];
  p.num_kv_heads = kd[0];
  p.num_pages = kd[1];
  p.page_size = kd[2];
  p.pages_per_seq = block_tables.dimensions()[1];
  p.sm_scale = sm_scale;
  p.soft_cap = soft_cap;
  p.sliding_window = sliding_window;
  const bool bf16 = k_pages.element_type() == ffi::U16;
  const int64_t G = p.num_q_heads / p.num_kv_heads;
  if (p.head_dim > kMaxHeadDim || G > kMaxRows || p.num_q_heads % p.num_kv_heads)
    return ffi::Error::InvalidArgument(
        "paged attention: needs head_dim <= 256 and q_heads a multiple of kv_heads, at most 64 per kv head");
  p.tile_tokens = std::min<int64_t>(kMaxTileTokens, kMaxRows / G);

  const int64_t T = qd[0];
  const int64_t S = kv_lens.dimensions()[0];
  const int64_t n = std::min<int64_t>(num_seqs.typed_data()[0], S);
  // Zero the padding rows (real rows are written by their items).
  const int64_t real_tokens = n > 0 ? std::min<int64_t>(p.cu_q_lens[n], T) : 0;
  std::memset(p.out + real_tokens * p.num_q_heads * p.head_dim, 0,
              (T - real_tokens) * p.num_q_heads * p.head_dim * sizeof(float));
  for (int32_t s = 0; s < n; ++s) {
    const int64_t q_len = p.cu_q_lens[s + 1] - p.cu_q_lens[s];
    if (q_len <= 0) continue;
    if (p.cu_q_lens[s + 1] > T || p.kv_lens[s] < q_len ||
        p.kv_lens[s] > p.pages_per_seq * p.page_size)
      return ffi::Error::InvalidArgument("paged attention: inconsistent cu_q_lens / kv_lens");
    for (int64_t t = 0; t * p.tile_tokens < q_len; ++t) {
      const int64_t ctx = p.kv_lens[s] - q_len + std::min<int64_t>((t + 1) * p.tile_tokens, q_len);
      const int64_t cost = ctx * std::min<int64_t>(p.tile_tokens, q_len - t * p.tile_tokens) + 64;
      for (int64_t h = 0; h < p.num_kv_heads; ++h)
        items.push_back({s, static_cast<int32_t>(h), static_cast<int32_t>(t), cost});
    }
  }
  // The table entries a sequence uses must be valid page ids (no bounds checks inside).
  for (int32_t s = 0; s < n; ++s) {
    const int64_t used = (p.kv_lens[s] + p.page_size - 1) / p.page_size;
    for (int64_t i = 0; i < used; ++i) {
      const int32_t page = p.block_tables[s * p.pages_per_seq + i];
      if (page < 0 || page >= p.num_pages)
        return ffi::Error::InvalidArgument("paged attention: block table holds an invalid page id");
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  parallel_for(pool, static_cast<int64_t>(items.size()), true, [&](int64_t i, Scratch& w) {
    if (bf16)
      run_item<uint16_t>(p, items[i], w);
    else
      run_item<float>(p, items[i], w);
  });
  return ffi::Error::Success();
}

// Greedy sampling's two reductions over logits [S, V] f32 in one pass per row: the first
// index of the maximum and log(sum(exp(x))). XLA:CPU runs jnp.argmax as a scalar
// (value, index) reduction: 14 ms for [128, 49152] against ~1 ms here.
ffi::Error ArgmaxLogsumexpImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::S32> argmax,
                               ffi::ResultBuffer<ffi::F32> lse) {
  const auto d = x.dimensions();
  if (d.size() != 2) return ffi::Error::InvalidArgument("argmax_logsumexp: x must be [rows, vocab]");
  const int64_t rows = d[0], V = d[1];
  const float* xs = x.typed_data();
  int32_t* am = argmax->typed_data();
  float* ls = lse->typed_data();
  constexpr int64_t kRowsPerTask = 8;
  parallel_for(pool, (rows + kRowsPerTask - 1) / kRowsPerTask, false, [&](int64_t task, Scratch&) {
    for (int64_t r = task * kRowsPerTask; r < std::min(rows, (task + 1) * kRowsPerTask); ++r) {
      const float* row = xs + r * V;
      float m = -INFINITY;
      int64_t i = 0;
#ifdef __AVX512F__
      __m512 vmax = _mm512_set1_ps(-INFINITY);
      for (; i + 16 <= V; i += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(row + i));
      m = _mm512_reduce_max_ps(vmax);
#endif
      for (; i < V; ++i) m = std::max(m, row[i]);
      int64_t idx = 0;  // the first index holding the max
      while (idx < V - 1 && !(row[idx] == m)) ++idx;
      // Blocks of 1024 summed in f32, the blocks in double: f32 sums over all ~50k terms
      // drifted by ~1e-5 of the logprob, enough to move beam-search scores by 5e-4.
      double sum = 0.0;
      for (int64_t b = 0; b < V; b += 1024) {
        const int64_t e = std::min(V, b + 1024);
        float part = 0.f;
        int64_t j = b;
#ifdef __AVX512F__
        __m512 acc = _mm512_setzero_ps();
        const __m512 mv = _mm512_set1_ps(m);
        for (; j + 16 <= e; j += 16) acc = _mm512_add_ps(acc, exp_ps(_mm512_sub_ps(_mm512_loadu_ps(row + j), mv)));
        part = _mm512_reduce_add_ps(acc);
#endif
        for (; j < e; ++j) part += std::exp(row[j] - m);
        sum += part;
      }
      am[r] = static_cast<int32_t>(idx);
      ls[r] = m + static_cast<float>(std::log(sum));
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmPagedAttentionCpu, PagedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("sm_scale")
                                  .Attr<int32_t>("sliding_window")
                                  .Attr<float>("soft_cap"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmArgmaxLogsumexpCpu, ArgmaxLogsumexpImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
