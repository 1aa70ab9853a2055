// y [M, N] f32 = y_in + per row r, (x[r] @ a[s]) @ b[s] with s = token_slots[r] (nothing where
// s < 0): multi-LoRA's products (jaxllm/lora/layers.py), each row against its own adapter only,
// added to the base layer's output in place.
//
// Why: XLA's way (every slot's `x a`, masked per row, then every slot's `b`) multiplies each row
// by all `num_slots` adapters. Here the rows are grouped by slot (a counting sort), and each
// group runs the packed GEMMs of gemm.cc / gemm_bf16.cc against its own adapter's panels:
// num_slots times less work, the same numbers (each product is a row of the same sums).
//
// Layouts (`pack_weight`'s panels):
//   a  [S * W / 16, K, 16] f32 or [S * W / 16, K / 2, 16, 2] bf16: slot s's [K, W] is panels
//      [s W / 16, (s + 1) W / 16)
//   b  [N / 16, S * width, 16] f32 or [N / 16, S * width / 2, 16, 2] bf16: every slot's [width,
//      N] stacked along K, slot s's rows [s width, (s + 1) width) of each panel
//   panel_part [N / 16] int32: output panel p multiplies xa's columns [k width, (k + 1) width)
//      with k = panel_part[p] (W = parts x width: a fused matrix's blocks, lora/adapter.py)
// Rows past `rows` (a bucket's padding) are y_in's.
//
// `lora_shrink` stops after x a and lays it out for the GEMMs that add the second product as they
// make their sums (AMX's tiles, gemm_bf16.cc's LoraTerm): xa [parts, M, S * width] bf16, row r's
// part k in the columns of its slot, zeros elsewhere, so that xa's part k @ b's panel p is row
// r's own adapter's product. That saves lora_add's pass over y and keeps the GEMM's SwiGLU
// epilogue.

#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "gemm.cc"
#include "gemm_bf16.cc"
#include "parallel_for.h"
#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxllm {
namespace {

// The rows of each slot, in order: rows order[start[s] .. start[s + 1]) have slot s.
struct SlotGroups {
  std::vector<int64_t> order, start;
  SlotGroups(const int32_t* slots, int64_t live, int64_t S) : start(S + 1, 0) {
    for (int64_t r = 0; r < live; ++r)
      if (slots[r] >= 0 && slots[r] < S) ++start[slots[r] + 1];
    for (int64_t s = 0; s < S; ++s) start[s + 1] += start[s];
    order.resize(start[S]);
    std::vector<int64_t> next(start.begin(), start.end() - 1);
    for (int64_t r = 0; r < live; ++r)
      if (slots[r] >= 0 && slots[r] < S) order[next[slots[r]]++] = r;
  }
  int64_t size() const { return static_cast<int64_t>(order.size()); }
};

// Output panels [p0, p1) of a group's n rows: f32 panels (gemm.cc) or bf16 ones (gemm_bf16.cc,
// four panels a call where it can: they share x's loads). `x` holds the group's rows (f32, or bf16
// pairs as words), `w` the weight's panels [P, K, 16] (f32) or [P, K / 2, 16] words; y [n, ldy]
// gets panel p's 16 columns at 16 p.
void group_panels(bool bf16, const void* x, const void* w, float* y, int64_t n, int64_t K, int64_t ldy, int64_t p0,
                  int64_t p1, int32_t path) {
  if (!bf16) {
    const GemmArgs g{static_cast<const float*>(x), static_cast<const float*>(w), y, n, K, ldy};
    for (int64_t p = p0; p < p1; ++p) panel_block(g, g.w + p * K * kPanel, p, 0, n, path);
    return;
  }
  const Bf16GemmArgs g{static_cast<const uint32_t*>(x), static_cast<const uint32_t*>(w), y, n, K / 2, ldy};
  path = bf16_gemm_path(path, n);
  int64_t p = p0;
  for (; p + 4 <= p1; p += 4) bf16_output_panels<4>(g, p, 0, n, false, path);
  for (; p + 2 <= p1; p += 2) bf16_output_panels<2>(g, p, 0, n, false, path);
  for (; p < p1; ++p) bf16_output_panels<1>(g, p, 0, n, false, path);
}

// y[order[i], panels p0 .. p1) += xa[i] @ b for i in [r0, r1), accumulated in place: b's K (the
// rank) is small, so the product is bound by y's traffic, which this reads and writes once.
// f32: xa f32 [*, ldx], b f32 panels [P, width, 16]. bf16: xa as bf16 pairs (words) [*, ldx / 2],
// b [P, width / 2, 16] words. Four rows at a time against one panel, the sums in registers.
constexpr int kAccRows = 4;

template <bool BF16>
void accumulate_rows(const void* xa, int64_t ldx, const void* b, int64_t width, int64_t S, const int64_t* order,
                     int64_t r0, int64_t r1, float* y, int64_t N, int64_t p0, int64_t p1, int32_t path) {
  for (int64_t i = r0; i < r1; i += kAccRows) {
    const int rows = static_cast<int>(std::min<int64_t>(kAccRows, r1 - i));
    for (int64_t p = p0; p < p1; ++p) {
      float* out[kAccRows];
      for (int r = 0; r < rows; ++r) out[r] = y + order[i + r] * N + p * kPanel;
      if constexpr (BF16) {
        const int64_t KP = width / 2;
        const uint32_t* x = static_cast<const uint32_t*>(xa) + i * (ldx / 2);
        const uint32_t* w = static_cast<const uint32_t*>(b) + p * S * KP * kPanel;
#ifdef JAXLLM_AVX512_BF16
        if (path == kAuto || path >= kAvx512) {
          __m512 acc[kAccRows];
          for (int r = 0; r < rows; ++r) acc[r] = _mm512_loadu_ps(out[r]);
          for (int64_t kp = 0; kp < KP; ++kp) {
            const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + kp * kPanel);
            for (int r = 0; r < rows; ++r)
              acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r * (ldx / 2) + kp])), wv);
          }
          for (int r = 0; r < rows; ++r) _mm512_storeu_ps(out[r], acc[r]);
          continue;
        }
#endif
        for (int r = 0; r < rows; ++r)
          for (int64_t kp = 0; kp < KP; ++kp) {
            const uint32_t xw = x[r * (ldx / 2) + kp];
            const float x0 = to_f32(static_cast<uint16_t>(xw)), x1 = to_f32(static_cast<uint16_t>(xw >> 16));
            for (int j = 0; j < kPanel; ++j) {
              const uint32_t ww = w[kp * kPanel + j];
              out[r][j] += x0 * to_f32(static_cast<uint16_t>(ww)) + x1 * to_f32(static_cast<uint16_t>(ww >> 16));
            }
          }
      } else {
        const float* x = static_cast<const float*>(xa) + i * ldx;
        const float* w = static_cast<const float*>(b) + p * S * width * kPanel;
#ifdef JAXLLM_AVX2
        if (path == kAuto || path >= kAvx2) {
          __m256 lo[kAccRows], hi[kAccRows];
          for (int r = 0; r < rows; ++r) lo[r] = _mm256_loadu_ps(out[r]), hi[r] = _mm256_loadu_ps(out[r] + 8);
          for (int64_t k = 0; k < width; ++k) {
            const __m256 w0 = _mm256_loadu_ps(w + k * kPanel), w1 = _mm256_loadu_ps(w + k * kPanel + 8);
            for (int r = 0; r < rows; ++r) {
              const __m256 xv = _mm256_broadcast_ss(x + r * ldx + k);
              lo[r] = _mm256_fmadd_ps(xv, w0, lo[r]);
              hi[r] = _mm256_fmadd_ps(xv, w1, hi[r]);
            }
          }
          for (int r = 0; r < rows; ++r) _mm256_storeu_ps(out[r], lo[r]), _mm256_storeu_ps(out[r] + 8, hi[r]);
          continue;
        }
#endif
        for (int r = 0; r < rows; ++r)
          for (int64_t k = 0; k < width; ++k)
            for (int j = 0; j < kPanel; ++j) out[r][j] += x[r * ldx + k] * w[k * kPanel + j];
      }
    }
  }
}

#ifdef JAXLLM_AMX_BF16
// accumulate_rows<true> on AMX's tiles, for groups the x a GEMM ran on them too (bf16_gemm_path):
// blocks of 16 rows, tile 0 a block's sums for one panel (loaded from y, stored back), tile 1 its
// x a columns (16 rows x `chunk` k-pairs), tile 2 the panel's k-pairs. Rows of y in a block that
// are not consecutive (a decode step's mix of slots) pass through `sums`. One tile dot of 16 x 16
// x 2 chunk multiply-adds stands for 16 broadcasts and dots a row on AVX-512; the pass over y
// stays (the GEMMs that take a LoraTerm avoid it). KP = width / 2: at most 16 or a multiple of 16.
void accumulate_rows_amx(const uint16_t* xa, int64_t ldx, const uint32_t* b, int64_t width, int64_t S,
                         const int64_t* order, int64_t r0, int64_t r1, float* y, int64_t N, int64_t p0, int64_t p1) {
  const int64_t KP = width / 2, chunk = std::min<int64_t>(KP, 16);
  alignas(64) float sums[16][kPanel];
  int64_t configured = 0;
  for (int64_t i = r0; i < r1; i += 16) {
    const int64_t m = std::min<int64_t>(16, r1 - i);
    if (m != configured) {
      TileConfig c;
      c.rows[0] = c.rows[1] = static_cast<uint8_t>(m);
      c.rows[2] = static_cast<uint8_t>(chunk);
      c.colsb[0] = c.colsb[2] = 64;
      c.colsb[1] = static_cast<uint16_t>(chunk * 4);
      load_tile_config(c);
      configured = m;
    }
    const uint16_t* x = xa + i * ldx;
    const bool consecutive = order[i + m - 1] - order[i] == m - 1;
    if (KP == chunk) _tile_loadd(1, x, ldx * 2);
    for (int64_t p = p0; p < p1; ++p) {
      float* out = y + order[i] * N + p * kPanel;
      if (consecutive) {
        _tile_loadd(0, out, N * 4);
      } else {
        for (int64_t r = 0; r < m; ++r) std::memcpy(sums[r], y + order[i + r] * N + p * kPanel, sizeof sums[r]);
        __asm__ volatile("" ::: "memory");  // (GCC's tileloadd names no memory read: keep the copies before it)
        _tile_loadd(0, sums, 64);
      }
      const uint32_t* w = b + p * S * KP * kPanel;
      for (int64_t kp = 0; kp < KP; kp += chunk) {
        if (KP != chunk) _tile_loadd(1, x + 2 * kp, ldx * 2);
        _tile_loadd(2, w + kp * kPanel, 64);
        _tile_dpbf16ps(0, 1, 2);
      }
      if (consecutive) {
        _tile_stored(0, out, N * 4);
      } else {
        _tile_stored(0, sums, 64);
        for (int64_t r = 0; r < m; ++r) std::memcpy(y + order[i + r] * N + p * kPanel, sums[r], sizeof sums[r]);
      }
    }
  }
  _tile_release();
}
#endif

// Work items: (slot, output panels [p0, p1)), at most kLoraPanels panels each, never across a
// part of b (its panels multiply other columns of x a).
constexpr int64_t kLoraPanels = 16;
constexpr int64_t kLoraAloneMacs = int64_t{1} << 20;  // (~15 rows of the default model's MLP)
struct LoraItem {
  int64_t slot, p0, p1;
};
void add_items(std::vector<LoraItem>& items, const SlotGroups& groups, int64_t S, int64_t p0, int64_t p1) {
  for (int64_t s = 0; s < S; ++s)
    if (groups.start[s + 1] > groups.start[s])
      for (int64_t p = p0; p < p1; p += kLoraPanels) items.push_back({s, p, std::min(p1, p + kLoraPanels)});
}

// Runs fn(i) for i in [0, count): on this thread for small calls (a few rows: waking the pool
// costs more than it saves; on the default model with 4 adapters, a threshold of 1M
// multiply-adds ran the standard workload ~3% faster than 8M, and 64M 13% slower), else on the pool.
void run_items(ffi::ThreadPool& pool, int64_t macs, int64_t count, const std::function<void(int64_t)>& fn) {
  if (macs < kLoraAloneMacs) {
    for (int64_t i = 0; i < count; ++i) fn(i);
  } else {
    parallel_for(pool, count, fn);
  }
}

// The first product of the live rows that have a slot: `groups` of them, and xa [n, W] = each
// group's rows @ its slot's a (f32; for bf16 panels rounded to bf16 as b's GEMM rounds its x, the
// halves in xa's first n W * 2 bytes). The call's size for run_items: n (K W + row_macs) MACs.
// Scratch kept from call to call on XLA's calling thread; the pool's tasks reach it through
// references (a thread_local named inside them would be their own thread's).
struct Shrunk {
  SlotGroups groups;
  std::vector<float>& xa;
  int64_t n() const { return groups.size(); }
};

template <bool BF16>
Shrunk shrink(ffi::ThreadPool& pool, ffi::AnyBuffer x, const int32_t* token_slots, int64_t live, const void* a,
              int64_t S, int64_t W, int64_t row_macs, int32_t path) {
  static thread_local std::vector<float> xs_, xa_;
  static thread_local std::vector<LoraItem> items_;
  std::vector<float>& xs = xs_;
  std::vector<LoraItem>& items = items_;
  Shrunk out{SlotGroups(token_slots, live, S), xa_};
  const SlotGroups& groups = out.groups;
  const int64_t n = groups.size(), K = x.dimensions()[1], elem = BF16 ? 2 : 4, a_panels = W / kPanel;
  if (n == 0) return out;
  // x's rows, grouped by slot (x is f32, or bf16 already: copied as pairs of halves).
  xs.resize(BF16 ? (n * K + 1) / 2 : n * K);
  for (int64_t i = 0; i < n; ++i)
    std::memcpy(reinterpret_cast<char*>(xs.data()) + i * K * elem,
                static_cast<const char*>(x.untyped_data()) + groups.order[i] * K * elem, K * elem);
  const char* a_base = static_cast<const char*>(a);
  out.xa.resize(n * W);
  items.clear();
  add_items(items, groups, S, 0, a_panels);
  float* xa = out.xa.data();
  run_items(pool, n * (K * W + row_macs), static_cast<int64_t>(items.size()), [&](int64_t i) {
    const LoraItem it = items[i];
    const int64_t r0 = groups.start[it.slot], rn = groups.start[it.slot + 1] - r0;
    group_panels(BF16, reinterpret_cast<const char*>(xs.data()) + r0 * K * elem,
                 a_base + it.slot * a_panels * K * kPanel * elem, xa + r0 * W, rn, K, W, it.p0, it.p1, path);
  });
  if (BF16) {
    uint16_t* half = reinterpret_cast<uint16_t*>(xa);
    for (int64_t i = 0; i < n * W; ++i) half[i] = to_bf16_bits(xa[i]);  // (in place: i <= the read)
  }
  return out;
}

// y [M, N] f32 = y_in + the rows' LoRA products (y_in aliased to y where XLA lets it).
template <bool BF16>
ffi::Error LoraAddImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> y_in, ffi::AnyBuffer x,
                       ffi::Buffer<ffi::S32> token_slots, ffi::Buffer<ffi::S32> rows, ffi::AnyBuffer a,
                       ffi::AnyBuffer b, ffi::Buffer<ffi::S32> panel_part, ffi::ResultBuffer<ffi::F32> y_out,
                       int32_t path, int64_t num_slots) {
  const auto xd = x.dimensions(), ad = a.dimensions(), bd = b.dimensions();
  if (xd.size() != 2 || ad.size() != (BF16 ? 4 : 3) || bd.size() != (BF16 ? 4 : 3) || num_slots < 1)
    return ffi::Error::InvalidArgument("lora_add: needs x [M, K] and packed a and b (see lora.cc)");
  const int64_t M = xd[0], K = xd[1], S = num_slots, N = panel_part.element_count() * kPanel;
  const int64_t W = ad[0] * kPanel / S, width = bd[1] * (BF16 ? 2 : 1) / S;
  if (ad[0] * kPanel != S * W || bd[0] * kPanel != N || bd[1] * (BF16 ? 2 : 1) != S * width || width < 1 ||
      W % width || W % kPanel || ad[1] * (BF16 ? 2 : 1) != K || token_slots.element_count() != M ||
      y_in.element_count() != M * N)
    return ffi::Error::InvalidArgument("lora_add: shapes do not match the packed layouts (see lora.cc)");
  if (!path_ok(path)) return ffi::Error::InvalidArgument("lora_add: this build has no such kernel path");
  float* y = y_out->typed_data();
  if (y != y_in.typed_data()) std::memcpy(y, y_in.typed_data(), M * N * sizeof(float));
  const int64_t live = rows.element_count() ? std::clamp<int64_t>(rows.typed_data()[0], 0, M) : M;
  const Shrunk shrunk = shrink<BF16>(pool, x, token_slots.typed_data(), live, a.untyped_data(), S, W, W * N, path);
  const SlotGroups& groups = shrunk.groups;
  const int64_t n = shrunk.n(), elem = BF16 ? 2 : 4, b_panels = N / kPanel;
  if (n == 0) return ffi::Error::Success();
  const char* b_base = static_cast<const char*>(b.untyped_data());
  const float* xa = shrunk.xa.data();
  // Each group's rows of y += its x a part @ its slot's b (items: slot x panels of one part).
  static thread_local std::vector<LoraItem> items_;
  std::vector<LoraItem>& items = items_;
  items.clear();
  const int32_t* part_of = panel_part.typed_data();
  for (int64_t p0 = 0, p1; p0 < b_panels; p0 = p1) {
    for (p1 = p0 + 1; p1 < b_panels && part_of[p1] == part_of[p0];) ++p1;
    add_items(items, groups, S, p0, p1);
  }
  run_items(pool, n * (K * W + W * N), static_cast<int64_t>(items.size()), [&](int64_t i) {
    const LoraItem it = items[i];
    const int64_t column = part_of[it.p0] * width;  // of x a
    const int64_t r0 = groups.start[it.slot], r1 = groups.start[it.slot + 1];
    const void* b_slot = b_base + it.slot * width * kPanel * elem;  // (its rows of each panel)
#ifdef JAXLLM_AMX_BF16
    if (BF16 && bf16_gemm_path(path, r1 - r0) == kAmx && (width <= 32 || width % 32 == 0))
      return accumulate_rows_amx(reinterpret_cast<const uint16_t*>(xa) + column, W,
                                 static_cast<const uint32_t*>(b_slot), width, S, groups.order.data(), r0, r1, y, N,
                                 it.p0, it.p1);
#endif
    const void* xp = BF16 ? static_cast<const void*>(reinterpret_cast<const uint16_t*>(xa) + column)
                          : static_cast<const void*>(xa + column);
    accumulate_rows<BF16>(xp, W, b_slot, width, S, groups.order.data(), r0, r1, y, N, it.p0, it.p1, path);
  });
  return ffi::Error::Success();
}

// xa [parts, M, S * width] bf16 (see the top of the file) from bf16 x and a.
ffi::Error LoraShrinkImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> token_slots,
                          ffi::Buffer<ffi::S32> rows, ffi::AnyBuffer a, ffi::ResultBuffer<ffi::BF16> xa_out,
                          int32_t path, int64_t num_slots) {
  const auto xd = x.dimensions(), ad = a.dimensions(), od = xa_out->dimensions();
  const int64_t S = num_slots;
  if (xd.size() != 2 || ad.size() != 4 || od.size() != 3 || S < 1 || x.element_type() != ffi::DataType::BF16 ||
      a.element_type() != ffi::DataType::BF16 || ad[1] * 2 != xd[1] || ad[0] * kPanel % S || od[1] != xd[0] ||
      od[2] % S || token_slots.element_count() != xd[0])
    return ffi::Error::InvalidArgument("lora_shrink: needs bf16 x [M, K], packed a and xa [parts, M, S * width]");
  const int64_t M = xd[0], W = ad[0] * kPanel / S, parts = od[0], width = od[2] / S;
  if (parts * width != W) return ffi::Error::InvalidArgument("lora_shrink: xa's parts x width is not a's W");
  if (!path_ok(path)) return ffi::Error::InvalidArgument("lora_shrink: this build has no such kernel path");
  uint16_t* out = reinterpret_cast<uint16_t*>(xa_out->untyped_data());
  std::memset(out, 0, parts * M * S * width * 2);
  const int64_t live = rows.element_count() ? std::clamp<int64_t>(rows.typed_data()[0], 0, M) : M;
  const Shrunk shrunk = shrink<true>(pool, x, token_slots.typed_data(), live, a.untyped_data(), S, W, 0, path);
  const uint16_t* xa = reinterpret_cast<const uint16_t*>(shrunk.xa.data());
  for (int64_t s = 0; s < S; ++s)
    for (int64_t i = shrunk.groups.start[s]; i < shrunk.groups.start[s + 1]; ++i)
      for (int64_t k = 0; k < parts; ++k)
        std::memcpy(out + (k * M + shrunk.groups.order[i]) * S * width + s * width, xa + i * W + k * width, width * 2);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxllm

#define JAXLLM_LORA_BINDING                                            \
  ffi::Ffi::Bind()                                                     \
      .Ctx<ffi::ThreadPool>()                                          \
      .Arg<ffi::Buffer<ffi::F32>>()   /* y_in [M, N] */                \
      .Arg<ffi::AnyBuffer>()          /* x [M, K] f32 or bf16 */       \
      .Arg<ffi::Buffer<ffi::S32>>()   /* token_slots [M] */            \
      .Arg<ffi::Buffer<ffi::S32>>()   /* rows: [] or [1], or empty */  \
      .Arg<ffi::AnyBuffer>()          /* a panels */                   \
      .Arg<ffi::AnyBuffer>()          /* b panels */                   \
      .Arg<ffi::Buffer<ffi::S32>>()   /* panel_part [N / 16] */        \
      .Ret<ffi::Buffer<ffi::F32>>()   /* y [M, N]: y_in + the products */ \
      .Attr<int32_t>("path")                                           \
      .Attr<int64_t>("num_slots")

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmLoraAddCpu, jaxllm::LoraAddImpl<false>, JAXLLM_LORA_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmLoraAddBf16Cpu, jaxllm::LoraAddImpl<true>, JAXLLM_LORA_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmLoraShrinkBf16Cpu, jaxllm::LoraShrinkImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()         // x [M, K] bf16
                                  .Arg<ffi::Buffer<ffi::S32>>()  // token_slots [M]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // rows: [] or [1], or empty
                                  .Arg<ffi::AnyBuffer>()         // a panels (bf16)
                                  .Ret<ffi::Buffer<ffi::BF16>>()  // xa [parts, M, S * width]
                                  .Attr<int32_t>("path")
                                  .Attr<int64_t>("num_slots"));
