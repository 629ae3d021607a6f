// Kernel preloading, one function per kernel file: each loads its file's kernels on the current
// device and returns the first failure. preload_kernels (kernels/api.h) calls those a Buffer needs.
#pragma once

#include <cuda_runtime_api.h>

namespace jax_ep {

// The normal mode (kernels/normal/): layout.cu, dispatch.cu, combine.cu, and over a device
// transport (normal_over_transport) their paths through the mapped and emulated transports.
cudaError_t preload_layout_kernels();
cudaError_t preload_dispatch_kernels();
cudaError_t preload_combine_kernels();
cudaError_t preload_dispatch_transport_kernels();
cudaError_t preload_combine_transport_kernels();

// The low-latency mode (kernels/low_latency/): dispatch.cu, combine.cu, and its put-protocol
// kernels over the mapped and emulated transports (transport.cu).
cudaError_t preload_low_latency_dispatch_kernels();
cudaError_t preload_low_latency_combine_kernels();
cudaError_t preload_low_latency_transport_kernels();

}  // namespace jax_ep
