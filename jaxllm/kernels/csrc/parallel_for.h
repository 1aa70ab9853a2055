// Work sharing over XLA's intra-op thread pool, for the kernels' FFI handlers.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace jaxllm {

// A spin-wait loop's pause (x86 `pause`; elsewhere nothing).
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// The state shared by the calling thread and the pool tasks of one parallel_for.
template <typename State>
struct ParallelFor {
  std::function<void(int64_t, State&)> fn;
  int64_t n = 0;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::mutex mu;
  std::condition_variable cv;

  void drain() {
    std::unique_ptr<State> state(new State);
    for (int64_t i; (i = next.fetch_add(1)) < n;) {
      fn(i, *state);
      if (done.fetch_add(1) + 1 == n) {
        std::lock_guard<std::mutex> lock(mu);
        cv.notify_all();
      }
    }
  }
};

// Runs fn(i, state) for every i in [0, n) on the calling thread and XLA's intra-op pool,
// handing out indices from an atomic counter (callers order them costliest first); each
// thread that takes part has its own State on the heap (a pool thread's stack is small).
// Pool tasks may start after this returns (XLA promises neither parallelism nor timing), so
// they share only this ref-counted state, and late ones find no index left.
template <typename State>
void parallel_for(xla::ffi::ThreadPool& pool, int64_t n, std::function<void(int64_t, State&)> fn) {
  if (n <= 0) return;
  auto work = std::make_shared<ParallelFor<State>>();
  work->fn = std::move(fn);
  work->n = n;
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), n) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { work->drain(); });
  work->drain();
  // The last items usually finish within microseconds of this thread's: wait for them spinning
  // (bounded) rather than sleeping on the condition variable, whose wake-up is slower.
  for (int spin = 0; spin < 20000 && work->done.load(std::memory_order_acquire) != n; ++spin) cpu_relax();
  std::unique_lock<std::mutex> lock(work->mu);
  work->cv.wait(lock, [&] { return work->done.load() == n; });
}

struct NoState {};  // the State of work that needs none

// Runs run(item, ahead) for every item in [0, count) on the calling thread and the pool, each
// thread claiming its next item before it runs the current one: `ahead` is the item the same
// thread runs next (-1: none), so that it can bring that item's data into cache meanwhile.
template <typename Fn>
void parallel_for_claiming_ahead(xla::ffi::ThreadPool& pool, int64_t count, Fn run) {
  if (count <= 0) return;
  std::atomic<int64_t> next{0};
  parallel_for<NoState>(pool, std::clamp<int64_t>(pool.num_threads(), 1, count), [&](int64_t, NoState&) {
    for (int64_t item = next.fetch_add(1); item < count;) {
      const int64_t ahead = next.fetch_add(1);
      run(item, ahead < count ? ahead : -1);
      item = ahead;
    }
  });
}

// The same for work that needs no per-thread state.
inline void parallel_for(xla::ffi::ThreadPool& pool, int64_t n, std::function<void(int64_t)> fn) {
  parallel_for<NoState>(pool, n, [&fn](int64_t i, NoState&) { fn(i); });
}

}  // namespace jaxllm
