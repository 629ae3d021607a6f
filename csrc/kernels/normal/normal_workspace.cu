// Size of the normal-mode region and preloading of the normal-mode kernels.
#include <cuda_runtime.h>

#include "kernels/normal/normal.h"
#include "kernels/normal/normal_workspace.h"
#include "runtime/context.h"

namespace jax_ep {

size_t normal_workspace_bytes(const BufferConfig& config) {
  return normal_layout(config).total_bytes;
}

// Errors are left in cudaGetLastError() for the caller (runtime/registry) to report.
void preload_normal_kernels() {
  if (preload_layout_kernels() != cudaSuccess) return;
  if (preload_dispatch_kernels() != cudaSuccess) return;
  preload_combine_kernels();
}

}  // namespace jax_ep
