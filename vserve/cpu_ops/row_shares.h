// Row shares of a streamed weight, claimed by the threads that stream it (stream_rows below,
// which the quantized kernels call; stack.cpp's decode stack), the
// software prefetch of the rows ahead (fetch_ahead), and the pause of a spinning thread
// (cpu_relax: the decode stack's waits, park.h's woken threads).
#pragma once

#include <ATen/Parallel.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

namespace vserve_rows {

// one turn of a spin-wait: a pause (x86), else a yield
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

// Rows [0, n) of a weight in one contiguous share per thread, each in chunks of `chunk` rows
// that its owner claims one at a time from the front; a thread done with its own share takes
// the chunks left in the others' from their far end.
class RowShares {
 public:
  RowShares(int64_t n, int64_t threads, int64_t chunk)
      : n_(n), threads_(threads), chunk_(chunk), taken_(threads) {}
  // the shares of a weight of n rows: one per thread but at least min_share bytes each, in
  // chunks of 64-256 KB (stream_rows's split)
  static RowShares of(int64_t n, int64_t row_bytes, int64_t max_threads,
                      int64_t min_share = 64 << 10) {
    const int64_t threads =
        std::min<int64_t>(max_threads, std::max<int64_t>(1, n * row_bytes / min_share));
    const int64_t share_bytes = n * row_bytes / threads;
    const int64_t chunk = std::max<int64_t>(
        1, std::clamp<int64_t>(share_bytes / 16, 64 << 10, 256 << 10) / row_bytes);
    return RowShares(n, threads, chunk);
  }
  int64_t threads() const { return threads_; }
  int64_t total_chunks() const {
    int64_t s = 0;
    for (int64_t t = 0; t < threads_; ++t) s += chunks(t);
    return s;
  }
  void reset() {
    for (auto& t : taken_) t.v.store(0, std::memory_order_relaxed);
  }
  int64_t lo(int64_t t) const { return n_ * t / threads_; }
  int64_t chunks(int64_t t) const { return (n_ * (t + 1) / threads_ - lo(t) + chunk_ - 1) / chunk_; }
  // claims the next chunk of share t from its front (the owner) or its back (a helper)
  bool claim(int64_t t, bool front, int64_t& c) {
    auto& v = taken_[t].v;
    uint64_t cur = v.load(std::memory_order_relaxed);
    const uint64_t total = static_cast<uint64_t>(chunks(t));
    for (;;) {
      uint64_t f = cur >> 32, b = cur & 0xFFFFFFFFu;
      if (f + b >= total) return false;
      uint64_t next = front ? cur + (uint64_t{1} << 32) : cur + 1;
      if (v.compare_exchange_weak(cur, next, std::memory_order_relaxed)) {
        c = static_cast<int64_t>(front ? f : total - 1 - b);
        return true;
      }
    }
  }
  template <class Fn>
  void run(int64_t t, int64_t c, Fn& fn) const {
    int64_t a = lo(t) + c * chunk_;
    fn(a, std::min(n_ * (t + 1) / threads_, a + chunk_));
  }

 private:
  struct alignas(64) Taken {  // one cache line per share
    std::atomic<uint64_t> v{0};  // chunks taken from the front << 32 | from the back
    Taken() = default;
    Taken(const Taken&) {}  // copies (of an unclaimed plan) start unclaimed
  };
  int64_t n_, threads_, chunk_;
  std::vector<Taken> taken_;
};

// fn(lo, hi) over rows [0, n) of a streamed weight. Each thread streams its own contiguous
// share front to back (what the prefetchers read best), in chunks of 64-256 KB that it
// claims one at a time; a thread done with its share takes the chunks left in the others'
// from their far end. A thread the OS preempts (the engine's host work beside the forward,
// on a machine with no spare core) then no longer holds up the whole call at the join with
// its unread half (measured: the embedded model's head, 3.0 -> 4.0 ms a step under async).
// min_share: the fewest bytes worth a thread (streaming: ~64 KB; the GEMM, whose tiles are
// arithmetic-bound, one tile)
template <class Fn>
void stream_rows(int64_t n, int64_t row_bytes, Fn&& fn, int64_t min_share = 64 << 10) {
  auto shares = RowShares::of(n, row_bytes, at::get_num_threads(), min_share);
  const int64_t threads = shares.threads();
  if (threads <= 1) {
    fn(int64_t{0}, n);
    return;
  }
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      int64_t c;
      while (shares.claim(t, true, c)) shares.run(t, c, fn);
      for (int64_t o = 1; o < threads; ++o) {
        int64_t u = (t + o) % threads;
        while (shares.claim(u, false, c)) shares.run(u, c, fn);
      }
    }
  });
}

constexpr int64_t kStreamAhead = 4096;  // bytes ahead the int8 gemvs prefetch their weight
// A row's worth of lines kStreamAhead bytes ahead of row r, within a thread's rows
// [.., r1). Where a core's own share of DRAM bandwidth is set by how many misses it keeps in
// flight (a 2-core Xeon VM with AMX: 9-14 GB/s a thread from DRAM against 19-28 from cache),
// the hardware prefetchers alone leave the int8 gemv waiting on memory; measured there
// (benchmarks/quant_gemv_speed.py --compare, 2 threads, from DRAM) M = 1 Q8_0 27.6 -> 34.3
// GB/s, Q5_0 18.4 -> 28.4, Q4_K 23.1 -> 29.5, Q6_K 21.1 -> 31.5 (from cache within +-7%),
// the embedded model's batch-1 step 13.7 -> 10.6-11.0 ms; 8 KB ahead measured the same.
inline void fetch_ahead(const uint8_t* w, int64_t row_bytes, int64_t r, int64_t r1) {
  const uint8_t* p = w + r * row_bytes + kStreamAhead;
  const uint8_t* end = w + r1 * row_bytes;
  for (int64_t o = 0; o < row_bytes && p + o < end; o += 64) __builtin_prefetch(p + o, 0, 3);
}

}  // namespace vserve_rows
