// The normal-mode dispatch's plan kernel (launcher: dispatch.cu): routing summary and count
// exchange of a dispatch or cached dispatch, templated on the path by which it crosses ranks
// (normal/put_path.cuh). In a header so that the NVSHMEM plugin
// (plugins/nvshmem_transport_kernels.cu) instantiates it with its transport, as dispatch.cu does
// with the others.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/fast_divisor.h"
#include "common/limits.h"
#include "common/peer_field.cuh"
#include "common/sync.cuh"
#include "kernels/normal/put_path.cuh"
#include "kernels/normal/workspace.h"

namespace jax_ep {
namespace normal_dispatch {

// One token per thread per round; the block size is the layout's unit of per-block counts.
constexpr int kPlanThreads = kPlanTokensPerBlock;
constexpr int kPlanWarps = kPlanThreads / kWarpSize;
static_assert(kPlanThreads % kWarpSize == 0, "whole warps: positions come from warp ballots");
static_assert(kNarrowRanks * kNarrowRanks <= kPlanThreads,
              "the narrow plan: one thread per count-matrix entry");
static_assert(kNarrowRanks <= 8, "the narrow plan: a token's rank mask is one byte (token_masks)");
// Per-block count words a thread loads before it checks any, so the loads overlap.
constexpr int kPlanPrefixBatch = 4;
// Rounds whose masks a thread keeps in one register (a byte each); later rounds store theirs in
// token_masks and read them back (only when T > kPlanKeptRounds * kPlanThreads * blocks).
constexpr int kPlanKeptRounds = 4;

struct DispatchPlanArgs {
  // Routing source: topk_idx (dispatch) or, when it is null, send_pos >= 0 (cached dispatch).
  const int32_t* topk_idx;  // [T, K]
  const int32_t* send_pos;  // [T, R]
  int num_tokens;
  int tokens_per_block;  // block b owns tokens [b * tokens_per_block, (b + 1) * tokens_per_block)
  int num_topk;
  int num_ranks;
  int rank;
  int num_experts;
  int num_local_experts;
  FastDivisor experts_per_rank;  // expert id -> its rank
  int max_tokens;
  int capacity;
  // Outputs of the dispatch (null in cached mode).
  int32_t* send_pos_out;                // [T, R]
  int32_t* num_recv_tokens;             // []
  int32_t* num_recv_tokens_per_expert;  // [E_loc], zeroed here for the transfer kernel
  // Workspace of this rank.
  const uint64_t* seq;
  int32_t* plan_words;    // NormalPlan::at(plan_words, R)
  int32_t* send_tokens;   // [R][T_max]
  uint8_t* token_masks;   // [T_max] (narrow plan)
  uint64_t* plan_counts;  // [blocks][R]
  const uint64_t* count_matrix;
  PeerField<uint64_t> peer_count_matrix;  // every rank's count matrix (this one's included)
  ErrorCounters* errors;
  WaitContext wait;
  NormalTransportArgs transport;  // a transport path's (last: the stores path never reads it)
};

// Bit r: token t goes to rank r. Counts ids outside [-1, E) in *num_invalid (they are ignored).
template <int kRankSlots>
__device__ __forceinline__ uint32_t token_rank_mask(const DispatchPlanArgs& args, int t,
                                                    int* num_invalid) {
  uint32_t mask = 0;
  if (args.topk_idx != nullptr) {
    // All ids of a token are loaded before they are used (one memory latency per token), as
    // 16-byte vectors when rows of ids are whole aligned vectors; the loops stop at num_topk
    // (uniform), so a token costs its own ids only.
    const int32_t* row = args.topk_idx + static_cast<int64_t>(t) * args.num_topk;
    int ids[kMaxTopk];
    if (args.num_topk % 4 == 0 && reinterpret_cast<uintptr_t>(args.topk_idx) % 16 == 0) {
#pragma unroll
      for (int k = 0; k < kMaxTopk; k += 4) {
        if (k >= args.num_topk) break;
        const int4 four = __ldg(reinterpret_cast<const int4*>(row + k));
        ids[k] = four.x;
        ids[k + 1] = four.y;
        ids[k + 2] = four.z;
        ids[k + 3] = four.w;
      }
    } else {
#pragma unroll
      for (int k = 0; k < kMaxTopk; ++k) {
        if (k >= args.num_topk) break;
        ids[k] = __ldg(row + k);
      }
    }
#pragma unroll
    for (int k = 0; k < kMaxTopk; ++k) {
      if (k >= args.num_topk) break;
      const int expert = ids[k];
      if (expert == -1) continue;
      if (expert < -1 || expert >= args.num_experts) {
        ++*num_invalid;
        continue;
      }
      mask |= 1u << args.experts_per_rank.divide(static_cast<uint32_t>(expert));
    }
  } else {
    const int32_t* row = args.send_pos + static_cast<int64_t>(t) * args.num_ranks;
    int pos[kRankSlots];
#pragma unroll
    for (int r = 0; r < kRankSlots; ++r) pos[r] = r < args.num_ranks ? __ldg(row + r) : -1;
#pragma unroll
    for (int r = 0; r < kRankSlots; ++r) mask |= (pos[r] >= 0 ? 1u : 0u) << r;
  }
  return mask;
}

// The last block's totals of the call: the plan's num_recv, and in routing mode num_recv_tokens
// and the rows past the capacity (counted as overflow).
__device__ __forceinline__ void publish_num_recv(const DispatchPlanArgs& args,
                                                 const NormalPlan& plan, int num_recv) {
  *plan.num_recv = num_recv;
  if (args.topk_idx != nullptr) {
    *args.num_recv_tokens = num_recv;
    if (num_recv > args.capacity) {
      atomicAdd(&args.errors->overflow_rows,
                static_cast<unsigned long long>(num_recv - args.capacity));
    }
  }
}

// The last block's publication of this rank's totals (`total(dst)`: rows to rank dst) as entry
// [rank][dst] of every rank's count matrix of the tag's parity: on the stores path the block's
// threads release-store the R x R words; over a transport warp 0 signals them (kSet, the same
// tagged word), its own row never (this rank never reads it back).
template <typename Path, typename Total>
__device__ __forceinline__ void publish_count_row(const Path& path, const DispatchPlanArgs& args,
                                                  uint64_t tag, Total total) {
  const int num_ranks = args.num_ranks;
  const int rank = args.rank;
  const int64_t parity_offset = static_cast<int64_t>(tag & 1) * count_matrix_stride(num_ranks);
  if constexpr (is_stores_path<Path>) {
    for (int i = threadIdx.x; i < num_ranks * num_ranks; i += blockDim.x) {
      const int peer = i / num_ranks;
      const int dst = i % num_ranks;
      st_release_sys(args.peer_count_matrix[peer] + parity_offset + rank * num_ranks + dst,
                     pack_tagged_count(tag, static_cast<uint32_t>(total(dst))));
    }
  } else if (threadIdx.x < kWarpSize) {
    const int lane = threadIdx.x;
    auto t = make_normal_transport(path, rank, 0, args.wait);
    for (int i = 0; i < num_ranks * num_ranks; ++i) {
      const int peer = i / num_ranks;
      const int dst = i % num_ranks;
      if (peer == rank) continue;
      const int64_t word = parity_offset + rank * num_ranks + dst;
      t.signal(peer, in_normal_area(path.args.layout.count_matrix + word * sizeof(uint64_t)),
               pack_tagged_count(tag, static_cast<uint32_t>(total(dst))), transport::SignalOp::kSet,
               lane);
    }
  }
}

__device__ __forceinline__ int warp_sum(int value) {
#pragma unroll
  for (int delta = kWarpSize / 2; delta > 0; delta >>= 1) {
    value += __shfl_xor_sync(0xffffffffu, value, delta);
  }
  return value;
}

// Role: routing summary and count exchange of one call. Cooperative grid (every block resident:
// blocks wait for each other's counts); block b owns the consecutive tokens
// [b * tokens_per_block, (b + 1) * tokens_per_block), one per thread per round of kPlanThreads.
// Phases of every block:
//   1. rank mask of its tokens and its count per destination; the count row goes to
//      plan_counts[b] (tagged words, relaxed: they carry only themselves). Also zeroes its share
//      of num_recv_tokens_per_expert and adds its invalid ids to the error counter.
//   2. block_base[dst] = tokens of blocks < b that go to dst (waits for their count rows); the
//      last block adds its own counts: the rank's totals, which it publishes as its row of
//      every rank's count matrix.
//   3. waits for the count-matrix rows it needs (rows < rank give dest_base; the last block
//      waits for all rows and writes the plan, num_recv_tokens and the overflow count).
//   4. per round: stream positions by warp ballots + a scan over the block's warps; writes
//      send_tokens[dst][position] = token and send_pos (dest_base + position, may be >= C; -1
//      when not sent). Positions grow with the token index, as blocks own consecutive tokens.
// Synchronisation: the last block writes the rank's row (tag-stamped words, release) into every
// rank's matrix (the one of the tag's parity); the blocks spin on the words they need of their
// own. A rank writes its row for call e only after its previous kernels (call e-1) finished, and
// the transfer kernel pushes only after this kernel, whose last block saw every row: the
// exchange is also the barrier that lets a single data region be reused every call. The
// per-block count rows need no parity: the next plan kernel runs after this one on the stream.
// kRankSlots: a power of two >= num_ranks; the per-rank loops run that many times (the kernel is
// bound by its instruction latency, and unrolling them to kNarrowRanks cost every rank count the
// work of 8).
// Over a transport (Path a TransportPath), warp 0 of the last block signals each entry of the
// row instead (kSet, the same tagged word) to every other rank; its own row it never reads.
template <int kRankSlots, typename Path>
__global__ void __launch_bounds__(kPlanThreads) dispatch_plan_kernel(const DispatchPlanArgs args) {
  static_assert(kRankSlots >= 1 && kRankSlots <= kNarrowRanks, "the narrow plan's instances");
  const Path path = PathOf<Path>::of(args.transport);
  __shared__ int own_count[kRankSlots];   // this block's tokens per destination
  __shared__ int block_base[kRankSlots];  // first position of this block's tokens in each stream
  __shared__ int warp_counts[kPlanWarps][kRankSlots];
  __shared__ int matrix[kRankSlots][kRankSlots];
  __shared__ int dest_base[kRankSlots];

  const int tid = threadIdx.x;
  const int lane = tid % kWarpSize;
  const int warp = tid / kWarpSize;
  const int block = blockIdx.x;
  const bool last_block = block == static_cast<int>(gridDim.x) - 1;
  const int num_ranks = args.num_ranks;
  const int rank = args.rank;
  const bool routing = args.topk_idx != nullptr;
  const uint64_t tag = *reinterpret_cast<const volatile uint64_t*>(args.seq) + 1;
  const WaitPhase phase = static_cast<WaitPhase>(args.wait.phase);
  const int token_begin = min(args.num_tokens, block * args.tokens_per_block);
  const int token_end = min(args.num_tokens, token_begin + args.tokens_per_block);
  const int num_rounds = (token_end - token_begin + kPlanThreads - 1) / kPlanThreads;
  const NormalPlan plan = NormalPlan::at(args.plan_words, num_ranks);

  if (tid < kRankSlots) block_base[tid] = 0;
  if (routing) {
    for (int e = block * kPlanThreads + tid; e < args.num_local_experts;
         e += gridDim.x * kPlanThreads) {
      args.num_recv_tokens_per_expert[e] = 0;
    }
  }

  // 1. Masks (kept for phase 4) and this block's count per destination.
  int num_invalid = 0;
  uint32_t kept_masks = 0;
  int count[kRankSlots];
#pragma unroll
  for (int r = 0; r < kRankSlots; ++r) count[r] = 0;
  for (int round = 0; round < num_rounds; ++round) {
    const int t = token_begin + round * kPlanThreads + tid;
    const uint32_t mask = t < token_end ? token_rank_mask<kRankSlots>(args, t, &num_invalid) : 0;
    if (round < kPlanKeptRounds) {
      kept_masks |= mask << (8 * round);
    } else if (t < token_end) {
      args.token_masks[t] = static_cast<uint8_t>(mask);
    }
#pragma unroll
    for (int r = 0; r < kRankSlots; ++r) {
      if (r < num_ranks) count[r] += __syncthreads_count((mask >> r) & 1u);
    }
  }
#pragma unroll
  for (int r = 0; r < kRankSlots; ++r) {
    if (tid == r && r < num_ranks) {
      own_count[r] = count[r];
      st_relaxed_gpu(args.plan_counts + block * num_ranks + r,
                     pack_tagged_count(tag, static_cast<uint32_t>(count[r])));
    }
  }
  if (routing) {
    num_invalid = warp_sum(num_invalid);
    if (lane == 0 && num_invalid > 0) {
      atomicAdd(&args.errors->invalid_expert_ids, static_cast<unsigned long long>(num_invalid));
    }
  }
  __syncthreads();  // block_base zeroed, own_count written

  // 2. Sum of the count rows of blocks < b, every thread a strided share of the words.
  {
    int sum[kRankSlots];
#pragma unroll
    for (int r = 0; r < kRankSlots; ++r) sum[r] = 0;
    // Word w: block w / R, destination w % R.
    const int num_words = block * num_ranks;
    auto word_at = [&](int w) { return args.plan_counts + w; };
    for (int first = tid; first < num_words; first += kPlanThreads * kPlanPrefixBatch) {
      uint64_t words[kPlanPrefixBatch];
#pragma unroll
      for (int i = 0; i < kPlanPrefixBatch; ++i) {
        const int w = first + i * kPlanThreads;
        words[i] = w < num_words ? ld_relaxed_gpu(word_at(w)) : 0;
      }
#pragma unroll
      for (int i = 0; i < kPlanPrefixBatch; ++i) {
        const int w = first + i * kPlanThreads;
        if (w >= num_words) continue;
        uint32_t value = static_cast<uint32_t>(words[i]);
        if (!has_tag(words[i], tag)) {
          value = wait_tagged_count<false>(word_at(w), tag, args.wait.timeout_ns, args.wait.record,
                                           rank, rank, phase);
        }
        const int dst = w % num_ranks;
#pragma unroll
        for (int r = 0; r < kRankSlots; ++r) sum[r] += r == dst ? static_cast<int>(value) : 0;
      }
    }
#pragma unroll
    for (int r = 0; r < kRankSlots; ++r) {
      if (r < num_ranks) {
        const int total = warp_sum(sum[r]);
        if (lane == 0 && total > 0) atomicAdd(&block_base[r], total);
      }
    }
  }
  __syncthreads();

  // The last block publishes this rank's totals: entry [rank][dst] of every rank's matrix.
  const int64_t parity_offset = static_cast<int64_t>(tag & 1) * count_matrix_stride(num_ranks);
  if (last_block) {
    publish_count_row(path, args, tag, [&](int dst) { return block_base[dst] + own_count[dst]; });
  }

  // 3. The rows of the count matrix this block needs (the last block knows its own row: it
  // does not wait for its own store to come back, which is all it would wait for at EP=1).
  const int num_rows = last_block ? num_ranks : rank;
  if (tid < num_rows * num_ranks) {
    const int src = tid / num_ranks;
    const int dst = tid % num_ranks;
    matrix[src][dst] = src == rank
                           ? block_base[dst] + own_count[dst]
                           : static_cast<int>(wait_tagged_count(
                                 args.count_matrix + parity_offset + src * num_ranks + dst, tag,
                                 args.wait.timeout_ns, args.wait.record, rank, src, phase));
  }
  __syncthreads();
  if (tid < num_ranks) {
    const int r = tid;
    int base = 0;
    for (int s = 0; s < rank; ++s) base += matrix[s][r];
    dest_base[r] = base;
    if (last_block) {
      int prefix = 0;
      for (int s = 0; s < r; ++s) prefix += matrix[s][rank];
      plan.send_count[r] = matrix[rank][r];
      plan.dest_base[r] = base;
      plan.recv_count[r] = matrix[r][rank];
      plan.recv_prefix[r] = prefix;
    }
  }
  if (last_block && tid == 0) {
    int num_recv = 0;
    for (int s = 0; s < num_ranks; ++s) num_recv += matrix[s][rank];
    publish_num_recv(args, plan, num_recv);
  }
  __syncthreads();

  // 4. Positions in token order: earlier rounds, earlier warps, lower lanes.
  int position[kRankSlots];  // first position of the current round in each stream
  int base[kRankSlots];
#pragma unroll
  for (int r = 0; r < kRankSlots; ++r) {
    position[r] = r < num_ranks ? block_base[r] : 0;
    base[r] = r < num_ranks ? dest_base[r] : 0;
  }
  const uint32_t lanes_below = (1u << lane) - 1;
  for (int round = 0; round < num_rounds; ++round) {
    const int t = token_begin + round * kPlanThreads + tid;
    const bool active = t < token_end;
    uint32_t mask = 0;
    if (round < kPlanKeptRounds) {
      mask = (kept_masks >> (8 * round)) & 0xffu;
    } else if (active) {
      mask = args.token_masks[t];  // this thread's own store of phase 1
    }
    uint32_t ballot[kRankSlots];
#pragma unroll
    for (int r = 0; r < kRankSlots; ++r) {
      ballot[r] = r < num_ranks ? __ballot_sync(0xffffffffu, (mask >> r) & 1u) : 0;
      if (lane == 0 && r < num_ranks) warp_counts[warp][r] = __popc(ballot[r]);
    }
    __syncthreads();
    int32_t* out =
        routing && active ? args.send_pos_out + static_cast<int64_t>(t) * num_ranks : nullptr;
#pragma unroll
    for (int r = 0; r < kRankSlots; ++r) {
      if (r < num_ranks) {
        int before = 0;
        int total = 0;
#pragma unroll
        for (int w = 0; w < kPlanWarps; ++w) {
          const int c = warp_counts[w][r];
          before += w < warp ? c : 0;
          total += c;
        }
        const bool sent = (mask >> r) & 1u;
        const int pos = position[r] + before + __popc(ballot[r] & lanes_below);
        if (sent) args.send_tokens[static_cast<int64_t>(r) * args.max_tokens + pos] = t;
        if (out != nullptr) out[r] = sent ? base[r] + pos : -1;
        position[r] += total;
      }
    }
    __syncthreads();  // warp_counts is rewritten by the next round
  }
}

// The wide plan (groups of more than kNarrowRanks ranks) keeps per-rank state in shared memory:
// wide_plan_shared_bytes(R) bytes (12 int words per rank, 48 KiB at kMaxRanks).
constexpr int kWidePlanWordsPerRank = 4 + kPlanWarps;
inline size_t wide_plan_shared_bytes(int num_ranks) {
  return sizeof(int) * kWidePlanWordsPerRank * static_cast<size_t>(num_ranks);
}
static_assert(sizeof(int) * kWidePlanWordsPerRank * kMaxRanks <= 48 * 1024,
              "the wide plan fits the shared memory every block gets without opting in");

// The distinct ranks token t goes to (at most kMaxTopk, in no particular order), in `ranks`;
// returns how many. Routing mode counts ids outside [-1, E) in *num_invalid (they are ignored);
// cached mode reads send_pos >= 0 (a handle sends a token to at most K ranks).
__device__ __forceinline__ int token_ranks(const DispatchPlanArgs& args, int t,
                                           int (&ranks)[kMaxTopk], int* num_invalid) {
  int count = 0;
  if (args.topk_idx != nullptr) {
    const int32_t* row = args.topk_idx + static_cast<int64_t>(t) * args.num_topk;
    for (int k = 0; k < args.num_topk; ++k) {
      const int expert = __ldg(row + k);
      if (expert == -1) continue;
      if (expert < -1 || expert >= args.num_experts) {
        ++*num_invalid;
        continue;
      }
      const int r = static_cast<int>(args.experts_per_rank.divide(static_cast<uint32_t>(expert)));
      bool seen = false;
      for (int i = 0; i < count; ++i) seen |= ranks[i] == r;
      if (!seen) ranks[count++] = r;
    }
  } else {
    const int32_t* row = args.send_pos + static_cast<int64_t>(t) * args.num_ranks;
    for (int r = 0; r < args.num_ranks && count < kMaxTopk; ++r) {
      if (__ldg(row + r) >= 0) ranks[count++] = r;
    }
  }
  return count;
}

// Role: the plan of dispatch_plan_kernel for groups of more than kNarrowRanks ranks, with the
// same phases, grid, tagged words and synchronisation; what differs is where per-rank state
// lives. Each block keeps, in shared memory, its count per destination, its base in each stream,
// the destinations' bases at their ranks and a running position per stream; a round's stream
// positions come from one bit per (destination, token) of the round (kPlanWarps words per
// destination: a token's position is the popcount of the bits below its own). A token's
// destinations are recomputed from its ids in phase 4 (no one-byte mask for R > 8).
template <typename Path>
__global__ void __launch_bounds__(kPlanThreads)
    dispatch_plan_wide_kernel(const DispatchPlanArgs args) {
  const Path path = PathOf<Path>::of(args.transport);
  extern __shared__ int wide_shared[];
  const int num_ranks = args.num_ranks;
  int* own_count = wide_shared;             // [R] this block's tokens per destination
  int* block_base = own_count + num_ranks;  // [R] first position of this block's tokens
  int* dest_base = block_base + num_ranks;  // [R] first row of this rank's tokens at each rank
  int* position = dest_base + num_ranks;    // [R] next position of the round in each stream
  uint32_t* bits = reinterpret_cast<uint32_t*>(position + num_ranks);  // [R][kPlanWarps]

  const int tid = threadIdx.x;
  const int lane = tid % kWarpSize;
  const int warp = tid / kWarpSize;
  const int block = blockIdx.x;
  const bool last_block = block == static_cast<int>(gridDim.x) - 1;
  const int rank = args.rank;
  const bool routing = args.topk_idx != nullptr;
  const uint64_t tag = *reinterpret_cast<const volatile uint64_t*>(args.seq) + 1;
  const WaitPhase phase = static_cast<WaitPhase>(args.wait.phase);
  const int token_begin = min(args.num_tokens, block * args.tokens_per_block);
  const int token_end = min(args.num_tokens, token_begin + args.tokens_per_block);
  const int num_rounds = (token_end - token_begin + kPlanThreads - 1) / kPlanThreads;
  const NormalPlan plan = NormalPlan::at(args.plan_words, num_ranks);

  for (int r = tid; r < num_ranks; r += kPlanThreads) {
    own_count[r] = 0;
    block_base[r] = 0;
  }
  if (routing) {
    for (int e = block * kPlanThreads + tid; e < args.num_local_experts;
         e += gridDim.x * kPlanThreads) {
      args.num_recv_tokens_per_expert[e] = 0;
    }
  }
  __syncthreads();

  // 1. This block's count per destination.
  int num_invalid = 0;
  for (int round = 0; round < num_rounds; ++round) {
    const int t = token_begin + round * kPlanThreads + tid;
    if (t >= token_end) continue;
    int ranks[kMaxTopk];
    const int count = token_ranks(args, t, ranks, &num_invalid);
    for (int i = 0; i < count; ++i) atomicAdd(&own_count[ranks[i]], 1);
  }
  if (routing) {
    num_invalid = warp_sum(num_invalid);
    if (lane == 0 && num_invalid > 0) {
      atomicAdd(&args.errors->invalid_expert_ids, static_cast<unsigned long long>(num_invalid));
    }
  }
  __syncthreads();
  for (int r = tid; r < num_ranks; r += kPlanThreads) {
    st_relaxed_gpu(args.plan_counts + static_cast<int64_t>(block) * num_ranks + r,
                   pack_tagged_count(tag, static_cast<uint32_t>(own_count[r])));
  }

  // 2. The tokens of blocks < b per destination.
  for (int r = tid; r < num_ranks; r += kPlanThreads) {
    int sum = 0;
    for (int b = 0; b < block; ++b) {
      const uint64_t* word = args.plan_counts + static_cast<int64_t>(b) * num_ranks + r;
      const uint64_t value = ld_relaxed_gpu(word);
      sum += static_cast<int>(has_tag(value, tag)
                                  ? static_cast<uint32_t>(value)
                                  : wait_tagged_count<false>(word, tag, args.wait.timeout_ns,
                                                             args.wait.record, rank, rank, phase));
    }
    block_base[r] = sum;
  }
  __syncthreads();

  // The last block publishes this rank's totals: entry [rank][dst] of every rank's matrix.
  const int64_t parity_offset = static_cast<int64_t>(tag & 1) * count_matrix_stride(num_ranks);
  auto total_to = [&](int dst) { return block_base[dst] + own_count[dst]; };
  if (last_block) publish_count_row(path, args, tag, total_to);

  // 3. The count-matrix entries this block needs: [src < rank][dst] for dest_base; the last
  // block also [src][rank] for what each source sends here (its own row it knows).
  auto entry = [&](int src, int dst) {
    if (src == rank) return total_to(dst);
    return static_cast<int>(wait_tagged_count(
        args.count_matrix + parity_offset + static_cast<int64_t>(src) * num_ranks + dst, tag,
        args.wait.timeout_ns, args.wait.record, rank, src, phase));
  };
  for (int r = tid; r < num_ranks; r += kPlanThreads) {
    int base = 0;
    for (int s = 0; s < rank; ++s) base += entry(s, r);
    dest_base[r] = base;
    position[r] = block_base[r];
    if (last_block) {
      plan.send_count[r] = total_to(r);
      plan.dest_base[r] = base;
      plan.recv_count[r] = entry(r, rank);
    }
  }
  __syncthreads();
  if (last_block && tid == 0) {
    int num_recv = 0;
    for (int s = 0; s < num_ranks; ++s) {
      plan.recv_prefix[s] = num_recv;
      num_recv += plan.recv_count[s];
    }
    publish_num_recv(args, plan, num_recv);
  }

  // 4. Positions in token order: earlier rounds, earlier warps, lower lanes.
  const uint32_t lanes_below = (1u << lane) - 1;
  for (int round = 0; round < num_rounds; ++round) {
    for (int i = tid; i < num_ranks * kPlanWarps; i += kPlanThreads) bits[i] = 0;
    __syncthreads();
    const int t = token_begin + round * kPlanThreads + tid;
    int ranks[kMaxTopk];
    int count = 0;
    if (t < token_end) {
      int ignored = 0;
      count = token_ranks(args, t, ranks, &ignored);
      for (int i = 0; i < count; ++i) atomicOr(&bits[ranks[i] * kPlanWarps + warp], 1u << lane);
    }
    __syncthreads();
    if (t < token_end) {
      int32_t* out = routing ? args.send_pos_out + static_cast<int64_t>(t) * num_ranks : nullptr;
      if (out != nullptr) {
        for (int r = 0; r < num_ranks; ++r) out[r] = -1;
      }
      for (int i = 0; i < count; ++i) {
        const int r = ranks[i];
        const uint32_t* words = bits + r * kPlanWarps;
        int before = __popc(words[warp] & lanes_below);
        for (int w = 0; w < warp; ++w) before += __popc(words[w]);
        const int pos = position[r] + before;
        args.send_tokens[static_cast<int64_t>(r) * args.max_tokens + pos] = t;
        if (out != nullptr) out[r] = dest_base[r] + pos;
      }
    }
    __syncthreads();
    for (int r = tid; r < num_ranks; r += kPlanThreads) {
      int total = 0;
      for (int w = 0; w < kPlanWarps; ++w) total += __popc(bits[r * kPlanWarps + w]);
      position[r] += total;
    }
    __syncthreads();  // bits is cleared by the next round
  }
}

}  // namespace normal_dispatch
}  // namespace jax_ep
