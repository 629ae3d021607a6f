// The device transport interface: how a kernel reaches a peer's symmetric memory.
//
// Two implementations share one set of members, so a kernel is written once as a template on
// its transport:
//   MappedTransport   (mapped_transport.cuh): the peer's memory is mapped (NVLink, CUDA IPC,
//                     NVSHMEM's peer-to-peer): a put is the warp's own stores, today's path.
//   EmulatedTransport (emulated_transport.cuh): commands go through a ring in pinned host memory
//                     to the host proxy (host_proxy.h), which performs them with copy-engine
//                     copies; it stands in for a network transport in tests.
//
// Members (every one warp-collective: all 32 lanes call it, converged, with equal arguments):
//   char* local(SymmetricAddress a)          this rank's byte at `a` (to stage rows, to read)
//   put(peer, dst, src, bytes, lane)         src is local, dst on `peer`; non-blocking: src must
//                                            not change until quiet() returns
//   put_signal(peer, dst, src, bytes, sig, value, op, lane)
//                                            a put, then the signal word `sig` on `peer` set to /
//                                            advanced by `value`, visible only after this put's
//                                            bytes (and nothing else's)
//   signal(peer, sig, value, op, lane)       the signal word alone
//   fence(lane)                              this warp's later commands to a peer are delivered
//                                            after its earlier ones to that peer
//   quiet(lane)                              returns when every earlier command of this warp is
//                                            delivered (its sources may be reused); other warps'
//                                            commands are not waited for
//   wait(sig, value, peer)                   spins until this rank's word `sig` >= value
//                                            (acquire; bounded like every wait in sync.cuh)
// Puts move whole 16-byte vectors: offsets and byte counts are multiples of kBytesPerVector.
// Signal words are 8-byte aligned uint64 with one writer rank each (one word per source), so
// an add can be performed by whoever executes that rank's commands.
#pragma once

#include <cstdint>

#include "kernels/common/sync.cuh"
#include "transport/command_ring.h"
#include "transport/symmetric_address.h"

namespace jax_ep {
namespace transport {

// Base pointers of the registered regions as seen from this device: bases[rank * num_regions +
// region]. The emulated transport only needs this rank's row (peers are the proxy's business).
struct RegionTable {
  char* const* bases;  // device memory
  int num_regions;

  __device__ __forceinline__ char* at(int rank, SymmetricAddress address) const {
    return bases[rank * num_regions + static_cast<int>(address.region)] + address.offset;
  }
};

// Spins until this rank's signal word reaches `value` (shared by both transports: signals land
// in local memory however they were written).
__device__ __forceinline__ void wait_signal_at_least(const RegionTable& regions, int rank,
                                                     SymmetricAddress signal, uint64_t value,
                                                     const WaitContext& wait, int peer) {
  const uint64_t* word = reinterpret_cast<const uint64_t*>(regions.at(rank, signal));
  wait_flag(wait, word, value, peer);
}

}  // namespace transport
}  // namespace jax_ep
