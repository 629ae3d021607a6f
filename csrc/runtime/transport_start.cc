// A Buffer's device transport, started once every peer of a rank is mapped (DeviceTransport other
// than kStores): the device table of every rank's regions, NVSHMEM's device state of the plugin's
// kernels, and over the emulated transport each local rank's ring and host proxy
// (docs/transport.md).
#include <cuda_runtime.h>

#include <string>

#include "kernels/api.h"
#include "runtime/buffer_state.h"
#include "runtime/nvshmem_host.h"

namespace jax_ep {

// Once every peer of `ctx` is mapped: the device table of every rank's transport regions, and the
// host side of the rank's transport when it has one (kernels/api.h, start_transport_rank).
std::string start_transport(int64_t buffer_id, BufferState& state, RankContext& ctx) {
  const BufferConfig& config = ctx.config;
  if (config.device_transport == DeviceTransport::kStores) return "";
  const std::vector<char*> table = transport_region_table(ctx);
  RETURN_MESSAGE_IF_CUDA_ERROR(ctx.device, cudaSetDevice(ctx.device));
  RETURN_MESSAGE_IF_CUDA_ERROR(
      ctx.device, cudaMemcpy(ctx.transport_region_bases, table.data(), sizeof(char*) * table.size(),
                             cudaMemcpyHostToDevice));
  if (config.device_transport == DeviceTransport::kNvshmem) {
    void* library = nullptr;
    std::string error = nvshmem_transport_library(&library);
    if (error.empty()) error = nvshmem_init_device_library(library);
    return error;
  }
  for (const TransportRank& running : state.transport_ranks) {
    if (running.ctx == &ctx) return "";  // started at creation (a group of this process alone)
  }
  // The ring's acknowledgement words: the low-latency kernels' warps, then the normal kernels'.
  transport_warps(ctx, &ctx.normal_first_warp);
  uint64_t region_bytes[kTransportRegions];
  transport_region_bytes(config, region_bytes);
  TransportRank rank;
  rank.ctx = &ctx;
  const std::string error = start_transport_rank(buffer_id, ctx, table.data(), region_bytes,
                                                 &rank.state, &ctx.transport_queue);
  if (!error.empty()) return error;
  if (rank.state != nullptr) state.transport_ranks.push_back(rank);
  return "";
}

// Waits for the local devices, then stops the transports' host sides (the proxies deliver what was
// published first): before peers are unmapped or workspaces freed.
void stop_transport(BufferState& state) {
  for (auto& ctx : state.contexts) {
    if (cudaSetDevice(ctx->device) == cudaSuccess) cudaDeviceSynchronize();
  }
  for (const TransportRank& rank : state.transport_ranks) {
    stop_transport_rank(rank.ctx->config.device_transport, rank.state);
  }
  state.transport_ranks.clear();
  cudaGetLastError();
}

}  // namespace jax_ep
