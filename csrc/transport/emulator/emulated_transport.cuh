// The device side of the emulated transport: every put, signal and quiet becomes one command in
// a ring in pinned host memory (command_ring.h); the host proxy (host_proxy.h) performs it with
// copy-engine copies. The kernel never touches a peer's memory, as over a network.
//
// One object per warp (it holds the warp's pending fence in a register). Lane 0 writes the
// command; the other lanes only keep the warp converged. Built only into the test module, where
// the rank's queue record (command_ring.h, EmulatedQueue) may carry a protocol mutant: the
// transport breaks no_fence, signal_before_data (in put_signal) and unregistered_source itself
// and tells the kernels, through keeps() (device_transport.cuh, Rule), which step to skip for
// the others.
#pragma once

#include <cstdint>

#include "common/sync.cuh"
#include "transport/device_transport.cuh"
#include "transport/emulator/command_ring.h"
#include "transport/emulator/mutant.h"

namespace jax_ep {
namespace transport {

struct EmulatedTransport {
  RegionTable regions;  // only this rank's row is read
  RingView ring;        // this warp's queue
  int rank;
  uint32_t warp;  // rank-wide warp index: keys quiet and fence in the proxy
  WaitContext wait_context;
  Mutant mutant = Mutant::kNone;
  bool fence_pending = false;

  // The emulated transport of one warp from its rank's queue record (device memory).
  static __device__ __forceinline__ EmulatedTransport of_queue(RegionTable regions,
                                                               const void* queue, int rank,
                                                               uint32_t warp, WaitContext wait) {
    const EmulatedQueue* record = static_cast<const EmulatedQueue*>(queue);
    return EmulatedTransport{regions, record->ring, rank, warp, wait, record->mutant};
  }

  // Whether the kernel takes `rule`'s step (device_transport.cuh): all but the mutant's.
  __device__ __forceinline__ bool keeps(Rule rule) const {
    switch (mutant) {
      case Mutant::kReuseBeforeQuiet:
        return rule != Rule::kQuietBeforeReuse;
      case Mutant::kNoFinalQuiet:
        return rule != Rule::kQuietBeforeEnd;
      case Mutant::kSignalBeforeData:
        return rule != Rule::kSignalAfterData;
      default:
        return true;
    }
  }

  // Whether the network loses this rank's signals to `peer` (lost_signals: every other rank).
  __device__ __forceinline__ bool loses_signal_to(int peer) const {
    return mutant == Mutant::kLostSignals && peer != rank;
  }

  // A put's source as the mutant names it: unregistered_source names a region nobody registered.
  __device__ __forceinline__ SymmetricAddress source(SymmetricAddress src) const {
    return mutant == Mutant::kUnregisteredSource ? SymmetricAddress{kUnregisteredRegion, src.offset}
                                                 : src;
  }

  __device__ __forceinline__ char* local(SymmetricAddress address) const {
    return regions.at(rank, address);
  }

  // Lane 0 only. Claims a slot, waits (bounded) until the proxy has freed it, fills it and
  // publishes it with a system-scope release, so the proxy that acquires `ready` sees every
  // field. Returns the command's position in the ring.
  __device__ __forceinline__ uint64_t push(TransportCommand command) {
    command.warp = warp;
    command.flags |= fence_pending ? kFenceBefore : 0u;
    const uint64_t position = atomicAdd(reinterpret_cast<unsigned long long*>(ring.reserve), 1ull);
    if (position >= ring.capacity) {
      wait_flag(wait_context, ring.consumed, position + 1 - ring.capacity, rank);
    }
    volatile TransportCommand* slot = ring.slots + (position & (ring.capacity - 1));
    slot->op = command.op;
    slot->flags = command.flags;
    slot->warp = command.warp;
    slot->peer = command.peer;
    slot->src_region = command.src_region;
    slot->dst_region = command.dst_region;
    slot->signal_region = command.signal_region;
    slot->signal_op = command.signal_op;
    slot->src_offset = command.src_offset;
    slot->dst_offset = command.dst_offset;
    slot->signal_offset = command.signal_offset;
    slot->bytes = command.bytes;
    slot->signal_value = command.signal_value;
    st_release_sys(const_cast<uint64_t*>(&slot->ready), position + 1);
    return position;
  }

  // Called by the whole warp; lane 0 pushes. The source bytes were written by all lanes: the
  // warp barrier orders them before lane 0's release (the proxy reads them after its acquire).
  __device__ __forceinline__ uint64_t push_from_warp(const TransportCommand& command, int lane) {
    __syncwarp();
    uint64_t position = 0;
    if (lane == 0) position = push(command);
    fence_pending = false;
    __syncwarp();
    return __shfl_sync(0xffffffffu, position, 0);
  }

  // The fields of a command: its kind and peer, the data (put), the signal (signal).
  static __device__ __forceinline__ TransportCommand command_of(CommandOp op, int peer) {
    TransportCommand command = {};
    command.op = static_cast<uint32_t>(op);
    command.peer = peer;
    return command;
  }
  static __device__ __forceinline__ void set_data(TransportCommand& command, SymmetricAddress dst,
                                                  SymmetricAddress src, uint64_t bytes) {
    command.src_region = src.region;
    command.src_offset = src.offset;
    command.dst_region = dst.region;
    command.dst_offset = dst.offset;
    command.bytes = bytes;
  }
  static __device__ __forceinline__ void set_signal(TransportCommand& command, SymmetricAddress sig,
                                                    uint64_t value, SignalOp op) {
    command.signal_region = sig.region;
    command.signal_offset = sig.offset;
    command.signal_value = value;
    command.signal_op = static_cast<uint32_t>(op);
  }

  __device__ __forceinline__ void put(int peer, SymmetricAddress dst, SymmetricAddress src,
                                      uint64_t bytes, int lane) {
    TransportCommand command = command_of(CommandOp::kPut, peer);
    set_data(command, dst, source(src), bytes);
    push_from_warp(command, lane);
  }

  __device__ __forceinline__ void put_signal(int peer, SymmetricAddress dst, SymmetricAddress src,
                                             uint64_t bytes, SymmetricAddress sig, uint64_t value,
                                             SignalOp op, int lane) {
    if (mutant == Mutant::kSignalBeforeData) {  // the signal, then the data it should follow
      signal(peer, sig, value, op, lane);
      put(peer, dst, src, bytes, lane);
      return;
    }
    if (loses_signal_to(peer)) {
      put(peer, dst, src, bytes, lane);
      return;
    }
    TransportCommand command = command_of(CommandOp::kPutSignal, peer);
    set_data(command, dst, source(src), bytes);
    set_signal(command, sig, value, op);
    push_from_warp(command, lane);
  }

  __device__ __forceinline__ void signal(int peer, SymmetricAddress sig, uint64_t value,
                                         SignalOp op, int lane) {
    if (loses_signal_to(peer)) return;
    TransportCommand command = command_of(CommandOp::kSignal, peer);
    set_signal(command, sig, value, op);
    push_from_warp(command, lane);
  }

  // Marks the warp's next command; costs no slot.
  __device__ __forceinline__ void fence(int /*lane*/) {
    if (mutant != Mutant::kNoFence) fence_pending = true;
  }

  // The proxy writes acks[warp] = position + 1 once this warp's earlier commands are delivered.
  __device__ __forceinline__ void quiet(int lane) {
    const TransportCommand command = command_of(CommandOp::kQuiet, rank);
    const uint64_t position = push_from_warp(command, lane);
    if (lane == 0) wait_flag(wait_context, ring.acks + warp, position + 1, rank);
    __syncwarp();
  }

  __device__ __forceinline__ void wait(SymmetricAddress sig, uint64_t value, int peer) const {
    wait_signal_at_least(regions, rank, sig, value, wait_context, peer);
  }
};

}  // namespace transport
}  // namespace jax_ep
