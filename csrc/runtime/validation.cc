// What create_buffer checks before it touches a device: the configuration and the groups, and
// for the NVSHMEM transport the PEs. Each problem is a message naming the value and the bound.
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "kernels/api.h"
#include "runtime/buffer_state.h"
#include "runtime/nvshmem_host.h"

namespace jax_ep {

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
  if (config.normal_window_rows < 0) {
    message << "jax_ep: normal_window_rows must be >= 0, got " << config.normal_window_rows;
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

}  // namespace jax_ep
