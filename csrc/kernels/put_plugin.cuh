// The table of a transport's put-protocol kernels (put_plugin.h), written once as a template on
// the transport: each launch instantiates the kernel over `Transport`. A translation unit that
// includes this specialises MakeTransport (low_latency_put/put_kernels.cuh) and
// MakeNormalTransport (normal/put_path.cuh) for its transport first: put_mapped.cu (jax_ep._C),
// plugins/nvshmem_transport_kernels.cu, xla_ffi/testing/emulated_kernels.cu (the test module).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "common/launch.h"
#include "kernels/low_latency_put/put_kernels.cuh"
#include "kernels/low_latency_put/put_protocol.h"
#include "kernels/normal/combine_plan.cuh"
#include "kernels/normal/combine_transfer.cuh"
#include "kernels/normal/dispatch_plan.cuh"
#include "kernels/normal/dispatch_transfer.cuh"
#include "kernels/normal/put_path.cuh"
#include "kernels/put_plugin.h"

namespace jax_ep {

template <typename Transport>
struct PutKernels {
  using Path = TransportPath<Transport>;

  static dim3 grid_of(const LowLatencyTransportLaunch& l) {
    return dim3(static_cast<unsigned>(l.rank_count * l.layout.shape.warps_per_rank));
  }

  static int low_latency_dispatch(const LowLatencyTransportLaunch* l,
                                  const LowLatencyTransportDispatch* op, cudaStream_t stream) {
    transport_kernels::low_latency_transport_dispatch_kernel<Transport>
        <<<grid_of(*l), kWarpSize, 0, stream>>>(*l, *op);
    return static_cast<int>(cudaGetLastError());
  }

  static int low_latency_combine(const LowLatencyTransportLaunch* l,
                                 const LowLatencyTransportCombine* op, cudaStream_t stream) {
    transport_kernels::low_latency_transport_combine_kernel<Transport>
        <<<grid_of(*l), kWarpSize, 0, stream>>>(*l, *op);
    return static_cast<int>(cudaGetLastError());
  }

  static int dispatch_plan(int rank_slots, int num_blocks, size_t shared_bytes,
                           const normal_dispatch::DispatchPlanArgs* args, cudaStream_t stream) {
    using normal_dispatch::dispatch_plan_kernel;
    using normal_dispatch::dispatch_plan_wide_kernel;
    using normal_dispatch::kPlanThreads;
    switch (rank_slots) {
      case 0:
        return static_cast<int>(launch_cooperative(dispatch_plan_wide_kernel<Path>, num_blocks,
                                                   kPlanThreads, shared_bytes, stream, *args));
      case 1:
        return static_cast<int>(launch_cooperative(dispatch_plan_kernel<1, Path>, num_blocks,
                                                   kPlanThreads, 0, stream, *args));
      case 2:
        return static_cast<int>(launch_cooperative(dispatch_plan_kernel<2, Path>, num_blocks,
                                                   kPlanThreads, 0, stream, *args));
      case 4:
        return static_cast<int>(launch_cooperative(dispatch_plan_kernel<4, Path>, num_blocks,
                                                   kPlanThreads, 0, stream, *args));
      case 8:
        return static_cast<int>(launch_cooperative(dispatch_plan_kernel<8, Path>, num_blocks,
                                                   kPlanThreads, 0, stream, *args));
      default:
        return static_cast<int>(cudaErrorInvalidValue);  // not one of the plan's instances
    }
  }

  static int dispatch_transfer(int num_blocks, size_t shared_bytes,
                               const normal_dispatch::DispatchTransferArgs* args,
                               cudaStream_t stream) {
    normal_dispatch::dispatch_transfer_kernel<Path>
        <<<num_blocks, kNormalTransferThreads, shared_bytes, stream>>>(*args);
    return static_cast<int>(cudaGetLastError());
  }

  static int combine_plan(size_t shared_bytes, const normal_combine::CombinePlanArgs* args,
                          cudaStream_t stream) {
    normal_combine::combine_plan_kernel<Path>
        <<<1, normal_combine::kCombinePlanThreads, shared_bytes, stream>>>(*args);
    return static_cast<int>(cudaGetLastError());
  }

  template <typename Element>
  static void launch_combine_transfer(int num_blocks, size_t shared_bytes,
                                      const normal_combine::CombineTransferArgs* args,
                                      cudaStream_t stream) {
    if (args->num_ranks > kNarrowRanks) {
      normal_combine::combine_transfer_kernel<Element, Path, true>
          <<<num_blocks, kNormalTransferThreads, shared_bytes, stream>>>(*args);
    } else {
      normal_combine::combine_transfer_kernel<Element, Path, false>
          <<<num_blocks, kNormalTransferThreads, shared_bytes, stream>>>(*args);
    }
  }

  static int combine_transfer(int element_bytes, int num_blocks, size_t shared_bytes,
                              const normal_combine::CombineTransferArgs* args,
                              cudaStream_t stream) {
    if (element_bytes == 4) {
      launch_combine_transfer<float>(num_blocks, shared_bytes, args, stream);
    } else if (element_bytes == 2) {
      launch_combine_transfer<__nv_bfloat16>(num_blocks, shared_bytes, args, stream);
    } else {
      return static_cast<int>(cudaErrorInvalidValue);
    }
    return static_cast<int>(cudaGetLastError());
  }

  static int preload() {
    cudaFuncAttributes attributes;
    for (const void* kernel :
         {reinterpret_cast<const void*>(
              transport_kernels::low_latency_transport_dispatch_kernel<Transport>),
          reinterpret_cast<const void*>(
              transport_kernels::low_latency_transport_combine_kernel<Transport>),
          reinterpret_cast<const void*>(normal_dispatch::dispatch_plan_kernel<1, Path>),
          reinterpret_cast<const void*>(normal_dispatch::dispatch_plan_kernel<2, Path>),
          reinterpret_cast<const void*>(normal_dispatch::dispatch_plan_kernel<4, Path>),
          reinterpret_cast<const void*>(normal_dispatch::dispatch_plan_kernel<8, Path>),
          reinterpret_cast<const void*>(normal_dispatch::dispatch_plan_wide_kernel<Path>),
          reinterpret_cast<const void*>(normal_dispatch::dispatch_transfer_kernel<Path>),
          reinterpret_cast<const void*>(normal_combine::combine_plan_kernel<Path>),
          reinterpret_cast<const void*>(
              normal_combine::combine_transfer_kernel<float, Path, false>),
          reinterpret_cast<const void*>(normal_combine::combine_transfer_kernel<float, Path, true>),
          reinterpret_cast<const void*>(
              normal_combine::combine_transfer_kernel<__nv_bfloat16, Path, false>),
          reinterpret_cast<const void*>(
              normal_combine::combine_transfer_kernel<__nv_bfloat16, Path, true>)}) {
      const cudaError_t status = cudaFuncGetAttributes(&attributes, kernel);
      if (status != cudaSuccess) return static_cast<int>(status);
    }
    return static_cast<int>(cudaSuccess);
  }

  // The table of launches (and preload) for `device_transport`; the caller adds the rest.
  static PutPlugin table(DeviceTransport device_transport) {
    PutPlugin plugin;
    plugin.device_transport = device_transport;
    plugin.low_latency_dispatch = &low_latency_dispatch;
    plugin.low_latency_combine = &low_latency_combine;
    plugin.dispatch_plan = &dispatch_plan;
    plugin.dispatch_transfer = &dispatch_transfer;
    plugin.combine_plan = &combine_plan;
    plugin.combine_transfer = &combine_transfer;
    plugin.preload = &preload;
    return plugin;
  }
};

}  // namespace jax_ep
