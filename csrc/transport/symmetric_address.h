// Where a byte lives for the transport: a symmetric region and an offset in it; and what a
// signal does to its word. Host and device code.
//
// A region id names memory of the same size and layout on every rank (a workspace, a send
// region, a signal array), so (peer, region, offset) is meaningful without knowing the peer's
// pointers: the mapped transport turns it into a peer-mapped address, the emulated one hands it
// to the host proxy, which checks it against what was registered.
#pragma once

#include <cstdint>

namespace jax_ep {
namespace transport {

struct SymmetricAddress {
  uint32_t region;
  uint64_t offset;
};

// What a signal does to its word: set it to the value, or advance it by the value.
enum class SignalOp : uint32_t {
  kSet = 0,
  kAdd = 1,
};

}  // namespace transport
}  // namespace jax_ep
