// Writing a step's keys and values into their cache slots (kernels/kv_write.py's `write_kv`),
// in place: the pages are aliased to the outputs.
//
// In XLA the write is one scatter per layer and K/V. Its result is the same, but XLA:CPU gives
// each scatter an LLVM module of its own (fusions of the same shape share one): 60 of a
// 30-layer step's ~120 modules, about 40% of every step shape's compile. Here one handler
// serves them all, and the [tokens, heads, head_dim] rows are read as they come (no transpose).
//
// Storage formats (kv_write.py): f32 rows; bf16 as uint16 bits, rounded to nearest even as
// XLA's convert does; int8 rows of head_dim codes then the 4 bytes of their f32 scale,
// symmetric, scale = max |x| * f32(1 / 127) (1 for a zero row; XLA multiplies by the reciprocal
// where a division by a constant is written), code = clip(round-half-even(x / scale)); fp8 rows
// the same with E4M3 codes (u8 bits), scale = max |x| * f32(1 / 448), code = x / scale clipped to
// +-448 and rounded to the nearest E4M3 value, ties to even, as XLA's convert rounds. The
// divisions x / scale are done in double and rounded to f32: under -ffast-math that is still the
// correctly rounded f32 quotient that XLA computes, so the codes match the jnp write exactly.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#ifdef __linux__
#include <sys/mman.h>
#endif

#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxllm {
namespace {

inline float div_f32(float a, float b) { return static_cast<float>(static_cast<double>(a) / static_cast<double>(b)); }

// The E4M3 code nearest x (|x| <= 448), ties to even. Below 2^-6 (the smallest normal, code 8)
// the codes step by 2^-9, so the code is x * 2^9 rounded; above, the f32's top 3 mantissa bits,
// rounded at the bits below them, carry into the exponent as they should, and the exponent is
// rebiased (127 -> 7).
inline uint8_t to_e4m3_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  u &= 0x7fffffffu;
  float mag;
  std::memcpy(&mag, &u, sizeof mag);
  if (mag < 0x1p-6f) return sign | static_cast<uint8_t>(std::nearbyint(mag * 512.f));
  u += 0x7ffffu + ((u >> 20) & 1u);
  return sign | static_cast<uint8_t>((u >> 20) - (120u << 3));
}

// One row of `d` floats into its slot's row of storage `kind`.
void store_row(const float* x, int64_t d, ffi::DataType kind, void* dst) {
  if (kind == ffi::F32) {
    std::memcpy(dst, x, d * sizeof(float));
  } else if (kind == ffi::U16) {
    auto* out = static_cast<uint16_t*>(dst);
    for (int64_t i = 0; i < d; ++i) out[i] = to_bf16_bits(x[i]);
  } else {  // S8 (int8) or U8 (fp8 bits): codes, then the scale's bytes
    const float top = kind == ffi::S8 ? 127.0f : 448.0f;
    float amax = 0.0f;
    for (int64_t i = 0; i < d; ++i) amax = std::max(amax, std::fabs(x[i]));
    float scale = amax * static_cast<float>(1.0 / top);
    if (!(scale > 0.0f)) scale = 1.0f;
    auto* out = static_cast<uint8_t*>(dst);
    for (int64_t i = 0; i < d; ++i) {
      const float v = std::clamp(div_f32(x[i], scale), -top, top);
      out[i] = kind == ffi::S8 ? static_cast<uint8_t>(static_cast<int8_t>(std::nearbyint(v))) : to_e4m3_bits(v);
    }
    std::memcpy(out + d, &scale, sizeof scale);
  }
}

ffi::Error WriteKvImpl(ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages, ffi::AnyBuffer k_new, ffi::AnyBuffer v_new,
                       ffi::Buffer<ffi::S32> slot_mapping, ffi::Result<ffi::AnyBuffer> k_out,
                       ffi::Result<ffi::AnyBuffer> v_out) {
  const auto pd = k_pages.dimensions();
  const auto nd = k_new.dimensions();
  const auto kind = k_pages.element_type();
  if (pd.size() != 4 || nd.size() != 3 || v_pages.dimensions().size() != 4 || v_new.dimensions().size() != 3)
    return ffi::Error::InvalidArgument("write_kv: pages must be [heads, pages, page_size, row], new rows [T, heads, D]");
  const bool quantized = kind == ffi::S8 || kind == ffi::U8;
  if ((kind != ffi::F32 && kind != ffi::U16 && !quantized) || v_pages.element_type() != kind ||
      v_pages.element_count() != k_pages.element_count())
    return ffi::Error::InvalidArgument("write_kv: pages must both be f32, u16 (bf16 bits), s8 or u8 (fp8 bits), alike");
  if (k_new.element_type() != ffi::F32 || v_new.element_type() != ffi::F32 || v_new.element_count() != k_new.element_count())
    return ffi::Error::InvalidArgument("write_kv: new keys and values must both be f32, alike");
  const int64_t heads = pd[0], num_slots = pd[1] * pd[2], row = pd[3];
  const int64_t tokens = nd[0], d = nd[2];
  if (nd[1] != heads || row != d + (quantized ? 4 : 0) || slot_mapping.element_count() != tokens)
    return ffi::Error::InvalidArgument("write_kv: heads, head_dim or tokens do not match the pages");
  // In place: XLA hands the pages' buffers back as the outputs (input_output_aliases).
  if (k_out->untyped_data() != k_pages.untyped_data() || v_out->untyped_data() != v_pages.untyped_data())
    return ffi::Error::InvalidArgument("write_kv: the pages must be aliased to the outputs");
  const int64_t row_bytes = row * (kind == ffi::F32 ? 4 : kind == ffi::U16 ? 2 : 1);
  const int32_t* slots = slot_mapping.typed_data();
  const auto* k = static_cast<const float*>(k_new.untyped_data());
  const auto* v = static_cast<const float*>(v_new.untyped_data());
  auto* kp = static_cast<char*>(k_out->untyped_data());
  auto* vp = static_cast<char*>(v_out->untyped_data());
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0 || slot >= num_slots) continue;  // padding: written nowhere
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t at = (h * num_slots + slot) * row_bytes;
      store_row(k + (t * heads + h) * d, d, kind, kp + at);
      store_row(v + (t * heads + h) * d, d, kind, vp + at);
    }
  }
  return ffi::Error::Success();
}

// A zeroed buffer (a new KV pool's pages) on 2 MiB pages where Linux allows it: madvise(MADV_HUGEPAGE)
// before the zeros are written makes each 2 MiB region fault in as one huge page. Decode attention
// reads each sequence's pages scattered over the pool, and with 4 KiB pages nearly every page read
// missed the TLB. A large output is usually a fresh mapping, but malloc may hand back heap memory
// already touched on 4 KiB pages, which would stay so: MADV_DONTNEED drops those first (free on an
// untouched mapping). (Collapsing 4 KiB pages afterwards, MADV_COLLAPSE, cost 1-3 s of a warm start.)
ffi::Error ZerosImpl(ffi::Result<ffi::AnyBuffer> out) {
  char* p = static_cast<char*>(out->untyped_data());
  const size_t n = out->size_bytes();
#ifdef __linux__
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  const uintptr_t lo = (reinterpret_cast<uintptr_t>(p) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t hi = (reinterpret_cast<uintptr_t>(p) + n) & ~(kHuge - 1);
  if (hi > lo && madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_HUGEPAGE) == 0) {  // best effort
    madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_DONTNEED);  // the buffer is ours, its bytes unset
  }
#endif
  std::memset(p, 0, n);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxllm

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmZerosCpu, jaxllm::ZerosImpl, ffi::Ffi::Bind().Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmWriteKvCpu, jaxllm::WriteKvImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()         // k_pages (aliased to k_out)
                                  .Arg<ffi::AnyBuffer>()         // v_pages (aliased to v_out)
                                  .Arg<ffi::AnyBuffer>()         // k_new [T, heads, head_dim] f32
                                  .Arg<ffi::AnyBuffer>()         // v_new
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slot_mapping [T]
                                  .Ret<ffi::AnyBuffer>()         // k_out
                                  .Ret<ffi::AnyBuffer>());       // v_out
