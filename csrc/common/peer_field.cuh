// Every rank's copy of one field of the workspace, as seen from this device: the Buffer's device
// table of peer workspaces (RankContext::peer_workspaces_device, one pointer per rank) plus the
// field's offset, the same on every rank. Kernel arguments hold this instead of a pointer per
// rank, so their size does not grow with the group.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace jax_ep {

template <typename T>
struct PeerField {
  char* const* workspaces = nullptr;  // [R] device memory, constant while kernels run
  size_t offset = 0;

  __device__ __forceinline__ T* operator[](int rank) const {
    const auto base = static_cast<uintptr_t>(
        __ldg(reinterpret_cast<const unsigned long long*>(workspaces) + rank));
    return reinterpret_cast<T*>(base + offset);
  }
};

}  // namespace jax_ep
