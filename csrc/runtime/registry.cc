// Registry of Buffers: device memory, peer tables and kernel preloading, per (buffer, device).
//
// Within a process, a peer's workspace is reachable through its plain device pointer once peer
// access is enabled. Ranks driven by other processes on the same host (one process per GPU)
// export their workspaces as CUDA IPC handles; each process maps the others' into its devices
// (import_workspace_handles). The Python side exchanges the handles (jax_ep/transports/ipc.py).
#include "runtime/registry.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <shared_mutex>
#include <sstream>
#include <utility>

#include "kernels/common/limits.h"
#include "kernels/low_latency/over_transport.h"
#include "kernels/normal/normal.h"
#include "kernels/normal/workspace.h"
#include "runtime/nvshmem_host.h"
#include "transport/emulated_ranks.h"

namespace jax_ep {
namespace {

// Transfer-kernel grid of the normal mode, per multiprocessor: one 512-thread block per SM.
constexpr int kNormalBlocksPerSm = 1;
// Share of those blocks that push rows to peers (the rest copy own rows, zero the padding and
// receive). NVLink saturates with far fewer SMs than HBM-bound local copies need.
constexpr int kNormalPushBlocksDivisor = 4;

// Commands in a rank's ring before its warps wait for the proxy (DeviceTransport::kEmulated).
constexpr uint64_t kEmulatorRingCapacity = 4096;

// The host proxy of one local rank over the emulated transport, and the memory of its ring.
// Members go in reverse order: the proxy thread stops before the ring is freed.
struct EmulatedRank {
  const RankContext* ctx = nullptr;
  transport::DeviceArena arena;
  std::unique_ptr<transport::RankProxy> proxy;
};

struct BufferState {
  BufferConfig config;
  std::vector<std::unique_ptr<RankContext>> contexts;   // every local device of every group
  std::vector<std::vector<int>> groups;                 // device ordinals or kRemoteRank
  std::vector<std::pair<int, void*>> imported;          // (device, mapping) of other processes
  std::vector<std::unique_ptr<EmulatedRank>> emulated;  // DeviceTransport::kEmulated
};

std::shared_mutex registry_mutex;
std::map<int64_t, BufferState> buffers;                           // guarded by registry_mutex
std::map<std::pair<int64_t, int>, const RankContext*> by_device;  // guarded by registry_mutex

std::string cuda_failure(int device, const char* call, cudaError_t status) {
  std::ostringstream message;
  message << "jax_ep: " << call << " failed on device " << device << ": "
          << cudaGetErrorName(status) << " (" << cudaGetErrorString(status) << ")";
  return message.str();
}

// Returns the message of a failed CUDA call (naming the device and the call) and clears the
// thread's last-error state so that it does not surface in an unrelated later check.
#define RETURN_MESSAGE_IF_CUDA_ERROR(device, call) \
  do {                                             \
    const cudaError_t status_ = (call);            \
    if (status_ != cudaSuccess) {                  \
      cudaGetLastError();                          \
      return cuda_failure(device, #call, status_); \
    }                                              \
  } while (0)

// Restores the calling thread's current device when it goes out of scope.
class CurrentDeviceGuard {
 public:
  CurrentDeviceGuard() { saved_ok_ = cudaGetDevice(&saved_) == cudaSuccess; }
  ~CurrentDeviceGuard() {
    if (saved_ok_) cudaSetDevice(saved_);
  }
  CurrentDeviceGuard(const CurrentDeviceGuard&) = delete;
  CurrentDeviceGuard& operator=(const CurrentDeviceGuard&) = delete;

 private:
  int saved_ = 0;
  bool saved_ok_ = false;
};

std::string validate(const BufferConfig& config, const std::vector<std::vector<int>>& groups) {
  std::ostringstream message;
  if (groups.empty()) return "jax_ep: create_buffer needs at least one group of devices";
  const int num_ranks = config.num_ranks;
  if (num_ranks < 1 || num_ranks > kMaxRanks) {
    message << "jax_ep: num_ranks must be in [1, " << kMaxRanks << "], got " << num_ranks;
    return message.str();
  }
  std::set<int> seen;
  for (const auto& group : groups) {
    if (static_cast<int>(group.size()) != num_ranks) {
      message << "jax_ep: every group must have " << num_ranks << " devices, got one with "
              << group.size();
      return message.str();
    }
    for (int device : group) {
      if (device != kRemoteRank && !seen.insert(device).second) {
        message << "jax_ep: device " << device << " appears twice in the groups";
        return message.str();
      }
    }
  }
  if (seen.empty()) return "jax_ep: create_buffer needs at least one device of this process";
  if (config.num_experts <= 0 || config.num_experts % num_ranks != 0) {
    message << "jax_ep: num_experts must be a positive multiple of num_ranks=" << num_ranks
            << ", got " << config.num_experts;
    return message.str();
  }
  if (config.hidden <= 0 || config.hidden % kChannelsPerScale != 0) {
    message << "jax_ep: hidden must be a positive multiple of " << kChannelsPerScale << ", got "
            << config.hidden;
    return message.str();
  }
  if (config.max_tokens_per_rank <= 0) {
    message << "jax_ep: max_tokens_per_rank must be positive, got " << config.max_tokens_per_rank;
    return message.str();
  }
  if (config.num_topk <= 0 || config.num_topk > kMaxTopk) {
    message << "jax_ep: num_topk must be in [1, " << kMaxTopk << "], got " << config.num_topk;
    return message.str();
  }
  const int64_t max_capacity = static_cast<int64_t>(num_ranks) * config.max_tokens_per_rank;
  if (config.capacity <= 0 || config.capacity > max_capacity) {
    message << "jax_ep: capacity must be in [1, num_ranks * max_tokens_per_rank = " << max_capacity
            << "], got " << config.capacity;
    return message.str();
  }
  if (config.dtype_bytes != 2 && config.dtype_bytes != 4) {
    message << "jax_ep: dtype_bytes must be 2 (bfloat16) or 4 (float32), got "
            << config.dtype_bytes;
    return message.str();
  }
  if (!(config.timeout_s > 0.0)) {
    message << "jax_ep: timeout_s must be positive, got " << config.timeout_s;
    return message.str();
  }
  const int transport = static_cast<int>(config.device_transport);
  if (transport < 0 || transport > static_cast<int>(DeviceTransport::kNvshmem)) {
    message << "jax_ep: device_transport must be 0 (stores), 1 (mapped), 2 (emulated) or 3 "
            << "(nvshmem), got " << transport;
    return message.str();
  }
  if (config.normal_send_slots < 0) {
    message << "jax_ep: normal_send_slots must be >= 0, got " << config.normal_send_slots;
    return message.str();
  }
  return "";
}

// The NVSHMEM transport: one PE per process and one local rank per PE (NVSHMEM binds a PE to
// one GPU), `pes` shaped like `groups`.
std::string validate_symmetric(const std::vector<std::vector<int>>& groups,
                               const std::vector<std::vector<int>>& pes) {
  if (pes.size() != groups.size()) return "jax_ep: pes must have one list per EP group";
  int local_ranks = 0;
  for (size_t g = 0; g < groups.size(); ++g) {
    if (pes[g].size() != groups[g].size()) return "jax_ep: pes must have one PE per rank";
    for (int device : groups[g]) local_ranks += device != kRemoteRank;
  }
  if (local_ranks != 1) {
    return "jax_ep: the NVSHMEM transport needs exactly one device per process (this process "
           "drives " +
           std::to_string(local_ranks) + " ranks of the Buffer)";
  }
  if (!nvshmem_initialized()) return "jax_ep: NVSHMEM is not initialised in this process";
  return "";
}

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
  RETURN_MESSAGE_IF_CUDA_ERROR(device,
                               cudaMalloc(&ctx.peer_workspaces_device, sizeof(char*) * kMaxRanks));
  RETURN_MESSAGE_IF_CUDA_ERROR(
      device, cudaDeviceGetAttribute(&ctx.num_sms, cudaDevAttrMultiProcessorCount, device));
  const BufferConfig& config = ctx.config;
  ctx.normal_blocks =
      config.normal_blocks > 0 ? config.normal_blocks : ctx.num_sms * kNormalBlocksPerSm;
  ctx.low_latency_blocks = config.low_latency_blocks;  // 0: low_latency_grid_size's default
  ctx.normal_push_blocks = config.normal_push_blocks > 0
                               ? config.normal_push_blocks
                               : std::max(1, ctx.normal_blocks / kNormalPushBlocksDivisor);

  preload_normal_kernels();
  RETURN_MESSAGE_IF_CUDA_ERROR(device, cudaGetLastError());  // from preload_normal_kernels()
  if (ctx.config.low_latency) {
    preload_low_latency_kernels();
    RETURN_MESSAGE_IF_CUDA_ERROR(device, cudaGetLastError());  // from preload_low_latency_kernels()
  }
  if (config.device_transport != DeviceTransport::kStores) {
    RETURN_MESSAGE_IF_CUDA_ERROR(device, cudaMalloc(&ctx.transport_region_bases,
                                                    sizeof(char*) * kTransportRegions * kMaxRanks));
  }
  if (config.device_transport != DeviceTransport::kStores && config.low_latency) {
    RETURN_MESSAGE_IF_CUDA_ERROR(device, preload_low_latency_transport_kernels());
  }
  // Over kNvshmem the normal kernels are the plugin's (not preloaded, as its low-latency ones).
  if (normal_over_transport(config) && config.device_transport != DeviceTransport::kNvshmem) {
    preload_normal_transport_kernels();
    RETURN_MESSAGE_IF_CUDA_ERROR(device, cudaGetLastError());  // from the preload
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

// Copies `ctx.peer_workspaces` to its device-memory twin.
std::string upload_peer_table(RankContext& ctx) {
  RETURN_MESSAGE_IF_CUDA_ERROR(ctx.device, cudaSetDevice(ctx.device));
  RETURN_MESSAGE_IF_CUDA_ERROR(ctx.device,
                               cudaMemcpy(ctx.peer_workspaces_device, ctx.peer_workspaces,
                                          sizeof(char*) * kMaxRanks, cudaMemcpyHostToDevice));
  RETURN_MESSAGE_IF_CUDA_ERROR(ctx.device, cudaDeviceSynchronize());
  return "";
}

// The peer table of a rank whose workspace is on the NVSHMEM heap: rank r's workspace is
// NVSHMEM PE pes[r]'s copy of the same symmetric object.
std::string map_symmetric_peers(RankContext& ctx, const std::vector<int>& pes) {
  for (int r = 0; r < ctx.config.num_ranks; ++r) {
    ctx.pes[r] = pes[r];
    ctx.peer_workspaces[r] = static_cast<char*>(nvshmem_peer_address(ctx.workspace, pes[r]));
    if (ctx.peer_workspaces[r] == nullptr) {
      return "jax_ep: rank " + std::to_string(r) + " (NVSHMEM PE " + std::to_string(pes[r]) +
             ") is not reachable by loads and stores from device " + std::to_string(ctx.device) +
             " (nvshmem_ptr is null: another host). Device-initiated NVSHMEM puts for such "
             "peers are not implemented yet (docs/process_models.md, \"What spans hosts\")";
    }
  }
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

// Every rank's transport regions as seen from `ctx`'s device, [rank][kTransportRegions]: the
// low-latency kernels' two (null in a Buffer without them), the normal-mode area (the
// workspace's start) and its send region (the workspace's end); null for ranks not mapped yet.
// Over kNvshmem only this rank's row is read: its addresses are symmetric (the workspace is one
// allocation on the symmetric heap, so a region's offset in it names the same bytes at every PE).
void transport_region_table(const RankContext& ctx, char* table[kTransportRegions * kMaxRanks]) {
  low_latency_transport_region_table(ctx, table);
  const bool normal = normal_over_transport(ctx.config);
  const size_t send_region = normal_send_region_offset(ctx.config);
  for (int r = 0; r < kMaxRanks; ++r) {
    char* workspace = r < ctx.config.num_ranks ? ctx.peer_workspaces[r] : nullptr;
    const bool mapped = normal && workspace != nullptr;
    table[kTransportRegions * r + kNormalAreaRegion] = mapped ? workspace : nullptr;
    table[kTransportRegions * r + kNormalSendRegion] = mapped ? workspace + send_region : nullptr;
  }
}

// Once every peer of `ctx` is mapped: the device table of every rank's transport regions, and over
// the emulated transport this rank's ring and host proxy (which registers every rank's regions).
std::string start_transport(BufferState& state, RankContext& ctx) {
  const BufferConfig& config = ctx.config;
  if (config.device_transport == DeviceTransport::kStores) return "";
  char* table[kTransportRegions * kMaxRanks];
  transport_region_table(ctx, table);
  RETURN_MESSAGE_IF_CUDA_ERROR(ctx.device, cudaSetDevice(ctx.device));
  RETURN_MESSAGE_IF_CUDA_ERROR(ctx.device, cudaMemcpy(ctx.transport_region_bases, table,
                                                      sizeof(table), cudaMemcpyHostToDevice));
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
  const LowLatencyTransportArea area = low_latency_transport_area(config);
  const uint64_t low_latency_workspace = config.low_latency ? area.workspace_region_bytes : 0;
  const uint64_t low_latency_staging = config.low_latency ? area.staging_region_bytes : 0;
  std::vector<std::vector<std::pair<void*, uint64_t>>> regions(config.num_ranks);
  for (int r = 0; r < config.num_ranks; ++r) {
    char* const* row = table + kTransportRegions * r;
    regions[r] = {{row[kTransportWorkspace], low_latency_workspace},
                  {row[kTransportStaging], low_latency_staging},
                  {row[kNormalAreaRegion], normal_workspace_bytes(config)},
                  {row[kNormalSendRegion], normal_send_region_bytes(config)}};
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
    // Acknowledgement words: the low-latency kernels' warps, then the normal kernels' push warps
    // (each issuing warp needs its own while it may run).
    ctx.normal_first_warp = static_cast<uint32_t>(kTransportOpWarps);
    ctx.transport_ring = transport::make_ring(emulated->arena, kEmulatorRingCapacity,
                                              ctx.normal_first_warp + normal_transport_warps(ctx));
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

}  // namespace

std::string create_buffer(int64_t buffer_id, const BufferConfig& config,
                          const std::vector<std::vector<int>>& groups,
                          const std::vector<std::vector<int>>& pes) {
  std::string error = validate(config, groups);
  if (error.empty() && !pes.empty()) error = validate_symmetric(groups, pes);
  if (error.empty() && config.device_transport == DeviceTransport::kNvshmem && pes.empty()) {
    error =
        "jax_ep: JAX_EP_DEVICE_TRANSPORT=nvshmem puts through NVSHMEM's symmetric heap: "
        "set JAX_EP_TRANSPORT=nvshmem too";
  }
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
        error = start_transport(state, *ctx);
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
    if (error.empty()) error = start_transport(state, *ctx);
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
  for (const auto& emulated : it->second.emulated) {
    for (const std::string& e : emulated->proxy->take_errors()) {
      errors.push_back("rank " + std::to_string(emulated->ctx->rank) + " of EP group " +
                       std::to_string(emulated->ctx->group) + ": " + e);
    }
  }
  return errors;
}

size_t workspace_bytes(const BufferConfig& config) {
  const size_t send_region = normal_send_region_bytes(config);
  return send_region > 0 ? normal_send_region_offset(config) + send_region : areas_bytes(config);
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

int mutable_rank_contexts(int64_t buffer_id, RankContext** out, int capacity) {
  std::shared_lock<std::shared_mutex> lock(registry_mutex);
  auto it = buffers.find(buffer_id);
  if (it == buffers.end()) return 0;
  const auto& contexts = it->second.contexts;
  for (size_t i = 0; i < contexts.size() && static_cast<int>(i) < capacity; ++i) {
    out[i] = contexts[i].get();
  }
  return static_cast<int>(contexts.size());
}

}  // namespace

const RuntimeApi* runtime_api() {
  static const RuntimeApi api = {sizeof(RankContext), &mutable_rank_contexts};
  return &api;
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
