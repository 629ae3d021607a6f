// The NVSHMEM plugin's entry points as the kernels' launchers call them (kernels/api.h): the
// plugin (csrc/plugins/nvshmem_transport_kernels.cu) is dlopen-ed on demand, and each launch of
// the kNvshmem path goes through the function it exports (cudaErrorNotSupported until loaded).
#include <dlfcn.h>

#include <mutex>

#include "kernels/api.h"
#include "kernels/low_latency/transport.h"
#include "kernels/normal/nvshmem.h"

namespace jax_ep {
namespace {

struct Plugin {
  void* library = nullptr;
  int (*dispatch)(const LowLatencyTransportLaunch*, const LowLatencyTransportDispatch*,
                  cudaStream_t) = nullptr;
  int (*combine)(const LowLatencyTransportLaunch*, const LowLatencyTransportCombine*,
                 cudaStream_t) = nullptr;
  int (*library_of_kernels)(void**, char*, size_t) = nullptr;
  // The normal mode's kernels (kernels/normal/nvshmem.h).
  int (*dispatch_plan)(int, int, size_t, const normal_dispatch::DispatchPlanArgs*,
                       cudaStream_t) = nullptr;
  int (*dispatch_transfer)(int, size_t, const normal_dispatch::DispatchTransferArgs*,
                           cudaStream_t) = nullptr;
  int (*combine_plan)(size_t, const normal_combine::CombinePlanArgs*, cudaStream_t) = nullptr;
  int (*combine_transfer)(int, int, size_t, const normal_combine::CombineTransferArgs*,
                          cudaStream_t) = nullptr;
};

template <typename Function>
void resolve(void* library, const char* name, Function* function) {
  *function = reinterpret_cast<Function>(dlsym(library, name));
}

Plugin plugin;  // written once under plugin_mutex, before any launch can use it
std::mutex plugin_mutex;

// A launch through the plugin's entry point `function` (its int is a cudaError_t), or
// cudaErrorNotSupported while the plugin is not loaded.
template <typename... Params, typename... Args>
cudaError_t call(int (*function)(Params...), Args... args) {
  if (function == nullptr) return cudaErrorNotSupported;
  return static_cast<cudaError_t>(function(args...));
}

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
  resolve(library, "jax_ep_nvshmem_dispatch", &loaded.dispatch);
  resolve(library, "jax_ep_nvshmem_combine", &loaded.combine);
  resolve(library, "jax_ep_nvshmem_library", &loaded.library_of_kernels);
  resolve(library, "jax_ep_nvshmem_normal_dispatch_plan", &loaded.dispatch_plan);
  resolve(library, "jax_ep_nvshmem_normal_dispatch_transfer", &loaded.dispatch_transfer);
  resolve(library, "jax_ep_nvshmem_normal_combine_plan", &loaded.combine_plan);
  resolve(library, "jax_ep_nvshmem_normal_combine_transfer", &loaded.combine_transfer);
  if (loaded.dispatch == nullptr || loaded.combine == nullptr ||
      loaded.library_of_kernels == nullptr || loaded.dispatch_plan == nullptr ||
      loaded.dispatch_transfer == nullptr || loaded.combine_plan == nullptr ||
      loaded.combine_transfer == nullptr) {
    dlclose(library);
    return "jax_ep: " + path + " lacks the jax_ep_nvshmem_* entry points (a stale build?)";
  }
  plugin = loaded;
  return "";
}

cudaError_t launch_low_latency_transport_dispatch_nvshmem(const LowLatencyTransportLaunch& launch,
                                                          const LowLatencyTransportDispatch& op,
                                                          cudaStream_t stream) {
  return call(plugin.dispatch, &launch, &op, stream);
}

cudaError_t launch_low_latency_transport_combine_nvshmem(const LowLatencyTransportLaunch& launch,
                                                         const LowLatencyTransportCombine& op,
                                                         cudaStream_t stream) {
  return call(plugin.combine, &launch, &op, stream);
}

cudaError_t launch_dispatch_plan_nvshmem(int rank_slots, int num_blocks, size_t shared_bytes,
                                         const normal_dispatch::DispatchPlanArgs& args,
                                         cudaStream_t stream) {
  return call(plugin.dispatch_plan, rank_slots, num_blocks, shared_bytes, &args, stream);
}

cudaError_t launch_dispatch_transfer_nvshmem(int num_blocks, size_t shared_bytes,
                                             const normal_dispatch::DispatchTransferArgs& args,
                                             cudaStream_t stream) {
  return call(plugin.dispatch_transfer, num_blocks, shared_bytes, &args, stream);
}

cudaError_t launch_combine_plan_nvshmem(size_t shared_bytes,
                                        const normal_combine::CombinePlanArgs& args,
                                        cudaStream_t stream) {
  return call(plugin.combine_plan, shared_bytes, &args, stream);
}

cudaError_t launch_combine_transfer_nvshmem(int element_bytes, int num_blocks, size_t shared_bytes,
                                            const normal_combine::CombineTransferArgs& args,
                                            cudaStream_t stream) {
  return call(plugin.combine_transfer, element_bytes, num_blocks, shared_bytes, &args, stream);
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
