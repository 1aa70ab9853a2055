// y [M, N] = x [M, K] @ w, f32, with w packed once at load time (`pack_weight` in native.py)
// into panels of 16 columns: w_packed [N / 16, K, 16], panel p holding columns 16p .. 16p + 15
// of w, row k of the panel the 16 weights that multiply x[:, k]. Quantized weights (int8 or
// int4 codes in the same panels) are in gemm_quant.cc.
//
// Why: XLA:CPU hands each f32 dot to YNNPACK, which repacks the whole weight matrix on every
// call. At decode batch sizes that repacking is most of the dot's time (a [8, 576] x [576,
// 3072] dot ran at 40 GFLOP/s on Zen 3 against 175 at M = 512). Here the panel is the packed
// form, read once per block of up to kRowChunk rows of x.
//
// Only the first `rows` rows of x are multiplied (a runtime scalar: the step's real tokens, or
// the rows that sample); the rest of y is zeros, so a bucket's padding costs no GEMM work.
//
// Work items are (chunk of up to kRowChunk rows, group of panels), shared over the caller and
// XLA's intra-op pool (parallel_for.h). Inside an item, each panel is swept by blocks of up to
// 6 rows: 6 x 16 accumulators in 12 AVX2 registers, one broadcast of x and two loads of the
// panel per k (the AVX2 + FMA path; AVX-512 CPUs run it too). Without AVX2 (or with `path`
// forcing it, for tests) a portable loop over the same layout runs.

#pragma once

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

constexpr int64_t kPanel = 16;     // columns per panel
constexpr int64_t kRowChunk = 96;  // rows of x per work item (a multiple of 6)

struct GemmArgs {
  const float* x;  // [M, K]
  const float* w;  // [N / 16, K, 16]
  float* y;        // [M, N]
  int64_t M, K, N;
};

// The weights a thread multiplies next, asked into L2 while it multiplies the current ones.
// A block of rows asks for its panels faster than memory brings them, so the first block of a
// panel waits on memory while the next blocks, finding the panel in L2, leave memory idle: the
// two took about the sum of their times. Here every kPrefetchSegment k-steps of every block
// ask for an equal share (`lines`) of the next panels' lines: one range of `len` bytes at
// at[0], or two of that length (gate and up panels). Threads claim their next work item ahead
// (run_panel_groups) to know which panels come next. On Zen 4 (the model's four
// layer GEMMs over 30 layers of distinct weights, and its LM head, through the FFI, alternating
// with the code before, two or three runs each): the f32 GEMM took 0.76-0.78x the time at 4-6
// rows, 0.64-0.68x at 8, 0.69-0.86x at 16, 0.81x at 32, 0.89x at 64 and 0.95x at 128 (1-2 rows
// within noise); the bf16 GEMM 0.87x at 12 rows, 0.88x at 16, 0.91x at 24 and 0.96x at 32, its
// LM head 0.77x, 0.85x and 0.90x at 12, 16 and 24; the W8A8 GEMM (gemm_w8a8.cc) 0.87x at 12 and
// 16 rows, 0.93x at 32 and 0.97x at 64-128.
struct Prefetcher {
  const char* at[2] = {nullptr, nullptr};
  int64_t len = 0, off = 0, lines = 0;  // off: bytes asked for so far
  // `lines` for `segments` more segments to ask for the rest.
  void spread(int64_t segments) { lines = ((len - off) / 64 + segments - 1) / std::max<int64_t>(1, segments); }
};
constexpr int64_t kPrefetchSegment = 16;  // k-steps between two bursts of prefetches

// A kernel's copy of a Prefetcher (nullptr: none) in locals: through the Prefetcher itself, every
// prefetch would wait on the store of the last one's `off`. Give the progress back with done().
struct PrefetchStream {
  const char* at0;
  const char* at1;
  int64_t off, len, burst;
  explicit PrefetchStream(const Prefetcher* pf)
      : at0(pf ? pf->at[0] : nullptr), at1(pf ? pf->at[1] : nullptr), off(pf ? pf->off : 0),
        len(pf ? pf->len : 0), burst(pf ? 64 * pf->lines : 0) {}
  // One burst: `burst` more bytes of each range.
  void next() {
    for (const int64_t stop = std::min(len, off + burst); off < stop; off += 64) {
      __builtin_prefetch(at0 + off, 0, 2);  // prefetcht1: into L2
      if (at1) __builtin_prefetch(at1 + off, 0, 2);
    }
  }
  void done(Prefetcher* pf) const {
    if (pf) pf->off = off;
  }
};

#ifdef JAXLLM_AVX2
// y rows [r, r + R), columns [col, col + 16): R x 2 vectors of sums over all K, in registers
// (the arguments are plain locals so the compiler keeps them there).
template <int R>
inline void panel_rows(const float* __restrict x, const float* __restrict panel, float* __restrict y, int64_t K,
                       int64_t ldy, Prefetcher* pf) {
  // Fully unrolled over the rows: GCC otherwise mirrors the sums to the stack every k.
  __m256 acc0[R], acc1[R];
#pragma GCC unroll 6
  for (int i = 0; i < R; ++i) acc0[i] = acc1[i] = _mm256_setzero_ps();
  PrefetchStream next_weights(pf);
  for (int64_t k0 = 0; k0 < K; k0 += kPrefetchSegment) {
    next_weights.next();
    for (int64_t k = k0, k1 = std::min(K, k0 + kPrefetchSegment); k < k1; ++k) {
      const __m256 b0 = _mm256_loadu_ps(panel + k * kPanel), b1 = _mm256_loadu_ps(panel + k * kPanel + 8);
#pragma GCC unroll 6
      for (int i = 0; i < R; ++i) {
        const __m256 a = _mm256_broadcast_ss(x + i * K + k);
        acc0[i] = _mm256_fmadd_ps(a, b0, acc0[i]);
        acc1[i] = _mm256_fmadd_ps(a, b1, acc1[i]);
      }
    }
  }
  next_weights.done(pf);
#pragma GCC unroll 6
  for (int i = 0; i < R; ++i) {
    _mm256_storeu_ps(y + i * ldy, acc0[i]);
    _mm256_storeu_ps(y + i * ldy + 8, acc1[i]);
  }
}

// `pf` (the next panel's Prefetcher) with its `lines` set is used as it is; unset, it is
// spread over this call's blocks (with a single block too: its panel stream alone left memory
// idle part of the time, and 4-6 rows took 0.76-0.78x the time with it).
void panel_block_avx2(const GemmArgs& g, const float* panel, int64_t p, int64_t r0, int64_t r1, Prefetcher* pf) {
  const int64_t K = g.K, N = g.N;
  if (pf && pf->lines == 0) {
    pf->spread((r1 - r0 + 5) / 6 * ((K + kPrefetchSegment - 1) / kPrefetchSegment));
  }
  int64_t r = r0;
  for (; r + 6 <= r1; r += 6) panel_rows<6>(g.x + r * K, panel, g.y + r * N + p * kPanel, K, N, pf);
  const float* x = g.x + r * K;
  float* y = g.y + r * N + p * kPanel;
  switch (r1 - r) {
    case 5: panel_rows<5>(x, panel, y, K, N, pf); break;
    case 4: panel_rows<4>(x, panel, y, K, N, pf); break;
    case 3: panel_rows<3>(x, panel, y, K, N, pf); break;
    case 2: panel_rows<2>(x, panel, y, K, N, pf); break;
    case 1: panel_rows<1>(x, panel, y, K, N, pf); break;
  }
}
#endif  // JAXLLM_AVX2

// Portable: one row at a time, the 16 sums in an array the compiler can keep in vectors.
void panel_block_portable(const GemmArgs& g, const float* panel, int64_t p, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    float acc[kPanel] = {};
    const float* x = g.x + r * g.K;
    for (int64_t k = 0; k < g.K; ++k)
      for (int64_t j = 0; j < kPanel; ++j) acc[j] += x[k] * panel[k * kPanel + j];
    for (int64_t j = 0; j < kPanel; ++j) g.y[r * g.N + p * kPanel + j] = acc[j];
  }
}

// y[r0 .. r1 - 1, panel p's columns] from `panel` (g.w's panel p, or a dequantized copy of
// it), on the widest path allowed (a KernelPath, as for attention); `pf` as panel_block_avx2's.
void panel_block(const GemmArgs& g, const float* panel, int64_t p, int64_t r0, int64_t r1, int32_t path,
                 Prefetcher* pf = nullptr) {
#ifdef JAXLLM_AVX2
  if (path == kAuto || path >= kAvx2) return panel_block_avx2(g, panel, p, r0, r1, pf);
#endif
  panel_block_portable(g, panel, p, r0, r1);
}

// ------------------------------------------------------------------ SwiGLU epilogue (swiglu = 1)
// w is a gated MLP's gate and up halves side by side ([K, 2I]: gate columns, then up columns,
// panels 0 .. I/16 - 1 and I/16 .. 2I/16 - 1), and y [M, I] = silu(x @ gate) * (x @ up): for
// each block of up to 6 rows, the gate panel's and the up panel's sums go to two small
// buffers in L1, then the epilogue writes y. No [M, 2I] intermediate, and no separate pass
// of XLA's (exp, divide) fusion over it.

// silu(g) * u, 8 wide: silu(g) = g / (1 + e^-g), computed as g * (g >= 0 ? 1 : e) / (1 + e)
// with e = e^-|g|, so that exp_f32x8 only ever sees x <= 0.
#ifdef JAXLLM_AVX2
inline __m256 swiglu_f32x8(__m256 g, __m256 u) {
  const __m256 e = exp_f32x8(_mm256_or_ps(g, _mm256_set1_ps(-0.f)));  // the sign bit set: -|g|
  const __m256 num = _mm256_blendv_ps(e, _mm256_set1_ps(1.f), _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_GE_OQ));
  return _mm256_mul_ps(_mm256_div_ps(_mm256_mul_ps(g, num), _mm256_add_ps(_mm256_set1_ps(1.f), e)), u);
}
#endif

inline float swiglu_f32(float g, float u) { return g / (1.f + std::exp(-g)) * u; }

// y[i][0 .. 15] = silu(tg[i]) * tu[i] for R rows of 16 (row stride ldy).
void swiglu_store(const float* tg, const float* tu, float* y, int64_t ldy, int64_t R, int32_t path) {
  int64_t i = 0;
#ifdef JAXLLM_AVX2
  if (path == kAuto || path >= kAvx2) {
    for (; i < R * kPanel; i += 8) {
      const __m256 out = swiglu_f32x8(_mm256_loadu_ps(tg + i), _mm256_loadu_ps(tu + i));
      _mm256_storeu_ps(y + (i / kPanel) * ldy + i % kPanel, out);
    }
  }
#endif
  for (; i < R * kPanel; ++i) y[(i / kPanel) * ldy + i % kPanel] = swiglu_f32(tg[i], tu[i]);
}

// y rows [r0, r1), output panel p's 16 columns (y [M, N / 2]), from f32 panels `gate` and `up`
// (g.w's panels p and p + N / 32, or their dequantized copies); `pf`: the next pair's
// Prefetcher, spread over every block.
void swiglu_block(const GemmArgs& g, const float* gate, const float* up, int64_t p, int64_t r0, int64_t r1,
                  int32_t path, Prefetcher* pf = nullptr) {
  const int64_t K = g.K, ldy = g.N / 2;
  if (pf) pf->spread(2 * ((r1 - r0 + 5) / 6) * ((K + kPrefetchSegment - 1) / kPrefetchSegment));
  alignas(64) float tg[6 * kPanel], tu[6 * kPanel];
  for (int64_t r = r0; r < r1; r += 6) {
    const int64_t R = std::min<int64_t>(6, r1 - r);
    const GemmArgs tmp_g{g.x + r * K, nullptr, tg, R, K, kPanel}, tmp_u{g.x + r * K, nullptr, tu, R, K, kPanel};
    panel_block(tmp_g, gate, 0, 0, R, path, pf);
    panel_block(tmp_u, up, 0, 0, R, path, pf);
    swiglu_store(tg, tu, g.y + r * ldy + p * kPanel, ldy, R, path);
  }
}

// Work items of a [M, K] x [K, N] product: (chunk of up to kRowChunk rows, group of panels),
// about 24 per thread, each at least one panel (a multiple of `granule` panels, but for the
// last group); item i covers rows [r0, r1) and panels [p0, p1).
// (24 rather than 8 took 2-4% off the model's GEMMs on family 23: a shorter tail where one
// thread waits for the other's last item; 64 was slower again.)
struct GemmItems {
  int64_t panels, row_chunks, per_item, count;
  GemmItems(int64_t M, int64_t N, int64_t threads, int64_t granule = 1) {
    panels = N / kPanel;
    row_chunks = (M + kRowChunk - 1) / kRowChunk;
    per_item = std::max<int64_t>(1, panels * row_chunks / (24 * std::max<int64_t>(1, threads)));
    per_item = (per_item + granule - 1) / granule * granule;
    count = (panels + per_item - 1) / per_item * row_chunks;
  }
  void bounds(int64_t item, int64_t M, int64_t& r0, int64_t& r1, int64_t& p0, int64_t& p1) const {
    const int64_t chunk = item % row_chunks, group = item / row_chunks;
    r0 = chunk * kRowChunk;
    r1 = std::min(M, r0 + kRowChunk);
    p0 = group * per_item;
    p1 = std::min(panels, p0 + per_item);
  }
};

// An item's output panels as groups of up to `widest` panels: of 4, then 2, then 1 (with swiglu
// of 2, then 1, each with its up panels).
struct PanelGroups {
  int64_t r0 = 0, r1 = 0, p0 = 0, n4 = 0, n2 = 0, count = 0;
  PanelGroups() = default;
  PanelGroups(const GemmItems& items, int64_t item, int64_t M, bool swiglu, int64_t widest) {
    int64_t p1;
    items.bounds(item, M, r0, r1, p0, p1);
    const int64_t n = p1 - p0;
    n4 = widest >= 4 && !swiglu ? n / 4 : 0;
    n2 = widest >= 2 ? (n - 4 * n4) / 2 : 0;
    count = n - 3 * n4 - n2;
  }
  // Group i's first output panel and width.
  void at(int64_t i, int64_t& p, int64_t& width) const {
    if (i < n4) {
      p = p0 + 4 * i, width = 4;
    } else if (i < n4 + n2) {
      p = p0 + 4 * n4 + 2 * (i - n4), width = 2;
    } else {
      p = p0 + 4 * n4 + 2 * n2 + (i - n4 - n2), width = 1;
    }
  }
};

// Runs run(p, width, r0, r1, pf) for every group of panels of every item, on the calling thread
// and the pool. `pf` asks for the weights of the group the same thread runs next, in this item or
// the one it claimed (nullptr after its last): output panel p's weights lie at w + p *
// panel_bytes, and with swiglu its up panel's N / 32 panels further.
template <typename Fn>
void run_panel_groups(ffi::ThreadPool& pool, const GemmItems& items, int64_t M, int64_t N, bool swiglu,
                      int64_t widest, const void* w, int64_t panel_bytes, Fn run) {
  const char* base = static_cast<const char*>(w);
  const int64_t up = N / 2 / kPanel * panel_bytes;
  parallel_for_claiming_ahead(pool, items.count, [&](int64_t item, int64_t ahead) {
    const PanelGroups cur(items, item, M, swiglu, widest);
    const PanelGroups next = ahead >= 0 ? PanelGroups(items, ahead, M, swiglu, widest) : PanelGroups();
    for (int64_t i = 0; i < cur.count; ++i) {
      int64_t p, width, next_p = -1, next_width = 0;
      cur.at(i, p, width);
      if (i + 1 < cur.count) {
        cur.at(i + 1, next_p, next_width);
      } else if (next.count > 0) {
        next.at(0, next_p, next_width);
      }
      Prefetcher pf;
      if (next_p >= 0) {
        pf.at[0] = base + next_p * panel_bytes;
        pf.at[1] = swiglu ? pf.at[0] + up : nullptr;
        pf.len = next_width * panel_bytes;
      }
      run(p, width, cur.r0, cur.r1, next_p >= 0 ? &pf : nullptr);
    }
  });
}

// The rows to compute: the `rows` input clamped to [0, M]; y's rows past them are zeroed.
int64_t live_rows(ffi::Buffer<ffi::S32> rows, int64_t M, int64_t N, float* y) {
  const int64_t live = rows.element_count() ? std::clamp<int64_t>(rows.typed_data()[0], 0, M) : M;
  std::memset(y + live * N, 0, (M - live) * N * sizeof(float));
  return live;
}

ffi::Error MatmulPackedImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                            ffi::Buffer<ffi::S32> rows, ffi::ResultBuffer<ffi::F32> y, int32_t path, int32_t swiglu) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || wd[2] != kPanel || wd[1] != xd[1] || (swiglu && wd[0] % 2))
    return ffi::Error::InvalidArgument("matmul_packed: needs x [M, K] and w [N / 16, K, 16] (N / 16 even for swiglu)");
  if (!path_ok(path))
    return ffi::Error::InvalidArgument("matmul_packed: this build has no such kernel path");
  GemmArgs g{x.typed_data(), w.typed_data(), y->typed_data(), xd[0], xd[1], wd[0] * kPanel};
  g.M = live_rows(rows, g.M, swiglu ? g.N / 2 : g.N, g.y);
  // With the epilogue, the items split the I / 16 panel pairs (their output panels). While a
  // panel (pair) runs, the next one this thread runs comes into L2 (Prefetcher).
  const GemmItems items(g.M, swiglu ? g.N / 2 : g.N, pool.num_threads());
  const int64_t up = g.N / 2 / kPanel, panel_floats = g.K * kPanel;
  const auto run_panel = [&](int64_t p, int64_t, int64_t r0, int64_t r1, Prefetcher* pf) {
    const float* w = g.w + p * panel_floats;
    if (swiglu)
      swiglu_block(g, w, w + up * panel_floats, p, r0, r1, path, pf);
    else
      panel_block(g, w, p, r0, r1, path, pf);
  };
  run_panel_groups(pool, items, g.M, g.N, swiglu, 1, g.w, panel_floats * 4, run_panel);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxllm

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmMatmulPackedCpu, jaxllm::MatmulPackedImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w_packed
                                  .Arg<ffi::Buffer<ffi::S32>>()  // rows: [] or [1], or empty for all
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y
                                  .Attr<int32_t>("path")
                                  .Attr<int32_t>("swiglu"));  // 1: y = silu(gate) * up (see swiglu_block)
