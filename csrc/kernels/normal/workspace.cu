// Size of the normal-mode area, its sequence word, and its send region over a device transport.
#include "kernels/normal/workspace.h"

#include "kernels/api.h"

namespace jax_ep {

size_t normal_workspace_bytes(const BufferConfig& config) {
  return normal_layout(config).total_bytes;
}

size_t normal_sequence_offset(const BufferConfig& config) { return normal_layout(config).seq; }

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

}  // namespace jax_ep
