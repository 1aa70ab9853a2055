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

// The count of a parallel loop's finished indices, shared by the calling thread and its pool tasks.
struct Completion {
  int64_t n = 0;
  std::atomic<int64_t> done{0};
  std::mutex mu;
  std::condition_variable cv;

  void finished_one() {
    if (done.fetch_add(1) + 1 == n) {
      std::lock_guard<std::mutex> lock(mu);
      cv.notify_all();
    }
  }
  // Returns once all n are done. The last ones usually finish within microseconds of the
  // caller's: wait for them spinning (bounded) rather than sleeping on the condition variable,
  // whose wake-up is slower.
  void wait() {
    for (int spin = 0; spin < 20000 && done.load(std::memory_order_acquire) != n; ++spin) cpu_relax();
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return done.load() == n; });
  }
};

// The state shared by the calling thread and the pool tasks of one parallel_for.
template <typename State>
struct ParallelFor : Completion {
  std::function<void(int64_t, State&)> fn;
  std::atomic<int64_t> next{0};

  void drain() {
    std::unique_ptr<State> state(new State);
    for (int64_t i; (i = next.fetch_add(1)) < n;) {
      fn(i, *state);
      finished_one();
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
  work->wait();
}

struct NoState {};  // the State of work that needs none

// The state shared by the threads of one parallel_for_shares: share t's unclaimed indices
// [front, back) packed in one word, front in the high half (indices below 2^32).
template <typename State>
struct ParallelShares : Completion {
  std::function<void(int64_t, State&)> fn;
  int64_t shares = 0;
  std::unique_ptr<std::atomic<uint64_t>[]> range;
  std::atomic<int64_t> ids{1};  // the calling thread is share 0

  // Claims share s's first (front) or last index into i; false once it has none.
  bool claim(int64_t s, bool front, int64_t& i) {
    uint64_t v = range[s].load(std::memory_order_relaxed);
    for (;;) {
      const uint64_t f = v >> 32, b = v & 0xffffffffu;
      if (f >= b) return false;
      const uint64_t want = front ? ((f + 1) << 32 | b) : (f << 32 | (b - 1));
      if (range[s].compare_exchange_weak(v, want, std::memory_order_acq_rel)) {
        i = static_cast<int64_t>(front ? f : b - 1);
        return true;
      }
    }
  }
  // Share `id`'s indices in order, then the others' from their backs.
  void drain(int64_t id) {
    std::unique_ptr<State> state(new State);
    int64_t i;
    if (id < shares)
      while (claim(id, true, i)) fn(i, *state), finished_one();
    for (int64_t k = 1; k <= shares; ++k)
      while (claim((id + k) % shares, false, i)) fn(i, *state), finished_one();
  }
};

// parallel_for with each thread's indices neighbours: thread t (of T taking part) runs its share
// [t n / T, (t + 1) n / T) in order, then takes the others' last indices while any are left. Where
// index order is memory order, each thread streams one range (and its prefetches ahead land in
// its own next item) rather than hopping between the threads' items.
template <typename State>
void parallel_for_shares(xla::ffi::ThreadPool& pool, int64_t n, std::function<void(int64_t, State&)> fn) {
  if (n <= 0) return;
  auto work = std::make_shared<ParallelShares<State>>();
  work->fn = std::move(fn);
  work->n = n;
  const int64_t shares = work->shares = std::min<int64_t>(std::max<int64_t>(1, pool.num_threads()), n);
  work->range.reset(new std::atomic<uint64_t>[shares]);
  for (int64_t t = 0; t < shares; ++t)
    work->range[t].store(static_cast<uint64_t>(t * n / shares) << 32 | static_cast<uint64_t>((t + 1) * n / shares));
  for (int64_t t = 1; t < shares; ++t) pool.Schedule([work] { work->drain(work->ids.fetch_add(1)); });
  work->drain(0);
  work->wait();
}

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
