// The CPU kernels' worker threads: one per CPU this process may use beyond the calling thread.
#pragma once
#include <cstdint>
#include <functional>

namespace mtp {

// fn(i) for i in [0, n), the calling thread and the workers taking items in turn; returns when every
// item is done. One call at a time (a rank has one device thread). A worker that wakes late finds the
// items taken and touches nothing, so a sleeping worker never delays a call: the caller does the work.
//
// Workers spin for 50 us after their last item, then wait up to 2 ms yielding the core to any other
// runnable thread, before they sleep: a step's kernels come tens to hundreds of microseconds apart, and a
// worker woken from a futex arrives too late to share a kernel.
void ParallelFor(int64_t n, const std::function<void(int64_t)>& fn);

// Threads a ParallelFor call may use, the caller included: the CPUs of this process's affinity mask, at
// most MTP_CPU_THREADS when that is set (the launcher sets it from parallel.cpu_threads, and splits
// the host among its ranks under tensor parallelism).
int CpuThreads();

}  // namespace mtp
