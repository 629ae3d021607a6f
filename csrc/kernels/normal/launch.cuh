// What dispatch.cu and combine.cu share to launch their kernels: the fields every transfer
// kernel's arguments hold, filled from the rank's context, and the one branch on the path by
// which a kernel crosses ranks (normal/put_path.cuh). Host code of .cu files.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/peer_field.cuh"
#include "common/sync.cuh"
#include "kernels/context.h"
#include "kernels/normal/put_path.cuh"
#include "kernels/normal/rounds.cuh"
#include "kernels/normal/windows.h"
#include "kernels/normal/workspace.h"
#include "kernels/put_plugin.h"

namespace jax_ep {

// Launches a normal-mode kernel on the rank's path: `launch_stores()` with stores, or over a
// device transport `launch_put(table)` with the table of its transport's put-protocol kernels
// (kernels/put_plugin.h; cudaErrorNotSupported where that transport is not loaded, which
// create_buffer refuses first). Returns the launch status.
template <typename LaunchStores, typename LaunchPut>
cudaError_t launch_on_path(const RankContext& ctx, LaunchStores launch_stores,
                           LaunchPut launch_put) {
  if (ctx.config.device_transport == DeviceTransport::kStores) return launch_stores();
  const PutPlugin* plugin = put_plugin(ctx.config.device_transport);
  if (plugin == nullptr) return cudaErrorNotSupported;
  return static_cast<cudaError_t>(launch_put(*plugin));
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
// come from the rank alone: its plan, sequence word, counters, rows and row flags, every peer's
// rows and row flags, its push blocks, its rounds' words, its bounded waits (in `phase`) and its
// transport. The launcher sets the call's window (set_window).
template <typename TransferArgs>
void fill_transfer_args(const RankContext& ctx, const NormalLayout& layout, WaitPhase phase,
                        TransferArgs& args) {
  const BufferConfig& config = ctx.config;
  args.num_ranks = config.num_ranks;
  args.rank = ctx.rank;
  args.max_tokens = config.max_tokens_per_rank;
  args.plan_words = reinterpret_cast<const int32_t*>(ctx.workspace + layout.plan);
  args.seq = reinterpret_cast<uint64_t*>(ctx.workspace + layout.seq);
  args.counters = reinterpret_cast<uint32_t*>(ctx.workspace + layout.counters);
  args.rows = ctx.workspace + layout.data;
  args.row_flags = reinterpret_cast<const uint64_t*>(ctx.workspace + layout.row_flags);
  args.peer_rows = {ctx.peer_workspaces_device, layout.data};
  args.peer_row_flags = {ctx.peer_workspaces_device, layout.row_flags};
  args.num_push_blocks = ctx.normal_push_blocks;
  args.rounds.published = args.counters + 2;
  args.rounds.finished = args.counters + 3;
  args.rounds.credits = reinterpret_cast<const uint64_t*>(ctx.workspace + layout.credits);
  args.rounds.peer_credits = {ctx.peer_workspaces_device, layout.credits};
  args.rounds.publisher_warp = normal_publisher_warp(ctx);
  args.wait = wait_context(ctx, phase);
  if (normal_over_transport(config)) args.transport = normal_transport_args(ctx);
}

inline void set_window(const NormalWindow& window, RoundArgs& rounds) {
  rounds.slots = window.slots;
  rounds.round_rows = window.round_rows;
  rounds.num_rounds = window.num_rounds;
}

}  // namespace jax_ep
