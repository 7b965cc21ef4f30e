// Row shares of a streamed weight, claimed by the threads that stream it (quant.cpp's
// stream_rows, stack.cpp's decode stack).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

namespace vserve_rows {

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

}  // namespace vserve_rows
