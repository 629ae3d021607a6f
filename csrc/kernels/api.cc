// The parts of kernels/api.h that span both modes: the workspace of one rank (the normal-mode
// area, the low-latency regions, the device transport's area of the low-latency kernels, the
// normal mode's send region), placed here from each area's size (each mode's workspace header),
// the device transport's regions and warps in it, and preloading.
#include "kernels/api.h"

#include <algorithm>
#include <initializer_list>

#include "kernels/low_latency/layout.cuh"
#include "kernels/low_latency_put/put_ops.h"
#include "kernels/low_latency_put/put_protocol.h"
#include "kernels/normal/workspace.h"
#include "kernels/preload.h"
#include "kernels/put_plugin.h"

namespace jax_ep {
namespace {

static_assert(kTransportWorkspace == 0 && kTransportStaging == 1 && kNormalAreaRegion == 2 &&
                  kNormalSendRegion == 3 && kTransportRegions == 4,
              "the ops' table: the low-latency kernels' two regions, then the normal mode's two");

// Every area but the normal mode's send region, which comes last.
size_t areas_bytes(const BufferConfig& config) {
  size_t total = normal_workspace_bytes(config);
  if (config.low_latency) {
    const size_t low_latency_end =
        low_latency_workspace_offset(config) + low_latency_workspace_bytes(config);
    if (low_latency_end > total) total = low_latency_end;
    const size_t transport_bytes = low_latency_transport_bytes(config);
    if (transport_bytes > 0) {
      total = std::max(total, low_latency_transport_offset(config) + transport_bytes);
    }
  }
  return total;
}

size_t normal_send_region_offset(const BufferConfig& config) {
  return align_up(areas_bytes(config), kNormalDataAlignment);
}

// The first failure of `preloads`, called in order.
cudaError_t preload_in_order(std::initializer_list<cudaError_t (*)()> preloads) {
  for (cudaError_t (*preload)() : preloads) {
    const cudaError_t status = preload();
    if (status != cudaSuccess) return status;
  }
  return cudaSuccess;
}

}  // namespace

size_t low_latency_workspace_offset(const BufferConfig& config) {
  return align_up(normal_workspace_bytes(config), kLowLatencyAlignBytes);
}

size_t low_latency_transport_offset(const BufferConfig& config) {
  return align_up(low_latency_workspace_offset(config) + low_latency_workspace_bytes(config),
                  kLowLatencyAlignBytes);
}

size_t workspace_bytes(const BufferConfig& config) {
  const size_t send_region = normal_send_region_bytes(config);
  return send_region > 0 ? normal_send_region_offset(config) + send_region : areas_bytes(config);
}

std::vector<char*> transport_region_table(const RankContext& ctx) {
  std::vector<char*> table = low_latency_transport_region_table(ctx);
  const bool normal = normal_over_transport(ctx.config);
  const size_t send_region = normal_send_region_offset(ctx.config);
  for (int r = 0; r < ctx.config.num_ranks; ++r) {
    char* workspace = ctx.peer_workspaces[r];
    const bool mapped = normal && workspace != nullptr;
    table[kTransportRegions * r + kNormalAreaRegion] = mapped ? workspace : nullptr;
    table[kTransportRegions * r + kNormalSendRegion] = mapped ? workspace + send_region : nullptr;
  }
  return table;
}

void transport_region_bytes(const BufferConfig& config, uint64_t bytes[kTransportRegions]) {
  const LowLatencyTransportArea area = low_latency_transport_area(config);
  bytes[kTransportWorkspace] = config.low_latency ? area.workspace_region_bytes : 0;
  bytes[kTransportStaging] = config.low_latency ? area.staging_region_bytes : 0;
  bytes[kNormalAreaRegion] = normal_workspace_bytes(config);
  bytes[kNormalSendRegion] = normal_send_region_bytes(config);
}

uint32_t transport_warps(const RankContext& ctx, uint32_t* normal_first_warp) {
  *normal_first_warp = static_cast<uint32_t>(kTransportOpWarps);
  return *normal_first_warp + normal_transport_warps(ctx);
}

cudaError_t preload_kernels(const BufferConfig& config) {
  cudaError_t status =
      preload_in_order({preload_layout_kernels, preload_dispatch_kernels, preload_combine_kernels});
  if (status == cudaSuccess && config.low_latency) {
    status = preload_in_order(
        {preload_low_latency_dispatch_kernels, preload_low_latency_combine_kernels});
  }
  // A device transport's put-protocol kernels, both modes', through its table (the NVSHMEM
  // plugin's are not preloaded).
  const PutPlugin* plugin = put_plugin(config.device_transport);
  if (status == cudaSuccess && plugin != nullptr && plugin->preload != nullptr) {
    status = static_cast<cudaError_t>(plugin->preload());
  }
  return status;
}

}  // namespace jax_ep
