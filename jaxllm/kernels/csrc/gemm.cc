// y [M, N] = x [M, K] @ w, f32, with w packed once at load time (`pack_weight` in native.py)
// into panels of 16 columns: w_packed [N / 16, K, 16], panel p holding columns 16p .. 16p + 15
// of w, row k of the panel the 16 weights that multiply x[:, k].
//
// Why: XLA:CPU hands each f32 dot to YNNPACK, which repacks the whole weight matrix on every
// call. At decode batch sizes that repacking is most of the dot's time (a [8, 576] x [576,
// 3072] dot ran at 40 GFLOP/s on Zen 3 against 175 at M = 512). Here the panel is the packed
// form, read once per block of up to kRowChunk rows of x.
//
// Work items are (chunk of up to kRowChunk rows, group of panels), shared over the caller and
// XLA's intra-op pool (parallel_for.h). Inside an item, each panel is swept by blocks of up to
// 6 rows: 6 x 16 accumulators in 12 AVX2 registers, one broadcast of x and two loads of the
// panel per k (the AVX2 + FMA path; AVX-512 CPUs run it too). Without AVX2 (or with `path`
// forcing it, for tests) a portable loop over the same layout runs.

#include <algorithm>
#include <cstdint>

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

#ifdef JAXLLM_AVX2
// y rows [r, r + R), columns [col, col + 16): R x 2 vectors of sums over all K, in registers
// (the arguments are plain locals so the compiler keeps them there).
template <int R>
inline void panel_rows(const float* __restrict x, const float* __restrict panel, float* __restrict y, int64_t K,
                       int64_t ldy) {
  // Fully unrolled over the rows: GCC otherwise mirrors the sums to the stack every k.
  __m256 acc0[R], acc1[R];
#pragma GCC unroll 6
  for (int i = 0; i < R; ++i) acc0[i] = acc1[i] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m256 b0 = _mm256_loadu_ps(panel + k * kPanel), b1 = _mm256_loadu_ps(panel + k * kPanel + 8);
#pragma GCC unroll 6
    for (int i = 0; i < R; ++i) {
      const __m256 a = _mm256_broadcast_ss(x + i * K + k);
      acc0[i] = _mm256_fmadd_ps(a, b0, acc0[i]);
      acc1[i] = _mm256_fmadd_ps(a, b1, acc1[i]);
    }
  }
#pragma GCC unroll 6
  for (int i = 0; i < R; ++i) {
    _mm256_storeu_ps(y + i * ldy, acc0[i]);
    _mm256_storeu_ps(y + i * ldy + 8, acc1[i]);
  }
}

void panel_block_avx2(const GemmArgs& g, int64_t p, int64_t r0, int64_t r1) {
  const float* panel = g.w + p * g.K * kPanel;
  const int64_t K = g.K, N = g.N;
  int64_t r = r0;
  for (; r + 6 <= r1; r += 6) panel_rows<6>(g.x + r * K, panel, g.y + r * N + p * kPanel, K, N);
  const float* x = g.x + r * K;
  float* y = g.y + r * N + p * kPanel;
  switch (r1 - r) {
    case 5: panel_rows<5>(x, panel, y, K, N); break;
    case 4: panel_rows<4>(x, panel, y, K, N); break;
    case 3: panel_rows<3>(x, panel, y, K, N); break;
    case 2: panel_rows<2>(x, panel, y, K, N); break;
    case 1: panel_rows<1>(x, panel, y, K, N); break;
  }
}
#endif  // JAXLLM_AVX2

// Portable: one row at a time, the 16 sums in an array the compiler can keep in vectors.
void panel_block_portable(const GemmArgs& g, int64_t p, int64_t r0, int64_t r1) {
  const float* panel = g.w + p * g.K * kPanel;
  for (int64_t r = r0; r < r1; ++r) {
    float acc[kPanel] = {};
    const float* x = g.x + r * g.K;
    for (int64_t k = 0; k < g.K; ++k)
      for (int64_t j = 0; j < kPanel; ++j) acc[j] += x[k] * panel[k * kPanel + j];
    for (int64_t j = 0; j < kPanel; ++j) g.y[r * g.N + p * kPanel + j] = acc[j];
  }
}

// y[r0 .. r1 - 1, panel p's columns], on the widest path allowed (a KernelPath, as for attention).
void panel_block(const GemmArgs& g, int64_t p, int64_t r0, int64_t r1, int32_t path) {
#ifdef JAXLLM_AVX2
  if (path == kAuto || path >= kAvx2) return panel_block_avx2(g, p, r0, r1);
#endif
  panel_block_portable(g, p, r0, r1);
}

ffi::Error MatmulPackedImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                            ffi::ResultBuffer<ffi::F32> y, int32_t path) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || wd[2] != kPanel || wd[1] != xd[1])
    return ffi::Error::InvalidArgument("matmul_packed: needs x [M, K] and w [N / 16, K, 16]");
  if (path < kAuto || path > kAvx512 || (path != kAuto && !(built_paths() & (1 << path))))
    return ffi::Error::InvalidArgument("matmul_packed: this build has no such kernel path");
  GemmArgs g{x.typed_data(), w.typed_data(), y->typed_data(), xd[0], xd[1], wd[0] * kPanel};
  const int64_t panels = wd[0];
  const int64_t row_chunks = (g.M + kRowChunk - 1) / kRowChunk;
  // About 8 items per thread, each at least one panel.
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t per_item = std::max<int64_t>(1, panels * row_chunks / (8 * threads));
  const int64_t groups = (panels + per_item - 1) / per_item;
  parallel_for(pool, groups * row_chunks, [&](int64_t item) {
    const int64_t chunk = item % row_chunks, group = item / row_chunks;
    const int64_t r0 = chunk * kRowChunk, r1 = std::min(g.M, r0 + kRowChunk);
    const int64_t p1 = std::min(panels, (group + 1) * per_item);
    for (int64_t p = group * per_item; p < p1; ++p) panel_block(g, p, r0, r1, path);
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxllm

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmMatmulPackedCpu, jaxllm::MatmulPackedImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w_packed
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y
                                  .Attr<int32_t>("path"));
