// libjax_ep_nvshmem.so: the low-latency dispatch and combine over NVSHMEM's device API
// (LowLatencyTransportKind::kNvshmem; transport/nvshmem_transport.cuh), a plugin that jax_ep._C
// loads only when a Buffer asks for JAX_EP_DEVICE_TRANSPORT=nvshmem (runtime/nvshmem_plugin.h).
// Built only where NVSHMEM's headers and device library are found. A library of its own because
// NVSHMEM's device library needs its host library at load time (jax_ep._C must import without
// NVSHMEM), and because its kernels are relocatable device code, device-linked against
// libnvshmem_device.a into this library's module; nvshmemx_culibrary_init fills that module's
// NVSHMEM device state once NVSHMEM is initialised.
#include <cuda.h>

#include <cstdio>

#include "kernels/low_latency/low_latency_transport.h"
#include "kernels/low_latency/low_latency_transport_kernels.cuh"
#include "transport/nvshmem_transport.cuh"

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
}  // namespace jax_ep

namespace {

using jax_ep::LowLatencyTransportCombine;
using jax_ep::LowLatencyTransportDispatch;
using jax_ep::LowLatencyTransportLaunch;
using jax_ep::transport::NvshmemTransport;
using jax_ep::transport_kernels::low_latency_transport_combine_kernel;
using jax_ep::transport_kernels::low_latency_transport_dispatch_kernel;

dim3 grid_of(const LowLatencyTransportLaunch& l) {
  return dim3(static_cast<unsigned>(l.rank_count * l.layout.shape.warps_per_rank));
}

}  // namespace

// The entry points jax_ep._C resolves by name (runtime/nvshmem_plugin.cc).
extern "C" {

__attribute__((visibility("default"))) int jax_ep_nvshmem_dispatch(
    const LowLatencyTransportLaunch* launch, const LowLatencyTransportDispatch* op,
    cudaStream_t stream) {
  low_latency_transport_dispatch_kernel<NvshmemTransport>
      <<<grid_of(*launch), jax_ep::kWarpSize, 0, stream>>>(*launch, *op);
  return static_cast<int>(cudaGetLastError());
}

__attribute__((visibility("default"))) int jax_ep_nvshmem_combine(
    const LowLatencyTransportLaunch* launch, const LowLatencyTransportCombine* op,
    cudaStream_t stream) {
  low_latency_transport_combine_kernel<NvshmemTransport>
      <<<grid_of(*launch), jax_ep::kWarpSize, 0, stream>>>(*launch, *op);
  return static_cast<int>(cudaGetLastError());
}

// This library's kernels as a CUlibrary, for nvshmemx_culibrary_init. 0, or nonzero with a
// message in `error`.
__attribute__((visibility("default"))) int jax_ep_nvshmem_library(void** library, char* error,
                                                                  size_t error_bytes) {
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
  const cudaError_t status = cudaGetKernel(
      &kernel,
      reinterpret_cast<const void*>(low_latency_transport_dispatch_kernel<NvshmemTransport>));
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

}  // extern "C"
