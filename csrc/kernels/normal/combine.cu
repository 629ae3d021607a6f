// Normal-mode combine (jax_ep_combine_v2): the reverse of dispatch.
//
// Two kernels per call, on the caller's stream:
//   1. combine_plan_kernel (1 block): tagged barrier with every rank, and the segment of y rows
//      held for each owner rank (recv_src is sorted by src_rank * T + token), by round when the
//      call has several (kernels/normal/windows.h).
//   2. combine_transfer_kernel (many blocks): pushes every y row (and y_w row) to its owner's
//      data region at slot [this rank][token % slots] with one release flag per row, and
//      reduces the tokens of this rank in float32 as their rows arrive (own rows are read
//      straight from y).
// The kernels live in combine_plan.cuh and combine_transfer.cuh (the NVSHMEM plugin
// instantiates them too); this file fills their arguments and launches them.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "common/launch.h"
#include "common/limits.h"
#include "kernels/api.h"
#include "kernels/normal/combine_plan.cuh"
#include "kernels/normal/combine_transfer.cuh"
#include "kernels/normal/launch.cuh"
#include "kernels/normal/put_path.cuh"
#include "kernels/normal/workspace.h"
#include "kernels/preload.h"

namespace jax_ep {
namespace {

using normal_combine::combine_plan_kernel;
using normal_combine::combine_plan_shared_bytes;
using normal_combine::combine_transfer_kernel;
using normal_combine::combine_transfer_shared_bytes;
using normal_combine::CombinePlanArgs;
using normal_combine::CombineTransferArgs;
using normal_combine::kCombinePlanThreads;
using normal_combine::kTransferThreads;

// The plan kernel on the rank's path: stores, or a device transport.
cudaError_t launch_plan(const RankContext& ctx, const CombinePlanArgs& plan, cudaStream_t stream) {
  const size_t shared_bytes = combine_plan_shared_bytes(plan.num_ranks);
  return launch_on_path(
      ctx,
      [&] {
        combine_plan_kernel<StoresPath><<<1, kCombinePlanThreads, shared_bytes, stream>>>(plan);
        return cudaGetLastError();
      },
      [&](const PutPlugin& put) { return put.combine_plan(shared_bytes, &plan, stream); });
}

// The transfer kernel of Element on the rank's path (the wide reduction above kNarrowRanks).
template <typename Element>
cudaError_t launch_transfer(const RankContext& ctx, const CombineTransferArgs& args,
                            cudaStream_t stream) {
  const size_t shared_bytes = combine_transfer_shared_bytes(args.num_ranks);
  const bool wide = args.num_ranks > kNarrowRanks;
  return launch_on_path(
      ctx,
      [&] {
        if (wide) {
          combine_transfer_kernel<Element, StoresPath, true>
              <<<ctx.normal_blocks, kTransferThreads, shared_bytes, stream>>>(args);
        } else {
          combine_transfer_kernel<Element, StoresPath, false>
              <<<ctx.normal_blocks, kTransferThreads, shared_bytes, stream>>>(args);
        }
        return cudaGetLastError();
      },
      [&](const PutPlugin& put) {
        return put.combine_transfer(static_cast<int>(sizeof(Element)), ctx.normal_blocks,
                                    shared_bytes, &args, stream);
      });
}

cudaError_t preload_combine_kernels_on_stores() {
  cudaFuncAttributes attributes;
  CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attributes, combine_plan_kernel<StoresPath>));
  CUDA_RETURN_IF_ERROR(
      cudaFuncGetAttributes(&attributes, combine_transfer_kernel<float, StoresPath, false>));
  CUDA_RETURN_IF_ERROR(
      cudaFuncGetAttributes(&attributes, combine_transfer_kernel<float, StoresPath, true>));
  CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(
      &attributes, combine_transfer_kernel<__nv_bfloat16, StoresPath, false>));
  return cudaFuncGetAttributes(&attributes,
                               combine_transfer_kernel<__nv_bfloat16, StoresPath, true>);
}

}  // namespace

cudaError_t launch_combine(const RankContext& ctx, const CombineParams& params,
                           cudaStream_t stream) {
  const BufferConfig& config = ctx.config;
  const NormalLayout layout = normal_layout(config);

  CombinePlanArgs plan = {};
  fill_plan_args(ctx, layout, WaitPhase::kCombineBarrier, plan);
  plan.recv_src = params.recv_src;
  plan.num_recv_tokens = params.num_recv_tokens;
  plan.num_tokens = params.num_tokens;
  plan.capacity = params.capacity;
  const int64_t region_bytes_per_row = combine_region_row_bytes(
      static_cast<int64_t>(config.hidden) * config.dtype_bytes, params.num_w);
  const NormalWindow window = combine_window(config, params.num_tokens, region_bytes_per_row);
  plan.round_rows = window.round_rows;
  plan.num_rounds = window.num_rounds;
  plan.round_bounds = reinterpret_cast<int32_t*>(ctx.workspace + layout.round_bounds);
  plan.round_levels = reinterpret_cast<int32_t*>(ctx.workspace + layout.round_levels);
  plan.barrier = reinterpret_cast<const uint64_t*>(ctx.workspace + layout.barrier);
  plan.peer_barrier = {ctx.peer_workspaces_device, layout.barrier};
  CUDA_RETURN_IF_ERROR(launch_plan(ctx, plan, stream));

  CombineTransferArgs args = {};
  fill_transfer_args(ctx, layout, WaitPhase::kCombineArrival, args);
  args.y = static_cast<const char*>(params.y);
  args.y_bytes_per_row = static_cast<int64_t>(config.hidden) * config.dtype_bytes;
  args.y_w = params.y_w;
  args.num_w = params.num_w;
  args.send_pos = params.send_pos;
  args.recv_src = params.recv_src;
  args.num_tokens = params.num_tokens;
  args.capacity = params.capacity;
  args.combined = static_cast<char*>(params.combined);
  args.combined_w = params.combined_w;
  args.region_bytes_per_row = region_bytes_per_row;
  args.round_bounds = plan.round_bounds;
  args.round_levels = plan.round_levels;
  set_window(window, args.rounds);
  if (config.dtype_bytes == 4) return launch_transfer<float>(ctx, args, stream);
  return launch_transfer<__nv_bfloat16>(ctx, args, stream);
}

int64_t combine_region_row_bytes(int64_t y_bytes_per_row, int num_w) {
  return region_row_bytes(y_bytes_per_row, num_w);
}

cudaError_t preload_combine_kernels() { return preload_combine_kernels_on_stores(); }

}  // namespace jax_ep
