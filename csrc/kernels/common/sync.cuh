// Memory-ordering and bounded-wait helpers shared by every kernel.
//
// Flags are 64-bit words holding a per-mode sequence tag; a waiter spins until the word reaches
// the tag it expects (tags only grow, so >= is safe against a peer that already moved on).
#pragma once

#include <cstdint>

#include "runtime/context.h"

namespace jax_ep {

__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* ptr) {
  uint64_t value;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(value) : "l"(ptr) : "memory");
  return value;
}

__device__ __forceinline__ void st_release_sys(uint64_t* ptr, uint64_t value) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(ptr), "l"(value) : "memory");
}

__device__ __forceinline__ int32_t ld_acquire_sys(const int32_t* ptr) {
  int32_t value;
  asm volatile("ld.acquire.sys.global.s32 %0, [%1];" : "=r"(value) : "l"(ptr) : "memory");
  return value;
}

__device__ __forceinline__ void st_release_sys(int32_t* ptr, int32_t value) {
  asm volatile("st.release.sys.global.s32 [%0], %1;" ::"l"(ptr), "r"(value) : "memory");
}

// Records who waited for whom in host-mapped memory, then kills the kernel (and with it the
// CUDA context): a peer that never arrives must not hang the job. The host reads the record.
__device__ __noinline__ inline void report_timeout_and_trap(TimeoutRecord* record, int rank,
                                                            int peer, WaitPhase phase,
                                                            uint64_t seq) {
  if (record != nullptr) {
    record->rank = rank;
    record->peer = peer;
    record->phase = static_cast<int32_t>(phase);
    record->seq = seq;
    __threadfence_system();
    record->timed_out = 1;
    __threadfence_system();
  }
  __trap();
}

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t ns;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));
  return ns;
}

// Spins until *flag >= tag (acquire), or traps after timeout_ns of wall time (%globaltimer,
// which does not depend on the SM clock).
__device__ __forceinline__ uint64_t wait_flag_at_least(const uint64_t* flag, uint64_t tag,
                                                       uint64_t timeout_ns,
                                                       TimeoutRecord* record, int rank, int peer,
                                                       WaitPhase phase) {
  uint64_t value = ld_acquire_sys(flag);
  if (value >= tag) return value;
  const uint64_t start = global_timer_ns();
  while ((value = ld_acquire_sys(flag)) < tag) {
    if (global_timer_ns() - start > timeout_ns) {
      report_timeout_and_trap(record, rank, peer, phase, tag);
    }
  }
  return value;
}

}  // namespace jax_ep
