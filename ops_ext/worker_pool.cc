// The CPU kernels' worker threads (worker_pool.h says what they promise).
//
// WHY not OpenMP or Paddle's pool: the items of one call must run whole on one thread each (results may
// not depend on the thread count), calls come every few tens of microseconds from one thread, and the
// pool must neither oversubscribe tensor-parallel ranks sharing the CPUs nor leave a sleeping worker's
// wake-up on the critical path. This is small enough to own.
#include "worker_pool.h"

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#define MTP_PAUSE() _mm_pause()
#else
#define MTP_PAUSE() std::this_thread::yield()
#endif

namespace {

constexpr auto kSpin = std::chrono::microseconds(50);  // a worker's busy wait for the next call
// ... then its wait that gives the core to any other runnable thread, before it sleeps. NOTE: at batch 1
// the Python between a step's kernels (and between steps) often takes longer than kSpin, and a worker
// woken from a futex joins a kernel too late to share it: block calls ran as if single-threaded. Waiting
// with sched_yield keeps the worker ready while the core is idle and costs a busy host nothing (one
// stream served +10-15%, 4 and 16 streams level; a 1 ms pause-spin had cost 7% at 16 streams).
constexpr auto kYieldSpin = std::chrono::microseconds(2000);
constexpr uint64_t kIndexBits = 32;
constexpr uint64_t kIndexMask = (uint64_t{1} << kIndexBits) - 1;

class Pool {
 public:
  static Pool& Get() {
    // NOTE: never destroyed: its workers wait on it until the process ends
    static Pool* pool = new Pool(mtp::CpuThreads() - 1);
    return *pool;
  }

  void Run(int64_t n, const std::function<void(int64_t)>& fn) {
    // NOTE: an item that calls ParallelFor itself runs it inline: the pool takes one call at a time
    if (workers_ == 0 || n < 2 || in_item_) {
      for (int64_t i = 0; i < n; ++i) fn(i);
      return;
    }
    std::lock_guard<std::mutex> one_call(call_mu_);
    const uint64_t gen = generation_.load(std::memory_order_relaxed) + 1;
    // NOTE: the ticket carries the generation, so a worker still holding an older call's job can never
    // claim an item of this one (its compare-exchange names the old generation). It is closed to the last
    // call first, and the job and size are released after it: a worker late to the last call that reads
    // this call's job or size (Loop) then finds this ticket, not the last one's spent ticket. Stored
    // after them, a size larger than the last call's left items of the spent ticket to claim, run with this
    // job (or the last one's, past its size), and counted in this call's done_, so Run could return while
    // an item still ran.
    ticket_.store(gen << kIndexBits, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    job_.store(&fn, std::memory_order_release);
    size_.store(n, std::memory_order_release);
    generation_.store(gen, std::memory_order_release);
    {
      std::lock_guard<std::mutex> lock(sleep_mu_);  // NOTE: orders the store before a sleeper's check
    }
    wake_.notify_all();
    Work(gen, fn, n);
    // NOTE: a worker descheduled mid-item (the cores are shared with the HTTP process) would keep a pure
    // spin busy for its whole time slice: after a while, give the core away between checks
    for (int spins = 0; done_.load(std::memory_order_acquire) < n; ++spins) {
      if (spins < 4096) {
        MTP_PAUSE();
      } else {
        std::this_thread::yield();
      }
    }
  }

 private:
  explicit Pool(int workers) : workers_(std::max(0, workers)) {
    for (int w = 0; w < workers_; ++w) std::thread([this] { Loop(); }).detach();
  }

  // Claim and run items of generation `gen` until none is left.
  void Work(uint64_t gen, const std::function<void(int64_t)>& fn, int64_t n) {
    for (;;) {
      uint64_t t = ticket_.load(std::memory_order_acquire);
      int64_t i;
      do {
        i = static_cast<int64_t>(t & kIndexMask);
        if ((t >> kIndexBits) != gen || i >= n) return;
      } while (!ticket_.compare_exchange_weak(t, t + 1, std::memory_order_acq_rel));
      in_item_ = true;
      fn(i);
      in_item_ = false;
      done_.fetch_add(1, std::memory_order_release);
    }
  }

  void Loop() {
    uint64_t seen = 0;
    for (;;) {
      uint64_t gen = WaitFor(seen);
      seen = gen;
      // NOTE: acquire: a job or size newer than `gen` comes with its call's ticket (Run)
      const auto* fn = job_.load(std::memory_order_acquire);
      const int64_t n = size_.load(std::memory_order_acquire);
      Work(gen, *fn, n);
    }
  }

  // The next generation after `seen`: spin a little, yield the core a while, then sleep until a call wakes us.
  uint64_t WaitFor(uint64_t seen) {
    const auto start = std::chrono::steady_clock::now();
    const auto until = start + kSpin;
    for (int i = 0;; ++i) {
      const uint64_t gen = generation_.load(std::memory_order_acquire);
      if (gen != seen) return gen;
      if ((i & 63) == 63 && std::chrono::steady_clock::now() > until) break;
      MTP_PAUSE();
    }
    const auto yield_until = start + kYieldSpin;
    for (int i = 0;; ++i) {
      const uint64_t gen = generation_.load(std::memory_order_acquire);
      if (gen != seen) return gen;
      if ((i & 15) == 15 && std::chrono::steady_clock::now() > yield_until) break;
      std::this_thread::yield();
    }
    std::unique_lock<std::mutex> lock(sleep_mu_);
    wake_.wait(lock, [&] { return generation_.load(std::memory_order_acquire) != seen; });
    return generation_.load(std::memory_order_acquire);
  }

  static thread_local bool in_item_;
  const int workers_;
  std::mutex call_mu_, sleep_mu_;
  std::condition_variable wake_;
  std::atomic<const std::function<void(int64_t)>*> job_{nullptr};
  std::atomic<int64_t> size_{0};
  std::atomic<int64_t> done_{0};
  std::atomic<uint64_t> ticket_{0};
  std::atomic<uint64_t> generation_{0};
};

thread_local bool Pool::in_item_ = false;

}  // namespace

int mtp::CpuThreads() {
  static const int threads = [] {
    cpu_set_t set;
    int cpus = sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set)
                                                              : static_cast<int>(std::thread::hardware_concurrency());
    // NOTE: not OMP_NUM_THREADS: importing Paddle sets it to 1 in every process that left it unset
    if (const char* wanted = std::getenv("MTP_CPU_THREADS")) {
      if (std::atoi(wanted) > 0) cpus = std::min(cpus, std::atoi(wanted));
    }
    return std::max(1, cpus);
  }();
  return threads;
}

void mtp::ParallelFor(int64_t n, const std::function<void(int64_t)>& fn) { Pool::Get().Run(n, fn); }
