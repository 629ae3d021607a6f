// Layout of the low-latency (decode) regions inside each rank's workspace.
//
// Every rank's workspace has the same layout, so a peer's word or row lives at
// `peer_workspaces[peer] + low_latency_workspace_offset(config) + <the same offset>`.
// The low-latency workspace holds two channels of this layout (kLowLatencyNumChannels): fused
// calls use channel 0, split send/receive pairs channel 1, each with its own sequence words and
// regions. So any number of fused calls may run between a send and its receive (XLA places the
// fused calls that autodiff's backward pass emits wherever data allows): the two call streams
// never share a tag, a parity or a row.
// All regions that peers write are double-buffered by call parity (see low_latency/dispatch.cu
// for the safety argument); the control words are written by this rank only.
//
//   control          LowLatencyControl: sequence words and block counters (local use only)
//   dispatch_counts  u64 [2][E_loc][R]      (tag << 32) | rows from source s for local expert e
//   combine_flags    u64 [2][R]             tag once every combine row from source s landed
//   dispatch_meta    int2 [2][E_loc][R][T_max]   (source token, k) of slot j; s == rank included
//   dispatch_row_flags u64 [2][E_loc][R][T_max]  tag once row (and meta) of slot j from remote
//                    source s landed (entries of s == rank unused: same index as dispatch_meta)
//   dispatch_rows    [2][E_loc][R-1][T_max] rows of 2H bytes, remote sources only (a rank never
//                    sends rows to itself). fp8 rows hold H bytes of e4m3 then H/128 float
//                    scales; bf16 rows hold H bf16.
//   dispatch_own_rows [T_max] rows of 2H bytes: this rank's tokens cast to fp8 (same row format),
//                    once per token by the split send half, for the receive half's own rows (fp8
//                    only: bf16 own rows are read from x; the fused op stores its own rows
//                    itself). Local use only, one copy: the send half of
//                    call n+1 starts after the receive half of call n ends (one stream).
//   combine_rows     bf16 [2][T_max][K][H]  expert output of (token, k), remote experts only
//
// Include from .cu and .cc files alike (no device-only syntax outside __CUDACC__ blocks).
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/limits.h"
#include "kernels/context.h"

namespace jax_ep {

// Alignment of every region (>= 16 for vector access; 256 keeps rows on DRAM-friendly starts).
constexpr size_t kLowLatencyAlignBytes = 256;
// Bytes of the low-latency regions in the workspace (both channels; 0 without low_latency), and
// their offset (after the normal-mode area; kernels/api.cc places the areas).
size_t low_latency_workspace_bytes(const BufferConfig& config);
size_t low_latency_workspace_offset(const BufferConfig& config);

// Number of alternating copies of every peer-written region.
constexpr int kLowLatencyNumParities = 2;
// Independent copies of the whole layout: 0 = fused calls, 1 = split send/receive pairs.
constexpr int kLowLatencyNumChannels = 2;

// Words private to one rank. Counters are reset to 0 by the block that sees them complete, so
// every launch finds them at 0 (launches on one stream are serialised).
struct LowLatencyControl {
  uint64_t dispatch_seq;                    // completed low-latency dispatch calls
  uint64_t combine_seq;                     // completed low-latency combine calls
  unsigned long long dispatch_blocks_done;  // dispatch blocks that finished
  unsigned long long combine_blocks_sent;   // combine blocks whose remote rows are all written
  unsigned long long combine_blocks_done;   // split receive blocks that finished
};

// Offsets (bytes from the start of the low-latency region) and index helpers. Plain data: the
// launchers copy it into the kernel arguments.
struct LowLatencyLayout {
  int num_ranks = 0;
  int num_local_experts = 0;
  int max_tokens = 0;  // T_max
  int num_topk = 0;
  int hidden = 0;

  size_t control = 0;
  size_t dispatch_counts = 0;
  size_t combine_flags = 0;
  size_t dispatch_meta = 0;
  size_t dispatch_row_flags = 0;
  size_t dispatch_rows = 0;
  size_t dispatch_own_rows = 0;
  size_t combine_rows = 0;
  size_t total_bytes = 0;

  // One dispatch row holds either bf16 (2H bytes) or fp8 + scales (H + H/32 bytes).
  JAX_EP_HOST_DEVICE size_t dispatch_row_bytes() const { return 2 * static_cast<size_t>(hidden); }
  JAX_EP_HOST_DEVICE size_t combine_row_bytes() const { return 2 * static_cast<size_t>(hidden); }

  JAX_EP_HOST_DEVICE size_t dispatch_count_index(int parity, int expert, int src) const {
    return (static_cast<size_t>(parity) * num_local_experts + expert) * num_ranks + src;
  }
  JAX_EP_HOST_DEVICE size_t flag_index(int parity, int src) const {
    return static_cast<size_t>(parity) * num_ranks + src;
  }
  JAX_EP_HOST_DEVICE size_t dispatch_meta_index(int parity, int expert, int src, int slot) const {
    const size_t block = dispatch_count_index(parity, expert, src);  // same [2][E_loc][R] order
    return block * max_tokens + slot;
  }
  // Row of (expert, remote source, slot) in the receiver `dst_rank`'s region (sources other than
  // the receiver, in rank order).
  JAX_EP_HOST_DEVICE size_t dispatch_row_offset(int parity, int expert, int src, int dst_rank,
                                                int slot) const {
    const int remote_idx = src < dst_rank ? src : src - 1;
    const size_t expert_block = static_cast<size_t>(parity) * num_local_experts + expert;
    const size_t block = expert_block * (num_ranks - 1) + remote_idx;
    return dispatch_rows + (block * max_tokens + slot) * dispatch_row_bytes();
  }
  // This rank's token `token` cast to fp8 (dispatch_own_rows).
  JAX_EP_HOST_DEVICE size_t dispatch_own_row_offset(int token) const {
    return dispatch_own_rows + static_cast<size_t>(token) * dispatch_row_bytes();
  }
  JAX_EP_HOST_DEVICE size_t combine_row_offset(int parity, int token, int k) const {
    const size_t row = (static_cast<size_t>(parity) * max_tokens + token) * num_topk + k;
    return combine_rows + row * combine_row_bytes();
  }
};

inline LowLatencyLayout make_low_latency_layout(const BufferConfig& config) {
  LowLatencyLayout layout;
  layout.num_ranks = config.num_ranks;
  layout.num_local_experts = config.num_ranks > 0 ? config.num_local_experts() : 0;
  layout.max_tokens = config.max_tokens_per_rank;
  layout.num_topk = config.num_topk;
  layout.hidden = config.hidden;

  const size_t num_parities = kLowLatencyNumParities;
  const size_t ranks = static_cast<size_t>(layout.num_ranks);
  const size_t experts = static_cast<size_t>(layout.num_local_experts);
  const size_t tokens = static_cast<size_t>(layout.max_tokens);
  const size_t remote_ranks = ranks > 0 ? ranks - 1 : 0;

  size_t offset = 0;
  auto carve = [&offset](size_t bytes) {
    const size_t start = offset;
    offset = align_up(offset + bytes, kLowLatencyAlignBytes);
    return start;
  };
  layout.control = carve(sizeof(LowLatencyControl));
  layout.dispatch_counts = carve(num_parities * experts * ranks * sizeof(uint64_t));
  layout.combine_flags = carve(num_parities * ranks * sizeof(uint64_t));
  layout.dispatch_meta = carve(num_parities * experts * ranks * tokens * 2 * sizeof(int32_t));
  layout.dispatch_row_flags = carve(num_parities * experts * ranks * tokens * sizeof(uint64_t));
  layout.dispatch_rows =
      carve(num_parities * experts * remote_ranks * tokens * layout.dispatch_row_bytes());
  layout.dispatch_own_rows = carve(tokens * layout.dispatch_row_bytes());
  layout.combine_rows = carve(num_parities * tokens * static_cast<size_t>(layout.num_topk) *
                              layout.combine_row_bytes());
  layout.total_bytes = offset;
  return layout;
}

}  // namespace jax_ep
