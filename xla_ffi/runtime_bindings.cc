// Host-side Buffer lifecycle exposed to Python (jax_ep._C): create/destroy, error counters and
// the workspace size formula. Called eagerly, outside any XLA program.
#include <cuda_runtime.h>

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/normal_workspace.h"
#include "runtime/context.h"
#include "runtime/nvshmem_host.h"
#include "runtime/registry.h"
#include "targets.h"

namespace nb = nanobind;

namespace jax_ep {
namespace {

BufferConfig make_config(int num_ranks, int num_experts, int hidden, int max_tokens_per_rank,
                         int num_topk, int capacity, int dtype_bytes, bool low_latency,
                         double timeout_s) {
  BufferConfig config;
  config.num_ranks = num_ranks;
  config.num_experts = num_experts;
  config.hidden = hidden;
  config.max_tokens_per_rank = max_tokens_per_rank;
  config.num_topk = num_topk;
  config.capacity = capacity;
  config.dtype_bytes = dtype_bytes;
  config.low_latency = low_latency;
  config.timeout_s = timeout_s;
  return config;
}

void create_buffer_or_raise(int64_t buffer_id, const std::vector<std::vector<int>>& groups,
                            const BufferConfig& config,
                            const std::vector<std::vector<int>>& pes = {}) {
  std::string error;
  {
    nb::gil_scoped_release release;
    error = create_buffer(buffer_id, config, groups, pes);
  }
  if (!error.empty()) throw std::runtime_error(error);
}

std::vector<const RankContext*> contexts_or_raise(int64_t buffer_id) {
  std::vector<const RankContext*> contexts = rank_contexts(buffer_id);
  if (contexts.empty()) {
    throw std::runtime_error("jax_ep: no Buffer with id " + std::to_string(buffer_id) +
                             " (closed, or never created)");
  }
  return contexts;
}

std::runtime_error cuda_failure(const RankContext& ctx, const char* call, cudaError_t status) {
  cudaGetLastError();
  std::ostringstream message;
  message << "jax_ep: " << call << " failed on device " << ctx.device << ": "
          << cudaGetErrorName(status) << " (" << cudaGetErrorString(status) << ")";
  return std::runtime_error(message.str());
}

struct DeviceErrors {
  bool read_ok = false;  // false: the device copy failed (e.g. its context died in a trap)
  cudaError_t status = cudaSuccess;
  ErrorCounters counters = {};
  uint64_t seq = 0;
};

DeviceErrors read_device_errors(const RankContext& ctx) {
  DeviceErrors result;
  const NormalLayout layout = normal_layout(ctx.config);
  result.status = cudaSetDevice(ctx.device);
  if (result.status == cudaSuccess) {
    result.status = cudaMemcpy(&result.counters, ctx.error_counters, sizeof(ErrorCounters),
                               cudaMemcpyDeviceToHost);
  }
  if (result.status == cudaSuccess) {
    result.status = cudaMemcpy(&result.seq, ctx.workspace + layout.seq, sizeof(uint64_t),
                               cudaMemcpyDeviceToHost);
  }
  result.read_ok = result.status == cudaSuccess;
  if (!result.read_ok) cudaGetLastError();
  return result;
}

}  // namespace

void add_runtime_functions(nb::module_& m) {
  // create_buffer(buffer_id, groups, num_experts, ...) as in docs/internals.md; the overload
  // with num_ranks after `groups` (what Buffer._runtime_config() passes) checks it against the
  // group size.
  m.def(
      "create_buffer",
      [](int64_t buffer_id, const std::vector<std::vector<int>>& groups, int num_experts,
         int hidden, int max_tokens_per_rank, int num_topk, int capacity, int dtype_bytes,
         bool low_latency, double timeout_s) {
        const int num_ranks = groups.empty() ? 0 : static_cast<int>(groups.front().size());
        create_buffer_or_raise(
            buffer_id, groups,
            make_config(num_ranks, num_experts, hidden, max_tokens_per_rank, num_topk, capacity,
                        dtype_bytes, low_latency, timeout_s));
      },
      nb::arg("buffer_id"), nb::arg("groups"), nb::arg("num_experts"), nb::arg("hidden"),
      nb::arg("max_tokens_per_rank"), nb::arg("num_topk"), nb::arg("capacity"),
      nb::arg("dtype_bytes"), nb::arg("low_latency"), nb::arg("timeout_s"),
      "Allocates the communication memory of Buffer `buffer_id` on every device of `groups` "
      "(each inner list = the device ordinals of one EP group, in rank order), builds the peer "
      "tables and preloads the kernels. Raises RuntimeError naming the failing device/call.");
  m.def(
      "create_buffer",
      [](int64_t buffer_id, const std::vector<std::vector<int>>& groups, int num_ranks,
         int num_experts, int hidden, int max_tokens_per_rank, int num_topk, int capacity,
         int dtype_bytes, bool low_latency, double timeout_s,
         const std::vector<std::vector<int>>& pes) {
        for (const auto& group : groups) {
          if (static_cast<int>(group.size()) != num_ranks) {
            throw std::runtime_error("jax_ep: num_ranks=" + std::to_string(num_ranks) +
                                     " but a group has " + std::to_string(group.size()) +
                                     " devices");
          }
        }
        create_buffer_or_raise(
            buffer_id, groups,
            make_config(num_ranks, num_experts, hidden, max_tokens_per_rank, num_topk, capacity,
                        dtype_bytes, low_latency, timeout_s),
            pes);
      },
      nb::arg("buffer_id"), nb::arg("groups"), nb::arg("num_ranks"), nb::arg("num_experts"),
      nb::arg("hidden"), nb::arg("max_tokens_per_rank"), nb::arg("num_topk"), nb::arg("capacity"),
      nb::arg("dtype_bytes"), nb::arg("low_latency"), nb::arg("timeout_s"),
      nb::arg("pes") = std::vector<std::vector<int>>(),
      "As above, with num_ranks checked against the groups; `pes` (shaped like `groups`): the "
      "NVSHMEM transport, the PE of every rank (nvshmem_initialize first).");

  m.def("nvshmem_built", &nvshmem_built,
        "Whether this build has NVSHMEM's types (the wheel's headers were found).");
  m.def(
      "nvshmem_load",
      [](const std::string& library_path) {
        const std::string error = nvshmem_load(library_path);
        if (!error.empty()) throw std::runtime_error(error);
      },
      nb::arg("library_path"), "Loads NVSHMEM's host library (libnvshmem_host.so.3).");
  m.def(
      "nvshmem_unique_id",
      []() {
        std::string unique_id;
        const std::string error = nvshmem_unique_id(&unique_id);
        if (!error.empty()) throw std::runtime_error(error);
        return nb::bytes(unique_id.data(), unique_id.size());
      },
      "A new NVSHMEM unique id (bytes), made by one process for all.");
  m.def(
      "nvshmem_initialize",
      [](nb::bytes unique_id, int pe, int num_pes, int device) {
        std::string error;
        const std::string id(unique_id.c_str(), unique_id.size());
        {
          nb::gil_scoped_release release;  // collective: waits for the other PEs
          error = nvshmem_initialize(id, pe, num_pes, device);
        }
        if (!error.empty()) throw std::runtime_error(error);
      },
      nb::arg("unique_id"), nb::arg("pe"), nb::arg("num_pes"), nb::arg("device"),
      "Joins the NVSHMEM job as PE `pe` of `num_pes` on CUDA device `device` (once per process).");
  m.def("nvshmem_initialized", &nvshmem_initialized);

  m.def(
      "export_workspace_handles",
      [](int64_t buffer_id) {
        std::vector<WorkspaceHandle> handles;
        std::string error;
        {
          nb::gil_scoped_release release;
          error = export_workspace_handles(buffer_id, &handles);
        }
        if (!error.empty()) throw std::runtime_error(error);
        nb::list result;
        for (const auto& h : handles) {
          result.append(nb::make_tuple(h.group, h.rank, nb::bytes(h.handle.data(), h.handle.size())));
        }
        return result;
      },
      nb::arg("buffer_id"),
      "(group, rank, CUDA IPC handle bytes) of every workspace this process allocated.");

  m.def(
      "import_workspace_handles",
      [](int64_t buffer_id, const nb::list& entries) {
        std::vector<WorkspaceHandle> handles;
        for (nb::handle entry : entries) {
          const nb::tuple item = nb::cast<nb::tuple>(entry);
          const nb::bytes bytes = nb::cast<nb::bytes>(item[2]);
          handles.push_back({nb::cast<int>(item[0]), nb::cast<int>(item[1]),
                             std::string(bytes.c_str(), bytes.size())});
        }
        std::string error;
        {
          nb::gil_scoped_release release;
          error = import_workspace_handles(buffer_id, handles);
        }
        if (!error.empty()) throw std::runtime_error(error);
      },
      nb::arg("buffer_id"), nb::arg("handles"),
      "Maps other processes' workspaces ((group, rank, handle bytes) from their "
      "export_workspace_handles) into this process's ranks of the same group.");

  m.def(
      "release_peer_workspaces",
      [](int64_t buffer_id) {
        nb::gil_scoped_release release;
        release_peer_workspaces(buffer_id);
      },
      nb::arg("buffer_id"),
      "Waits for the Buffer's local devices and unmaps the workspaces of other processes.");

  m.def(
      "destroy_buffer",
      [](int64_t buffer_id) {
        nb::gil_scoped_release release;
        destroy_buffer(buffer_id);
      },
      nb::arg("buffer_id"),
      "Synchronises the Buffer's devices and frees its memory. Unknown ids are ignored.");

  m.def(
      "read_timeouts",
      [](int64_t buffer_id) {
        nb::list result;
        for (const RankContext* ctx : contexts_or_raise(buffer_id)) {
          const volatile TimeoutRecord* record = ctx->timeout_record_host;
          nb::dict entry;
          entry["device"] = ctx->device;
          entry["rank"] = ctx->rank;
          entry["timed_out"] = record->timed_out != 0;
          entry["timeout_peer"] = static_cast<int>(record->peer);
          entry["timeout_phase"] = static_cast<int>(record->phase);
          entry["seq"] = static_cast<int64_t>(record->seq);
          result.append(entry);
        }
        return result;
      },
      nb::arg("buffer_id"),
      "The host-mapped timeout record of every device (no CUDA call: safe after a kernel "
      "trapped): device, rank, timed_out, timeout_peer, timeout_phase, seq.");

  m.def(
      "read_errors",
      [](int64_t buffer_id) {
        const std::vector<const RankContext*> contexts = contexts_or_raise(buffer_id);
        std::vector<DeviceErrors> errors;
        {
          nb::gil_scoped_release release;
          for (const RankContext* ctx : contexts) errors.push_back(read_device_errors(*ctx));
        }
        nb::list result;
        for (size_t i = 0; i < contexts.size(); ++i) {
          const RankContext& ctx = *contexts[i];
          const volatile TimeoutRecord* record = ctx.timeout_record_host;
          const bool timed_out = record->timed_out != 0;
          // A device whose kernel trapped cannot be read any more; its timeout record (host
          // memory) still can, and is what the caller needs. Any other failure is raised.
          if (!errors[i].read_ok && !timed_out) {
            throw cuda_failure(ctx, "cudaMemcpy(error counters)", errors[i].status);
          }
          const int64_t unknown = -1;
          nb::dict entry;
          entry["device"] = ctx.device;
          entry["rank"] = ctx.rank;
          entry["invalid_expert_ids"] =
              errors[i].read_ok ? static_cast<int64_t>(errors[i].counters.invalid_expert_ids)
                                : unknown;
          entry["overflow_rows"] =
              errors[i].read_ok ? static_cast<int64_t>(errors[i].counters.overflow_rows) : unknown;
          entry["dropped_low_latency_rows"] =
              errors[i].read_ok
                  ? static_cast<int64_t>(errors[i].counters.dropped_low_latency_rows)
                  : unknown;
          entry["timed_out"] = timed_out;
          entry["timeout_peer"] = timed_out ? static_cast<int>(record->peer) : -1;
          entry["timeout_phase"] = timed_out ? static_cast<int>(record->phase) : 0;
          entry["seq"] = errors[i].read_ok ? static_cast<int64_t>(errors[i].seq) : unknown;
          result.append(entry);
        }
        return result;
      },
      nb::arg("buffer_id"),
      "One dict per device: device, rank, invalid_expert_ids, overflow_rows, "
      "dropped_low_latency_rows, timed_out, "
      "timeout_peer, timeout_phase (WaitPhase value, 0 = none), seq (normal-mode sequence). "
      "Counters read -1 when the device can no longer be read after a timeout.");

  m.def(
      "reset_errors",
      [](int64_t buffer_id) {
        const std::vector<const RankContext*> contexts = contexts_or_raise(buffer_id);
        nb::gil_scoped_release release;
        for (const RankContext* ctx : contexts) {
          cudaError_t status = cudaSetDevice(ctx->device);
          if (status == cudaSuccess) {
            status = cudaMemset(ctx->error_counters, 0, sizeof(ErrorCounters));
          }
          if (status == cudaSuccess) status = cudaDeviceSynchronize();
          if (status != cudaSuccess) throw cuda_failure(*ctx, "cudaMemset(error counters)", status);
        }
      },
      nb::arg("buffer_id"), "Zeroes the invalid-id and overflow counters on every device.");

  m.def(
      "workspace_bytes",
      [](int num_ranks, int num_experts, int hidden, int max_tokens_per_rank, int num_topk,
         int capacity, int dtype_bytes, bool low_latency) {
        const BufferConfig config =
            make_config(num_ranks, num_experts, hidden, max_tokens_per_rank, num_topk, capacity,
                        dtype_bytes, low_latency, /*timeout_s=*/10.0);
        return static_cast<int64_t>(workspace_bytes(config));
      },
      nb::arg("num_ranks"), nb::arg("num_experts"), nb::arg("hidden"),
      nb::arg("max_tokens_per_rank"), nb::arg("num_topk"), nb::arg("capacity"),
      nb::arg("dtype_bytes"), nb::arg("low_latency"),
      "Bytes of device memory create_buffer allocates per device for this configuration "
      "(the workspace; plus a few hundred bytes of counters and tables).");

  m.def(
      "handler_call_counts",
      []() {
        const HandlerCallCounts counts = handler_call_counts();
        nb::dict out;
        out["calls"] = counts.calls;
        out["captured"] = counts.captured;
        return out;
      },
      "Process-wide FFI handler executions, and how many ran under CUDA-graph stream capture.");
}

}  // namespace jax_ep
