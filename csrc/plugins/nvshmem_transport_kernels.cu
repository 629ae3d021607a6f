// libjax_ep_nvshmem.so: the low-latency dispatch and combine, and the normal mode's plan and
// transfer kernels, over NVSHMEM's device API (DeviceTransport::kNvshmem;
// transport/nvshmem/nvshmem_transport.cuh), a plugin that jax_ep._C loads only when a Buffer asks
// for JAX_EP_DEVICE_TRANSPORT=nvshmem (kernels/put_plugins.cc), through the table it exports
// (kernels/put_plugin.h).
// Built only where NVSHMEM's headers and device library are found. A library of its own because
// NVSHMEM's device library needs its host library at load time (jax_ep._C must import without
// NVSHMEM), and because its kernels are relocatable device code, device-linked against
// libnvshmem_device.a into this library's module; nvshmemx_culibrary_init fills that module's
// NVSHMEM device state once NVSHMEM is initialised.
#include <cuda.h>

#include <cstdio>

#include "kernels/put_plugin.cuh"
#include "transport/nvshmem/nvshmem_transport.cuh"

namespace jax_ep {
namespace transport_kernels {

template <>
struct MakeTransport<transport::NvshmemTransport> {
  static __device__ transport::NvshmemTransport make(const LowLatencyTransportLaunch& l,
                                                     const Warp& w, WaitPhase phase) {
    return transport::NvshmemTransport{RegionTable{l.region_bases, l.regions_per_rank}, w.rank,
                                       l.pe_of_rank, wait_of(l, w.rank, phase)};
  }
};

}  // namespace transport_kernels

// The normal kernels' transport: addresses are this rank's (symmetric, the table's own row);
// warp indices matter to the emulated transport only.
template <>
struct MakeNormalTransport<transport::NvshmemTransport> {
  static __device__ __forceinline__ transport::NvshmemTransport make(const NormalTransportArgs& a,
                                                                     int rank, uint32_t /*warp*/,
                                                                     const WaitContext& wait) {
    return transport::NvshmemTransport{transport::RegionTable{a.region_bases, kTransportRegions},
                                       rank, a.pe_of_rank, wait};
  }
};

}  // namespace jax_ep

namespace {

using NvshmemKernels = jax_ep::PutKernels<jax_ep::transport::NvshmemTransport>;

// This library's kernels as a CUlibrary, for nvshmemx_culibrary_init. 0, or nonzero with a
// message in `error`.
int library_of_kernels(void** library, char* error, size_t error_bytes) {
  using GetLibrary = CUresult (*)(CUlibrary*, CUkernel);
  void* entry = nullptr;
  cudaDriverEntryPointQueryResult found;
  if (cudaGetDriverEntryPointByVersion("cuKernelGetLibrary", &entry, 12050, cudaEnableDefault,
                                       &found) != cudaSuccess ||
      found != cudaDriverEntryPointSuccess || entry == nullptr) {
    cudaGetLastError();
    std::snprintf(error, error_bytes, "the CUDA driver has no cuKernelGetLibrary (12.5+)");
    return 1;
  }
  cudaKernel_t kernel = nullptr;
  const cudaError_t status =
      cudaGetKernel(&kernel, reinterpret_cast<const void*>(
                                 jax_ep::transport_kernels::low_latency_transport_dispatch_kernel<
                                     jax_ep::transport::NvshmemTransport>));
  if (status != cudaSuccess) {
    cudaGetLastError();
    std::snprintf(error, error_bytes, "cudaGetKernel: %s", cudaGetErrorName(status));
    return 1;
  }
  CUlibrary handle = nullptr;
  const CUresult result =
      reinterpret_cast<GetLibrary>(entry)(&handle, reinterpret_cast<CUkernel>(kernel));
  if (result != CUDA_SUCCESS) {
    std::snprintf(error, error_bytes, "cuKernelGetLibrary failed (CUresult %d)",
                  static_cast<int>(result));
    return 1;
  }
  *library = handle;
  return 0;
}

jax_ep::PutPlugin make_plugin() {
  jax_ep::PutPlugin plugin = NvshmemKernels::table(jax_ep::DeviceTransport::kNvshmem);
  plugin.preload = nullptr;  // not preloaded: its module is NVSHMEM-initialised after loading
  plugin.library = &library_of_kernels;
  return plugin;
}

}  // namespace

// The table jax_ep._C resolves by name (kernels/put_plugins.cc, kPutPluginSymbol).
extern "C" __attribute__((visibility("default"))) const jax_ep::PutPlugin* jax_ep_put_plugin() {
  static const jax_ep::PutPlugin plugin = make_plugin();
  return &plugin;
}
