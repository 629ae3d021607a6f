// The device transport through NVSHMEM's device API (device_transport.cuh's interface): puts and
// signals are NVSHMEM operations on the symmetric heap, performed by whatever NVSHMEM reaches the
// peer with (peer-to-peer stores, its host proxy, or a NIC). The regions must live on the
// symmetric heap (JAX_EP_PEER_MAPPING=nvshmem): a region of this rank and the same offset name the
// same bytes on every PE. Only with NVSHMEM's headers (JAX_EP_HAVE_NVSHMEM); the kernels that use
// it are compiled without relocatable device code and their module is registered with
// nvshmemx_culibrary_init (csrc/plugins/nvshmem_transport_kernels.cu).
#pragma once

#include <nvshmem.h>
#include <nvshmemx.h>

#include <cstdint>

#include "common/limits.h"
#include "transport/device_transport.cuh"

namespace jax_ep {
namespace transport {

struct NvshmemTransport {
  RegionTable regions;  // this rank's row: symmetric addresses
  int rank;
  const int* pe_of_rank;  // [num_ranks] the NVSHMEM PE of every rank
  WaitContext wait_context;

  __device__ __forceinline__ char* local(SymmetricAddress address) const {
    return regions.at(rank, address);
  }

  __device__ __forceinline__ void put(int peer, SymmetricAddress dst, SymmetricAddress src,
                                      uint64_t bytes, int /*lane*/) const {
    nvshmemx_putmem_nbi_warp(local(dst), local(src), bytes, pe_of_rank[peer]);
  }

  __device__ __forceinline__ void signal(int peer, SymmetricAddress sig, uint64_t value,
                                         SignalOp op, int lane) const {
    __syncwarp();
    if (lane == 0) {
      nvshmemx_signal_op(reinterpret_cast<uint64_t*>(local(sig)), value, signal_op(op),
                         pe_of_rank[peer]);
    }
    __syncwarp();
  }

  __device__ __forceinline__ void put_signal(int peer, SymmetricAddress dst, SymmetricAddress src,
                                             uint64_t bytes, SymmetricAddress sig, uint64_t value,
                                             SignalOp op, int /*lane*/) const {
    nvshmemx_putmem_signal_nbi_warp(local(dst), local(src), bytes,
                                    reinterpret_cast<uint64_t*>(local(sig)), value, signal_op(op),
                                    pe_of_rank[peer]);
  }

  // NVSHMEM orders and completes the operations of the calling PE: one lane speaks for the warp
  // once the warp's lanes have issued theirs.
  __device__ __forceinline__ void fence(int lane) const {
    __syncwarp();
    if (lane == 0) nvshmem_fence();
    __syncwarp();
  }

  __device__ __forceinline__ void quiet(int lane) const {
    __syncwarp();
    if (lane == 0) nvshmem_quiet();
    __syncwarp();
  }

  __device__ __forceinline__ void wait(SymmetricAddress sig, uint64_t value, int peer) const {
    wait_signal_at_least(regions, rank, sig, value, wait_context, peer);
  }

  static __device__ __forceinline__ int signal_op(SignalOp op) {
    return op == SignalOp::kAdd ? NVSHMEM_SIGNAL_ADD : NVSHMEM_SIGNAL_SET;
  }
};

}  // namespace transport
}  // namespace jax_ep
