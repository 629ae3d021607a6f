#include "runtime/nvshmem_plugin.h"

#include <dlfcn.h>

#include <mutex>

namespace jax_ep {
namespace {

struct Plugin {
  void* library = nullptr;
  int (*dispatch)(const LowLatencyTransportLaunch*, const LowLatencyTransportDispatch*,
                  cudaStream_t) = nullptr;
  int (*combine)(const LowLatencyTransportLaunch*, const LowLatencyTransportCombine*,
                 cudaStream_t) = nullptr;
  int (*library_of_kernels)(void**, char*, size_t) = nullptr;
};

Plugin plugin;  // written once under plugin_mutex, before any launch can use it
std::mutex plugin_mutex;

}  // namespace

std::string nvshmem_plugin_load(const std::string& path) {
  std::lock_guard<std::mutex> lock(plugin_mutex);
  if (plugin.library != nullptr) return "";
  void* library = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (library == nullptr) {
    const char* why = dlerror();
    return "jax_ep: cannot load the NVSHMEM device transport " + path + ": " +
           (why != nullptr ? why : "unknown error") +
           " (it is built only where NVSHMEM's headers and device library are found)";
  }
  Plugin loaded;
  loaded.library = library;
  loaded.dispatch =
      reinterpret_cast<decltype(loaded.dispatch)>(dlsym(library, "jax_ep_nvshmem_dispatch"));
  loaded.combine =
      reinterpret_cast<decltype(loaded.combine)>(dlsym(library, "jax_ep_nvshmem_combine"));
  loaded.library_of_kernels = reinterpret_cast<decltype(loaded.library_of_kernels)>(
      dlsym(library, "jax_ep_nvshmem_library"));
  if (loaded.dispatch == nullptr || loaded.combine == nullptr ||
      loaded.library_of_kernels == nullptr) {
    dlclose(library);
    return "jax_ep: " + path + " lacks the jax_ep_nvshmem_* entry points (a stale build?)";
  }
  plugin = loaded;
  return "";
}

cudaError_t launch_low_latency_transport_dispatch_nvshmem(const LowLatencyTransportLaunch& launch,
                                                          const LowLatencyTransportDispatch& op,
                                                          cudaStream_t stream) {
  if (plugin.dispatch == nullptr) return cudaErrorNotSupported;
  return static_cast<cudaError_t>(plugin.dispatch(&launch, &op, stream));
}

cudaError_t launch_low_latency_transport_combine_nvshmem(const LowLatencyTransportLaunch& launch,
                                                         const LowLatencyTransportCombine& op,
                                                         cudaStream_t stream) {
  if (plugin.combine == nullptr) return cudaErrorNotSupported;
  return static_cast<cudaError_t>(plugin.combine(&launch, &op, stream));
}

std::string nvshmem_transport_library(void** library) {
  if (plugin.library_of_kernels == nullptr) {
    return "jax_ep: the NVSHMEM device transport is not loaded (nvshmem_plugin_load)";
  }
  char error[256] = {0};
  if (plugin.library_of_kernels(library, error, sizeof(error)) != 0) {
    return std::string("jax_ep: the NVSHMEM device transport's kernels: ") + error;
  }
  return "";
}

}  // namespace jax_ep
