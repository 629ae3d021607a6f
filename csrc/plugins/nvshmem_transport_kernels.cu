// libjax_ep_nvshmem.so: the low-latency dispatch and combine, and the normal mode's plan and
// transfer kernels, over NVSHMEM's device API (DeviceTransport::kNvshmem;
// transport/nvshmem_transport.cuh), a plugin that jax_ep._C loads only when a Buffer asks for
// JAX_EP_DEVICE_TRANSPORT=nvshmem (kernels/nvshmem_plugin.cc).
// Built only where NVSHMEM's headers and device library are found. A library of its own because
// NVSHMEM's device library needs its host library at load time (jax_ep._C must import without
// NVSHMEM), and because its kernels are relocatable device code, device-linked against
// libnvshmem_device.a into this library's module; nvshmemx_culibrary_init fills that module's
// NVSHMEM device state once NVSHMEM is initialised.
#include <cuda.h>
#include <cuda_bf16.h>

#include <cstdio>

#include "kernels/common/launch.h"
#include "kernels/low_latency/transport.h"
#include "kernels/low_latency/transport_kernels.cuh"
#include "kernels/normal/combine_plan.cuh"
#include "kernels/normal/combine_transfer.cuh"
#include "kernels/normal/dispatch_plan.cuh"
#include "kernels/normal/dispatch_transfer.cuh"
#include "kernels/normal/transport.cuh"
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

using jax_ep::LowLatencyTransportCombine;
using jax_ep::LowLatencyTransportDispatch;
using jax_ep::LowLatencyTransportLaunch;
using jax_ep::transport::NvshmemTransport;
using jax_ep::transport_kernels::low_latency_transport_combine_kernel;
using jax_ep::transport_kernels::low_latency_transport_dispatch_kernel;
using NvshmemPath = jax_ep::TransportPath<NvshmemTransport>;
using jax_ep::kNormalTransferThreads;  // both transfer kernels' block
using jax_ep::normal_combine::combine_plan_kernel;
using jax_ep::normal_combine::combine_transfer_kernel;
using jax_ep::normal_combine::CombinePlanArgs;
using jax_ep::normal_combine::CombineTransferArgs;
using jax_ep::normal_combine::kCombinePlanThreads;
using jax_ep::normal_dispatch::dispatch_plan_kernel;
using jax_ep::normal_dispatch::dispatch_plan_wide_kernel;
using jax_ep::normal_dispatch::dispatch_transfer_kernel;
using jax_ep::normal_dispatch::DispatchPlanArgs;
using jax_ep::normal_dispatch::DispatchTransferArgs;
using jax_ep::normal_dispatch::kPlanThreads;

dim3 grid_of(const LowLatencyTransportLaunch& l) {
  return dim3(static_cast<unsigned>(l.rank_count * l.layout.shape.warps_per_rank));
}

}  // namespace

// The entry points jax_ep._C resolves by name (kernels/nvshmem_plugin.cc).
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

// The normal mode's kernels (kernels/normal/nvshmem.h: _C fills the arguments and the grid
// as for its own paths). A cudaError_t.
__attribute__((visibility("default"))) int jax_ep_nvshmem_normal_dispatch_plan(
    int rank_slots, int num_blocks, size_t shared_bytes, const DispatchPlanArgs* args,
    cudaStream_t stream) {
  cudaError_t status = cudaErrorInvalidValue;
  switch (rank_slots) {
    case 0:
      status = jax_ep::launch_cooperative(dispatch_plan_wide_kernel<NvshmemPath>, num_blocks,
                                          kPlanThreads, shared_bytes, stream, *args);
      break;
    case 1:
      status = jax_ep::launch_cooperative(dispatch_plan_kernel<1, NvshmemPath>, num_blocks,
                                          kPlanThreads, 0, stream, *args);
      break;
    case 2:
      status = jax_ep::launch_cooperative(dispatch_plan_kernel<2, NvshmemPath>, num_blocks,
                                          kPlanThreads, 0, stream, *args);
      break;
    case 4:
      status = jax_ep::launch_cooperative(dispatch_plan_kernel<4, NvshmemPath>, num_blocks,
                                          kPlanThreads, 0, stream, *args);
      break;
    case 8:
      status = jax_ep::launch_cooperative(dispatch_plan_kernel<8, NvshmemPath>, num_blocks,
                                          kPlanThreads, 0, stream, *args);
      break;
    default:
      break;  // not one of the plan's instances
  }
  return static_cast<int>(status);
}

__attribute__((visibility("default"))) int jax_ep_nvshmem_normal_dispatch_transfer(
    int num_blocks, size_t shared_bytes, const DispatchTransferArgs* args, cudaStream_t stream) {
  dispatch_transfer_kernel<NvshmemPath>
      <<<num_blocks, kNormalTransferThreads, shared_bytes, stream>>>(*args);
  return static_cast<int>(cudaGetLastError());
}

__attribute__((visibility("default"))) int jax_ep_nvshmem_normal_combine_plan(
    size_t shared_bytes, const CombinePlanArgs* args, cudaStream_t stream) {
  combine_plan_kernel<NvshmemPath><<<1, kCombinePlanThreads, shared_bytes, stream>>>(*args);
  return static_cast<int>(cudaGetLastError());
}

// element_bytes: 2 (bfloat16) or 4 (float32).
__attribute__((visibility("default"))) int jax_ep_nvshmem_normal_combine_transfer(
    int element_bytes, int num_blocks, size_t shared_bytes, const CombineTransferArgs* args,
    cudaStream_t stream) {
  const bool wide = args->num_ranks > jax_ep::kNarrowRanks;
  if (element_bytes == 4 && wide) {
    combine_transfer_kernel<float, NvshmemPath, true>
        <<<num_blocks, kNormalTransferThreads, shared_bytes, stream>>>(*args);
  } else if (element_bytes == 4) {
    combine_transfer_kernel<float, NvshmemPath, false>
        <<<num_blocks, kNormalTransferThreads, shared_bytes, stream>>>(*args);
  } else if (element_bytes == 2 && wide) {
    combine_transfer_kernel<__nv_bfloat16, NvshmemPath, true>
        <<<num_blocks, kNormalTransferThreads, shared_bytes, stream>>>(*args);
  } else if (element_bytes == 2) {
    combine_transfer_kernel<__nv_bfloat16, NvshmemPath, false>
        <<<num_blocks, kNormalTransferThreads, shared_bytes, stream>>>(*args);
  } else {
    return static_cast<int>(cudaErrorInvalidValue);
  }
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
