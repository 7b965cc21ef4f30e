// The worker's host work between two forwards, with its OpenMP team asleep (`parked`).
//
// After a parallel region libgomp keeps the team's other threads spinning for GOMP_SPINCOUNT
// iterations (300k, 7.5 ms on a Zen 4: longer than a decode step) so that the next region
// starts without a wake-up. A worker whose threads fill every core of the host then holds
// them all while its main thread alone replies, takes the next step and prepares its inputs:
// the engine core, woken by that reply, finds no free core, takes one from the next forward
// and stalls its whole team. `run_parked` runs that host work on the calling thread inside a
// region whose other threads block on a condition variable instead, so their cores are free
// for the engine core and the front end during it; they wake when fn calls `unpark` (or
// returns) and spin until it returns, ready for the forward (workers/host_gap.py decides
// when).
#pragma once

#include <omp.h>

#include <atomic>
#include <condition_variable>
#include <exception>
#include <mutex>

#include "row_shares.h"  // cpu_relax

namespace vserve_park {

// what the parked threads wait on; `unpark` wakes them before fn has returned
struct ParkState {
  std::mutex mu;
  std::condition_variable cv;
  bool wake = false;              // under mu: leave the condition variable
  std::atomic<bool> done{false};  // fn returned: leave the region
};

// the park that fn (on the calling thread) runs in, if any
inline ParkState*& current_park() {
  static thread_local ParkState* park = nullptr;
  return park;
}

// Called from fn: the parked threads wake now and spin until fn returns. A sleeping thread
// takes a while to wake (~0.3 ms measured on a 2-core VM, whose idle vCPU must be woken
// first), and the forward after the park cannot start without it; fn calls this when the
// host work that needed the cores is over, so the wake-up runs under fn's own last part.
// Outside a park: nothing.
inline void wake(ParkState& s) {
  {
    std::lock_guard<std::mutex> lock(s.mu);
    if (s.wake) return;
    s.wake = true;
  }
  s.cv.notify_all();
}

inline void unpark() {
  if (ParkState* s = current_park()) wake(*s);
}

// fn() on this thread while the other `threads - 1` threads of the OpenMP pool sleep (until
// fn calls `unpark`, or returns); fn's exception is rethrown here. One thread, or inside a
// parallel region: fn() alone.
template <class Fn>
void run_parked(int threads, Fn&& fn) {
  if (threads <= 1 || omp_in_parallel()) {
    fn();
    return;
  }
  ParkState state;
  std::exception_ptr error;
#pragma omp parallel num_threads(threads)
  {
    if (omp_get_thread_num() == 0) {
      ParkState* outer = current_park();
      current_park() = &state;
      try {
        fn();
      } catch (...) {  // an exception must not leave a parallel region
        error = std::current_exception();
      }
      current_park() = outer;
      state.done.store(true, std::memory_order_release);
      wake(state);
    } else {
      {
        std::unique_lock<std::mutex> lock(state.mu);
        state.cv.wait(lock, [&] { return state.wake; });
      }
      while (!state.done.load(std::memory_order_acquire)) vserve_rows::cpu_relax();
    }
  }
  if (error) std::rethrow_exception(error);
}

}  // namespace vserve_park
