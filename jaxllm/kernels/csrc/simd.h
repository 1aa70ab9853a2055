// The kernels' code paths (KernelPath) and named SIMD helpers: bf16 (and fp8 E4M3) -> f32 widening
// (scalar, and 8 or 16 at a time), a polynomial exp (8 or 16 wide), SwiGLU (16 wide), a 16x16 word
// transpose, a 4-way horizontal sum, and row reductions (max, sum of exp). The 16-wide helpers
// exist only under `#ifdef __AVX512F__`, the 8-wide ones under `#ifdef __AVX2__` (with FMA),
// beside the scalar to_f32 of the portable path; max_of and sum_exp run the widest loop the build
// has and a scalar loop for the rest of the row.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <new>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

// The AVX2 path needs FMA beside AVX2 (every AVX2 CPU jaxllm targets has both).
#if defined(__AVX2__) && defined(__FMA__)
#define JAXLLM_AVX2 1
#endif
// The int8 GEMMs' vpdpbusd path (gemm_q4a8.cc, gemm_w8a8.cc).
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
#define JAXLLM_AVX512_VNNI 1
// With AVX512_VBMI's two-source byte permutes as well: 4-bit codes read as they are packed.
#if defined(__AVX512VBMI__)
#define JAXLLM_AVX512_VBMI 1
#endif
#endif
// AMX's bf16 tiles (gemm_bf16.cc, from two rows), with AVX512_BF16 for the rest of that file.
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define JAXLLM_AMX_BF16 1
#include <sys/syscall.h>
#include <unistd.h>
// And its int8 tiles (the int8 rows' kernels at 8-16 rows, gemm_q4a8.cc and gemm_q6a8.cc).
#if defined(__AMX_INT8__) && defined(__AVX512VNNI__)
#define JAXLLM_AMX_INT8 1
#endif
#endif

namespace jaxllm {

// A vector whose data starts on a cache line: a buffer that AMX's tiles load from must have it, or
// every 64-byte tile row spans two lines (the bf16 tiles ran at half speed over malloc's 16-byte
// aligned scratch on the Xeon kind).
template <typename T>
struct CacheLineAllocator {
  using value_type = T;
  CacheLineAllocator() = default;
  template <typename U>
  CacheLineAllocator(const CacheLineAllocator<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t(64)); }
  template <typename U>
  bool operator==(const CacheLineAllocator<U>&) const { return true; }
};
template <typename T>
using AlignedVector = std::vector<T, CacheLineAllocator<T>>;

// The kernels' code paths, narrowest first; a build has those its -march allows (attention
// has portable, AVX2 and AVX-512; the f32 GEMM portable and AVX2, the bf16 one portable,
// AVX-512 with BF16 and AMX). A `path` argument names the widest to try: a kernel without code
// for it runs its widest below (AMX is AVX-512 everywhere but in the bf16 GEMM; the int8 rows'
// kernels take AMX's int8 tiles under auto and AVX-512 alike, since they compute the VNNI
// kernels' numbers exactly, and AMX's bf16 tiles under amx).
enum KernelPath : int32_t { kAuto = 0, kPortable = 1, kAvx2 = 2, kAvx512 = 3, kAmx = 4 };

#ifdef JAXLLM_AMX_BF16
// Linux gives a process AMX's tile registers only once it asks (arch_prctl ARCH_REQ_XCOMP_PERM
// for XTILEDATA, Linux 5.16 on); before that a tile instruction faults. Asked once a process.
inline bool amx_ready() {
  static const bool ready = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ready;
}

// ldtilecfg's 64-byte operand (palette 1): each tile's rows and bytes per row.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// ldtilecfg of all of c (GCC's _tile_loadconfig names only its first 8 bytes as read, so the
// compiler may leave the rest of a local config unwritten: a fault).
inline void load_tile_config(const TileConfig& c) { __asm__ volatile("ldtilecfg %0" ::"m"(c)); }
#endif

// Bit p set: path p is built into this library (AMX: and this process may use its tiles).
inline int32_t built_paths() {
  int32_t bits = 1 << kPortable;
#ifdef JAXLLM_AVX2
  bits |= 1 << kAvx2;
#endif
#ifdef __AVX512F__
  bits |= 1 << kAvx512;
#endif
#ifdef JAXLLM_AMX_BF16
  if (amx_ready()) bits |= 1 << kAmx;
#endif
  return bits;
}

// Whether a kernel's `path` argument is auto or a path of this build.
inline bool path_ok(int32_t path) {
  return path == kAuto || (path >= kPortable && path <= kAmx && (built_paths() & (1 << path)));
}

// The vector exps' constants (Cephes' expf): e^x = 2^n e^r with n = round(x log2 e) and
// r = x - n ln 2 (ln 2 in two parts, for precision), e^r ~ 1 + r + r^2 P(r) with P of degree 5
// (coefficients kExpPoly, highest power first); x is clamped at kExpMin first.
constexpr float kExpMin = -88.f, kLog2e = 1.44269504088896341f, kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

// A bf16 value is the upper half of an f32: widening puts its 16 bits on top of 16 zeros.
inline float to_f32(uint16_t bf16_bits) {
  uint32_t u = static_cast<uint32_t>(bf16_bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
// f32 -> bf16 bits, rounded to nearest even (as ml_dtypes and VCVTNE2PS2BF16 round).
inline uint16_t to_bf16_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN stays quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
inline float to_f32(float x) { return x; }
inline float to_f32(int8_t code) { return static_cast<float>(code); }
// An fp8 E4M3 ("e4m3fn") code: a normal code's exponent and mantissa bits, shifted into an
// f32's and rebiased (7 -> 127), are its value; subnormals (exponent 0) are mantissa * 2^-9.
// Exact for every code but NaN (0x7f, 0xff), which the KV write never stores.
inline float to_f32(uint8_t e4m3) {
  const uint32_t mag = e4m3 & 0x7fu;
  float f = static_cast<float>(mag) * 0x1p-9f;
  if (mag >= 8) {
    const uint32_t u = (mag << 20) + (120u << 23);
    std::memcpy(&f, &u, sizeof f);
  }
  return e4m3 & 0x80u ? -f : f;
}

#ifdef __AVX512F__
// 16 consecutive cache elements (bf16 bits or f32) as 16 f32.
inline __m512 load_f32x16(const uint16_t* bf16_bits) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bf16_bits));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline __m512 load_f32x16(const float* x) { return _mm512_loadu_ps(x); }

// A 32-bit word read from bf16 data holds two adjacent elements: the even one in its low half,
// the odd one in its high half. These give each as f32, for 16 words at once.
inline __m512 even_bf16_to_f32(__m512i words) { return _mm512_castsi512_ps(_mm512_slli_epi32(words, 16)); }
inline __m512 odd_bf16_to_f32(__m512i words) {
  return _mm512_castsi512_ps(_mm512_and_si512(words, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}

// In place: r[k] becomes column k of the 16x16 matrix of 32-bit words whose rows were r[0..15].
inline void transpose16x16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i + 0] = _mm512_unpacklo_epi64(t[4 * i + 0], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i + 0], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 4; ++j) {
      t[8 * i + j] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + 4 + j], 0x88);
      t[8 * i + 4 + j] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + 4 + j], 0xdd);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0x88);
    r[8 + j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0xdd);
  }
}

// e^x for x <= 0 (and -1e30 -> 0): Cephes-style range reduction and a degree-6 polynomial.
// Without -ffinite-math-only the compiler does not call glibc's vector expf: on the sampler's
// [128, 49152] logits, scalar std::exp took 15 ms and this 3.5 ms.
inline __m512 exp_f32x16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(kExpMin));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 y = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(kExpPoly[i]));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(y, n);
}

// silu(g) * u, 16 wide (the GEMMs' SwiGLU epilogue): g * (g >= 0 ? 1 : e) / (1 + e) with
// e = e^-|g|, so that exp_f32x16 only sees x <= 0.
inline __m512 swiglu_f32x16(__m512 g, __m512 u) {
  const __m512 e = exp_f32x16(_mm512_or_ps(g, _mm512_set1_ps(-0.f)));
  const __mmask16 pos = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_GE_OQ);
  const __m512 num = _mm512_mask_blend_ps(pos, e, _mm512_set1_ps(1.f));
  return _mm512_mul_ps(_mm512_div_ps(_mm512_mul_ps(g, num), _mm512_add_ps(_mm512_set1_ps(1.f), e)), u);
}
#endif  // __AVX512F__

#ifdef JAXLLM_AVX2
// 8 consecutive cache elements (bf16 bits or f32) as 8 f32.
inline __m256 load_f32x8(const uint16_t* bf16_bits) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bf16_bits));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
inline __m256 load_f32x8(const float* x) { return _mm256_loadu_ps(x); }
inline __m256 load_f32x8(const int8_t* codes) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes))));
}
// 8 fp8 E4M3 codes as 8 f32, as to_f32(uint8_t) decodes one.
inline __m256 load_f32x8(const uint8_t* e4m3) {
  const __m256i bits = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(e4m3)));
  const __m256i mag = _mm256_and_si256(bits, _mm256_set1_epi32(0x7f));
  const __m256 normal = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(mag, 20), _mm256_set1_epi32(120 << 23)));
  const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(mag), _mm256_set1_ps(0x1p-9f));
  const __m256 value = _mm256_blendv_ps(normal, sub, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(8), mag)));
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(0x80)), 24);
  return _mm256_or_ps(value, _mm256_castsi256_ps(sign));
}

// e^x for x <= 0 (and -1e30 -> 0): exp_f32x16's reduction and polynomial, 8 wide; 2^n is built
// in the exponent bits (n >= -127 after the clamp, where the bits give 0).
inline __m256 exp_f32x8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(kExpMin));
  const __m256 n =
      _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 y = _mm256_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(kExpPoly[i]));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i pow2n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(pow2n));
}

// The four sums of the 8 lanes of a, b, c and d, in that order.
inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

inline float reduce_max(__m256 x) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline float reduce_add(__m256 x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif  // JAXLLM_AVX2

// max(x[0], ..., x[n - 1]); -inf for n = 0.
inline float max_of(const float* x, int64_t n) {
  float m = -INFINITY;
  int64_t i = 0;
#ifdef __AVX512F__
  __m512 vmax = _mm512_set1_ps(-INFINITY);
  for (; i + 16 <= n; i += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(x + i));
  m = _mm512_reduce_max_ps(vmax);
#elif defined(JAXLLM_AVX2)
  __m256 vmax = _mm256_set1_ps(-INFINITY);
  for (; i + 8 <= n; i += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(x + i));
  m = reduce_max(vmax);
#endif
  for (; i < n; ++i) m = std::max(m, x[i]);
  return m;
}

// sum_i exp(x[i] - shift) over [0, n), accumulated in f32 (shift >= every x[i]).
inline float sum_exp(const float* x, int64_t n, float shift) {
  float sum = 0.f;
  int64_t i = 0;
#ifdef __AVX512F__
  __m512 acc = _mm512_setzero_ps();
  const __m512 vshift = _mm512_set1_ps(shift);
  for (; i + 16 <= n; i += 16) acc = _mm512_add_ps(acc, exp_f32x16(_mm512_sub_ps(_mm512_loadu_ps(x + i), vshift)));
  sum = _mm512_reduce_add_ps(acc);
#elif defined(JAXLLM_AVX2)
  __m256 acc = _mm256_setzero_ps();
  const __m256 vshift = _mm256_set1_ps(shift);
  for (; i + 8 <= n; i += 8) acc = _mm256_add_ps(acc, exp_f32x8(_mm256_sub_ps(_mm256_loadu_ps(x + i), vshift)));
  sum = reduce_add(acc);
#endif
  for (; i < n; ++i) sum += std::exp(x[i] - shift);
  return sum;
}

}  // namespace jaxllm
