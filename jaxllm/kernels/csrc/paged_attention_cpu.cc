// Ragged paged attention for XLA:CPU, as an XLA FFI custom call.
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
#include <memory>
#include <mutex>
#include <vector>

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

template <typename KV>
void run_item(const Problem& p, const Item& item, float* kbuf, float* kt, float* vbuf) {
  const int64_t D = p.head_dim, G = p.num_q_heads / p.num_kv_heads;
  const int32_t s = item.seq;
  const int64_t q_start = p.cu_q_lens[s], q_len = p.cu_q_lens[s + 1] - q_start;
  const int64_t kv_len = p.kv_lens[s];
  const int64_t t0 = static_cast<int64_t>(item.tile) * p.tile_tokens;
  const int64_t ntok = std::min<int64_t>(p.tile_tokens, q_len - t0);
  const int M = static_cast<int>(ntok * G);
  const int32_t* table = p.block_tables + static_cast<int64_t>(s) * p.pages_per_seq;
  const KV* kp = static_cast<const KV*>(p.k_pages);
  const KV* vp = static_cast<const KV*>(p.v_pages);

  // Row r = (token r / G, query head kv_head * G + r % G).
  alignas(64) float qrow[kMaxRows][kMaxHeadDim];
  alignas(64) float acc[kMaxRows][kMaxHeadDim];
  alignas(64) float sc[kMaxRows][kChunkKeys];
  float m[kMaxRows], l[kMaxRows];
  int64_t qpos[kMaxRows];
  for (int r = 0; r < M; ++r) {
    const int64_t tok = q_start + t0 + r / G, head = item.kv_head * G + r % G;
    const float* src = p.q + (tok * p.num_q_heads + head) * D;
    for (int64_t d = 0; d < D; ++d) qrow[r][d] = src[d] * p.sm_scale;
    for (int64_t d = 0; d < D; ++d) acc[r][d] = 0.f;
    m[r] = kNegInf;
    l[r] = 0.f;
    qpos[r] = kv_len - q_len + t0 + r / G;
  }
  const int64_t last_pos = qpos[M - 1];
  int64_t begin = 0;
  if (p.sliding_window > 0) begin = std::max<int64_t>(0, qpos[0] - p.sliding_window + 1);
  begin -= begin % p.page_size;

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
  for (int r = 0; r < M; ++r) {
    const int64_t tok = q_start + t0 + r / G, head = item.kv_head * G + r % G;
    float* dst = p.out + (tok * p.num_q_heads + head) * D;
    const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
    for (int64_t d = 0; d < D; ++d) dst[d] = acc[r][d] * inv;
  }
}

// Shared by the caller and the pool tasks; pool tasks may start after the call returned
// (XLA gives no guarantee they run in parallel, or at all before the caller finishes), so
// they own a reference and touch nothing else.
struct Work {
  Problem problem;
  std::vector<Item> items;
  bool bf16;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::mutex mu;
  std::condition_variable cv;

  void drain() {
    std::vector<float> scratch(2 * kChunkKeys * kMaxHeadDim + kChunkKeys * kMaxHeadDim);
    float* kbuf = scratch.data();
    float* vbuf = kbuf + kChunkKeys * kMaxHeadDim;
    float* kt = vbuf + kChunkKeys * kMaxHeadDim;
    const int64_t total = static_cast<int64_t>(items.size());
    for (int64_t i; (i = next.fetch_add(1)) < total;) {
      if (bf16)
        run_item<uint16_t>(problem, items[i], kbuf, kt, vbuf);
      else
        run_item<float>(problem, items[i], kbuf, kt, vbuf);
      if (done.fetch_add(1) + 1 == total) {
        std::lock_guard<std::mutex> lock(mu);
        cv.notify_all();
      }
    }
  }
};

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
  auto work = std::make_shared<Work>();
  Problem& p = work->problem;
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
  work->bf16 = k_pages.element_type() == ffi::U16;
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
        work->items.push_back({s, static_cast<int32_t>(h), static_cast<int32_t>(t), cost});
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
  std::stable_sort(work->items.begin(), work->items.end(),
                   [](const Item& a, const Item& b) { return a.cost > b.cost; });
  const int64_t total = static_cast<int64_t>(work->items.size());
  if (total == 0) return ffi::Error::Success();

  const int64_t helpers = std::min<int64_t>(pool.num_threads(), total) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { work->drain(); });
  work->drain();
  std::unique_lock<std::mutex> lock(work->mu);
  work->cv.wait(lock, [&] { return work->done.load() == total; });
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
