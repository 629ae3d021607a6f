// The NVSHMEM device transport's kernels live in a plugin, libjax_ep_nvshmem.so next to
// jax_ep._C (csrc/plugins/nvshmem_transport_kernels.cu), built only where NVSHMEM is found and
// loaded only when a Buffer asks for JAX_EP_DEVICE_TRANSPORT=nvshmem: jax_ep._C itself imports
// without NVSHMEM. These are its entry points as _C calls them (the low-latency launches in
// low_latency/transport.h, the normal mode's in kernels/normal/nvshmem.h).
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "kernels/low_latency/transport.h"

namespace jax_ep {

// Loads the plugin (once; NVSHMEM's host library must be loaded first, RTLD_GLOBAL, as
// nvshmem_load does). "" or an error naming the path.
std::string nvshmem_plugin_load(const std::string& path);

}  // namespace jax_ep
