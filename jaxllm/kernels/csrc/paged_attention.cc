// Ragged paged attention: work items, the portable path and the FFI handler (see
// paged_attention.h for the contract; the SIMD paths are in paged_attention_avx512.cc and
// paged_attention_avx2.cc).

#include "paged_attention.h"

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

// Widens the rows of cache positions [first, first + n) (n <= kChunkKeys) of one sequence and
// kv head to f32 rows dst[n, head_dim] (int8 rows times their scales).
template <typename KV>
void widen_chunk(const PagedAttentionArgs& a, const KV* pages, const int32_t* page_table, int64_t kv_head,
                 int64_t first, int n, float* dst) {
  const int64_t D = a.head_dim;
  for (int j = 0; j < n; ++j) {
    const KV* src = kv_row(a, pages, page_table, kv_head, first + j);
    const float scale = row_scale(a, src);
    float* d = dst + static_cast<int64_t>(j) * D;
    for (int64_t i = 0; i < D; ++i) d[i] = to_f32(src[i]) * scale;
  }
}

// scratch.scores[r][j] = q[r] . keys[j] for M rows and n keys. Few rows (decodes): one dot per
// (row, key). Many rows (prompt tiles): transpose the chunk once so each row's scores are a
// broadcast-FMA over the keys. The two sum in different orders (fast math vectorises the dot),
// so with `pinned` (a path asked for by name: `batch_invariant`) every item transposes, and a
// row's scores never depend on how many rows share its item.
inline void chunk_scores_portable(Scratch& s, int M, int n, int64_t D, bool pinned) {
  if (M < 8 && !pinned) {
    for (int r = 0; r < M; ++r)
      for (int j = 0; j < n; ++j) {
        const float* k = s.keys + static_cast<int64_t>(j) * D;
        float dot = 0.f;
        for (int64_t d = 0; d < D; ++d) dot += s.q[r][d] * k[d];
        s.scores[r][j] = dot;
      }
    return;
  }
  for (int j = 0; j < n; ++j)
    for (int64_t d = 0; d < D; ++d) s.keys_t[d * kChunkKeys + j] = s.keys[j * D + d];
  for (int r = 0; r < M; ++r) {
    float row[kChunkKeys] = {};
    for (int64_t d = 0; d < D; ++d) {
      const float qd = s.q[r][d];
      const float* kd = s.keys_t + d * kChunkKeys;
      for (int j = 0; j < kChunkKeys; ++j) row[j] += qd * kd[j];
    }
    for (int j = 0; j < n; ++j) s.scores[r][j] = row[j];
  }
}

// Row r's online-softmax step over the chunk's keys [first, first + n): soft cap and mask its
// scores, rescale its state and accumulator to the new max, and add the chunk's weighted values.
inline void softmax_pv_row_portable(const PagedAttentionArgs& a, QueryRows& rows, int r, int64_t first, int n,
                                    Scratch& s) {
  const int64_t D = a.head_dim;
  float* srow = s.scores[r];
  float cmax = kNegInf;
  for (int j = 0; j < n; ++j) {
    const int64_t pos = first + j;
    float x = srow[j];
    if (a.soft_cap > 0.f) x = a.soft_cap * std::tanh(x / a.soft_cap);
    bool ok = pos <= rows.qpos[r];
    if (a.sliding_window > 0) ok = ok && pos > rows.qpos[r] - a.sliding_window;
    x = ok ? x : kNegInf;
    srow[j] = x;
    cmax = std::max(cmax, x);
  }
  if (cmax <= kNegInf) return;  // every key of this chunk is masked for this row
  const float m_new = std::max(rows.m[r], cmax);
  const float alpha = std::exp(rows.m[r] - m_new);
  float sum = 0.f;
  for (int j = 0; j < n; ++j) {
    const float e = srow[j] <= kNegInf ? 0.f : std::exp(srow[j] - m_new);
    srow[j] = e;
    sum += e;
  }
  rows.l[r] = rows.l[r] * alpha + sum;
  rows.m[r] = m_new;
  float* acc = s.acc[r];
  for (int64_t d = 0; d < D; ++d) acc[d] *= alpha;
  for (int j = 0; j < n; ++j) {
    const float w = srow[j];
    const float* v = s.values + static_cast<int64_t>(j) * D;
    for (int64_t d = 0; d < D; ++d) acc[d] += w * v[d];
  }
}

// Portable path: any head_dim, any CPU (the compiler vectorizes what it can).
template <typename KV>
void attend_portable(const PagedAttentionArgs& a, const WorkItem& item, Scratch& s) {
  const KV* k_pages = static_cast<const KV*>(a.k_pages);
  const KV* v_pages = static_cast<const KV*>(a.v_pages);
  QueryRows rows;
  load_query_rows(a, item, s, rows, a.page_size);
  for (int64_t first = rows.begin; first <= rows.last_pos; first += kChunkKeys) {
    const int n = static_cast<int>(std::min<int64_t>(kChunkKeys, rows.last_pos + 1 - first));
    widen_chunk(a, k_pages, rows.page_table, item.kv_head, first, n, s.keys);
    widen_chunk(a, v_pages, rows.page_table, item.kv_head, first, n, s.values);
    chunk_scores_portable(s, rows.M, n, a.head_dim, a.path != kAuto);
    for (int r = 0; r < rows.M; ++r) softmax_pv_row_portable(a, rows, r, first, n, s);
  }
  store_output_rows(a, item, s, rows);
}

// Items of at most this many query tokens (decodes, a few drafts) take the AVX2 path first on
// `auto`, even where AVX-512 is built: reading K and V in place beats widening and transposing
// each chunk when so few rows use it. On Zen 4 (paged bf16 cache, 9 / 3 heads, head_dim 64)
// AVX2 took 0.55x AVX-512's time at 1 token, 0.77-0.95x at 3-8, about the same at 16, and
// 1.1x on a 512-token prompt chunk.
constexpr int64_t kInPlaceMaxTokens = 8;
constexpr int64_t kItemsPerClaim = 4;

// Asks for the K and V rows of the first chunk `item` will read to be brought into L2.
void prefetch_first_chunk(const PagedAttentionArgs& a, const WorkItem& item) {
  const int64_t q_len = a.cu_q_lens[item.seq + 1] - a.cu_q_lens[item.seq];
  const int64_t qpos = a.kv_lens[item.seq] - q_len + static_cast<int64_t>(item.tile) * a.tile_tokens;
  const int64_t begin = a.sliding_window > 0 ? std::max<int64_t>(0, qpos - a.sliding_window + 1) : 0;
  const int64_t n = std::min<int64_t>(kChunkKeys, a.kv_lens[item.seq] - begin);
  const int32_t* table = a.page_tables + static_cast<int64_t>(item.seq) * a.pages_per_seq;
  if (a.kv_type == kKvF32)
    prefetch_keys<float, 2>(a, table, item.kv_head, begin, n);
  else if (a.kv_type == kKvBf16)
    prefetch_keys<uint16_t, 2>(a, table, item.kv_head, begin, n);
  else  // int8 and fp8 rows: bytes
    prefetch_keys<uint8_t, 2>(a, table, item.kv_head, begin, n);
}

void attend(const PagedAttentionArgs& a, const WorkItem& item, Scratch& s) {
  const bool any = a.path == kAuto;
  const int64_t q_len = a.cu_q_lens[item.seq + 1] - a.cu_q_lens[item.seq];
  if (any && q_len - item.tile * a.tile_tokens <= kInPlaceMaxTokens && attend_avx2(a, item, s)) return;
  if ((any || a.path >= kAvx512) && attend_avx512(a, item, s)) return;
  if ((any || a.path >= kAvx2) && attend_avx2(a, item, s)) return;
  if (a.kv_type == kKvBf16)
    attend_portable<uint16_t>(a, item, s);
  else if (a.kv_type == kKvInt8)
    attend_portable<int8_t>(a, item, s);
  else if (a.kv_type == kKvFp8)
    attend_portable<uint8_t>(a, item, s);
  else
    attend_portable<float>(a, item, s);
}

// One item per (sequence, tile, kv head), longest first. Also checks what the items' loops
// rely on: each sequence's query rows lie inside q and its keys inside its page table.
ffi::Error make_work_items(const PagedAttentionArgs& a, std::vector<WorkItem>& items) {
  for (int32_t s = 0; s < a.num_seqs; ++s) {
    const int64_t q_len = a.cu_q_lens[s + 1] - a.cu_q_lens[s];
    if (q_len <= 0) continue;
    if (a.cu_q_lens[s] < 0 || a.cu_q_lens[s + 1] > a.num_tokens || a.kv_lens[s] < q_len ||
        a.kv_lens[s] > a.pages_per_seq * a.page_size)
      return ffi::Error::InvalidArgument("paged attention: inconsistent cu_q_lens / kv_lens");
    for (int64_t t = 0; t * a.tile_tokens < q_len; ++t) {
      const int64_t ctx = a.kv_lens[s] - q_len + std::min<int64_t>((t + 1) * a.tile_tokens, q_len);
      const int64_t cost = ctx * std::min<int64_t>(a.tile_tokens, q_len - t * a.tile_tokens) + 64;
      for (int64_t h = 0; h < a.num_kv_heads; ++h)
        items.push_back({s, static_cast<int32_t>(h), static_cast<int32_t>(t), cost});
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const WorkItem& x, const WorkItem& y) { return x.cost > y.cost; });
  return ffi::Error::Success();
}

// The table entries a sequence with queries uses must be valid page ids (no bounds checks
// inside); its kv_lens were checked by make_work_items. Sequences without queries are not read.
ffi::Error check_page_tables(const PagedAttentionArgs& a) {
  for (int32_t s = 0; s < a.num_seqs; ++s) {
    if (a.cu_q_lens[s + 1] <= a.cu_q_lens[s]) continue;
    const int64_t used = (a.kv_lens[s] + a.page_size - 1) / a.page_size;
    for (int64_t i = 0; i < used; ++i) {
      const int32_t page = a.page_tables[s * a.pages_per_seq + i];
      if (page < 0 || page >= a.num_pages)
        return ffi::Error::InvalidArgument("paged attention: page table holds an invalid page id");
    }
  }
  return ffi::Error::Success();
}

ffi::Error PagedAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_pages,
                              ffi::AnyBuffer v_pages, ffi::Buffer<ffi::S32> kv_lens,
                              ffi::Buffer<ffi::S32> page_tables, ffi::Buffer<ffi::S32> cu_q_lens,
                              ffi::Buffer<ffi::S32> num_seqs, ffi::ResultBuffer<ffi::F32> out,
                              float sm_scale, int32_t sliding_window, float soft_cap, int32_t path,
                              int32_t causal) {
  const auto qd = q.dimensions();
  const auto kd = k_pages.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || page_tables.dimensions().size() != 2)
    return ffi::Error::InvalidArgument("paged attention: bad ranks");
  const auto kv = k_pages.element_type();
  const bool quantized = kv == ffi::S8 || kv == ffi::U8;
  if (kv != v_pages.element_type() || (kv != ffi::U16 && kv != ffi::F32 && !quantized) ||
      v_pages.dimensions().size() != 4 || v_pages.element_count() != k_pages.element_count())
    return ffi::Error::InvalidArgument("paged attention: pages must both be u16 (bf16 bits), f32, s8 or u8 (fp8 bits), alike");
  if (kd[3] != qd[2] + (quantized ? 4 : 0))
    return ffi::Error::InvalidArgument("paged attention: a cache row must be head_dim wide (int8, fp8: head_dim + 4)");
  if (kd[0] <= 0 || kd[2] <= 0 || qd[1] <= 0 || qd[2] <= 0)
    return ffi::Error::InvalidArgument("paged attention: needs kv heads, page size, q heads and head_dim > 0");
  PagedAttentionArgs a;
  a.q = q.typed_data();
  a.k_pages = k_pages.untyped_data();
  a.v_pages = v_pages.untyped_data();
  a.kv_lens = kv_lens.typed_data();
  a.page_tables = page_tables.typed_data();
  a.cu_q_lens = cu_q_lens.typed_data();
  a.out = out->typed_data();
  a.num_seqs = std::min<int64_t>(num_seqs.typed_data()[0], kv_lens.dimensions()[0]);
  if (cu_q_lens.dimensions().size() != 1 || cu_q_lens.dimensions()[0] < a.num_seqs + 1 ||
      page_tables.dimensions()[0] < a.num_seqs)
    return ffi::Error::InvalidArgument("paged attention: cu_q_lens / page_tables shorter than num_seqs");
  a.num_tokens = qd[0];
  a.num_q_heads = qd[1];
  a.head_dim = qd[2];
  a.num_kv_heads = kd[0];
  a.num_pages = kd[1];
  a.page_size = kd[2];
  a.pages_per_seq = page_tables.dimensions()[1];
  a.kv_type = kv == ffi::U16 ? kKvBf16 : kv == ffi::S8 ? kKvInt8 : kv == ffi::U8 ? kKvFp8 : kKvF32;
  a.row_stride = kd[3];
  a.sm_scale = sm_scale;
  a.soft_cap = soft_cap;
  a.sliding_window = sliding_window;
  a.causal = causal;
  if (!causal && sliding_window > 0)
    return ffi::Error::InvalidArgument("paged attention: a sliding window needs causal attention");
  if (!path_ok(path))
    return ffi::Error::InvalidArgument("paged attention: this build has no such kernel path");
  a.path = path;
  a.q_heads_per_kv_head = a.num_q_heads / a.num_kv_heads;
  if (a.head_dim > kMaxHeadDim || a.q_heads_per_kv_head > kMaxRows || a.num_q_heads % a.num_kv_heads)
    return ffi::Error::InvalidArgument(
        "paged attention: needs head_dim <= 256 and q_heads a multiple of kv_heads, at most 64 per kv head");
  a.tile_tokens = std::min<int64_t>(kMaxTileTokens, kMaxRows / a.q_heads_per_kv_head);

  // Zero the padding rows (real rows are written by their items).
  const int64_t row_floats = a.num_q_heads * a.head_dim;
  const int64_t real_tokens =
      a.num_seqs > 0 ? std::clamp<int64_t>(a.cu_q_lens[a.num_seqs], 0, a.num_tokens) : 0;
  std::memset(a.out + real_tokens * row_floats, 0, (a.num_tokens - real_tokens) * row_floats * sizeof(float));
  std::vector<WorkItem> items;
  if (ffi::Error err = make_work_items(a, items); err.failure()) return err;
  if (ffi::Error err = check_page_tables(a); err.failure()) return err;
  // A thread takes a few consecutive items at a time and prefetches each next one's first keys
  // while the current one runs (within an item, each chunk prefetches the next).
  const int64_t n = static_cast<int64_t>(items.size());
  const int64_t per = std::clamp<int64_t>(n / (8 * std::max<int64_t>(1, pool.num_threads())), 1, kItemsPerClaim);
  parallel_for<Scratch>(pool, (n + per - 1) / per, [&](int64_t g, Scratch& scratch) {
    const int64_t end = std::min(n, (g + 1) * per);
    for (int64_t i = g * per; i < end; ++i) {
      if (i + 1 < end) prefetch_first_chunk(a, items[i + 1]);
      attend(a, items[i], scratch);
    }
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxllm

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmPagedAttentionCpu, jaxllm::PagedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::AnyBuffer>()         // k_pages
                                  .Arg<ffi::AnyBuffer>()         // v_pages
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // page_tables
                                  .Arg<ffi::Buffer<ffi::S32>>()  // cu_q_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // num_seqs
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out
                                  .Attr<float>("sm_scale")
                                  .Attr<int32_t>("sliding_window")
                                  .Attr<float>("soft_cap")
                                  .Attr<int32_t>("path")
                                  .Attr<int32_t>("causal"));

// The kernel paths this library was built with (bit p: KernelPath p), for tests and benchmarks.
extern "C" int32_t JaxllmKernelPaths() { return jaxllm::built_paths(); }
