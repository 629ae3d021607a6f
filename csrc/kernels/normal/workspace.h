// Layout of the normal-mode region of a rank's workspace (identical on every rank, so a peer's
// copy of any field is `peer_workspace + the same offset`).
//
//   seq            uint64               sequence number of the last finished normal-mode call
//   counters       uint32[3 + M]        transfer kernels: next work item, finished blocks, rounds
//                                       published, then rows (dispatch) or tokens (combine)
//                                       finished in each round (M = kNormalMaxRounds; reset by
//                                       the last block of a call)
//   plan           int32[1 + 4R]        per-call routing summary (NormalPlan; written by the plan
//                                       kernels)
//   count_matrix   uint64[2][R][R]      [tag & 1][src][dst] = (tag << 32 | rows src sends
//                                       dst); every rank writes its row into every peer's
//                                       matrix. Two by parity: a peer that received nothing
//                                       from this rank may finish call e and publish its row of
//                                       call e+1 before this rank has read the one of call e
//                                       (never two calls ahead: e+2 needs this rank's e+1 row).
//   barrier        uint64[R]            [src] = tag of src's latest combine barrier
//   credits        uint64[R][M]         [dst][k] = tag once dst finished round k of the call as a
//                                       receiver (kernels/normal/windows.h); set by dst
//   round_bounds   int32[R][M + 1]      combine of several rounds: [owner][k] = first row of y
//                                       whose token of that owner is in round k or later
//   round_levels   int32[M]             combine of several rounds: most rows this rank sends one
//                                       owner in round k
//   row_flags      uint64[R][T_max]     [src][i] = tag once src wrote its i-th row here
//                                       (dispatch: i = position in src's stream to this rank;
//                                       combine: i = token index of this rank)
//   send_tokens    int32[R][T_max]      [dst][p] = this rank's token at position p of its
//                                       stream to dst (inverse of send_pos)
//   token_masks    uint8[T_max]         bit r: token goes to rank r (the narrow plan's scratch)
//   plan_counts    uint64[B_max][R]     [b][dst] = (tag << 32 | tokens of block b of the
//                                       dispatch plan that go to dst); B_max =
//                                       plan_block_slots(config)
//   data           rows                 the window (kernels/normal/windows.h) of both modes'
//                                       rows. Dispatch: output row o at slot o % slots; combine:
//                                       rows [src][token % slots]. Shared by both: every call
//                                       starts with an all-rank exchange that each rank enters
//                                       only after finishing its previous call, so no peer
//                                       writes a row before its owner is done reading.
//
// Row format in `data`: [payload bytes][aux words][pad to 16 bytes]; the aux words of a row are
// float32/int32: dispatch [scales S'][local ids K][weights K][src 1], cached dispatch
// [scales S'][w K'], combine [w K'].
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/limits.h"
#include "kernels/context.h"
#include "kernels/normal/windows.h"

namespace jax_ep {

// Bytes of the normal-mode area at the workspace's start (normal_layout(config).total_bytes).
size_t normal_workspace_bytes(const BufferConfig& config);

// The normal mode over a device transport (kernels/normal/put_path.cuh): true for every
// device transport (its kernels: the transport's table, kernels/put_plugin.h). Its regions in
// the ops' table (RankContext::transport_region_bases), after the low-latency kernels' two (over
// kNvshmem both lie in the workspace, on the symmetric heap: this rank's addresses name the same
// bytes on every PE):
bool normal_over_transport(const BufferConfig& config);
constexpr uint32_t kNormalAreaRegion = 2;  // the normal-mode area (workspace offset 0,
                                           // normal_workspace_bytes): puts and signals land here
constexpr uint32_t kNormalSendRegion = 3;  // normal_send_region_bytes: rows staged for puts
// The send region over a device transport (0 bytes when the ops use stores): rows staged for
// puts, at the end of the workspace.
size_t normal_send_region_bytes(const BufferConfig& config);
// Warps of one rank's normal kernels that issue transport commands (each needs its own
// acknowledgement word in an emulated ring): the push warps of a transfer kernel, then one
// publisher of finished rounds per block (from normal_publisher_warp on).
uint32_t normal_transport_warps(const RankContext& ctx);
uint32_t normal_publisher_warp(const RankContext& ctx);

// Per-call routing summary of one rank, derived from the exchanged count matrix: a view of
// normal_plan_words(R) int32 words (in the workspace, or a kernel's shared-memory copy).
constexpr int normal_plan_words(int num_ranks) { return 1 + 4 * num_ranks; }

template <typename Int>
struct NormalPlanOf {
  Int* num_recv;     // sum of recv_count (may exceed the capacity)
  Int* send_count;   // [R] rows this rank sends to each rank (overflowed included)
  Int* dest_base;    // [R] its first row at each rank
  Int* recv_count;   // [R] rows each rank sends here (combine: rows held per owner)
  Int* recv_prefix;  // [R] first row of each source in this rank's outputs

  static JAX_EP_HOST_DEVICE NormalPlanOf at(Int* words, int num_ranks) {
    return {words, words + 1, words + 1 + num_ranks, words + 1 + 2 * num_ranks,
            words + 1 + 3 * num_ranks};
  }
};
using NormalPlan = NormalPlanOf<int32_t>;

struct NormalLayout {
  size_t seq = 0;
  size_t counters = 0;
  size_t plan = 0;
  size_t count_matrix = 0;
  size_t barrier = 0;
  size_t credits = 0;
  size_t round_bounds = 0;
  size_t round_levels = 0;
  size_t row_flags = 0;
  size_t send_tokens = 0;
  size_t token_masks = 0;
  size_t plan_counts = 0;
  size_t data = 0;
  size_t data_bytes = 0;
  size_t total_bytes = 0;
  int64_t dispatch_rows = 0;  // rows of the largest dispatch row the data region holds
  int64_t combine_rows = 0;   // rows of the largest combine row it holds
};

// Words of the counters field: work item, finished blocks, rounds published, one per round.
constexpr int kNormalCounterWords = 3 + kNormalMaxRounds;

// Tokens per block of the dispatch plan kernel (one per thread): its grid is
// ceil(T / kPlanTokensPerBlock) blocks, fewer when the device has fewer SMs, so it never needs
// more than plan_block_slots() per-block count rows.
constexpr int kPlanTokensPerBlock = 256;

inline int plan_block_slots(const BufferConfig& config) {
  const int slots = (config.max_tokens_per_rank + kPlanTokensPerBlock - 1) / kPlanTokensPerBlock;
  return slots > 1 ? slots : 1;
}

// Threads of a block of the transfer kernels (dispatch and combine).
constexpr int kNormalTransferThreads = 512;

// One count matrix [src][dst] per tag parity.
constexpr int64_t count_matrix_stride(int num_ranks) {
  return static_cast<int64_t>(num_ranks) * num_ranks;
}

constexpr size_t kNormalFieldAlignment = 256;
// The data region starts on its own page so that rows never share a line with signal words.
constexpr size_t kNormalDataAlignment = 4096;

// Bytes of one row in `data`: payload, then `num_aux_words` 4-byte words, padded to 16 bytes.
constexpr int64_t region_row_bytes(int64_t payload_bytes, int64_t num_aux_words) {
  return static_cast<int64_t>(
      align_up(static_cast<size_t>(payload_bytes + 4 * num_aux_words), kBytesPerVector));
}

// Aux words of a dispatch row: scales, local ids, weights, source index.
constexpr int64_t dispatch_aux_words(int64_t num_scales, int64_t num_topk) {
  return num_scales + 2 * num_topk + 1;
}

inline NormalLayout normal_layout(const BufferConfig& config) {
  NormalLayout layout;
  const size_t max_tokens = static_cast<size_t>(config.max_tokens_per_rank);
  size_t offset = 0;
  auto take = [&offset](size_t bytes) {
    const size_t at = offset;
    offset = align_up(offset + bytes, kNormalFieldAlignment);
    return at;
  };
  layout.seq = take(sizeof(uint64_t));
  layout.counters = take(kNormalCounterWords * sizeof(uint32_t));
  const size_t num_ranks = static_cast<size_t>(config.num_ranks);
  layout.plan = take(sizeof(int32_t) * normal_plan_words(config.num_ranks));
  layout.count_matrix = take(sizeof(uint64_t) * 2 * count_matrix_stride(config.num_ranks));
  layout.barrier = take(sizeof(uint64_t) * num_ranks);
  layout.credits = take(sizeof(uint64_t) * num_ranks * kNormalMaxRounds);
  layout.round_bounds = take(sizeof(int32_t) * num_ranks * (kNormalMaxRounds + 1));
  layout.round_levels = take(sizeof(int32_t) * kNormalMaxRounds);
  layout.row_flags = take(sizeof(uint64_t) * num_ranks * max_tokens);
  layout.send_tokens = take(sizeof(int32_t) * num_ranks * max_tokens);
  layout.token_masks = take(sizeof(uint8_t) * max_tokens);
  layout.plan_counts = take(sizeof(uint64_t) * num_ranks * plan_block_slots(config));
  offset = align_up(offset, kNormalDataAlignment);
  layout.data = offset;

  // The window's rows: every row of a call while they fit the budget, a bounded window beyond.
  const int64_t budget =
      config.normal_window_rows > 0 ? config.normal_window_rows : kDefaultNormalWindowRows;
  const int64_t ranks = config.num_ranks > 0 ? config.num_ranks : 1;
  layout.dispatch_rows = normal_window_rows(config.capacity, budget);
  layout.combine_rows = ranks * normal_window_rows(config.max_tokens_per_rank, budget / ranks);
  const int64_t hidden_bytes = static_cast<int64_t>(config.hidden) * config.dtype_bytes;
  const int64_t num_scales = config.hidden / kChannelsPerScale;
  const size_t dispatch_bytes =
      static_cast<size_t>(layout.dispatch_rows) *
      region_row_bytes(hidden_bytes, dispatch_aux_words(num_scales, config.num_topk));
  const size_t combine_bytes =
      static_cast<size_t>(layout.combine_rows) * region_row_bytes(hidden_bytes, config.num_topk);
  layout.data_bytes = align_up(dispatch_bytes > combine_bytes ? dispatch_bytes : combine_bytes,
                               kNormalDataAlignment);
  layout.total_bytes = layout.data + layout.data_bytes;
  return layout;
}

// The windows of one call in the data region (its rows hold `row_bytes` each): a dispatch or
// cached dispatch of `capacity` rows, a combine of `num_tokens` tokens (slots per source rank).
inline NormalWindow dispatch_window(const BufferConfig& config, int64_t capacity,
                                    int64_t row_bytes) {
  return normal_window(capacity, static_cast<int64_t>(normal_layout(config).data_bytes) /
                                     (row_bytes > 0 ? row_bytes : 1));
}
inline NormalWindow combine_window(const BufferConfig& config, int64_t num_tokens,
                                   int64_t row_bytes) {
  const int64_t rows =
      static_cast<int64_t>(normal_layout(config).data_bytes) / (row_bytes > 0 ? row_bytes : 1);
  return normal_window(num_tokens, rows / (config.num_ranks > 0 ? config.num_ranks : 1));
}

}  // namespace jax_ep
