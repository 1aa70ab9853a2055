// Greedy sampling's two reductions over logits [rows, vocab] f32, in one pass per row: the
// first index of the maximum and log(sum(exp(x))), as an XLA FFI custom call. XLA:CPU runs
// jnp.argmax as a scalar (value, index) reduction: 14 ms for [128, 49152] against ~1 ms here.

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "parallel_for.h"
#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxllm {
namespace {

constexpr int64_t kRowsPerTask = 8;
// Chunks of 1024 summed in f32, the chunks in double: f32 sums over all ~50k terms drifted by
// ~1e-5 of the logprob, enough to move beam-search scores by 5e-4.
constexpr int64_t kSumChunk = 1024;

// The first index in row[0, n) that holds m (n - 1 if none does, e.g. for a NaN max).
int64_t first_index_of(const float* row, int64_t n, float m) {
  int64_t i = 0;
  while (i < n - 1 && !(row[i] == m)) ++i;
  return i;
}

// log(sum_i exp(row[i])) for a row whose maximum is m.
float logsumexp(const float* row, int64_t n, float m) {
  double sum = 0.0;
  for (int64_t start = 0; start < n; start += kSumChunk) sum += sum_exp(row + start, std::min(kSumChunk, n - start), m);
  return m + static_cast<float>(std::log(sum));
}

ffi::Error ArgmaxLogsumexpImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> logits, ffi::ResultBuffer<ffi::S32> argmax,
                               ffi::ResultBuffer<ffi::F32> lse) {
  const auto dims = logits.dimensions();
  if (dims.size() != 2) return ffi::Error::InvalidArgument("argmax_logsumexp: x must be [rows, vocab]");
  const int64_t rows = dims[0], vocab = dims[1];
  const float* x = logits.typed_data();
  int32_t* argmax_out = argmax->typed_data();
  float* lse_out = lse->typed_data();
  parallel_for(pool, (rows + kRowsPerTask - 1) / kRowsPerTask, [&](int64_t task) {
    for (int64_t r = task * kRowsPerTask; r < std::min(rows, (task + 1) * kRowsPerTask); ++r) {
      const float* row = x + r * vocab;
      const float m = max_of(row, vocab);
      argmax_out[r] = static_cast<int32_t>(first_index_of(row, vocab, m));
      lse_out[r] = logsumexp(row, vocab, m);
    }
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxllm

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmArgmaxLogsumexpCpu, jaxllm::ArgmaxLogsumexpImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // logits
                                  .Ret<ffi::Buffer<ffi::S32>>()  // argmax
                                  .Ret<ffi::Buffer<ffi::F32>>());  // lse
