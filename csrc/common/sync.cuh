// Memory-ordering and bounded-wait helpers shared by every kernel.
//
// Flags are 64-bit words holding a per-mode sequence tag; a waiter spins until the word reaches
// the tag it expects (tags only grow, so >= is safe against a peer that already moved on).
#pragma once

#include <cstdint>

#include "common/wait_phase.h"

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
                                                       uint64_t timeout_ns, TimeoutRecord* record,
                                                       int rank, int peer, WaitPhase phase) {
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

// Count words carry a 32-bit tag and a 32-bit payload in one 64-bit store, so a reader that sees
// the tag also sees the payload: no separate flag, no fence between two stores.
__host__ __device__ constexpr uint64_t pack_tagged_count(uint64_t tag, uint32_t count) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(tag)) << 32) | count;
}

// Words written and read on one device that publish nothing but their own value.
__device__ __forceinline__ uint64_t ld_relaxed_gpu(const uint64_t* ptr) {
  uint64_t value;
  asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(value) : "l"(ptr) : "memory");
  return value;
}

__device__ __forceinline__ void st_relaxed_gpu(uint64_t* ptr, uint64_t value) {
  asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(ptr), "l"(value) : "memory");
}

// True when the tagged count word `value` carries the low 32 bits of `tag`.
__device__ __forceinline__ bool has_tag(uint64_t value, uint64_t tag) {
  return static_cast<uint32_t>(value >> 32) == static_cast<uint32_t>(tag);
}

// Spins until the 32-bit tag of *word equals the low 32 bits of `tag`, then returns the 32-bit
// payload. Equality keeps it right across the 2^32 wrap-around; callers make sure a word is not
// rewritten before its reader consumed it (the normal mode alternates two matrices by tag
// parity). Bounded like wait_flag_at_least. kSystem: acquire at system scope (a peer's word
// that publishes what it wrote before); else relaxed at GPU scope (a word of this device that
// carries only its count).
template <bool kSystem = true>
__device__ __forceinline__ uint32_t wait_tagged_count(const uint64_t* word, uint64_t tag,
                                                      uint64_t timeout_ns, TimeoutRecord* record,
                                                      int rank, int peer, WaitPhase phase) {
  auto load = [word] {
    if constexpr (kSystem) {
      return ld_acquire_sys(word);
    } else {
      return ld_relaxed_gpu(word);
    }
  };
  uint64_t value = load();
  if (has_tag(value, tag)) return static_cast<uint32_t>(value);
  const uint64_t start = global_timer_ns();
  while (!has_tag(value = load(), tag)) {
    if (global_timer_ns() - start > timeout_ns) {
      report_timeout_and_trap(record, rank, peer, phase, tag);
    }
  }
  return static_cast<uint32_t>(value);
}

// Everything one bounded wait needs besides the flag: who waits, the bound and where to report.
struct WaitContext {
  uint64_t timeout_ns;
  TimeoutRecord* record;  // host-mapped; device pointer of the mapping
  int32_t rank;
  int32_t phase;  // WaitPhase
};

__device__ __forceinline__ void wait_flag(const WaitContext& wait, const uint64_t* flag,
                                          uint64_t tag, int peer) {
  wait_flag_at_least(flag, tag, wait.timeout_ns, wait.record, wait.rank, peer,
                     static_cast<WaitPhase>(wait.phase));
}

// Grid-wide "last block out" bookkeeping shared by the transfer kernels: every block calls this
// once at its very end; the last one resets the call's counters for the next call (`counters`:
// the work item, the finished blocks, then num_counters - 2 words of the kernel's own) and
// publishes the sequence number `tag` (read at the start of the next call, after a kernel
// boundary).
__device__ __forceinline__ void finish_transfer_block(uint32_t* counters, int num_counters,
                                                      uint64_t* seq, uint64_t tag) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    const uint32_t done = atomicAdd(counters + 1, 1u);
    if (done == gridDim.x - 1) {
      for (int i = 0; i < num_counters; ++i) {
        reinterpret_cast<volatile uint32_t*>(counters)[i] = 0;
      }
      *reinterpret_cast<volatile uint64_t*>(seq) = tag;
    }
  }
}

// Hands out work items in increasing order to the blocks of a grid (all threads get the same
// index). Items are claimed in order, so every item below a claimed one is already claimed by a
// running block: a block that waits for a peer never starves the items that peer waits for.
__device__ __forceinline__ int claim_work_item(uint32_t* work_counter, int* shared_item) {
  __syncthreads();  // everyone has read the previous value
  if (threadIdx.x == 0) *shared_item = static_cast<int>(atomicAdd(work_counter, 1u));
  __syncthreads();
  return *shared_item;
}

}  // namespace jax_ep
