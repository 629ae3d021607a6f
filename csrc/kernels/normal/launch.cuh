// What dispatch.cu and combine.cu share to launch their kernels: the fields every transfer
// kernel's arguments hold, filled from the rank's context, and the one branch on the path by
// which a kernel crosses ranks (normal/transport.cuh). Host code of .cu files.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/common/peer_field.cuh"
#include "kernels/common/sync.cuh"
#include "kernels/context.h"
#include "kernels/normal/transport.cuh"
#include "kernels/normal/workspace.h"

namespace jax_ep {

// The path type of a kernel's template (StoresPath or TransportPath<T>), as a value.
template <typename Path>
struct PathTag {
  using type = Path;
};

// Launches a normal-mode kernel on the rank's path: `launch(PathTag<Path>{})` with the stores
// path or the mapped or emulated transport's, or, over NVSHMEM's device API, `launch_nvshmem()`:
// those kernels are the NVSHMEM plugin's instances (normal/nvshmem.h). Returns the launch status.
template <typename Launch, typename LaunchNvshmem>
cudaError_t launch_on_path(const RankContext& ctx, Launch launch, LaunchNvshmem launch_nvshmem) {
  switch (ctx.config.device_transport) {
    case DeviceTransport::kMapped:
      return launch(PathTag<TransportPath<transport::MappedTransport>>{});
    case DeviceTransport::kEmulated:
      return launch(PathTag<TransportPath<transport::EmulatedTransport>>{});
    case DeviceTransport::kNvshmem:
      return launch_nvshmem();
    default:
      return launch(PathTag<StoresPath>{});
  }
}

// The bounded waits of `ctx`'s kernels in `phase`.
inline WaitContext wait_context(const RankContext& ctx, WaitPhase phase) {
  return {ctx.timeout_ns, ctx.timeout_record, ctx.rank, static_cast<int32_t>(phase)};
}

// The fields of a plan kernel's arguments (DispatchPlanArgs, CombinePlanArgs) that come from the
// rank alone: its plan and sequence word, its bounded waits (in `phase`) and its transport.
template <typename PlanArgs>
void fill_plan_args(const RankContext& ctx, const NormalLayout& layout, WaitPhase phase,
                    PlanArgs& args) {
  args.num_ranks = ctx.config.num_ranks;
  args.rank = ctx.rank;
  args.seq = reinterpret_cast<const uint64_t*>(ctx.workspace + layout.seq);
  args.plan_words = reinterpret_cast<int32_t*>(ctx.workspace + layout.plan);
  args.wait = wait_context(ctx, phase);
  if (normal_over_transport(ctx.config)) args.transport = normal_transport_args(ctx);
}

// The fields of a transfer kernel's arguments (DispatchTransferArgs, CombineTransferArgs) that
// come from the rank alone: its plan, sequence word, work counters, rows and row flags, every
// peer's rows and row flags, its push blocks, its bounded waits (in `phase`) and its transport.
template <typename TransferArgs>
void fill_transfer_args(const RankContext& ctx, const NormalLayout& layout, WaitPhase phase,
                        TransferArgs& args) {
  const BufferConfig& config = ctx.config;
  args.num_ranks = config.num_ranks;
  args.rank = ctx.rank;
  args.max_tokens = config.max_tokens_per_rank;
  args.plan_words = reinterpret_cast<const int32_t*>(ctx.workspace + layout.plan);
  args.seq = reinterpret_cast<uint64_t*>(ctx.workspace + layout.seq);
  args.work_counter = reinterpret_cast<uint32_t*>(ctx.workspace + layout.counters);
  args.done_counter = args.work_counter + 1;
  args.rows = ctx.workspace + layout.data;
  args.row_flags = reinterpret_cast<const uint64_t*>(ctx.workspace + layout.row_flags);
  args.peer_rows = {ctx.peer_workspaces_device, layout.data};
  args.peer_row_flags = {ctx.peer_workspaces_device, layout.row_flags};
  args.num_push_blocks = ctx.normal_push_blocks;
  args.wait = wait_context(ctx, phase);
  if (normal_over_transport(config)) args.transport = normal_transport_args(ctx);
}

}  // namespace jax_ep
