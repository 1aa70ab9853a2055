// Ragged paged attention on the CPU, as an XLA FFI custom call (handler in paged_attention.cc).
//
// Same contract as kernels.ragged_paged_attention_reference (see reference.py); the inputs are
// the fields of PagedAttentionArgs below, and padding rows of `out` are zeros.
//
// Why a custom call: on XLA:CPU the same computation written in jnp becomes hundreds of tiny
// batched dots and page gathers per layer (about 20x off the memory roofline). Here one work
// item is (sequence, kv head, tile of up to 16 query tokens): its query rows (tile tokens x
// query heads of the kv head) stay in registers/L1 while the sequence's pages stream through
// once, converted to f32 a chunk of keys at a time, with an online softmax. Items are handed
// out longest first to the caller thread and XLA's intra-op thread pool (parallel_for.h).
// Each item runs the widest path the build has for its head_dim: AVX-512
// (paged_attention_avx512.cc; head_dim 32, 64, 128 or 256), else AVX2 + FMA
// (paged_attention_avx2.cc; head_dim a multiple of 32), else the portable path
// (paged_attention.cc). The `path` argument can force a narrower one (for tests and benchmarks).
//
// Words: a "page" (what the public `block_size` option sizes) is page_size consecutive tokens of one
// sequence in the KV cache; a "tile" is the query tokens of one work item; a "chunk" is the
// kChunkKeys keys widened to f32 together.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "simd.h"

namespace jaxllm {

constexpr int kMaxTileTokens = 16;  // query tokens per work item (prefill)
constexpr int kChunkKeys = 64;      // keys widened to f32 at a time
constexpr int kMaxHeadDim = 256;
constexpr int kMaxRows = 64;        // tile tokens x query heads per kv head, at most
constexpr float kNegInf = -1e30f;   // masked score (finite: -inf - -inf would be NaN)

// What the pages hold: f32, bf16 bits (u16), or int8 or fp8 E4M3 (u8 bits) codes with a scale
// per row (kv_write.py: row = head_dim codes, then the row's f32 scale as 4 bytes; value =
// code * scale). A template's KV type is the element: float, uint16_t, int8_t or uint8_t.
enum KvType : int32_t { kKvF32 = 0, kKvBf16 = 1, kKvInt8 = 2, kKvFp8 = 3 };

// The kernel's inputs, checked by the FFI handler. T = query tokens (padding included),
// S = sequence slots (the first num_seqs in use).
struct PagedAttentionArgs {
  const float* q;               // [T, num_q_heads, head_dim] f32
  const void* k_pages;          // [num_kv_heads, num_pages, page_size, row] u16 (bf16 bits) or f32 (row =
                                //   head_dim), or s8 / u8 (fp8 bits) (row = head_dim codes, then the f32
                                //   scale's 4 bytes)
  const void* v_pages;          // same as k_pages
  const int32_t* kv_lens;       // [S] s32: tokens in each sequence's cache, this step's included
  const int32_t* page_tables;  // [S, pages_per_seq] s32: page ids of each sequence's tokens
  const int32_t* cu_q_lens;     // [S + 1] s32: sequence s's query tokens are rows cu_q_lens[s] ..
                                //   cu_q_lens[s + 1] - 1 of q; they are its last tokens
  float* out;                   // [T, num_q_heads, head_dim] f32
  int64_t num_seqs;             // sequences in use: the num_seqs input, at most S
  int64_t num_tokens;           // T
  int64_t num_q_heads, num_kv_heads, head_dim;
  int64_t num_pages, page_size, pages_per_seq;
  int64_t q_heads_per_kv_head;  // G = num_q_heads / num_kv_heads
  int64_t tile_tokens;          // query tokens per work item: min(16, kMaxRows / G)
  int32_t kv_type;              // a KvType: what the pages hold
  int64_t row_stride;           // elements of a cache row: head_dim, or head_dim + 4 for int8 / fp8
  float sm_scale;               // scores are sm_scale * (q . k)
  float soft_cap;               // 0: none; else scores become soft_cap * tanh(score / soft_cap)
  int32_t sliding_window;       // 0: none; else a query at position p sees keys p - window + 1 .. p
  int32_t causal;               // 1: a query sees the keys up to its own position; 0: all of its sequence's
  int32_t path;                 // a KernelPath: the widest path to try (kAuto: any)
};

// One unit of parallel work: query tokens [tile * tile_tokens, ...) of sequence `seq` (at most
// tile_tokens of them), with the query heads of kv head `kv_head`.
struct WorkItem {
  int32_t seq, kv_head, tile;
  int64_t cost;  // about the score count, for ordering longest first
};

// Per-thread working memory of a work item (heap: too large for a pool thread's stack).
// Row r of an item is (token r / G of its tile, query head kv_head * G + r % G).
struct alignas(64) Scratch {
  float q[kMaxRows][kMaxHeadDim];            // query rows, times sm_scale
  float acc[kMaxRows][kMaxHeadDim];          // sum over keys of softmax weight x v
  float scores[kMaxRows][kChunkKeys];        // a chunk's scores, then its softmax weights
  float keys[kChunkKeys * kMaxHeadDim];      // [n, head_dim]: a chunk's keys (portable path)
  float keys_t[kMaxHeadDim * kChunkKeys];    // [head_dim, kChunkKeys]: the same, transposed
  float values[kChunkKeys * kMaxHeadDim];    // [n, head_dim]: a chunk's values
};

// The query rows of one work item and their online-softmax state.
struct QueryRows {
  int M;                        // rows: tile tokens x G
  int64_t G, first_token;       // G query heads per kv head; q row of the tile's first token
  const int32_t* page_table;   // the sequence's, [pages_per_seq]
  int64_t qpos[kMaxRows];       // cache position of each row's token
  float m[kMaxRows], l[kMaxRows];  // running max of the scores, running sum of exp(score - m)
  int64_t begin, last_pos;      // keys to visit: begin (a multiple of the path's alignment) .. last_pos
};

// Fills `rows` for `item` and loads its query rows, scaled, into scratch.q, with scratch.acc
// zeroed. The first key to visit is rounded down to a multiple of `align`.
inline void load_query_rows(const PagedAttentionArgs& a, const WorkItem& item, Scratch& scratch, QueryRows& rows,
                            int64_t align) {
  const int64_t D = a.head_dim;
  const int64_t G = rows.G = a.q_heads_per_kv_head;
  const int32_t s = item.seq;
  const int64_t q_start = a.cu_q_lens[s], q_len = a.cu_q_lens[s + 1] - q_start;
  const int64_t t0 = static_cast<int64_t>(item.tile) * a.tile_tokens;
  rows.first_token = q_start + t0;
  rows.M = static_cast<int>(std::min<int64_t>(a.tile_tokens, q_len - t0) * G);
  rows.page_table = a.page_tables + static_cast<int64_t>(s) * a.pages_per_seq;
  for (int i = 0; i < rows.M; ++i) {
    const int64_t tok = rows.first_token + i / G, head = item.kv_head * G + i % G;
    const float* src = a.q + (tok * a.num_q_heads + head) * D;
    for (int64_t d = 0; d < D; ++d) scratch.q[i][d] = src[d] * a.sm_scale;
    for (int64_t d = 0; d < D; ++d) scratch.acc[i][d] = 0.f;
    rows.m[i] = kNegInf;
    rows.l[i] = 0.f;
    // (Bidirectional, an encoder's: every row as the sequence's last, so every key passes the masks.)
    rows.qpos[i] = a.causal ? a.kv_lens[s] - q_len + t0 + i / G : a.kv_lens[s] - 1;
  }
  rows.last_pos = rows.qpos[rows.M - 1];
  rows.begin = a.sliding_window > 0 ? std::max<int64_t>(0, rows.qpos[0] - a.sliding_window + 1) : 0;
  rows.begin -= rows.begin % align;
}

// out rows = acc / l (a row that saw no key, impossible for a causal row, gives zeros).
inline void store_output_rows(const PagedAttentionArgs& a, const WorkItem& item, const Scratch& scratch,
                              const QueryRows& rows) {
  for (int i = 0; i < rows.M; ++i) {
    const int64_t tok = rows.first_token + i / rows.G, head = item.kv_head * rows.G + i % rows.G;
    float* dst = a.out + (tok * a.num_q_heads + head) * a.head_dim;
    const float inv = rows.l[i] > 0.f ? 1.f / rows.l[i] : 0.f;
    for (int64_t d = 0; d < a.head_dim; ++d) dst[d] = scratch.acc[i][d] * inv;
  }
}

// Runs `item` on the AVX-512 path and returns true, or returns false where that path does not
// apply (a build without AVX-512, or a head_dim it has no code for).
bool attend_avx512(const PagedAttentionArgs& a, const WorkItem& item, Scratch& scratch);
// The same for the AVX2 path (a build without AVX2 + FMA, or a head_dim not a multiple of 32).
bool attend_avx2(const PagedAttentionArgs& a, const WorkItem& item, Scratch& scratch);

// The key (or value) row of cache position `pos` of one sequence, inside a page of `pages`.
template <typename KV>
inline const KV* kv_row(const PagedAttentionArgs& a, const KV* pages, const int32_t* page_table,
                        int64_t kv_head, int64_t pos) {
  const int64_t P = a.page_size;
  return pages + ((kv_head * a.num_pages + page_table[pos / P]) * P + pos % P) * a.row_stride;
}

// Asks for the K and V rows of cache positions [first, first + n) of one sequence and kv head to
// be brought into cache, L1 (kLocality 3: prefetcht0) or L2 (2: prefetcht1): a sequence's pages
// lie anywhere in the pool, and the hardware prefetcher stops at each page's end.
template <typename KV, int kLocality>
inline void prefetch_keys(const PagedAttentionArgs& a, const int32_t* page_table, int64_t kv_head, int64_t first,
                          int64_t n) {
  const KV* k_pages = static_cast<const KV*>(a.k_pages);
  const KV* v_pages = static_cast<const KV*>(a.v_pages);
  const int64_t row_bytes = a.row_stride * static_cast<int64_t>(sizeof(KV));
  for (int64_t j = 0; j < n; ++j) {
    const char* k = reinterpret_cast<const char*>(kv_row(a, k_pages, page_table, kv_head, first + j));
    const char* v = reinterpret_cast<const char*>(kv_row(a, v_pages, page_table, kv_head, first + j));
    for (int64_t b = 0; b < row_bytes; b += 64) {
      __builtin_prefetch(k + b, 0, kLocality);
      __builtin_prefetch(v + b, 0, kLocality);
    }
  }
}

// The scale of an int8 or fp8 cache row (1 for float rows).
template <typename KV>
inline float row_scale(const PagedAttentionArgs& a, const KV* row) {
  if constexpr (sizeof(KV) == 1) {
    float s;
    std::memcpy(&s, row + a.head_dim, sizeof s);
    return s;
  } else {
    return 1.f;
  }
}

}  // namespace jaxllm
