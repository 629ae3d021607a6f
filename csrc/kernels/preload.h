// Kernel preloading, one function per kernel file: each loads its file's kernels on the current
// device and returns the first failure. preload_kernels (kernels/api.h) calls those a Buffer needs.
#pragma once

#include <cuda_runtime_api.h>

namespace jax_ep {

// The normal mode (kernels/normal/): layout.cu, dispatch.cu, combine.cu, their store path.
cudaError_t preload_layout_kernels();
cudaError_t preload_dispatch_kernels();
cudaError_t preload_combine_kernels();

// The low-latency mode (kernels/low_latency/): dispatch.cu, combine.cu, the store kernels.
cudaError_t preload_low_latency_dispatch_kernels();
cudaError_t preload_low_latency_combine_kernels();

// A device transport's put-protocol kernels of both modes are preloaded through its table
// (kernels/put_plugin.h, PutPlugin::preload).

}  // namespace jax_ep
