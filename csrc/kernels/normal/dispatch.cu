// Normal-mode dispatch (jax_ep_dispatch_v2) and cached dispatch (jax_ep_cached_dispatch_v2).
//
// Two kernels per call, on the caller's stream:
//   1. dispatch_plan_kernel (cooperative; a block per kPlanTokensPerBlock tokens, at most one
//      per SM): token -> rank masks, per-destination stream positions (per-block counts, a scan
//      over blocks, then one inside each block), count exchange with every rank, send_pos /
//      num_recv_tokens, the plan and the inverse maps send_tokens[dst][position] = token.
//   2. dispatch_transfer_kernel (many blocks): pushes rows into the peers' data regions at the
//      slot of their output row (one release flag per row; in rounds when the capacity exceeds
//      the window, kernels/normal/windows.h), copies this rank's own rows straight from x,
//      zero-fills the padding rows, and copies arrived peer rows into the outputs as their flags
//      come in, so the local pass overlaps the transfer.
// The cached dispatch runs the same two kernels with routing taken from send_pos (mask
// send_pos >= 0) and an optional float32 payload `w` instead of ids/weights/src.
// The kernels live in dispatch_plan.cuh and dispatch_transfer.cuh (the NVSHMEM plugin
// instantiates them too); this file fills their arguments and launches them.
#include <cuda_runtime.h>

#include <algorithm>

#include "common/fast_divisor.h"
#include "common/launch.h"
#include "common/limits.h"
#include "kernels/api.h"
#include "kernels/normal/dispatch_plan.cuh"
#include "kernels/normal/dispatch_transfer.cuh"
#include "kernels/normal/launch.cuh"
#include "kernels/normal/put_path.cuh"
#include "kernels/normal/workspace.h"
#include "kernels/preload.h"

namespace jax_ep {
namespace {

using normal_dispatch::dispatch_plan_kernel;
using normal_dispatch::dispatch_plan_wide_kernel;
using normal_dispatch::dispatch_transfer_kernel;
using normal_dispatch::DispatchPlanArgs;
using normal_dispatch::DispatchTransferArgs;
using normal_dispatch::kPlanThreads;
using normal_dispatch::kTransferThreads;
using normal_dispatch::transfer_shared_bytes;
using normal_dispatch::transfer_shared_experts;
using normal_dispatch::wide_plan_shared_bytes;

// Fields shared by the plan arguments of dispatch and cached dispatch.
DispatchPlanArgs make_plan_args(const RankContext& ctx, const NormalLayout& layout, int num_tokens,
                                int capacity, WaitPhase phase) {
  const BufferConfig& config = ctx.config;
  DispatchPlanArgs args = {};
  fill_plan_args(ctx, layout, phase, args);
  args.num_tokens = num_tokens;
  args.num_topk = config.num_topk;
  args.num_experts = config.num_experts;
  args.num_local_experts = config.num_local_experts();
  args.experts_per_rank = FastDivisor(static_cast<uint32_t>(config.num_local_experts()));
  args.max_tokens = config.max_tokens_per_rank;
  args.capacity = capacity;
  args.send_tokens = reinterpret_cast<int32_t*>(ctx.workspace + layout.send_tokens);
  args.token_masks = reinterpret_cast<uint8_t*>(ctx.workspace + layout.token_masks);
  args.plan_counts = reinterpret_cast<uint64_t*>(ctx.workspace + layout.plan_counts);
  args.count_matrix = reinterpret_cast<const uint64_t*>(ctx.workspace + layout.count_matrix);
  args.peer_count_matrix = {ctx.peer_workspaces_device, layout.count_matrix};
  args.errors = ctx.error_counters;
  return args;
}

// The narrow plan kernel of kRankSlots (1, 2, 4 or 8), or with kRankSlots = 0 the wide one, on
// the rank's path: stores, or a device transport.
template <int kRankSlots>
cudaError_t launch_plan_on_path(const RankContext& ctx, int num_blocks, cudaStream_t stream,
                                const DispatchPlanArgs& args) {
  const size_t shared_bytes = kRankSlots == 0 ? wide_plan_shared_bytes(args.num_ranks) : 0;
  return launch_on_path(
      ctx,
      [&] {
        if constexpr (kRankSlots == 0) {
          return launch_cooperative(dispatch_plan_wide_kernel<StoresPath>, num_blocks, kPlanThreads,
                                    shared_bytes, stream, args);
        } else {
          return launch_cooperative(dispatch_plan_kernel<kRankSlots, StoresPath>, num_blocks,
                                    kPlanThreads, 0, stream, args);
        }
      },
      [&](const PutPlugin& put) {
        return put.dispatch_plan(kRankSlots, num_blocks, shared_bytes, &args, stream);
      });
}

// Grid of the plan: one block per kPlanTokensPerBlock tokens (so at most plan_block_slots()),
// at most one per SM (cooperative), at least one (it also runs the exchange when T = 0).
cudaError_t launch_plan(const RankContext& ctx, DispatchPlanArgs args, cudaStream_t stream) {
  int num_sms = 0;
  CUDA_RETURN_IF_ERROR(device_num_sms(ctx.device, ctx.num_sms, &num_sms));
  // Within the Buffer's SM budget (ctx.normal_blocks: Buffer(num_sms=...), one block per SM).
  const int num_blocks = std::max(
      1, std::min({ceil_div(args.num_tokens, kPlanTokensPerBlock), num_sms, ctx.normal_blocks}));
  args.tokens_per_block = ceil_div(args.num_tokens, num_blocks);
  if (args.num_ranks <= 1) return launch_plan_on_path<1>(ctx, num_blocks, stream, args);
  if (args.num_ranks <= 2) return launch_plan_on_path<2>(ctx, num_blocks, stream, args);
  if (args.num_ranks <= 4) return launch_plan_on_path<4>(ctx, num_blocks, stream, args);
  static_assert(kNarrowRanks == 8, "one narrow instance per power of two up to kNarrowRanks");
  if (args.num_ranks <= 8) return launch_plan_on_path<8>(ctx, num_blocks, stream, args);
  return launch_plan_on_path<0>(ctx, num_blocks, stream, args);
}

// Fields shared by the transfer arguments of dispatch and cached dispatch (Params: either's), the
// rows both move included: x (and its scales) into recv_x (and recv_scales).
template <typename Params>
DispatchTransferArgs make_transfer_args(const RankContext& ctx, const NormalLayout& layout,
                                        const Params& params, WaitPhase phase) {
  DispatchTransferArgs args = {};
  fill_transfer_args(ctx, layout, phase, args);
  args.num_tokens = params.num_tokens;
  args.capacity = params.capacity;
  args.num_local_experts = ctx.config.num_local_experts();
  args.experts_per_rank = FastDivisor(static_cast<uint32_t>(ctx.config.num_local_experts()));
  args.send_tokens = reinterpret_cast<const int32_t*>(ctx.workspace + layout.send_tokens);
  args.x = static_cast<const char*>(params.x);
  args.x_bytes_per_row = params.x_bytes_per_row;
  args.x_scales = params.x_scales;
  args.num_scales = params.num_scales;
  args.recv_x = static_cast<char*>(params.recv_x);
  args.recv_scales = params.recv_scales;
  return args;
}

cudaError_t launch_transfer(const RankContext& ctx, const DispatchTransferArgs& args,
                            cudaStream_t stream) {
  const size_t shared_bytes = transfer_shared_bytes(args.num_shared_experts, args.num_ranks);
  const int grid = ctx.normal_blocks;
  return launch_on_path(
      ctx,
      [&] {
        dispatch_transfer_kernel<StoresPath>
            <<<grid, kTransferThreads, shared_bytes, stream>>>(args);
        return cudaGetLastError();
      },
      [&](const PutPlugin& put) {
        return put.dispatch_transfer(grid, shared_bytes, &args, stream);
      });
}

cudaError_t preload_dispatch_kernels_on_stores() {
  cudaFuncAttributes attributes;
  CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attributes, dispatch_plan_kernel<1, StoresPath>));
  CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attributes, dispatch_plan_kernel<2, StoresPath>));
  CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attributes, dispatch_plan_kernel<4, StoresPath>));
  CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attributes, dispatch_plan_kernel<8, StoresPath>));
  CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attributes, dispatch_plan_wide_kernel<StoresPath>));
  return cudaFuncGetAttributes(&attributes, dispatch_transfer_kernel<StoresPath>);
}

// Both dispatches: the plan kernel (arguments completed by `set_plan`, waits in `plan_phase`),
// then the transfer kernel (completed by `set_transfer`, waits in `transfer_phase`).
template <typename Params, typename SetPlan, typename SetTransfer>
cudaError_t launch_plan_and_transfer(const RankContext& ctx, const Params& params,
                                     WaitPhase plan_phase, WaitPhase transfer_phase,
                                     cudaStream_t stream, SetPlan set_plan,
                                     SetTransfer set_transfer) {
  const NormalLayout layout = normal_layout(ctx.config);
  DispatchPlanArgs plan =
      make_plan_args(ctx, layout, params.num_tokens, params.capacity, plan_phase);
  set_plan(plan);
  CUDA_RETURN_IF_ERROR(launch_plan(ctx, plan, stream));
  DispatchTransferArgs transfer = make_transfer_args(ctx, layout, params, transfer_phase);
  set_transfer(transfer);
  set_window(dispatch_window(ctx.config, params.capacity, transfer.region_bytes_per_row),
             transfer.rounds);
  return launch_transfer(ctx, transfer, stream);
}

}  // namespace

cudaError_t launch_dispatch(const RankContext& ctx, const DispatchParams& params,
                            cudaStream_t stream) {
  return launch_plan_and_transfer(
      ctx, params, WaitPhase::kDispatchCounts, WaitPhase::kDispatchArrival, stream,
      [&](DispatchPlanArgs& plan) {
        plan.topk_idx = params.topk_idx;
        plan.send_pos_out = params.send_pos;
        plan.num_recv_tokens = params.num_recv_tokens;
        plan.num_recv_tokens_per_expert = params.num_recv_tokens_per_expert;
      },
      [&](DispatchTransferArgs& transfer) {
        transfer.topk_idx = params.topk_idx;
        transfer.topk_weights = params.topk_weights;
        transfer.num_topk = ctx.config.num_topk;
        transfer.recv_topk_idx = params.recv_topk_idx;
        transfer.recv_topk_weights = params.recv_topk_weights;
        transfer.recv_src = params.recv_src;
        transfer.num_recv_tokens_per_expert = params.num_recv_tokens_per_expert;
        transfer.num_shared_experts =
            transfer_shared_experts(ctx.config.num_local_experts(), ctx.config.num_ranks);
        transfer.region_bytes_per_row = dispatch_region_row_bytes(
            params.x_bytes_per_row, params.num_scales, ctx.config.num_topk);
      });
}

// The cached dispatch: routing from send_pos (its plan and exchange wait in the combine's phases,
// its place in a step), rows of x and an optional float32 payload w.
cudaError_t launch_cached_dispatch(const RankContext& ctx, const CachedDispatchParams& params,
                                   cudaStream_t stream) {
  return launch_plan_and_transfer(
      ctx, params, WaitPhase::kCombineBarrier, WaitPhase::kCombineArrival, stream,
      [&](DispatchPlanArgs& plan) { plan.send_pos = params.send_pos; },
      [&](DispatchTransferArgs& transfer) {
        transfer.payload = params.w;
        transfer.num_payload = params.num_w;
        transfer.recv_payload = params.recv_w;
        transfer.region_bytes_per_row = cached_dispatch_region_row_bytes(
            params.x_bytes_per_row, params.num_scales, params.num_w);
      });
}

int64_t dispatch_region_row_bytes(int64_t x_bytes_per_row, int num_scales, int num_topk) {
  return region_row_bytes(x_bytes_per_row, dispatch_aux_words(num_scales, num_topk));
}

int64_t cached_dispatch_region_row_bytes(int64_t x_bytes_per_row, int num_scales, int num_w) {
  return region_row_bytes(x_bytes_per_row, num_scales + num_w);
}

cudaError_t preload_dispatch_kernels() { return preload_dispatch_kernels_on_stores(); }

}  // namespace jax_ep
