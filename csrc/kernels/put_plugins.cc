// The put-protocol kernels of every device transport, by DeviceTransport (put_plugin.h): the
// mapped transport's are built in; the others come from a shared library that exports
// kPutPluginSymbol, loaded (dlopen) when a Buffer asks for them: the NVSHMEM plugin, or the test
// module, which hands over its emulated transport. Tables are written once each, under a mutex,
// before a Buffer over that transport is created; launches read them without a lock.
#include <dlfcn.h>

#include <atomic>
#include <mutex>
#include <string>

#include "kernels/api.h"
#include "kernels/put_plugin.h"

namespace jax_ep {
namespace {

constexpr int kNumTransports = 4;  // DeviceTransport's values
std::atomic<const PutPlugin*> loaded[kNumTransports];
std::mutex load_mutex;

const char* name_of(DeviceTransport transport) {
  switch (transport) {
    case DeviceTransport::kMapped:
      return "mapped";
    case DeviceTransport::kEmulated:
      return "emulated";
    case DeviceTransport::kNvshmem:
      return "nvshmem";
    default:
      return "stores";
  }
}

// "" or why `plugin`, found in `path`, is not a table this build can use.
std::string check_table(const PutPlugin* plugin, const std::string& path) {
  if (plugin == nullptr) return "jax_ep: " + path + " returned no put-protocol kernels";
  if (plugin->table_bytes != sizeof(PutPlugin) ||
      plugin->rank_context_bytes != sizeof(RankContext)) {
    return "jax_ep: " + path + " comes from another build of jax_ep (its table of kernels has " +
           "another layout): rebuild it with jax_ep";
  }
  const DeviceTransport transport = plugin->device_transport;
  if (transport != DeviceTransport::kEmulated && transport != DeviceTransport::kNvshmem) {
    return std::string("jax_ep: ") + path + " offers the " + name_of(transport) +
           " transport, which is jax_ep._C's own";
  }
  if (plugin->low_latency_dispatch == nullptr || plugin->low_latency_combine == nullptr ||
      plugin->dispatch_plan == nullptr || plugin->dispatch_transfer == nullptr ||
      plugin->combine_plan == nullptr || plugin->combine_transfer == nullptr) {
    return "jax_ep: " + path + " lacks some of the put-protocol kernels (a stale build?)";
  }
  const bool host_side = plugin->start_rank != nullptr;
  if (host_side != (plugin->stop_rank != nullptr) ||
      host_side != (plugin->take_errors != nullptr)) {
    return "jax_ep: " + path + " has a partial host side (start_rank, stop_rank, take_errors)";
  }
  return "";
}

}  // namespace

std::string transport_plugin_load(const std::string& path) {
  std::lock_guard<std::mutex> lock(load_mutex);
  void* library = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (library == nullptr) {
    const char* why = dlerror();
    return "jax_ep: cannot load the device transport " + path + ": " +
           (why != nullptr ? why : "unknown error") +
           " (the NVSHMEM plugin is built only where NVSHMEM's headers and device library are "
           "found)";
  }
  using Entry = const PutPlugin* (*)();
  const Entry entry = reinterpret_cast<Entry>(dlsym(library, kPutPluginSymbol));
  if (entry == nullptr) {
    dlclose(library);
    return "jax_ep: " + path + " exports no " + kPutPluginSymbol + " (a stale build?)";
  }
  const PutPlugin* plugin = entry();
  const std::string problem = check_table(plugin, path);
  if (!problem.empty()) {
    dlclose(library);
    return problem;
  }
  // Kept open for the life of the process: launches and proxies run its code.
  std::atomic<const PutPlugin*>& slot = loaded[static_cast<int>(plugin->device_transport)];
  const PutPlugin* before = slot.load();
  if (before != nullptr && before != plugin) {
    dlclose(library);
    return std::string("jax_ep: the ") + name_of(plugin->device_transport) +
           " transport is loaded already, from another library than " + path;
  }
  slot.store(plugin);
  return "";
}

const PutPlugin* put_plugin(DeviceTransport device_transport) {
  if (device_transport == DeviceTransport::kMapped) return mapped_put_plugin();
  const int index = static_cast<int>(device_transport);
  if (index <= 0 || index >= kNumTransports) return nullptr;
  return loaded[index].load();
}

std::string transport_plugin_missing(DeviceTransport device_transport) {
  if (device_transport == DeviceTransport::kStores || put_plugin(device_transport) != nullptr) {
    return "";
  }
  if (device_transport == DeviceTransport::kEmulated) {
    return "jax_ep: JAX_EP_DEVICE_TRANSPORT=emulated runs the emulated transport of the test "
           "module, which this process has not registered: call "
           "jax_ep._C_testing.register_emulated_transport() before creating the Buffer (the test "
           "module is built and installed beside jax_ep._C)";
  }
  return "jax_ep: JAX_EP_DEVICE_TRANSPORT=nvshmem needs the NVSHMEM plugin loaded "
         "(jax_ep._C.transport_plugin_load(<libjax_ep_nvshmem.so>), which the Buffer does with "
         "JAX_EP_PEER_MAPPING=nvshmem)";
}

std::string nvshmem_transport_library(void** library) {
  const PutPlugin* plugin = put_plugin(DeviceTransport::kNvshmem);
  if (plugin == nullptr || plugin->library == nullptr) {
    return "jax_ep: the NVSHMEM device transport is not loaded (transport_plugin_load)";
  }
  char error[256] = {0};
  if (plugin->library(library, error, sizeof(error)) != 0) {
    return std::string("jax_ep: the NVSHMEM device transport's kernels: ") + error;
  }
  return "";
}

std::string start_transport_rank(int64_t buffer_id, const RankContext& ctx,
                                 char* const* region_table, const uint64_t* region_bytes,
                                 void** rank, const void** queue) {
  *rank = nullptr;
  *queue = nullptr;
  const PutPlugin* plugin = put_plugin(ctx.config.device_transport);
  if (plugin == nullptr) return transport_plugin_missing(ctx.config.device_transport);
  if (plugin->start_rank == nullptr) return "";
  char error[512] = {0};
  if (plugin->start_rank(buffer_id, &ctx, region_table, region_bytes, rank, queue, error,
                         sizeof(error)) != 0) {
    return std::string("jax_ep: the ") + name_of(ctx.config.device_transport) +
           " transport of rank " + std::to_string(ctx.rank) + " (device " +
           std::to_string(ctx.device) + "): " + error;
  }
  return "";
}

void stop_transport_rank(DeviceTransport device_transport, void* rank) {
  const PutPlugin* plugin = put_plugin(device_transport);
  if (plugin != nullptr && plugin->stop_rank != nullptr && rank != nullptr) {
    plugin->stop_rank(rank);
  }
}

std::vector<std::string> take_transport_rank_errors(DeviceTransport device_transport, void* rank) {
  std::vector<std::string> errors;
  const PutPlugin* plugin = put_plugin(device_transport);
  if (plugin == nullptr || plugin->take_errors == nullptr || rank == nullptr) return errors;
  plugin->take_errors(
      rank,
      [](void* context, const char* error) {
        static_cast<std::vector<std::string>*>(context)->emplace_back(error);
      },
      &errors);
  return errors;
}

}  // namespace jax_ep
