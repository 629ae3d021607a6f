// The normal-mode kernels over NVSHMEM's device API (DeviceTransport::kNvshmem): the plan and
// transfer kernels of dispatch_plan.cuh, dispatch_transfer.cuh, combine_plan.cuh and
// combine_transfer.cuh instantiated with TransportPath<NvshmemTransport> in the NVSHMEM plugin
// (plugins/nvshmem_transport_kernels.cu), launched through it (kernels/nvshmem_plugin.cc).
// dispatch.cu and combine.cu fill the arguments as for the other paths and call these instead of
// launching. cudaErrorNotSupported while the plugin is not loaded.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

namespace jax_ep {
namespace normal_dispatch {
struct DispatchPlanArgs;
struct DispatchTransferArgs;
}  // namespace normal_dispatch
namespace normal_combine {
struct CombinePlanArgs;
struct CombineTransferArgs;
}  // namespace normal_combine

// Cooperative, as launch_plan's; rank_slots: the narrow plan kernel's kRankSlots (1, 2, 4 or 8),
// or 0 for the wide one (with shared_bytes of dynamic shared memory).
cudaError_t launch_dispatch_plan_nvshmem(int rank_slots, int num_blocks, size_t shared_bytes,
                                         const normal_dispatch::DispatchPlanArgs& args,
                                         cudaStream_t stream);
cudaError_t launch_dispatch_transfer_nvshmem(int num_blocks, size_t shared_bytes,
                                             const normal_dispatch::DispatchTransferArgs& args,
                                             cudaStream_t stream);
cudaError_t launch_combine_plan_nvshmem(size_t shared_bytes,
                                        const normal_combine::CombinePlanArgs& args,
                                        cudaStream_t stream);
// element_bytes: y's element, 2 (bfloat16) or 4 (float32).
cudaError_t launch_combine_transfer_nvshmem(int element_bytes, int num_blocks, size_t shared_bytes,
                                            const normal_combine::CombineTransferArgs& args,
                                            cudaStream_t stream);

}  // namespace jax_ep
