// Where a byte lives for the transport: a symmetric region and an offset in it.
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

}  // namespace transport
}  // namespace jax_ep
