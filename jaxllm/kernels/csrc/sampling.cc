// Sampling over logits [rows, vocab] f32, as XLA FFI custom calls.
//
// ArgmaxLogsumexp: greedy sampling's two reductions in one pass per row, the first index of
// the maximum and log(sum(exp(x))). XLA:CPU runs jnp.argmax as a scalar (value, index)
// reduction: 14 ms for [128, 49152] against ~1 ms here. An optional packed token mask
// (structured output's, bit t % 32 of word t // 32) counts a row's disallowed tokens as -inf;
// rows whose words are all ones skip it. In XLA the mask was a lax.cond around the logits,
// whose copy of [rows, vocab] cost every greedy step ~9 ms at 128 rows even with no grammar.
//
// SampleRows: a sampled row's token (runner/sampler.py's `draw_xla`, row by row): temperature,
// min_p, top_k, top_p, a speculative draft accepted or taken out, then an inverse-CDF draw,
// with the uniforms given (drawn in XLA from each request's seed). In XLA the same work is
// ~60 fused kernels (two 32-pass bisections, a cumsum as reduce-windows): 1.5 s of every step
// shape's compile, and 64 passes over [rows, vocab] per step; here one pass per stage, and a
// sort of only the few tokens that top_p keeps.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <vector>

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
#ifdef JAXLLM_AVX2
  const __m256 vm = _mm256_set1_ps(m);  // 8 at a time: the scalar scan was ~15% of the kernel
  for (; i + 8 <= n; i += 8) {
    const int hits = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + i), vm, _CMP_EQ_OQ));
    if (hits) return i + __builtin_ctz(hits);
  }
#endif
  while (i < n - 1 && !(row[i] == m)) ++i;
  return std::min(i, n - 1);
}

// log(sum_i exp(row[i])) for a row whose maximum is m.
float logsumexp(const float* row, int64_t n, float m) {
  double sum = 0.0;
  for (int64_t start = 0; start < n; start += kSumChunk) sum += sum_exp(row + start, std::min(kSumChunk, n - start), m);
  return m + static_cast<float>(std::log(sum));
}

struct MaskedRow {
  std::vector<float> values;
};

// Row r of x, or with a mask that leaves some token out, a copy in `masked` with those at -inf.
const float* masked_row(const float* x, const int32_t* mask, int64_t words, int64_t r, int64_t vocab,
                        std::vector<float>& masked) {
  const float* row = x + r * vocab;
  if (!mask) return row;
  const uint32_t* bits = reinterpret_cast<const uint32_t*>(mask + r * words);
  if (std::all_of(bits, bits + words, [](uint32_t w) { return w == ~0u; })) return row;
  masked.resize(vocab);
  for (int64_t t = 0; t < vocab; ++t) masked[t] = (bits[t / 32] >> (t % 32)) & 1 ? row[t] : -INFINITY;
  return masked.data();
}

ffi::Error ArgmaxLogsumexpImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> logits, ffi::Buffer<ffi::S32> token_mask,
                               ffi::ResultBuffer<ffi::S32> argmax, ffi::ResultBuffer<ffi::F32> lse) {
  const auto dims = logits.dimensions();
  if (dims.size() != 2) return ffi::Error::InvalidArgument("argmax_logsumexp: x must be [rows, vocab]");
  const int64_t rows = dims[0], vocab = dims[1];
  const auto md = token_mask.dimensions();
  const bool has_mask = token_mask.element_count() > 0;
  if (has_mask && (md.size() != 2 || md[0] != rows || md[1] * 32 < vocab))
    return ffi::Error::InvalidArgument("argmax_logsumexp: token_mask must be [rows, >= vocab / 32] (or empty)");
  const int32_t* mask = has_mask ? token_mask.typed_data() : nullptr;
  const int64_t words = has_mask ? md[1] : 0;
  const float* x = logits.typed_data();
  int32_t* argmax_out = argmax->typed_data();
  float* lse_out = lse->typed_data();
  parallel_for<MaskedRow>(pool, (rows + kRowsPerTask - 1) / kRowsPerTask, [&](int64_t task, MaskedRow& scratch) {
    for (int64_t r = task * kRowsPerTask; r < std::min(rows, (task + 1) * kRowsPerTask); ++r) {
      const float* row = masked_row(x, mask, words, r, vocab, scratch.values);
      const float m = max_of(row, vocab);
      argmax_out[r] = static_cast<int32_t>(first_index_of(row, vocab, m));
      lse_out[r] = m == -INFINITY ? -INFINITY : logsumexp(row, vocab, m);   // -inf: every token masked
    }
  });
  return ffi::Error::Success();
}

// Per-thread scratch of SampleRows (each vocab-sized).
struct SampleScratch {
  std::vector<float> z, p, masked, top;
  std::vector<uint8_t> keep;
};

// p[i] = exp(z[i] - shift) (shift >= every z[i]); returns their sum.
float exp_shifted(const float* z, float* p, int64_t n, float shift) {
  float sum = 0.f;
  int64_t i = 0;
#ifdef __AVX512F__
  __m512 acc = _mm512_setzero_ps();
  const __m512 vshift = _mm512_set1_ps(shift);
  for (; i + 16 <= n; i += 16) {
    const __m512 e = exp_f32x16(_mm512_sub_ps(_mm512_loadu_ps(z + i), vshift));
    _mm512_storeu_ps(p + i, e);
    acc = _mm512_add_ps(acc, e);
  }
  sum = _mm512_reduce_add_ps(acc);
#elif defined(JAXLLM_AVX2)
  __m256 acc = _mm256_setzero_ps();
  const __m256 vshift = _mm256_set1_ps(shift);
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp_f32x8(_mm256_sub_ps(_mm256_loadu_ps(z + i), vshift));
    _mm256_storeu_ps(p + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  sum = reduce_add(acc);
#endif
  for (; i < n; ++i) sum += (p[i] = std::exp(z[i] - shift));
  return sum;
}

// The top_p cut-off over `masked` (probabilities summing to ~1, 0 where dropped): the largest
// value v whose tokens with masked >= v hold at least top_p of the mass (ties counted
// together), or 0 (keep all) if rounding leaves every set short. Only tokens at or above a
// bound that already holds top_p are sorted: the bound falls 16x per pass from the maximum.
float top_p_cutoff(const float* masked, int64_t n, float top_p, std::vector<float>& top) {
  float bound = max_of(masked, n);
  while (true) {
    float mass = 0.f;
    for (int64_t i = 0; i < n; ++i) mass += masked[i] >= bound ? masked[i] : 0.f;
    if (mass >= top_p) break;
    if (bound == 0.f) return 0.f;
    bound = bound < 1e-30f ? 0.f : bound / 16.f;
  }
  top.clear();
  for (int64_t i = 0; i < n; ++i)
    if (masked[i] >= bound && masked[i] > 0.f) top.push_back(masked[i]);
  std::sort(top.begin(), top.end(), std::greater<float>());
  float cum = 0.f;
  for (size_t j = 0; j < top.size(); ++j) {
    cum += top[j];
    if (cum >= top_p && (j + 1 == top.size() || top[j + 1] != top[j])) return top[j];
  }
  return top.empty() ? 0.f : top.back();
}

// One sampled row's token (see the file's comment); a greedy row (temperature <= 0) gets 0,
// which the caller replaces by its argmax.
int32_t sample_row(const float* x, int64_t n, float temperature, float min_p, int32_t top_k, float top_p,
                   int32_t draft, float u, float u_draft, SampleScratch& s) {
  if (!(temperature > 0.f)) return 0;
  s.z.resize(n);
  s.p.resize(n);
  s.keep.resize(n);
  float* z = s.z.data();
  float* p = s.p.data();
  uint8_t* keep = s.keep.data();
  for (int64_t i = 0; i < n; ++i) z[i] = x[i] / temperature;
  const float inv_sum = 1.f / exp_shifted(z, p, n, max_of(z, n));
  for (int64_t i = 0; i < n; ++i) p[i] *= inv_sum;
  const float floor_p = min_p * max_of(p, n);
  for (int64_t i = 0; i < n; ++i) keep[i] = p[i] >= floor_p;
  if (top_k > 0 && top_k < n) {     // keep logits >= the k-th largest (ties kept)
    s.top.assign(z, z + n);
    std::nth_element(s.top.begin(), s.top.begin() + (top_k - 1), s.top.end(), std::greater<float>());
    const float kth = s.top[top_k - 1];
    for (int64_t i = 0; i < n; ++i) keep[i] &= z[i] >= kth;
  }
  if (top_p < 1.f) {                // on the kept set, renormalised
    s.masked.resize(n);
    float* masked = s.masked.data();
    float kept = 0.f;
    for (int64_t i = 0; i < n; ++i) kept += keep[i] ? p[i] : 0.f;
    for (int64_t i = 0; i < n; ++i) masked[i] = keep[i] ? p[i] / kept : 0.f;
    const float cutoff = top_p_cutoff(masked, n, top_p, s.top);
    for (int64_t i = 0; i < n; ++i) keep[i] &= masked[i] >= cutoff;
  }
  if (draft >= 0 && draft < n) {    // accept the draft with probability p(draft), else take it out
    float kept = 0.f;
    for (int64_t i = 0; i < n; ++i) kept += keep[i] ? p[i] : 0.f;
    if (u_draft < (keep[draft] ? p[draft] : 0.f) / kept) return draft;
    keep[draft] = 0;
  }
  float total = 0.f;                // inverse CDF over the kept probabilities
  int64_t last_kept = n - 1;
  for (int64_t i = 0; i < n; ++i) {
    if (keep[i]) {
      total += p[i];
      last_kept = i;
    }
  }
  const float target = u * total;
  float cdf = 0.f;
  for (int64_t i = 0; i < last_kept; ++i) {
    cdf += keep[i] ? p[i] : 0.f;
    if (cdf > target) return static_cast<int32_t>(i);
  }
  return static_cast<int32_t>(last_kept);  // also the float edge u * total == total
}

ffi::Error SampleRowsImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> logits, ffi::Buffer<ffi::F32> temperature,
                          ffi::Buffer<ffi::F32> min_p, ffi::Buffer<ffi::S32> top_k, ffi::Buffer<ffi::F32> top_p,
                          ffi::Buffer<ffi::S32> draft, ffi::Buffer<ffi::F32> u, ffi::Buffer<ffi::F32> u_draft,
                          ffi::ResultBuffer<ffi::S32> tokens) {
  const auto dims = logits.dimensions();
  if (dims.size() != 2) return ffi::Error::InvalidArgument("sample_rows: logits must be [rows, vocab]");
  const int64_t rows = dims[0], vocab = dims[1];
  auto per_row = [rows](auto d) { return d.size() == 1 && d[0] == rows; };
  if (!(per_row(temperature.dimensions()) && per_row(min_p.dimensions()) && per_row(top_k.dimensions()) &&
        per_row(top_p.dimensions()) && per_row(draft.dimensions()) && per_row(u.dimensions()) &&
        per_row(u_draft.dimensions())))
    return ffi::Error::InvalidArgument("sample_rows: per-row inputs must be [rows]");
  const float* x = logits.typed_data();
  int32_t* out = tokens->typed_data();
  parallel_for<SampleScratch>(pool, rows, [&](int64_t r, SampleScratch& scratch) {
    out[r] = sample_row(x + r * vocab, vocab, temperature.typed_data()[r], min_p.typed_data()[r],
                        top_k.typed_data()[r], top_p.typed_data()[r], draft.typed_data()[r], u.typed_data()[r],
                        u_draft.typed_data()[r], scratch);
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxllm

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmArgmaxLogsumexpCpu, jaxllm::ArgmaxLogsumexpImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // logits [rows, vocab]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // token_mask [rows, words], or empty: none
                                  .Ret<ffi::Buffer<ffi::S32>>()  // argmax
                                  .Ret<ffi::Buffer<ffi::F32>>());  // lse

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmSampleRowsCpu, jaxllm::SampleRowsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // logits [rows, vocab]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // temperature [rows]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // min_p
                                  .Arg<ffi::Buffer<ffi::S32>>()  // top_k (0: off)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // top_p
                                  .Arg<ffi::Buffer<ffi::S32>>()  // draft token (-1: none)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // u: the draw's uniform in [0, 1)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // u_draft: the draft's acceptance uniform
                                  .Ret<ffi::Buffer<ffi::S32>>());  // tokens [rows]
