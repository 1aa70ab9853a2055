// RMSNorm, with the residual add before it, as one FFI call (kernels/native.py's `rms_norm`).
//
// In XLA:CPU a layer's `x + attn` and RMSNorm are five ops that do not fuse (the add, the square,
// the mean as a reduce-window, the rsqrt, the scaling with its cast to bf16), each its own thunk
// and temporary: about 6 us per norm on 4 rows, 75 us on 128 (Zen 4, 60 norms in one jit). Here a
// row is read once for its sum of squares and once for the scaled output, rows shared over XLA's
// intra-op threads. In the whole step that was within noise of XLA's time, but a bucket compiles
// in about 0.7x the time and the standard workload's peak RSS is about 100 MiB lower.
//
// Per row r of x [T, H] (and delta, if given): s = x + delta (stored, f32), then
// out = s * (1 / sqrt(mean(s * s) + eps)) * weight, f32 or bf16 (rounded to nearest even, as
// XLA's convert does). Rows from `rows` on (a bucket's padding) give zeros in both outputs.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "parallel_for.h"
#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxllm {
namespace {

constexpr int64_t kNormRowsPerItem = 8;
constexpr int64_t kNormParallelElements = 1 << 15;  // below this many elements, one thread

void norm_row(const float* x, const float* delta, const float* w, int64_t h, float eps, float* sum, float* out_f32,
              uint16_t* out_bf16) {
  const float* s = x;
  if (delta != nullptr) {
    for (int64_t i = 0; i < h; ++i) sum[i] = x[i] + delta[i];
    s = sum;
  }
  float squares = 0.0f;
  for (int64_t i = 0; i < h; ++i) squares += s[i] * s[i];
  const float r = 1.0f / std::sqrt(squares / static_cast<float>(h) + eps);
  if (out_f32 != nullptr) {
    for (int64_t i = 0; i < h; ++i) out_f32[i] = s[i] * r * w[i];
  } else {
    for (int64_t i = 0; i < h; ++i) out_bf16[i] = to_bf16_bits(s[i] * r * w[i]);
  }
}

ffi::Error RmsNormImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> delta,
                       ffi::Buffer<ffi::F32> weight, ffi::Buffer<ffi::S32> live_rows, ffi::Result<ffi::Buffer<ffi::F32>> sum,
                       ffi::Result<ffi::AnyBuffer> out, float eps) {
  const auto dims = x.dimensions();
  if (dims.size() != 2) return ffi::Error::InvalidArgument("rms_norm: x must be [T, H]");
  const int64_t t = dims[0], h = dims[1];
  const bool add = delta.element_count() != 0;
  if (add && (delta.element_count() != t * h || sum->element_count() != t * h))
    return ffi::Error::InvalidArgument("rms_norm: delta and the sum must be x's shape");
  if (weight.element_count() != h || out->element_count() != t * h)
    return ffi::Error::InvalidArgument("rms_norm: weight must be [H], the output x's shape");
  const bool bf16 = out->element_type() == ffi::BF16;
  if (!bf16 && out->element_type() != ffi::F32) return ffi::Error::InvalidArgument("rms_norm: output f32 or bf16");
  int64_t rows = t;
  if (live_rows.element_count() == 1) rows = std::clamp<int64_t>(live_rows.typed_data()[0], 0, t);
  const float* xs = x.typed_data();
  const float* ds = add ? delta.typed_data() : nullptr;
  const float* w = weight.typed_data();
  float* ss = add ? sum->typed_data() : nullptr;
  auto* out_f32 = bf16 ? nullptr : static_cast<float*>(out->untyped_data());
  auto* out_bf16 = bf16 ? static_cast<uint16_t*>(out->untyped_data()) : nullptr;
  auto block = [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      norm_row(xs + r * h, add ? ds + r * h : nullptr, w, h, eps, add ? ss + r * h : nullptr,
               bf16 ? nullptr : out_f32 + r * h, bf16 ? out_bf16 + r * h : nullptr);
  };
  if (rows * h < kNormParallelElements) {
    block(0, rows);
  } else {
    const int64_t items = (rows + kNormRowsPerItem - 1) / kNormRowsPerItem;
    parallel_for<NoState>(pool, items, [&](int64_t i, NoState&) {
      block(i * kNormRowsPerItem, std::min(rows, (i + 1) * kNormRowsPerItem));
    });
  }
  const int64_t pad = (t - rows) * h;  // padding rows: zeros
  if (add) std::memset(ss + rows * h, 0, pad * sizeof(float));
  std::memset(static_cast<char*>(out->untyped_data()) + rows * h * (bf16 ? 2 : 4), 0, pad * (bf16 ? 2 : 4));
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxllm

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmRmsNormCpu, jaxllm::RmsNormImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [T, H]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // delta [T, H], or [0]: none
                                  .Arg<ffi::Buffer<ffi::F32>>()  // weight [H]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // live rows: [] (a scalar) or [0] for all
                                  .Ret<ffi::Buffer<ffi::F32>>()  // x + delta [T, H] (or [0] without delta)
                                  .Ret<ffi::AnyBuffer>()         // the normed rows [T, H], f32 or bf16
                                  .Attr<float>("eps"));
