"""This CPU's peak rate of the dot instructions jaxllm's GEMMs are built on: f32 FMA, int8 dots
(VPDPBUSD: AVX512_VNNI on 512-bit registers, AVX-VNNI on 256-bit ones; AVX2's VPMADDUBSW into
int16 sums) and bf16 dots
(VDPBF16PS, AVX512_BF16), each with 8 to 20 independent accumulators (the best kept), on 1
thread and on every core. A GEMM's GFLOP/s from `weight_stream.py` or `step.py` over the matching
figure here is how far from the instruction peak it runs.

    python benchmarks/dot_peak.py [--seconds 1]

A multiply-add counts two operations (an int8 dot's 4 products into each lane count 8).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]
sys.path.insert(0, HERE)
from workload import cpu_line, machine_info  # noqa: E402

del sys.path[0]

# Each kernel: N accumulators (8-20, the best kept), `iters` rounds; the operands pass through an
# empty asm so that the compiler cannot fold the loop. `measure`'s `ops`: operations per instruction.
SOURCE = r"""
#include <immintrin.h>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <type_traits>
#include <vector>

template <typename S, int N, typename A, typename Step>
double run(long iters, A a, A b, Step step) {  // S: the accumulators' type, A: the operands'
  S s[N];
  for (auto& v : s) v = S{};
  for (long t = 0; t < iters; ++t) {
#pragma GCC unroll 24
    for (int i = 0; i < N; ++i) s[i] = step(s[i], a, b);
    asm volatile("" : "+v"(a), "+v"(b));
  }
  double sink = 0;
  for (auto& v : s) {
    float lane;
    std::memcpy(&lane, &v, sizeof lane);
    sink += lane;
  }
  return sink;
}

volatile double g_sink;

// The best rate over 8-20 accumulators (enough to cover the instruction's latency, not so many
// that the loop spills), in GOP/s; `ops` per instruction.
template <typename Kernel, int N = 8>
double best_rate(double ops, int threads, double seconds, Kernel kernel) {
  long iters = 1 << 16;
  for (;;) {  // grow until a round takes `seconds`
    auto t0 = std::chrono::steady_clock::now();
    std::vector<std::thread> pool;
    std::vector<double> sink(threads);
    for (int i = 0; i < threads; ++i)
      pool.emplace_back([&, i] { sink[i] = kernel(std::integral_constant<int, N>{}, iters); });
    for (auto& t : pool) t.join();
    for (double v : sink) g_sink = g_sink + v;  // (the sums read: the loops cannot be dropped)
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (s >= seconds) {
      const double rate = ops * N * iters * threads / s / 1e9;
      if constexpr (N < 20) return std::max(rate, best_rate<Kernel, N + 4>(ops, threads, seconds, kernel));
      return rate;
    }
    iters *= 2;
  }
}

template <typename Kernel>
void measure(const char* name, double ops, int threads, double seconds, Kernel kernel) {
  std::printf("%s|%d|%.1f\n", name, threads, best_rate(ops, threads, seconds, kernel));
}

// A kernel for best_rate: accumulators of type S, operands a0, b0 of type A, `expr` the step.
#define KERNEL(S, A, a0, b0, expr)                                                     \
  [](auto acc, long n) {                                                               \
    return run<S, decltype(acc)::value>(n, a0, b0, [](S s, A a, A b) { return expr; }); \
  }

int main(int argc, char** argv) {
  const double seconds = std::atof(argv[1]);
  const int cores = static_cast<int>(std::thread::hardware_concurrency());
  for (int threads : {1, cores}) {
#ifdef __AVX512F__
    measure("f32 FMA zmm", 32, threads, seconds,
            KERNEL(__m512, __m512, _mm512_set1_ps(1.f), _mm512_set1_ps(1e-9f), _mm512_fmadd_ps(a, b, s)));
#endif
#ifdef __AVX2__
    measure("f32 FMA ymm", 16, threads, seconds,
            KERNEL(__m256, __m256, _mm256_set1_ps(1.f), _mm256_set1_ps(1e-9f), _mm256_fmadd_ps(a, b, s)));
#endif
#ifdef __AVX2__  // (AVX2's int8 dots: byte pairs into int16 sums, as the AVX2 kernels take them)
    measure("int8 VPMADDUBSW + VPADDW ymm", 64, threads, seconds,
            KERNEL(__m256i, __m256i, _mm256_set1_epi8(1), _mm256_set1_epi8(1),
                   _mm256_add_epi16(s, _mm256_maddubs_epi16(a, b))));
#endif
#ifdef __AVX512VNNI__
    measure("int8 VPDPBUSD zmm", 128, threads, seconds,
            KERNEL(__m512i, __m512i, _mm512_set1_epi8(1), _mm512_set1_epi8(1), _mm512_dpbusd_epi32(s, a, b)));
#endif
#ifdef __AVXVNNI__
    measure("int8 VPDPBUSD ymm (AVX-VNNI)", 64, threads, seconds,
            KERNEL(__m256i, __m256i, _mm256_set1_epi8(1), _mm256_set1_epi8(1), _mm256_dpbusd_avx_epi32(s, a, b)));
#endif
#ifdef __AVX512BF16__
    measure("bf16 VDPBF16PS zmm", 64, threads, seconds,
            KERNEL(__m512, __m512bh, (__m512bh)_mm512_set1_epi16(0x3f80), (__m512bh)_mm512_set1_epi16(0x3f80),
                   _mm512_dpbf16_ps(s, a, b)));
#endif
  }
}
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=1.0, help="the shortest round per figure")
    args = parser.parse_args()
    compiler = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")
    if compiler is None:
        sys.exit("no C++ compiler found (set CXX)")
    with tempfile.TemporaryDirectory() as work:
        source, binary = os.path.join(work, "peak.cc"), os.path.join(work, "peak")
        with open(source, "w") as f:
            f.write(SOURCE)
        subprocess.run([compiler, "-O3", "-march=native", "-std=c++17", "-pthread", source, "-o", binary], check=True)
        lines = subprocess.run([binary, str(args.seconds)], check=True, capture_output=True, text=True).stdout
    print(cpu_line(machine_info()))
    print("| instruction | threads | GOP/s |\n|---|---:|---:|")
    for line in lines.splitlines():
        name, threads, rate = line.split("|")
        print(f"| {name} | {threads} | {float(rate):,.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
