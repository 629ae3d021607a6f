// The device transport interface: how a kernel reaches a peer's symmetric memory.
//
// Every implementation has one set of members, so a kernel is written once as a template on
// its transport:
//   MappedTransport   (mapped/mapped_transport.cuh): the peer's memory is mapped (NVLink, CUDA
//                     IPC): a put is the warp's own stores.
//   NvshmemTransport  (nvshmem/nvshmem_transport.cuh): NVSHMEM's device API (the NVSHMEM plugin
//                     only).
//   EmulatedTransport (emulator/emulated_transport.cuh): commands go through a ring in pinned
//                     host memory to a host proxy, which performs them with copy-engine copies;
//                     it stands in for a network transport in tests (the test module only).
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
#include <type_traits>
#include <utility>

#include "common/sync.cuh"
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

// The steps of the ordering contract (docs/transport.md) that a kernel takes by itself, around
// its transport calls. A kernel asks `keeps(t, rule)` before each; every transport keeps them all
// (the call is the constant true), except the emulator's, which the test module builds with a
// protocol mutant that breaks one, so that its tests show the emulator catches it
// (emulator/mutant.h). The mutants that a transport call alone breaks (a fence dropped, a
// signal before its put's data, a source outside every region) are the emulator's own.
enum class Rule : uint32_t {
  kQuietBeforeReuse = 1,  // a send slot is restaged only after the quiet that covers its put
  kQuietBeforeEnd = 2,    // a send half quiets its puts before it ends
  kSignalAfterData = 3,   // a word that says "rows landed" is signalled after their puts
};

// Whether Transport may break a rule: it has a member `bool keeps(Rule) const`.
template <typename Transport, typename = void>
struct MayBreakRules : std::false_type {};
template <typename Transport>
struct MayBreakRules<Transport,
                     std::void_t<decltype(std::declval<const Transport&>().keeps(Rule{}))>>
    : std::true_type {};

template <typename Transport>
__device__ __forceinline__ bool keeps(const Transport& t, Rule rule) {
  if constexpr (MayBreakRules<Transport>::value) {
    return t.keeps(rule);
  } else {
    return true;
  }
}

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
