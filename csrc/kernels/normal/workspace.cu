// Size of the normal-mode region and preloading of the normal-mode kernels.
#include <cuda_runtime.h>

#include "kernels/normal/normal.h"
#include "kernels/normal/workspace.h"
#include "runtime/context.h"

namespace jax_ep {

size_t normal_workspace_bytes(const BufferConfig& config) {
  return normal_layout(config).total_bytes;
}

bool normal_over_transport(const BufferConfig& config) {
  return config.device_transport != DeviceTransport::kStores;
}

// As large as the data region: every row a call may push fits, whatever its size (the handlers
// bound rows * row bytes by the data region), so each push warp has at least one slot.
size_t normal_send_region_bytes(const BufferConfig& config) {
  return normal_over_transport(config) ? normal_layout(config).data_bytes : 0;
}

uint32_t normal_transport_warps(const RankContext& ctx) {
  return static_cast<uint32_t>(ctx.normal_push_blocks) * (kNormalTransferThreads / kWarpSize);
}

// Errors are left in cudaGetLastError() for the caller (runtime/registry) to report.
void preload_normal_kernels() {
  if (preload_layout_kernels() != cudaSuccess) return;
  if (preload_dispatch_kernels() != cudaSuccess) return;
  preload_combine_kernels();
}

void preload_normal_transport_kernels() {
  if (preload_dispatch_transport_kernels() != cudaSuccess) return;
  preload_combine_transport_kernels();
}

}  // namespace jax_ep
