// The device transport over peer mappings: puts are the warp's own 16-byte stores into the
// peer's mapped memory, signals are system-scope release stores / atomics. What the kernels do
// today, behind the interface of device_transport.cuh.
#pragma once

#include <cstdint>

#include "common/copy.cuh"
#include "common/limits.h"
#include "common/sync.cuh"
#include "transport/device_transport.cuh"

namespace jax_ep {
namespace transport {

__device__ __forceinline__ void red_add_release_sys(uint64_t* ptr, uint64_t value) {
  asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(ptr), "l"(value) : "memory");
}

struct MappedTransport {
  RegionTable regions;  // every rank's row: peers' bases are mapped pointers
  int rank;
  WaitContext wait_context;

  __device__ __forceinline__ char* local(SymmetricAddress address) const {
    return regions.at(rank, address);
  }

  __device__ __forceinline__ void put(int peer, SymmetricAddress dst, SymmetricAddress src,
                                      uint64_t bytes, int lane) const {
    // Sources are staged send regions written earlier by this kernel: read through L2.
    warp_copy_vectors<false>(reinterpret_cast<int4*>(regions.at(peer, dst)),
                             reinterpret_cast<const int4*>(local(src)),
                             static_cast<int64_t>(bytes / kBytesPerVector), lane);
  }

  __device__ __forceinline__ void signal(int peer, SymmetricAddress sig, uint64_t value,
                                         SignalOp op, int lane) const {
    // The lanes' earlier stores are ordered before lane 0's release by the warp barrier.
    __syncwarp();
    if (lane == 0) {
      uint64_t* word = reinterpret_cast<uint64_t*>(regions.at(peer, sig));
      if (op == SignalOp::kAdd) {
        red_add_release_sys(word, value);
      } else {
        st_release_sys(word, value);
      }
    }
    __syncwarp();
  }

  __device__ __forceinline__ void put_signal(int peer, SymmetricAddress dst, SymmetricAddress src,
                                             uint64_t bytes, SymmetricAddress sig, uint64_t value,
                                             SignalOp op, int lane) const {
    put(peer, dst, src, bytes, lane);
    signal(peer, sig, value, op, lane);
  }

  // Stores are ordered by a system-scope fence; they are complete once it has been passed, so
  // quiet is the same fence.
  __device__ __forceinline__ void fence(int /*lane*/) const {
    __syncwarp();
    __threadfence_system();
    __syncwarp();
  }

  __device__ __forceinline__ void quiet(int lane) const { fence(lane); }

  __device__ __forceinline__ void wait(SymmetricAddress sig, uint64_t value, int peer) const {
    wait_signal_at_least(regions, rank, sig, value, wait_context, peer);
  }
};

}  // namespace transport
}  // namespace jax_ep
