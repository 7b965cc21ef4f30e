// The worker's host work between two forwards, with its OpenMP team asleep (`parked`).
//
// After a parallel region libgomp keeps the team's other threads spinning for GOMP_SPINCOUNT
// iterations (300k, 7.5 ms on a Zen 4: longer than a decode step) so that the next region
// starts without a wake-up. A worker whose threads fill every core of the host then holds
// them all while its main thread alone replies, takes the next step and prepares its inputs:
// the engine core, woken by that reply, finds no free core, takes one from the next forward
// and stalls its whole team. `run_parked` runs that host work on the calling thread inside a
// region whose other threads block on a condition variable instead, so their cores are free
// for the engine core and the front end during it; they wake when it ends and spin again
// for the forward (workers/host_gap.py decides when).
#pragma once

#include <omp.h>

#include <condition_variable>
#include <exception>
#include <mutex>

namespace vserve_park {

// fn() on this thread while the other `threads - 1` threads of the OpenMP pool sleep; fn's
// exception is rethrown here. One thread, or inside a parallel region: fn() alone.
template <class Fn>
void run_parked(int threads, Fn&& fn) {
  if (threads <= 1 || omp_in_parallel()) {
    fn();
    return;
  }
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  std::exception_ptr error;
#pragma omp parallel num_threads(threads)
  {
    if (omp_get_thread_num() == 0) {
      try {
        fn();
      } catch (...) {  // an exception must not leave a parallel region
        error = std::current_exception();
      }
      {
        std::lock_guard<std::mutex> lock(mu);
        done = true;
      }
      cv.notify_all();
    } else {
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] { return done; });
    }
  }
  if (error) std::rethrow_exception(error);
}

}  // namespace vserve_park
