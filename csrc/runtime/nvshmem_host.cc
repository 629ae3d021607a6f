#include "runtime/nvshmem_host.h"

#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <cstdlib>
#include <mutex>
#include <set>
#include <string>

#ifndef JAX_EP_HAVE_NVSHMEM
#define JAX_EP_HAVE_NVSHMEM 0
#endif
#if JAX_EP_HAVE_NVSHMEM
#include <host/nvshmemx_api.h>
#endif

namespace jax_ep {
namespace {

#if JAX_EP_HAVE_NVSHMEM

// The host-library entry points jax_ep uses, resolved by name.
struct NvshmemApi {
  void* library = nullptr;
  std::string path;
  int (*get_uniqueid)(nvshmemx_uniqueid_t*) = nullptr;
  int (*set_attr_uniqueid_args)(int, int, const nvshmemx_uniqueid_t*,
                                nvshmemx_init_attr_t*) = nullptr;
  int (*hostlib_init_attr)(unsigned int, nvshmemx_init_attr_t*) = nullptr;
  void* (*malloc)(size_t) = nullptr;
  void (*free)(void*) = nullptr;
  void* (*ptr)(const void*, int) = nullptr;
  int (*culibrary_init)(CUlibrary) = nullptr;
  bool initialized = false;
  std::set<void*> device_libraries;  // those nvshmem_init_device_library filled
};

NvshmemApi api;
std::mutex api_mutex;

template <typename Function>
bool resolve(const char* name, Function* function, std::string* missing) {
  *function = reinterpret_cast<Function>(dlsym(api.library, name));
  if (*function == nullptr) *missing += std::string(missing->empty() ? "" : ", ") + name;
  return *function != nullptr;
}

#else

const char* const kNotBuilt =
    "jax_ep was built without NVSHMEM (its headers were not found at build time: install "
    "nvidia-nvshmem-cu13 before building jax_ep, or set JAX_EP_NVSHMEM_HOME)";

#endif  // JAX_EP_HAVE_NVSHMEM

}  // namespace

bool nvshmem_built() { return JAX_EP_HAVE_NVSHMEM != 0; }

#if JAX_EP_HAVE_NVSHMEM

std::string nvshmem_load(const std::string& library_path) {
  std::lock_guard<std::mutex> lock(api_mutex);
  if (api.library != nullptr) {
    return api.path == library_path
               ? ""
               : "jax_ep: NVSHMEM is already loaded from " + api.path + ", not " + library_path;
  }
  // RTLD_GLOBAL: the library dlopens its bootstrap and transport plugins (found next to it).
  void* library = dlopen(library_path.c_str(), RTLD_NOW | RTLD_GLOBAL);
  if (library == nullptr) {
    const char* why = dlerror();
    return "jax_ep: cannot load the NVSHMEM host library " + library_path + ": " +
           (why != nullptr ? why : "unknown error");
  }
  api.library = library;
  std::string missing;
  resolve("nvshmemx_get_uniqueid", &api.get_uniqueid, &missing);
  resolve("nvshmemx_set_attr_uniqueid_args", &api.set_attr_uniqueid_args, &missing);
  resolve("nvshmemx_hostlib_init_attr", &api.hostlib_init_attr, &missing);
  resolve("nvshmem_malloc", &api.malloc, &missing);
  resolve("nvshmem_free", &api.free, &missing);
  resolve("nvshmem_ptr", &api.ptr, &missing);
  // Only the NVSHMEM device transport needs it (nvshmem_init_device_library says so).
  api.culibrary_init =
      reinterpret_cast<decltype(api.culibrary_init)>(dlsym(library, "nvshmemx_culibrary_init"));
  if (!missing.empty()) {
    dlclose(library);
    api = NvshmemApi{};
    return "jax_ep: " + library_path + " lacks " + missing + " (NVSHMEM 3.x expected)";
  }
  api.path = library_path;
  return "";
}

std::string nvshmem_unique_id(std::string* unique_id) {
  std::lock_guard<std::mutex> lock(api_mutex);
  if (api.library == nullptr) return "jax_ep: NVSHMEM is not loaded";
  nvshmemx_uniqueid_t id = NVSHMEMX_UNIQUEID_INITIALIZER;
  const int status = api.get_uniqueid(&id);
  if (status != 0) return "jax_ep: nvshmemx_get_uniqueid failed (" + std::to_string(status) + ")";
  unique_id->assign(reinterpret_cast<const char*>(&id), sizeof(id));
  return "";
}

std::string nvshmem_initialize(const std::string& unique_id, int pe, int num_pes, int device) {
  std::lock_guard<std::mutex> lock(api_mutex);
  if (api.library == nullptr) return "jax_ep: NVSHMEM is not loaded";
  if (api.initialized) return "";
  if (unique_id.size() != sizeof(nvshmemx_uniqueid_t)) {
    return "jax_ep: an NVSHMEM unique id has " + std::to_string(sizeof(nvshmemx_uniqueid_t)) +
           " bytes, got " + std::to_string(unique_id.size());
  }
  nvshmemx_uniqueid_t id;
  unique_id.copy(reinterpret_cast<char*>(&id), sizeof(id));
  const cudaError_t cuda_status = cudaSetDevice(device);  // NVSHMEM binds the PE to it
  if (cuda_status != cudaSuccess) {
    cudaGetLastError();
    return std::string("jax_ep: cudaSetDevice before NVSHMEM initialisation failed: ") +
           cudaGetErrorName(cuda_status);
  }
  nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
  int status = api.set_attr_uniqueid_args(pe, num_pes, &id, &attr);
  if (status == 0) status = api.hostlib_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID, &attr);
  if (status != 0) {
    return "jax_ep: NVSHMEM initialisation failed for PE " + std::to_string(pe) + " of " +
           std::to_string(num_pes) + " (status " + std::to_string(status) +
           "; NVSHMEM_DEBUG=INFO says more)";
  }
  api.initialized = true;
  return "";
}

bool nvshmem_initialized() {
  std::lock_guard<std::mutex> lock(api_mutex);
  return api.initialized;
}

std::string nvshmem_allocate(size_t bytes, void** ptr) {
  std::lock_guard<std::mutex> lock(api_mutex);
  if (!api.initialized) return "jax_ep: NVSHMEM is not initialised in this process";
  *ptr = api.malloc(bytes);
  if (*ptr == nullptr) {
    const char* heap = std::getenv("NVSHMEM_SYMMETRIC_SIZE");
    return "jax_ep: nvshmem_malloc(" + std::to_string(bytes) +
           ") failed: the symmetric heap (NVSHMEM_SYMMETRIC_SIZE=" +
           (heap != nullptr ? std::string(heap) : std::string("NVSHMEM's default")) +
           ", set when the first Buffer joined) is too small for this Buffer's workspace beside "
           "the Buffers already on it (raise NVSHMEM_SYMMETRIC_SIZE before the first Buffer), or "
           "the GPU is full (lower XLA_PYTHON_CLIENT_MEM_FRACTION)";
  }
  return "";
}

void* nvshmem_peer_address(void* ptr, int pe) {
  std::lock_guard<std::mutex> lock(api_mutex);
  return api.initialized ? api.ptr(ptr, pe) : nullptr;
}

void nvshmem_release(void* ptr) {
  std::lock_guard<std::mutex> lock(api_mutex);
  if (api.initialized && ptr != nullptr) api.free(ptr);
}

std::string nvshmem_init_device_library(void* library) {
  std::lock_guard<std::mutex> lock(api_mutex);
  if (!api.initialized) return "jax_ep: NVSHMEM is not initialised in this process";
  if (api.device_libraries.count(library) != 0) return "";
  if (api.culibrary_init == nullptr) {
    return "jax_ep: " + api.path +
           " has no nvshmemx_culibrary_init (NVSHMEM 3.8 or newer is "
           "needed for JAX_EP_DEVICE_TRANSPORT=nvshmem)";
  }
  const int status = api.culibrary_init(static_cast<CUlibrary>(library));
  if (status != 0) {
    return "jax_ep: nvshmemx_culibrary_init failed (status " + std::to_string(status) +
           ") for the NVSHMEM device transport's kernels";
  }
  api.device_libraries.insert(library);
  return "";
}

#else  // !JAX_EP_HAVE_NVSHMEM

std::string nvshmem_load(const std::string&) { return kNotBuilt; }
std::string nvshmem_unique_id(std::string*) { return kNotBuilt; }
std::string nvshmem_initialize(const std::string&, int, int, int) { return kNotBuilt; }
bool nvshmem_initialized() { return false; }
std::string nvshmem_allocate(size_t, void**) { return kNotBuilt; }
void* nvshmem_peer_address(void*, int) { return nullptr; }
void nvshmem_release(void*) {}
std::string nvshmem_init_device_library(void*) { return kNotBuilt; }

#endif  // JAX_EP_HAVE_NVSHMEM

}  // namespace jax_ep
