// The registry's record of one Buffer, and the steps of its set-up that the registry's files
// share: registry.cc (the table of Buffers and the functions of registry.h), validation.cc (what
// create_buffer checks first), allocation.cc (each rank's memory and peers), transport_start.cc
// (the device transport's start-up). Internal to csrc/runtime/.
#pragma once

#include <cuda_runtime_api.h>

#include <memory>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "kernels/api.h"
#include "runtime/registry.h"

namespace jax_ep {

// The host side of one local rank's device transport (the emulated transport's proxy), made by
// its table's start_rank (kernels/put_plugin.h): opaque here.
struct TransportRank {
  const RankContext* ctx = nullptr;
  void* state = nullptr;
};

struct BufferState {
  BufferConfig config;
  std::vector<std::unique_ptr<RankContext>> contexts;  // every local device of every group
  std::vector<std::vector<int>> groups;                // device ordinals or kRemoteRank
  std::vector<std::pair<int, void*>> imported;         // (device, mapping) of other processes
  std::vector<TransportRank> transport_ranks;          // a transport with a host side
};

inline std::string cuda_failure(int device, const char* call, cudaError_t status) {
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

// ------------------------------------------------------------------------ validation.cc
// "" or what is wrong with `config` and `groups` (create_buffer's arguments).
std::string validate(const BufferConfig& config, const std::vector<std::vector<int>>& groups);
// The NVSHMEM transport: one PE per process and one local rank per PE (NVSHMEM binds a PE to
// one GPU), `pes` shaped like `groups`.
std::string validate_symmetric(const std::vector<std::vector<int>>& groups,
                               const std::vector<std::vector<int>>& pes);

// ------------------------------------------------------------------------ allocation.cc
// The contexts of the local ranks of one group, each allocated, its peers enabled and its peer
// table uploaded; appended to `contexts` (also on failure, for free_rank_context).
// `pes` (NVSHMEM transport, one local rank): the PE of every rank of the group; nullptr: device
// memory, peers of this process by unified addressing, of other processes by CUDA IPC.
std::string create_group(const BufferConfig& config, int group_index, const std::vector<int>& group,
                         const std::vector<int>* pes,
                         std::vector<std::unique_ptr<RankContext>>& contexts);
// Copies `ctx.peer_workspaces` to its device-memory twin.
std::string upload_peer_table(RankContext& ctx);
// Frees what was allocated for `ctx` (any subset), on its device. Errors are ignored: this runs
// on failure paths and at close, where nothing better can be done.
void free_rank_context(RankContext& ctx);
// Unmaps what import_workspace_handles() mapped (after the local devices are idle).
void close_imported(std::vector<std::pair<int, void*>>& imported);

// ------------------------------------------------------------------- transport_start.cc
// Once every peer of `ctx` is mapped: the device table of every rank's transport regions, and the
// host side of a transport that has one (the emulated transport's ring and host proxy, which
// registers every rank's regions).
std::string start_transport(int64_t buffer_id, BufferState& state, RankContext& ctx);
// Waits for the local devices, then stops the transports' host sides (the proxies deliver what
// was published first): before peers are unmapped or workspaces freed.
void stop_transport(BufferState& state);

}  // namespace jax_ep
