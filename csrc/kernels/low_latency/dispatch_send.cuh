// The send half of the low-latency dispatch (phases 0-4, and 4b in the fused op; the protocol and
// its memory ordering are described in low_latency/dispatch.cu).
//
// Work split: the call's T * K (token, k) pairs, in (token, k) order, are cut into ranges of
// pairs_per_block, one per block, so every block sends about the same number of rows whatever T
// is (before 2026-12-02 a block sent whole tokens: at T=128 on 124 blocks, 64 blocks sent 2
// tokens' 16 rows each while 60 sent none, and at T=1 one block sent all 8 rows). A block first
// stages the x rows of the tokens its pairs belong to in shared memory (cp.async, issued before
// anything else so the loads fly during phases 1-2; fp8: cast there once), then stores every row
// from there: each token is read from memory and cast at most once per block.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "common/copy.cuh"
#include "common/fp8_cast.cuh"
#include "common/launch.h"
#include "common/limits.h"
#include "common/phase_timeline.cuh"
#include "common/sync.cuh"
#include "kernels/low_latency/common.cuh"
#include "kernels/low_latency/dispatch_args.cuh"
#include "kernels/low_latency/layout.cuh"

namespace jax_ep::ll_dispatch {

// Bytes of bf16 x rows one block stages at once (stage_tokens = this / 2H, at least 1, at most
// the tokens a block's pairs can span).
constexpr size_t kSendStageBytes = 64 * 1024;

// Where one pair of the block goes. Shared memory, written by warp 0 in phase 2; `row` is the
// destination of the pass that stores the pair (nullptr: none).
struct SendPair {
  char* row;
  float* scales;   // fp8: the destination row's scales (region rows: row + H; outputs: recv_scales)
  int2* meta;      // remote pair: its meta entry at the peer (nullptr: not a remote pair)
  uint64_t* flag;  // remote pair: its row flag at the peer (nullptr: not a remote pair)
  int2 value;      // (token, k)
  int own_expert;  // own pair of the fused op: its local expert and slot
  int own_slot;
};

// Tokens that `pairs` consecutive pairs can touch.
__host__ __device__ constexpr int tokens_spanned(int pairs, int num_topk) {
  return pairs <= 0 ? 0 : (pairs + num_topk - 2) / num_topk + 1;
}

__host__ inline int send_stage_tokens(int pairs_per_block, int num_topk, int hidden) {
  const int fit = static_cast<int>(kSendStageBytes / (2 * static_cast<size_t>(hidden)));
  const int spanned = tokens_spanned(pairs_per_block, num_topk);
  return fit < 1 ? 1 : (fit < spanned ? fit : spanned);
}

// The send half's dynamic shared memory, carved from `base` (nullptr: sizes only).
struct SendSmem {
  SendPair* pairs;     // [P] the block's pairs
  int* ids;            // [tokens_spanned(P) * K] topk_idx of the whole tokens the pairs belong to
  int* remote_list;    // [P] pass 1: remote pairs (and split fp8: a token's own-row cast)
  int* own_list;       // [P] pass 2 (fused op): own pairs
  int* list_lengths;   // [2]
  int* hist_before;    // [E] rows per expert from pairs before the block's (phase 2: running)
  int* hist_total;     // [E] the publisher's totals
  int4* raw_stage;     // [S][H/8] bf16 rows of x
  int4* fp8_stage;     // [S][H/16] e4m3 rows (fp8 only)
  float* scale_stage;  // [S][H/128] their scales (fp8 only)
  size_t bytes;
};

__host__ __device__ inline SendSmem carve_send_smem(unsigned char* base, int pairs_per_block,
                                                    int num_topk, int num_experts, int stage_tokens,
                                                    int hidden, bool use_fp8) {
  SendSmem s = {};
  size_t offset = 0;
  auto carve = [&](size_t bytes) {
    const size_t start = offset;
    offset = (offset + bytes + 15) / 16 * 16;
    return base == nullptr ? nullptr : base + start;
  };
  const size_t pairs = static_cast<size_t>(pairs_per_block);
  const size_t tokens = static_cast<size_t>(stage_tokens);
  s.pairs = reinterpret_cast<SendPair*>(carve(pairs * sizeof(SendPair)));
  s.ids = reinterpret_cast<int*>(carve(
      static_cast<size_t>(tokens_spanned(pairs_per_block, num_topk)) * num_topk * sizeof(int)));
  s.remote_list = reinterpret_cast<int*>(carve(pairs * sizeof(int)));
  s.own_list = reinterpret_cast<int*>(carve(pairs * sizeof(int)));
  s.list_lengths = reinterpret_cast<int*>(carve(2 * sizeof(int)));
  s.hist_before = reinterpret_cast<int*>(carve(static_cast<size_t>(num_experts) * sizeof(int)));
  s.hist_total = reinterpret_cast<int*>(carve(static_cast<size_t>(num_experts) * sizeof(int)));
  s.raw_stage = reinterpret_cast<int4*>(carve(tokens * 2 * hidden));
  if (use_fp8) {
    s.fp8_stage = reinterpret_cast<int4*>(carve(tokens * hidden));
    s.scale_stage =
        reinterpret_cast<float*>(carve(tokens * (hidden / kChannelsPerScale) * sizeof(float)));
  }
  s.bytes = offset;
  return s;
}

// The block's pairs [p0, p1) and the tokens [tok0, tok_end) they belong to.
struct BlockPairs {
  int p0, p1;
  int tok0, tok_end;
};

__device__ __forceinline__ BlockPairs block_pairs(const DispatchArgs& args) {
  const int num_topk = args.rank.layout.num_topk;
  const int total = args.num_tokens * num_topk;
  BlockPairs b;
  b.p0 = min(total, static_cast<int>(blockIdx.x) * args.pairs_per_block);
  b.p1 = min(total, b.p0 + args.pairs_per_block);
  b.tok0 = b.p0 / num_topk;
  b.tok_end = b.p1 > b.p0 ? (b.p1 - 1) / num_topk + 1 : b.tok0;
  return b;
}

// Issues the asynchronous loads of x rows [s0, s0 + n) into the raw stage (every thread).
__device__ __forceinline__ void stage_x_rows(const DispatchArgs& args, const SendSmem& sm, int s0,
                                             int n) {
  const int vecs = args.rank.layout.hidden / kBf16PerVector;
  const int4* src = reinterpret_cast<const int4*>(args.x) + static_cast<size_t>(s0) * vecs;
  for (int v = static_cast<int>(threadIdx.x); v < n * vecs; v += blockDim.x) {
    cp_async_v4(sm.raw_stage + v, src + v);
  }
  cp_async_commit();
}

// Waits for the stage's loads (block-wide); fp8: casts its n rows once (scale per 128 channels
// via 8-lane shuffles: the 8 lanes of a group hold the same token, H/16 % 8 == 0).
template <bool kUseFp8>
__device__ __forceinline__ void finish_stage(const DispatchArgs& args, const SendSmem& sm, int n) {
  cp_async_wait_all();
  __syncthreads();
  if constexpr (kUseFp8) {
    const int pieces = args.rank.layout.hidden / kFp8ChannelsPerPiece;
    const int total = n * pieces;
    for (int base = 0; base < total; base += blockDim.x) {  // uniform trip count: shuffles
      const int f = base + static_cast<int>(threadIdx.x);
      const bool active = f < total;
      int4 a = make_int4(0, 0, 0, 0), b = a;
      if (active) {
        a = sm.raw_stage[2 * f];
        b = sm.raw_stage[2 * f + 1];
      }
      const float amax = fp8_group_amax(active ? bf16_piece_amax(a, b) : 0.0f);
      const float scale = fp8_scale_from_amax(amax, args.round_scale);
      const int4 packed = bf16_piece_to_e4m3(a, b, 1.0f / scale);
      if (!active) continue;
      sm.fp8_stage[f] = packed;
      if (f % kFp8PiecesPerScale == 0) sm.scale_stage[f / kFp8PiecesPerScale] = scale;
    }
    __syncthreads();
  }
}

// Stores the staged rows of list entries [i0, i1) (pair indices, tokens in [s0, s0 + S)) to
// their pairs' rows: thread f of the flattened (entry, vector) space (fp8: (entry, piece), plus
// the scale at the first piece of each group), so lanes store consecutive 16-byte vectors.
template <bool kUseFp8>
__device__ __forceinline__ void store_staged_rows(const DispatchArgs& args, const SendSmem& sm,
                                                  const int* list, int i0, int i1, int s0) {
  constexpr int kUnroll = 4;  // stores in flight per thread
  const int hidden = args.rank.layout.hidden;
  const int vecs = hidden / (kUseFp8 ? kFp8ChannelsPerPiece : kBf16PerVector);
  const int4* stage = kUseFp8 ? sm.fp8_stage : sm.raw_stage;
  const int total = (i1 - i0) * vecs;
  const int step = static_cast<int>(blockDim.x);
  for (int base = static_cast<int>(threadIdx.x); base < total; base += kUnroll * step) {
    int4 v[kUnroll];
    int4* dst[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int f = base + u * step;
      dst[u] = nullptr;
      if (f >= total) continue;
      const int entry = f / vecs;
      const int vec = f - entry * vecs;
      const SendPair& pair = sm.pairs[list[i0 + entry]];
      const int staged_row = pair.value.x - s0;
      v[u] = stage[staged_row * vecs + vec];
      dst[u] = reinterpret_cast<int4*>(pair.row) + vec;
      if (kUseFp8 && vec % kFp8PiecesPerScale == 0) {
        pair.scales[vec / kFp8PiecesPerScale] =
            sm.scale_stage[staged_row * (hidden / kChannelsPerScale) + vec / kFp8PiecesPerScale];
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (dst[u] != nullptr) st_v4(dst[u], v[u]);
    }
  }
}

// List entries [i0, i1) whose tokens are in [s0, s1) (lists are in pair order, so token order).
__device__ __forceinline__ int2 list_range(const SendSmem& sm, const int* list, int length, int s0,
                                           int s1) {
  int i0 = 0;
  while (i0 < length && sm.pairs[list[i0]].value.x < s0) ++i0;
  int i1 = i0;
  while (i1 < length && sm.pairs[list[i1]].value.x < s1) ++i1;
  return make_int2(i0, i1);
}

// One store pass over `list`, stage by stage. `resident`: the stage now in shared memory (the
// pass starts there and goes on in the direction `step`, so that a second pass in the other
// direction reloads nothing when the tokens fit one stage); updated to the last one loaded.
template <bool kUseFp8>
__device__ __forceinline__ void store_pass(const DispatchArgs& args, const SendSmem& sm,
                                           const BlockPairs& bp, const int* list, int length,
                                           int& resident, int num_stages) {
  const int s_tokens = args.stage_tokens;
  const int first = resident;
  const int step = first == 0 ? 1 : -1;
  for (int i = 0; i < num_stages; ++i) {
    const int stage = first + i * step;
    const int s0 = bp.tok0 + stage * s_tokens;
    const int s1 = min(bp.tok_end, s0 + s_tokens);
    if (stage != resident) {
      __syncthreads();  // every thread is done with the old stage
      stage_x_rows(args, sm, s0, s1 - s0);
      finish_stage<kUseFp8>(args, sm, s1 - s0);
      resident = stage;
    }
    const int2 range = list_range(sm, list, length, s0, s1);
    store_staged_rows<kUseFp8>(args, sm, list, range.x, range.y, s0);
  }
}

// Phase 2 for split fp8: whether (t, k), an own pair, is the first own pair of its token (it
// then writes the token's cast row to dispatch_own_rows, dropped or not: the other own pairs of
// the token, in this block or another, need it).
__device__ __forceinline__ bool first_own_pair(const int* token_ids, int k, int num_local,
                                               int num_experts, int me) {
  for (int j = 0; j < k; ++j) {
    const int g = token_ids[j];
    if (g >= 0 && g < num_experts && g / num_local == me) return false;
  }
  return true;
}

// Phase 2 (warp 0): slots of the block's pairs in order, 32 at a time (lane = pair): slot of
// (t, k) = rows of expert g from pairs before it (hist_before, then a running count; the lanes of
// one id take theirs at once, in lane order, so rows stay ordered by (token, k)). Fills `pairs`
// and the two lists, counts invalid ids and dropped rows.
template <bool kUseFp8, bool kPushOwn>
__device__ __forceinline__ void plan_block_pairs(const DispatchArgs& args, const SendSmem& sm,
                                                 const BlockPairs& bp, int parity) {
  const LowLatencyRank& rk = args.rank;
  const LowLatencyLayout& layout = rk.layout;
  const int num_local = layout.num_local_experts;
  const int num_topk = layout.num_topk;
  const int num_experts = args.num_experts;
  const int me = rk.rank;
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const uint32_t lanes_below = (1u << lane) - 1;
  int remote_length = 0, own_length = 0;
  unsigned long long invalid_ids = 0, dropped_rows = 0;
  for (int chunk = bp.p0; chunk < bp.p1; chunk += kWarpSize) {
    const int p = chunk + lane;
    const bool active = p < bp.p1;
    const int t = p / num_topk;
    const int k = p - t * num_topk;
    const int* token_ids = sm.ids + (t - bp.tok0) * num_topk;
    const int g = active ? token_ids[k] : -1;
    const bool valid = g >= 0 && g < num_experts;
    // Unique keys for lanes without a valid id (-2 - lane is never an id nor -1).
    const uint32_t same = __match_any_sync(kFullMask, valid ? g : -2 - lane);
    const int leader = __ffs(same) - 1;
    int first_slot = 0;
    if (valid && lane == leader) first_slot = atomicAdd(sm.hist_before + g, __popc(same));
    first_slot = __shfl_sync(kFullMask, first_slot, leader);
    SendPair pair = {nullptr, nullptr, nullptr, nullptr, make_int2(t, k), -1, -1};
    bool remote_entry = false, own_entry = false;
    if (valid) {
      const int slot = first_slot + __popc(same & lanes_below);
      const int dst = g / num_local;
      const int expert = g - dst * num_local;
      const size_t meta_index = layout.dispatch_meta_index(parity, expert, me, slot);
      if (slot >= layout.max_tokens) ++dropped_rows;
      if (dst == me) {
        if (kUseFp8 && !kPushOwn && first_own_pair(token_ids, k, num_local, num_experts, me)) {
          pair.row = rk.local + layout.dispatch_own_row_offset(t);
          pair.scales = reinterpret_cast<float*>(pair.row + layout.hidden);
          remote_entry = true;
        }
        if (slot < layout.max_tokens) {
          if constexpr (kPushOwn) {
            pair.own_expert = expert;
            pair.own_slot = slot;
            own_entry = true;
          } else {
            reinterpret_cast<int2*>(rk.local + layout.dispatch_meta)[meta_index] = pair.value;
          }
        }
      } else if (slot < layout.max_tokens) {
        pair.row = rk.peers[dst] + layout.dispatch_row_offset(parity, expert, me, dst, slot);
        pair.scales = reinterpret_cast<float*>(pair.row + layout.hidden);
        pair.meta = reinterpret_cast<int2*>(rk.peers[dst] + layout.dispatch_meta) + meta_index;
        pair.flag =
            reinterpret_cast<uint64_t*>(rk.peers[dst] + layout.dispatch_row_flags) + meta_index;
        remote_entry = true;
      }
    } else if (active && g != -1) {
      ++invalid_ids;
    }
    if (active) sm.pairs[p - bp.p0] = pair;
    const uint32_t remote_lanes = __ballot_sync(kFullMask, remote_entry);
    const uint32_t own_lanes = __ballot_sync(kFullMask, own_entry);
    if (remote_entry)
      sm.remote_list[remote_length + __popc(remote_lanes & lanes_below)] = p - bp.p0;
    if (own_entry) sm.own_list[own_length + __popc(own_lanes & lanes_below)] = p - bp.p0;
    remote_length += __popc(remote_lanes);
    own_length += __popc(own_lanes);
  }
#pragma unroll
  for (int mask = kWarpSize / 2; mask > 0; mask >>= 1) {
    invalid_ids += __shfl_xor_sync(kFullMask, invalid_ids, mask);
    dropped_rows += __shfl_xor_sync(kFullMask, dropped_rows, mask);
  }
  if (lane == 0) {
    sm.list_lengths[0] = remote_length;
    sm.list_lengths[1] = own_length;
    if (invalid_ids > 0 && rk.errors != nullptr) {
      atomicAdd(&rk.errors->invalid_expert_ids, invalid_ids);
    }
    if (dropped_rows > 0 && rk.errors != nullptr) {
      atomicAdd(&rk.errors->dropped_low_latency_rows, dropped_rows);
    }
  }
}

// Phase 4: after the block barrier that follows pass 1, publishes every remote pair of the
// block: meta, then (one fence per thread) the row flag. Entries without a flag (split fp8's
// own-row casts) and threads without an entry do nothing.
__device__ __forceinline__ void release_remote_pairs(const SendSmem& sm, int length, uint64_t tag) {
  const int tid = static_cast<int>(threadIdx.x);
  if (tid >= length) return;
  for (int i = tid; i < length; i += blockDim.x) {
    const SendPair& pair = sm.pairs[sm.remote_list[i]];
    if (pair.meta != nullptr) *pair.meta = pair.value;
  }
  // Release: every data store of the block precedes this fence (bar.sync before the call), and
  // so do this thread's meta stores; the flag stores below come after it.
  fence_acq_rel_sys();
  for (int i = tid; i < length; i += blockDim.x) {
    const SendPair& pair = sm.pairs[sm.remote_list[i]];
    if (pair.flag != nullptr) st_relaxed_sys(pair.flag, tag);
  }
}

// Phase 4b, first part (fused op, block-wide): the output rows of the block's own pairs. Output
// row of own pair (e, slot) = rows that the sources below this rank send to e (their count words,
// published at the start of their launches: the wait is short, and rank 0 never waits) + slot.
// Writes recv_src / recv_k of those rows and points the pairs at them (`first_rows`: hist_before,
// free after phase 2).
template <bool kUseFp8>
__device__ __forceinline__ void locate_own_rows(const DispatchArgs& args, const SendSmem& sm,
                                                int own_length, uint64_t tag, int parity) {
  const LowLatencyRank& rk = args.rank;
  const LowLatencyLayout& layout = rk.layout;
  const int me = rk.rank;
  const int num_local = layout.num_local_experts;
  const int rows_per_expert = layout.num_ranks * layout.max_tokens;
  const int tid = static_cast<int>(threadIdx.x);
  int* first_rows = sm.hist_before;
  for (int e = tid; e < num_local; e += blockDim.x) first_rows[e] = 0;
  __syncthreads();
  const uint64_t* words = reinterpret_cast<const uint64_t*>(rk.local + layout.dispatch_counts);
  for (int g = tid; g < num_local * me; g += blockDim.x) {  // g = e * rank + s, sources s < rank
    const int expert = g / me;
    const int src = g - expert * me;
    const uint32_t value = wait_tagged_count(
        words + layout.dispatch_count_index(parity, expert, src), tag, rk.timeout_ns,
        rk.timeout_record, me, src, WaitPhase::kLowLatencyDispatchRecv);
    atomicAdd(first_rows + expert,
              static_cast<int>(min(value, static_cast<uint32_t>(layout.max_tokens))));
  }
  __syncthreads();
  const size_t out_row_bytes = kUseFp8 ? layout.hidden : 2 * static_cast<size_t>(layout.hidden);
  for (int i = tid; i < own_length; i += blockDim.x) {
    SendPair& pair = sm.pairs[sm.own_list[i]];
    const size_t row_index = static_cast<size_t>(pair.own_expert) * rows_per_expert +
                             first_rows[pair.own_expert] + pair.own_slot;
    pair.row = static_cast<char*>(args.recv_x) + row_index * out_row_bytes;
    pair.scales =
        kUseFp8 ? args.recv_scales + row_index * (layout.hidden / kChannelsPerScale) : nullptr;
    args.recv_src[row_index] = me * layout.max_tokens + pair.value.x;
    args.recv_k[row_index] = pair.value.y;
  }
  __syncthreads();
}

// Phases 0-4 (the send half): stage x, histograms, count words, slots and own meta, rows to the
// peers and their flags; never waits for a peer. kPushOwn (fused op): then phase 4b, the own
// rows stored straight into the outputs (its only wait: the count words of lower ranks).
// Otherwise (split send launch) the own rows are left to the receive launch: their meta, and
// fp8 rows cast once per token into dispatch_own_rows.
template <bool kUseFp8, bool kPushOwn>
__device__ __forceinline__ void send_half(const DispatchArgs& args, unsigned char* smem,
                                          uint64_t tag, int parity) {
  const LowLatencyRank& rk = args.rank;
  const LowLatencyLayout& layout = rk.layout;
  const int num_local = layout.num_local_experts;
  const int num_topk = layout.num_topk;
  const int num_experts = args.num_experts;
  const int tid = static_cast<int>(threadIdx.x);
  const SendSmem sm = carve_send_smem(smem, args.pairs_per_block, num_topk, num_experts,
                                      args.stage_tokens, layout.hidden, kUseFp8);
  const BlockPairs bp = block_pairs(args);
  const bool has_pairs = bp.p1 > bp.p0;
  const bool is_publisher = blockIdx.x == gridDim.x - 1;
  const int num_stages = ceil_div(bp.tok_end - bp.tok0, args.stage_tokens);

  // Phase 0: the first stage of x rows (x does not depend on the routing).
  if (has_pairs) stage_x_rows(args, sm, bp.tok0, min(bp.tok_end - bp.tok0, args.stage_tokens));

  // Phase 1: histograms; the publisher releases the count words at every rank.
  if (has_pairs || is_publisher) {
    for (int g = tid; g < num_experts; g += blockDim.x) {
      sm.hist_before[g] = 0;
      sm.hist_total[g] = 0;
    }
    const int span_ids = (bp.tok_end - bp.tok0) * num_topk;
    for (int i = tid; i < span_ids; i += blockDim.x) {
      sm.ids[i] = __ldg(args.topk_idx + static_cast<size_t>(bp.tok0) * num_topk + i);
    }
    __syncthreads();
    const int scan_end = is_publisher ? args.num_tokens * num_topk : bp.p0;
    for (int p = tid; p < scan_end; p += blockDim.x) {
      const int g = __ldg(args.topk_idx + p);
      if (g < 0 || g >= num_experts) continue;
      if (has_pairs && p < bp.p0) atomicAdd(sm.hist_before + g, 1);
      if (is_publisher) atomicAdd(sm.hist_total + g, 1);
    }
    __syncthreads();
    if (is_publisher) {
      for (int g = tid; g < num_experts; g += blockDim.x) {
        const int dst = g / num_local;
        const int expert = g - dst * num_local;
        const uint32_t count = static_cast<uint32_t>(min(sm.hist_total[g], layout.max_tokens));
        uint64_t* word = reinterpret_cast<uint64_t*>(rk.peers[dst] + layout.dispatch_counts) +
                         layout.dispatch_count_index(parity, expert, rk.rank);
        st_relaxed_sys(word, pack_tagged_count(tag, count));
      }
    }
  }
  timeline_mark(1);
  if (!has_pairs) return;

  // Phase 2.
  if (tid < kWarpSize) plan_block_pairs<kUseFp8, kPushOwn>(args, sm, bp, parity);
  finish_stage<kUseFp8>(args, sm, min(bp.tok_end - bp.tok0, args.stage_tokens));  // barrier
  const int remote_length = sm.list_lengths[0];
  const int own_length = sm.list_lengths[1];
  int resident = 0;
  timeline_mark(2);

  // Phase 3 (pass 1): remote rows (split fp8: and the own rows' casts).
  if (remote_length > 0) {
    store_pass<kUseFp8>(args, sm, bp, sm.remote_list, remote_length, resident, num_stages);
  }

  // Phase 4: publish this block's remote rows.
  __syncthreads();
  release_remote_pairs(sm, remote_length, tag);
  timeline_mark(3);

  // Phase 4b (pass 2).
  if constexpr (kPushOwn) {
    if (own_length > 0) {
      locate_own_rows<kUseFp8>(args, sm, own_length, tag, parity);  // barriers
      store_pass<kUseFp8>(args, sm, bp, sm.own_list, own_length, resident, num_stages);
    }
  }
  timeline_mark(4);
}

}  // namespace jax_ep::ll_dispatch
