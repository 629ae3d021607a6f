// A Buffer's memory and peers, rank by rank: the workspace (device memory, or NVSHMEM's
// symmetric heap), its error counters and timeout record, the grids, the kernels, peer access and
// the peer tables. Peers of this process are reached by unified addressing; other processes'
// ranks through CUDA IPC (registry.cc maps their workspaces) or NVSHMEM's peer mappings.
#include <cuda_runtime.h>

#include <algorithm>
#include <memory>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "kernels/api.h"
#include "runtime/buffer_state.h"
#include "runtime/nvshmem_host.h"

namespace jax_ep {
namespace {

// Transfer-kernel grid of the normal mode, per multiprocessor: one 512-thread block per SM.
constexpr int kNormalBlocksPerSm = 1;
// Share of those blocks that push rows to peers (the rest copy own rows, zero the padding and
// receive). NVLink saturates with far fewer SMs than HBM-bound local copies need.
constexpr int kNormalPushBlocksDivisor = 4;

// Per-device allocations of one rank (workspace, counters, timeout record) and its kernels.
std::string allocate_rank(RankContext& ctx) {
  const int device = ctx.device;
  RETURN_MESSAGE_IF_CUDA_ERROR(device, cudaSetDevice(device));
  if (ctx.symmetric_workspace) {
    void* symmetric = nullptr;
    const std::string error = nvshmem_allocate(ctx.workspace_bytes, &symmetric);
    if (!error.empty()) return error;
    ctx.workspace = static_cast<char*>(symmetric);
  }
  const cudaError_t status =
      ctx.symmetric_workspace ? cudaSuccess : cudaMalloc(&ctx.workspace, ctx.workspace_bytes);
  if (status != cudaSuccess) {
    cudaGetLastError();
    std::ostringstream message;
    message << cuda_failure(device, "cudaMalloc(workspace)", status) << "; the Buffer needs "
            << ctx.workspace_bytes << " bytes per device (XLA preallocates most GPU memory: "
            << "lower XLA_PYTHON_CLIENT_MEM_FRACTION or create the Buffer earlier)";
    ctx.workspace = nullptr;
    return message.str();
  }
  RETURN_MESSAGE_IF_CUDA_ERROR(device, cudaMemset(ctx.workspace, 0, ctx.workspace_bytes));
  RETURN_MESSAGE_IF_CUDA_ERROR(device, cudaMalloc(&ctx.error_counters, sizeof(ErrorCounters)));
  RETURN_MESSAGE_IF_CUDA_ERROR(device, cudaMemset(ctx.error_counters, 0, sizeof(ErrorCounters)));
  RETURN_MESSAGE_IF_CUDA_ERROR(device,
                               cudaHostAlloc(&ctx.timeout_record_host, sizeof(TimeoutRecord),
                                             cudaHostAllocMapped | cudaHostAllocPortable));
  *ctx.timeout_record_host = TimeoutRecord{};
  RETURN_MESSAGE_IF_CUDA_ERROR(
      device, cudaHostGetDevicePointer(&ctx.timeout_record, ctx.timeout_record_host, 0));
  const size_t num_ranks = static_cast<size_t>(ctx.config.num_ranks);
  RETURN_MESSAGE_IF_CUDA_ERROR(device,
                               cudaMalloc(&ctx.peer_workspaces_device, sizeof(char*) * num_ranks));
  RETURN_MESSAGE_IF_CUDA_ERROR(device, cudaMalloc(&ctx.pes_device, sizeof(int) * num_ranks));
  RETURN_MESSAGE_IF_CUDA_ERROR(device, cudaMemset(ctx.pes_device, 0, sizeof(int) * num_ranks));
  RETURN_MESSAGE_IF_CUDA_ERROR(
      device, cudaDeviceGetAttribute(&ctx.num_sms, cudaDevAttrMultiProcessorCount, device));
  const BufferConfig& config = ctx.config;
  ctx.normal_blocks =
      config.normal_blocks > 0 ? config.normal_blocks : ctx.num_sms * kNormalBlocksPerSm;
  ctx.low_latency_blocks = config.low_latency_blocks;  // 0: low_latency_grid_size's default
  ctx.normal_push_blocks = config.normal_push_blocks > 0
                               ? config.normal_push_blocks
                               : std::max(1, ctx.normal_blocks / kNormalPushBlocksDivisor);

  RETURN_MESSAGE_IF_CUDA_ERROR(device, preload_kernels(config));
  if (config.device_transport != DeviceTransport::kStores) {
    RETURN_MESSAGE_IF_CUDA_ERROR(
        device, cudaMalloc(&ctx.transport_region_bases,
                           sizeof(char*) * kTransportRegions * static_cast<size_t>(num_ranks)));
  }
  return "";
}

// Enables access from `device` to every other device of its group.
std::string enable_peer_access(int device, const std::vector<int>& group) {
  RETURN_MESSAGE_IF_CUDA_ERROR(device, cudaSetDevice(device));
  for (int peer : group) {
    if (peer == device || peer == kRemoteRank) continue;  // other processes: CUDA IPC
    int can_access = 0;
    RETURN_MESSAGE_IF_CUDA_ERROR(device, cudaDeviceCanAccessPeer(&can_access, device, peer));
    if (!can_access) {
      std::ostringstream message;
      message << "jax_ep: device " << device << " cannot access the memory of device " << peer
              << " (cudaDeviceCanAccessPeer is false): the ranks of one EP group must be "
              << "connected by NVLink or PCIe peer-to-peer";
      return message.str();
    }
    const cudaError_t status = cudaDeviceEnablePeerAccess(peer, 0);
    if (status == cudaErrorPeerAccessAlreadyEnabled) {
      cudaGetLastError();  // XLA enabled it already; clear the error
    } else if (status != cudaSuccess) {
      std::ostringstream message;
      message << cuda_failure(device, "cudaDeviceEnablePeerAccess", status) << " (peer device "
              << peer << ")";
      return message.str();
    }
  }
  return "";
}

// The peer table of a rank whose workspace is on the NVSHMEM heap: rank r's workspace is
// NVSHMEM PE pes[r]'s copy of the same symmetric object, null where nvshmem_ptr cannot map it
// (another host, or NVSHMEM_DISABLE_P2P). Such a peer is reached only by NVSHMEM's device API:
// the kNvshmem transport's kernels address peers by PE and their own symmetric addresses, never
// through this table.
std::string map_symmetric_peers(RankContext& ctx, const std::vector<int>& pes) {
  for (int r = 0; r < ctx.config.num_ranks; ++r) {
    ctx.pes[r] = pes[r];
    ctx.peer_workspaces[r] = static_cast<char*>(nvshmem_peer_address(ctx.workspace, pes[r]));
    if (ctx.peer_workspaces[r] == nullptr &&
        ctx.config.device_transport != DeviceTransport::kNvshmem) {
      return "jax_ep: rank " + std::to_string(r) + " (NVSHMEM PE " + std::to_string(pes[r]) +
             ") is not reachable by loads and stores from device " + std::to_string(ctx.device) +
             " (nvshmem_ptr is null: another host): set JAX_EP_DEVICE_TRANSPORT=nvshmem, whose "
             "puts reach it through NVSHMEM (docs/process_models.md, \"What spans hosts\")";
    }
  }
  return "";
}

}  // namespace

// Frees what was allocated for `ctx` (any subset), on its device. Errors are ignored: this runs
// on failure paths and at close, where nothing better can be done.
void free_rank_context(RankContext& ctx) {
  if (cudaSetDevice(ctx.device) != cudaSuccess) return;
  cudaDeviceSynchronize();
  if (ctx.workspace != nullptr) {
    if (ctx.symmetric_workspace) {
      nvshmem_release(ctx.workspace);  // collective: every PE frees its Buffers in one order
    } else {
      cudaFree(ctx.workspace);
    }
  }
  if (ctx.peer_workspaces_device != nullptr) cudaFree(ctx.peer_workspaces_device);
  if (ctx.pes_device != nullptr) cudaFree(ctx.pes_device);
  ctx.pes_device = nullptr;
  if (ctx.transport_region_bases != nullptr) cudaFree(ctx.transport_region_bases);
  ctx.transport_region_bases = nullptr;
  if (ctx.error_counters != nullptr) cudaFree(ctx.error_counters);
  if (ctx.timeout_record_host != nullptr) cudaFreeHost(ctx.timeout_record_host);
  ctx.workspace = nullptr;
  ctx.peer_workspaces_device = nullptr;
  ctx.error_counters = nullptr;
  ctx.timeout_record = nullptr;
  ctx.timeout_record_host = nullptr;
  cudaGetLastError();  // do not leave a failure of the cleanup behind for the next caller
}

// Copies `ctx.peer_workspaces` and `ctx.pes` to their device-memory twins.
std::string upload_peer_table(RankContext& ctx) {
  RETURN_MESSAGE_IF_CUDA_ERROR(ctx.device, cudaSetDevice(ctx.device));
  RETURN_MESSAGE_IF_CUDA_ERROR(
      ctx.device, cudaMemcpy(ctx.peer_workspaces_device, ctx.peer_workspaces.data(),
                             sizeof(char*) * ctx.peer_workspaces.size(), cudaMemcpyHostToDevice));
  RETURN_MESSAGE_IF_CUDA_ERROR(
      ctx.device, cudaMemcpy(ctx.pes_device, ctx.pes.data(), sizeof(int) * ctx.pes.size(),
                             cudaMemcpyHostToDevice));
  RETURN_MESSAGE_IF_CUDA_ERROR(ctx.device, cudaDeviceSynchronize());
  return "";
}

// `pes` (NVSHMEM transport, one local rank): the PE of every rank of the group; nullptr: device
// memory, peers of this process by unified addressing, of other processes by CUDA IPC.
std::string create_group(const BufferConfig& config, int group_index, const std::vector<int>& group,
                         const std::vector<int>* pes,
                         std::vector<std::unique_ptr<RankContext>>& contexts) {
  const size_t first = contexts.size();
  std::vector<RankContext*> by_rank(group.size(), nullptr);
  for (int rank = 0; rank < static_cast<int>(group.size()); ++rank) {
    if (group[rank] == kRemoteRank) continue;
    auto ctx = std::make_unique<RankContext>();
    ctx->config = config;
    ctx->group = group_index;
    ctx->rank = rank;
    ctx->device = group[rank];
    ctx->workspace_bytes = workspace_bytes(config);
    ctx->peer_workspaces.assign(config.num_ranks, nullptr);
    ctx->pes.assign(config.num_ranks, 0);
    ctx->symmetric_workspace = pes != nullptr;
    ctx->timeout_ns = static_cast<uint64_t>(config.timeout_s * 1e9);
    by_rank[rank] = ctx.get();
    contexts.push_back(std::move(ctx));
    std::string error = pes != nullptr ? "" : enable_peer_access(group[rank], group);
    if (error.empty()) error = allocate_rank(*contexts.back());
    if (error.empty() && pes != nullptr) error = map_symmetric_peers(*contexts.back(), *pes);
    if (!error.empty()) return error;
    if (pes != nullptr) return upload_peer_table(*contexts.back());
  }
  // Peer tables: with unified addressing a device pointer is valid on every peer that has
  // access, so every local rank sees the same table. Other processes' entries stay null until
  // import_workspace_handles() maps them.
  for (size_t i = first; i < contexts.size(); ++i) {
    RankContext& ctx = *contexts[i];
    for (int r = 0; r < config.num_ranks; ++r) {
      ctx.peer_workspaces[r] = by_rank[r] != nullptr ? by_rank[r]->workspace : nullptr;
    }
    std::string error = upload_peer_table(ctx);
    if (!error.empty()) return error;
  }
  return "";
}

// Unmaps what import_workspace_handles() mapped (after the local devices are idle).
void close_imported(std::vector<std::pair<int, void*>>& imported) {
  for (const auto& [device, mapping] : imported) {
    if (cudaSetDevice(device) != cudaSuccess) continue;
    cudaDeviceSynchronize();
    cudaIpcCloseMemHandle(mapping);
  }
  imported.clear();
  cudaGetLastError();
}

}  // namespace jax_ep
