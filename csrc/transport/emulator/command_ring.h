// The command record a kernel hands to the host proxy, and the ring of them in pinned host memory.
//
// Shared by the device producer (emulated_transport.cuh), the host proxy (host_proxy.h) and the
// tests' host producer below, so all three agree on one layout. Multi-producer, one consumer:
// a producer claims a position with an atomic add on `reserve`, waits until the slot is free
// (position - *consumed < capacity), fills it, and publishes it last by a system-scope release
// store of `ready = position + 1`. The proxy acquires `ready`, copies the command out and
// releases `consumed`. Positions are 64-bit and only grow, so a slot's `ready` never repeats.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#if !defined(__CUDA_ARCH__)
#include <thread>
#endif

#include "transport/emulator/mutant.h"
#include "transport/symmetric_address.h"  // SignalOp

namespace jax_ep {
namespace transport {

enum class CommandOp : uint32_t {
  kPut = 1,        // bytes from the local src to dst on `peer`
  kPutSignal = 2,  // a put, then the signal word on `peer`, applied after this put's data only
  kSignal = 3,     // the signal word on `peer` alone
  kQuiet = 4,      // completes the issuing warp's earlier commands, then writes its ack word
};

// kFenceBefore: not delivered before any earlier command of the same warp to the same peer
// (device fence() marks the warp's next command; a fence with nothing after it orders nothing).
constexpr uint32_t kFenceBefore = 1u;

struct TransportCommand {
  uint32_t op;     // CommandOp
  uint32_t flags;  // kFenceBefore
  uint32_t warp;   // issuing warp (a rank-wide index): quiet and fence are per warp
  int32_t peer;    // destination rank
  uint32_t src_region;
  uint32_t dst_region;
  uint32_t signal_region;
  uint32_t signal_op;  // SignalOp
  uint64_t src_offset;
  uint64_t dst_offset;
  uint64_t signal_offset;
  uint64_t bytes;
  uint64_t signal_value;
  uint64_t ready;  // position + 1 once the slot is published (written last)
};
static_assert(sizeof(TransportCommand) == 80, "the ring layout is shared with device code");

// Everything a producer or the consumer needs to reach one ring. Plain pointers: on the GPU,
// `slots`, `consumed` and `acks` are pinned host memory mapped into the device, `reserve` is
// device memory (device atomics on host memory are not portable over PCIe); in the CPU tests
// all four are host memory.
struct RingView {
  TransportCommand* slots;
  uint64_t capacity;   // slots; a power of two
  uint64_t* reserve;   // producers' claim counter
  uint64_t* consumed;  // positions the proxy has taken out of the ring
  uint64_t* acks;      // per warp: position + 1 of its last completed quiet
  uint32_t num_warps;  // entries of `acks`
};

// What the kernels of one emulated rank read to build their transport (device memory; the
// kernels' launch arguments carry a pointer to it, opaque to everything but the emulator): the
// rank's ring, and the protocol mutant its kernels run with (a test sets it, before the first op).
struct EmulatedQueue {
  RingView ring;
  Mutant mutant;
};

#if !defined(__CUDA_ARCH__)
// The host side of a producer, as the device does it: for tests that stand in for a kernel.
// Returns the command's position. Spins while the ring is full.
inline uint64_t host_push_command(const RingView& ring, const TransportCommand& command) {
  const uint64_t position = __atomic_fetch_add(ring.reserve, 1, __ATOMIC_RELAXED);
  while (position - __atomic_load_n(ring.consumed, __ATOMIC_ACQUIRE) >= ring.capacity) {
    std::this_thread::yield();  // tests run more producers than cores
  }
  TransportCommand* slot = &ring.slots[position & (ring.capacity - 1)];
  // Every field but `ready`, then `ready`: the proxy never sees a half-written command.
  std::memcpy(slot, &command, offsetof(TransportCommand, ready));
  __atomic_store_n(&slot->ready, position + 1, __ATOMIC_RELEASE);
  return position;
}
#endif

}  // namespace transport
}  // namespace jax_ep
