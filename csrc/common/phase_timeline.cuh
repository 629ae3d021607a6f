// Optional phase timeline of the low-latency kernels: when every block passes each phase, to find
// a launch's critical path on a GPU (profilers give a kernel's time and its warps' stall samples,
// not the order in which blocks wait for one another). Compiled out unless the build defines
// JAX_EP_PHASE_TIMELINE (a build setting of the same name); then thread 0 of every block keeps
// %globaltimer at each mark and, at the kernel's end, prints one line
//   jax_ep-timeline <op> <halves> <block> <mark 0 ns> <mark 1 ns> ... (0: not reached)
// which benchmarks/phase_timeline.py collects. Never in a release build: printf costs time.
#pragma once

#include <cstdint>
#ifdef JAX_EP_PHASE_TIMELINE
#include <cstdio>
#endif

#include "common/sync.cuh"

namespace jax_ep {

// Marks per kernel: the launch's start, then one per phase boundary.
constexpr int kTimelineMarks = 8;

#ifdef JAX_EP_PHASE_TIMELINE
__device__ __forceinline__ uint64_t* timeline_marks() {
  __shared__ uint64_t marks[kTimelineMarks];
  return marks;
}

// Thread 0 of the block records the time of mark `slot` (block-uniform call sites only).
__device__ __forceinline__ void timeline_mark(int slot) {
  if (threadIdx.x == 0 && slot < kTimelineMarks) timeline_marks()[slot] = global_timer_ns();
}

__device__ __forceinline__ void timeline_begin() {
  if (threadIdx.x == 0) {
    for (int i = 0; i < kTimelineMarks; ++i) timeline_marks()[i] = 0;
  }
  timeline_mark(0);
}

// `op`: the op's name; `halves`: 3 fused, 1 send, 2 receive (LowLatencyHalves).
__device__ __forceinline__ void timeline_print(const char* op, int halves) {
  if (threadIdx.x != 0) return;
  const uint64_t* m = timeline_marks();
  printf("jax_ep-timeline %s %d %d %llu %llu %llu %llu %llu %llu %llu %llu\n", op, halves,
         static_cast<int>(blockIdx.x), static_cast<unsigned long long>(m[0]),
         static_cast<unsigned long long>(m[1]), static_cast<unsigned long long>(m[2]),
         static_cast<unsigned long long>(m[3]), static_cast<unsigned long long>(m[4]),
         static_cast<unsigned long long>(m[5]), static_cast<unsigned long long>(m[6]),
         static_cast<unsigned long long>(m[7]));
}
#else
__device__ __forceinline__ void timeline_mark(int) {}
__device__ __forceinline__ void timeline_begin() {}
__device__ __forceinline__ void timeline_print(const char*, int) {}
#endif

static_assert(kTimelineMarks == 8, "timeline_print prints 8 marks");

}  // namespace jax_ep
