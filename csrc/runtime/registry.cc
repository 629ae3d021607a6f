// Registry of Buffers: (buffer, device) -> RankContext, and each Buffer's life: creation (its
// steps in validation.cc, allocation.cc, transport_start.cc), the exchange of workspaces between
// processes, and destruction.
//
// Within a process, a peer's workspace is reachable through its plain device pointer once peer
// access is enabled. Ranks driven by other processes on the same host (one process per GPU)
// export their workspaces as CUDA IPC handles; each process maps the others' into its devices
// (import_workspace_handles). The Python side exchanges the handles (jax_ep/peers/ipc.py).
#include "runtime/registry.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <sstream>
#include <utility>

#include "runtime/buffer_state.h"

namespace jax_ep {
namespace {

std::shared_mutex registry_mutex;
std::map<int64_t, BufferState> buffers;                           // guarded by registry_mutex
std::map<std::pair<int64_t, int>, const RankContext*> by_device;  // guarded by registry_mutex

}  // namespace

std::string create_buffer(int64_t buffer_id, const BufferConfig& config,
                          const std::vector<std::vector<int>>& groups,
                          const std::vector<std::vector<int>>& pes) {
  std::string error = validate(config, groups);
  if (error.empty() && !pes.empty()) error = validate_symmetric(groups, pes);
  if (error.empty() && config.device_transport == DeviceTransport::kNvshmem && pes.empty()) {
    error =
        "jax_ep: JAX_EP_DEVICE_TRANSPORT=nvshmem puts through NVSHMEM's symmetric heap: "
        "set JAX_EP_PEER_MAPPING=nvshmem too";
  }
  if (error.empty()) error = transport_plugin_missing(config.device_transport);
  if (!error.empty()) return error;
  {
    std::shared_lock<std::shared_mutex> lock(registry_mutex);
    if (buffers.count(buffer_id) != 0) {
      return "jax_ep: buffer id " + std::to_string(buffer_id) + " is already registered";
    }
  }

  BufferState state;
  state.config = config;
  state.groups = groups;
  {
    CurrentDeviceGuard device_guard;
    for (size_t g = 0; g < groups.size(); ++g) {
      error = create_group(config, static_cast<int>(g), groups[g], pes.empty() ? nullptr : &pes[g],
                           state.contexts);
      if (!error.empty()) break;
    }
    // Every peer is mapped now in groups of this process alone and on NVSHMEM's symmetric
    // heap; the others' after import_workspace_handles().
    for (auto& ctx : state.contexts) {
      const std::vector<int>& group = groups[ctx->group];
      if (!error.empty()) break;
      if (ctx->symmetric_workspace || std::count(group.begin(), group.end(), kRemoteRank) == 0) {
        error = start_transport(buffer_id, state, *ctx);
      }
    }
    if (!error.empty()) {
      stop_transport(state);
      for (auto& ctx : state.contexts) free_rank_context(*ctx);
      return error;
    }
  }

  std::unique_lock<std::shared_mutex> lock(registry_mutex);
  if (buffers.count(buffer_id) != 0) {
    CurrentDeviceGuard device_guard;
    for (auto& ctx : state.contexts) free_rank_context(*ctx);
    return "jax_ep: buffer id " + std::to_string(buffer_id) + " is already registered";
  }
  for (const auto& ctx : state.contexts) by_device[{buffer_id, ctx->device}] = ctx.get();
  buffers.emplace(buffer_id, std::move(state));
  return "";
}

void destroy_buffer(int64_t buffer_id) {
  BufferState state;
  {
    std::unique_lock<std::shared_mutex> lock(registry_mutex);
    auto it = buffers.find(buffer_id);
    if (it == buffers.end()) return;
    state = std::move(it->second);
    buffers.erase(it);
    for (const auto& ctx : state.contexts) by_device.erase({buffer_id, ctx->device});
  }
  CurrentDeviceGuard device_guard;
  stop_transport(state);
  close_imported(state.imported);
  for (auto& ctx : state.contexts) free_rank_context(*ctx);
}

std::string export_workspace_handles(int64_t buffer_id, std::vector<WorkspaceHandle>* handles) {
  std::shared_lock<std::shared_mutex> lock(registry_mutex);
  auto it = buffers.find(buffer_id);
  if (it == buffers.end()) return "jax_ep: no Buffer with id " + std::to_string(buffer_id);
  CurrentDeviceGuard device_guard;
  for (const auto& ctx : it->second.contexts) {
    cudaIpcMemHandle_t handle;
    RETURN_MESSAGE_IF_CUDA_ERROR(ctx->device, cudaSetDevice(ctx->device));
    RETURN_MESSAGE_IF_CUDA_ERROR(ctx->device, cudaIpcGetMemHandle(&handle, ctx->workspace));
    handles->push_back({ctx->group, ctx->rank,
                        std::string(reinterpret_cast<const char*>(&handle), sizeof(handle))});
  }
  return "";
}

std::string import_workspace_handles(int64_t buffer_id,
                                     const std::vector<WorkspaceHandle>& handles) {
  std::unique_lock<std::shared_mutex> lock(registry_mutex);
  auto it = buffers.find(buffer_id);
  if (it == buffers.end()) return "jax_ep: no Buffer with id " + std::to_string(buffer_id);
  BufferState& state = it->second;
  std::map<std::pair<int, int>, const WorkspaceHandle*> by_rank;
  for (const auto& h : handles) {
    if (h.handle.size() != sizeof(cudaIpcMemHandle_t)) {
      return "jax_ep: a workspace handle must have " + std::to_string(sizeof(cudaIpcMemHandle_t)) +
             " bytes, got " + std::to_string(h.handle.size());
    }
    by_rank[{h.group, h.rank}] = &h;
  }
  CurrentDeviceGuard device_guard;
  for (auto& ctx : state.contexts) {
    const std::vector<int>& group = state.groups[ctx->group];
    for (int r = 0; r < static_cast<int>(group.size()); ++r) {
      if (group[r] != kRemoteRank) continue;
      auto found = by_rank.find({ctx->group, r});
      if (found == by_rank.end()) {
        return "jax_ep: no workspace handle for rank " + std::to_string(r) + " of EP group " +
               std::to_string(ctx->group);
      }
      cudaIpcMemHandle_t handle;
      std::memcpy(&handle, found->second->handle.data(), sizeof(handle));
      void* mapping = nullptr;
      RETURN_MESSAGE_IF_CUDA_ERROR(ctx->device, cudaSetDevice(ctx->device));
      const cudaError_t status =
          cudaIpcOpenMemHandle(&mapping, handle, cudaIpcMemLazyEnablePeerAccess);
      if (status != cudaSuccess) {
        cudaGetLastError();
        std::ostringstream message;
        message << cuda_failure(ctx->device, "cudaIpcOpenMemHandle", status) << " (workspace of "
                << "rank " << r << " of EP group " << ctx->group << ", another process): the "
                << "ranks of one EP group must be GPUs of one host with peer access";
        return message.str();
      }
      state.imported.emplace_back(ctx->device, mapping);
      ctx->peer_workspaces[r] = static_cast<char*>(mapping);
    }
    std::string error = upload_peer_table(*ctx);
    if (error.empty()) error = start_transport(buffer_id, state, *ctx);
    if (!error.empty()) return error;
  }
  return "";
}

void release_peer_workspaces(int64_t buffer_id) {
  std::unique_lock<std::shared_mutex> lock(registry_mutex);
  auto it = buffers.find(buffer_id);
  if (it == buffers.end()) return;
  CurrentDeviceGuard device_guard;
  stop_transport(it->second);  // the proxies write into the imported workspaces
  close_imported(it->second.imported);
  cudaGetLastError();
}

std::vector<std::string> take_transport_errors(int64_t buffer_id) {
  std::shared_lock<std::shared_mutex> lock(registry_mutex);
  std::vector<std::string> errors;
  auto it = buffers.find(buffer_id);
  if (it == buffers.end()) return errors;
  for (const TransportRank& rank : it->second.transport_ranks) {
    for (const std::string& e :
         take_transport_rank_errors(rank.ctx->config.device_transport, rank.state)) {
      errors.push_back("rank " + std::to_string(rank.ctx->rank) + " of EP group " +
                       std::to_string(rank.ctx->group) + ": " + e);
    }
  }
  return errors;
}

const RankContext* find_rank_context(int64_t buffer_id, int device) {
  std::shared_lock<std::shared_mutex> lock(registry_mutex);
  auto it = by_device.find({buffer_id, device});
  return it == by_device.end() ? nullptr : it->second;
}

std::vector<const RankContext*> rank_contexts(int64_t buffer_id) {
  std::shared_lock<std::shared_mutex> lock(registry_mutex);
  std::vector<const RankContext*> result;
  auto it = buffers.find(buffer_id);
  if (it == buffers.end()) return result;
  for (const auto& ctx : it->second.contexts) result.push_back(ctx.get());
  return result;
}

namespace {
std::atomic<uint64_t> g_handler_calls{0};
std::atomic<uint64_t> g_captured_handler_calls{0};
}  // namespace

void record_handler_call(bool stream_capturing) {
  g_handler_calls.fetch_add(1, std::memory_order_relaxed);
  if (stream_capturing) g_captured_handler_calls.fetch_add(1, std::memory_order_relaxed);
}

HandlerCallCounts handler_call_counts() {
  return {g_handler_calls.load(std::memory_order_relaxed),
          g_captured_handler_calls.load(std::memory_order_relaxed)};
}

}  // namespace jax_ep
