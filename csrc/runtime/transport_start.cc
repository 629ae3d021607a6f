// A Buffer's device transport, started once every peer of a rank is mapped (DeviceTransport other
// than kStores): the device table of every rank's regions, NVSHMEM's device state of the plugin's
// kernels, and over the emulated transport each local rank's ring and host proxy
// (docs/transport.md).
#include <cuda_runtime.h>

#include <exception>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "kernels/api.h"
#include "runtime/buffer_state.h"
#include "runtime/nvshmem_host.h"
#include "transport/emulated_ranks.h"

namespace jax_ep {
namespace {

// Commands in a rank's ring before its warps wait for the proxy (DeviceTransport::kEmulated).
constexpr uint64_t kEmulatorRingCapacity = 4096;

}  // namespace

// Once every peer of `ctx` is mapped: the device table of every rank's transport regions, and over
// the emulated transport this rank's ring and host proxy (which registers every rank's regions).
std::string start_transport(BufferState& state, RankContext& ctx) {
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
  if (config.device_transport != DeviceTransport::kEmulated) return "";
  for (const auto& running : state.emulated) {
    if (running->ctx == &ctx) return "";  // started at creation (a group of this process alone)
  }
  // Region ids are the table's columns; an area the Buffer lacks is registered empty, so a
  // command into it is reported.
  uint64_t region_bytes[kTransportRegions];
  transport_region_bytes(config, region_bytes);
  std::vector<std::vector<std::pair<void*, uint64_t>>> regions(config.num_ranks);
  for (int r = 0; r < config.num_ranks; ++r) {
    for (int region = 0; region < kTransportRegions; ++region) {
      regions[r].emplace_back(table[kTransportRegions * r + region], region_bytes[region]);
    }
  }
  transport::ProxyOptions options;  // adversarial, as docs/transport.md describes
  options.ordering = transport::Ordering::kUnordered;
  options.seed = config.emulator_seed + static_cast<uint64_t>(ctx.rank);
  options.chunk_bytes = 1024;
  options.max_delay_steps = 4;
  options.snapshot_sources = true;
  options.log_deliveries = false;
  auto emulated = std::make_unique<EmulatedRank>();
  emulated->ctx = &ctx;
  try {
    // An acknowledgement word per issuing warp (each needs its own while it may run).
    const uint32_t num_warps = transport_warps(ctx, &ctx.normal_first_warp);
    ctx.transport_ring = transport::make_ring(emulated->arena, kEmulatorRingCapacity, num_warps);
    emulated->proxy =
        std::make_unique<transport::RankProxy>(ctx.rank, options, ctx.transport_ring, regions);
  } catch (const std::exception& e) {
    return std::string("jax_ep: the emulated transport of rank ") + std::to_string(ctx.rank) +
           " (device " + std::to_string(ctx.device) + "): " + e.what();
  }
  state.emulated.push_back(std::move(emulated));
  return "";
}

// Waits for the local devices, then stops the proxies (they deliver what was published first):
// before peers are unmapped or workspaces freed.
void stop_transport(BufferState& state) {
  for (auto& ctx : state.contexts) {
    if (cudaSetDevice(ctx->device) == cudaSuccess) cudaDeviceSynchronize();
  }
  state.emulated.clear();
  cudaGetLastError();
}

}  // namespace jax_ep
