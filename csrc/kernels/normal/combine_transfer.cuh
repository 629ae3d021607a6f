// The normal-mode combine's transfer kernel (launcher: combine.cu), templated on the path by
// which it crosses ranks (normal/put_path.cuh). In a header so that the NVSHMEM plugin
// (plugins/nvshmem_transport_kernels.cu) instantiates it with its transport, as combine.cu does
// with the others.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/copy.cuh"
#include "common/limits.h"
#include "common/peer_field.cuh"
#include "common/sync.cuh"
#include "kernels/normal/combine_plan.cuh"
#include "kernels/normal/put_path.cuh"
#include "kernels/normal/rounds.cuh"
#include "kernels/normal/windows.h"
#include "kernels/normal/workspace.h"

namespace jax_ep {
namespace normal_combine {

constexpr int kTransferThreads = kNormalTransferThreads;
constexpr int kTransferWarps = kTransferThreads / kWarpSize;
// Tokens of one reduce work item: two per warp of the block.
constexpr int kTokensPerItem = 2 * kTransferWarps;
// 16-byte vectors each lane of a reducing warp loads per source before it adds.
constexpr int kReduceUnroll = 2;
static_assert(kNormalRoundUnit % kTokensPerItem == 0, "a reduce item lies in one round");
// Dynamic shared memory of a block: the first push entry of each round (int64), then the plan's
// words.
inline size_t combine_transfer_shared_bytes(int num_ranks) {
  return sizeof(int64_t) * (kNormalMaxRounds + 1) +
         sizeof(int) * static_cast<size_t>(normal_plan_words(num_ranks));
}

struct CombineTransferArgs {
  const char* y;  // [C, y_bytes_per_row]
  int64_t y_bytes_per_row;
  const float* y_w;  // [C, num_w]
  int num_w;
  const int32_t* send_pos;  // [T, R]
  const int32_t* recv_src;  // [C]
  int num_tokens;
  int capacity;
  int num_ranks;
  int rank;
  int max_tokens;
  char* combined;     // [T, y_bytes_per_row]
  float* combined_w;  // [T, num_w]
  // Workspace of this rank.
  const int32_t* plan_words;  // NormalPlan::at(plan_words, R)
  uint64_t* seq;
  uint32_t* counters;  // kNormalCounterWords: next work item, finished blocks, then the rounds'
  const char* rows;    // data region: rows [src][token % slots]
  const uint64_t* row_flags;
  PeerField<char> peer_rows;
  PeerField<uint64_t> peer_row_flags;
  int64_t region_bytes_per_row;
  int num_push_blocks;
  RoundArgs rounds;  // the window: token t at slots [src][t % slots], in round t / round_rows
  const int32_t* round_bounds;  // several rounds: [owner][k] rows of y (fill_round_bounds)
  const int32_t* round_levels;  // several rounds: [k] most rows sent to one owner
  WaitContext wait;
  NormalTransportArgs transport;  // a transport path's (last: the stores path never reads it)
};

// The slot of `token` in each source's part of the data region.
__device__ __forceinline__ int64_t token_slot(const RoundArgs& rounds, int token) {
  return token < rounds.slots ? token : token % rounds.slots;
}

// float32 accumulation of 16-byte vectors of Element.
template <typename Element>
struct VectorMath;

template <>
struct VectorMath<__nv_bfloat16> {
  static constexpr int kPerVector = 8;
  __device__ static void add(float (&acc)[kPerVector], const int4& v) {
    const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
    for (int i = 0; i < kPerVector / 2; ++i) {
      const float2 f = __bfloat1622float2(pairs[i]);
      acc[2 * i] += f.x;
      acc[2 * i + 1] += f.y;
    }
  }
  __device__ static int4 pack(const float (&acc)[kPerVector]) {
    int4 v;
    __nv_bfloat162* pairs = reinterpret_cast<__nv_bfloat162*>(&v);
#pragma unroll
    for (int i = 0; i < kPerVector / 2; ++i) {
      pairs[i] = __floats2bfloat162_rn(acc[2 * i], acc[2 * i + 1]);
    }
    return v;
  }
};

template <>
struct VectorMath<float> {
  static constexpr int kPerVector = 4;
  __device__ static void add(float (&acc)[kPerVector], const int4& v) {
    acc[0] += __int_as_float(v.x);
    acc[1] += __int_as_float(v.y);
    acc[2] += __int_as_float(v.z);
    acc[3] += __int_as_float(v.w);
  }
  __device__ static int4 pack(const float (&acc)[kPerVector]) {
    return make_int4(__float_as_int(acc[0]), __float_as_int(acc[1]), __float_as_int(acc[2]),
                     __float_as_int(acc[3]));
  }
};

// The row that rank r holds of a token for its sum: y's row own_pos for this rank, the data
// region row [r][slot] for the others (slot: token_slot of the token).
struct SourceRows {
  const CombineTransferArgs& args;
  int64_t slot;
  int own_pos;

  __device__ __forceinline__ const char* operator()(int r) const {
    return r == args.rank ? args.y + static_cast<int64_t>(own_pos) * args.y_bytes_per_row
                          : args.rows + (static_cast<int64_t>(r) * args.rounds.slots + slot) *
                                            args.region_bytes_per_row;
  }
};

// combined[token] = sum over ranks r (ascending) with 0 <= send_pos[token, r] < C of that
// rank's row: y itself for this rank, the data region row [r][token] for the others (lane r
// first acquires its row flag). One warp, float32, rounded once. Groups of at most kNarrowRanks
// ranks (one lane and one register row per rank).
template <typename Element>
__device__ __forceinline__ void reduce_token(const CombineTransferArgs& args, int token,
                                             uint64_t tag, int lane) {
  using Math = VectorMath<Element>;
  const int num_ranks = args.num_ranks;
  const int rank = args.rank;
  const int pos =
      lane < num_ranks ? __ldg(args.send_pos + static_cast<int64_t>(token) * num_ranks + lane) : -1;
  const bool valid = lane < num_ranks && pos >= 0 && pos < args.capacity;
  if (valid && lane != rank) {
    wait_flag(args.wait, args.row_flags + static_cast<int64_t>(lane) * args.max_tokens + token, tag,
              lane);
  }
  const uint32_t sources = __ballot_sync(0xffffffffu, valid);
  const int own_pos = __shfl_sync(0xffffffffu, pos, rank);
  __syncwarp();  // orders each lane's acquire before every lane's loads of that source's row

  const SourceRows source_row{args, token_slot(args.rounds, token), max(own_pos, 0)};

  const int64_t num_vectors = args.y_bytes_per_row / kBytesPerVector;
  int4* out = reinterpret_cast<int4*>(args.combined + token * args.y_bytes_per_row);
  for (int64_t base = lane; base < num_vectors; base += kWarpSize * kReduceUnroll) {
    int4 loaded[kReduceUnroll][kNarrowRanks];
#pragma unroll
    for (int r = 0; r < kNarrowRanks; ++r) {
      if ((sources >> r) & 1u) {
        const int4* row = reinterpret_cast<const int4*>(source_row(r));
#pragma unroll
        for (int u = 0; u < kReduceUnroll; ++u) {
          const int64_t idx = base + u * kWarpSize;
          if (idx < num_vectors)
            loaded[u][r] = r == rank ? ld_nc_v4(row + idx) : ld_cg_v4(row + idx);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kReduceUnroll; ++u) {
      const int64_t idx = base + u * kWarpSize;
      if (idx >= num_vectors) continue;
      float acc[Math::kPerVector];
#pragma unroll
      for (int i = 0; i < Math::kPerVector; ++i) acc[i] = 0.0f;
#pragma unroll
      for (int r = 0; r < kNarrowRanks; ++r) {
        if ((sources >> r) & 1u) Math::add(acc, loaded[u][r]);
      }
      st_v4(out + idx, Math::pack(acc));
    }
  }

  for (int c = lane; c < args.num_w; c += kWarpSize) {
    float sum = 0.0f;
    for (int r = 0; r < num_ranks; ++r) {
      if (!((sources >> r) & 1u)) continue;
      if (r == rank) {
        sum += __ldg(args.y_w + static_cast<int64_t>(own_pos) * args.num_w + c);
      } else {
        sum += ld_cg_f32(reinterpret_cast<const float*>(source_row(r) + args.y_bytes_per_row) + c);
      }
    }
    args.combined_w[static_cast<int64_t>(token) * args.num_w + c] = sum;
  }
}

// reduce_token for groups of more than kNarrowRanks ranks: the same sum in the same order. The
// warp gathers the token's sources in ascending order into `sources` (shared memory of its own;
// a handle sends a token to at most K <= kWarpSize ranks, more are not summed), lane i acquires
// the flag of source i, then each lane sums its vectors source by source.
template <typename Element>
__device__ __forceinline__ void reduce_token_wide(const CombineTransferArgs& args, int token,
                                                  uint64_t tag, int* sources, int lane) {
  using Math = VectorMath<Element>;
  const int num_ranks = args.num_ranks;
  const int rank = args.rank;
  const int32_t* send_pos = args.send_pos + static_cast<int64_t>(token) * num_ranks;
  const uint32_t lanes_below = (1u << lane) - 1;
  int num_sources = 0;
  for (int first = 0; first < num_ranks; first += kWarpSize) {
    const int r = first + lane;
    const int pos = r < num_ranks ? __ldg(send_pos + r) : -1;
    const bool valid = r < num_ranks && pos >= 0 && pos < args.capacity;
    const uint32_t ballot = __ballot_sync(0xffffffffu, valid);
    const int index = num_sources + __popc(ballot & lanes_below);
    if (valid && index < kWarpSize) sources[index] = r;
    num_sources += __popc(ballot);
  }
  num_sources = min(num_sources, kWarpSize);
  __syncwarp();
  if (lane < num_sources && sources[lane] != rank) {
    wait_flag(args.wait,
              args.row_flags + static_cast<int64_t>(sources[lane]) * args.max_tokens + token, tag,
              sources[lane]);
  }
  __syncwarp();  // orders each lane's acquire before every lane's loads of that source's row

  const int own_pos = max(__ldg(send_pos + rank), 0);
  const SourceRows source_row{args, token_slot(args.rounds, token), own_pos};
  const int64_t num_vectors = args.y_bytes_per_row / kBytesPerVector;
  int4* out = reinterpret_cast<int4*>(args.combined + token * args.y_bytes_per_row);
  for (int64_t idx = lane; idx < num_vectors; idx += kWarpSize) {
    float acc[Math::kPerVector];
#pragma unroll
    for (int i = 0; i < Math::kPerVector; ++i) acc[i] = 0.0f;
    for (int i = 0; i < num_sources; ++i) {
      const int r = sources[i];
      const int4* row = reinterpret_cast<const int4*>(source_row(r));
      Math::add(acc, r == rank ? ld_nc_v4(row + idx) : ld_cg_v4(row + idx));
    }
    st_v4(out + idx, Math::pack(acc));
  }
  for (int c = lane; c < args.num_w; c += kWarpSize) {
    float sum = 0.0f;
    for (int i = 0; i < num_sources; ++i) {
      const int r = sources[i];
      if (r == rank) {
        sum += __ldg(args.y_w + static_cast<int64_t>(own_pos) * args.num_w + c);
      } else {
        sum += ld_cg_f32(reinterpret_cast<const float*>(source_row(r) + args.y_bytes_per_row) + c);
      }
    }
    args.combined_w[static_cast<int64_t>(token) * args.num_w + c] = sum;
  }
  __syncwarp();  // `sources` is rewritten for the warp's next token
}

// Role: the data movement of one combine, as work items claimed in this order:
//   [push roles] [reduce items of kTokensPerItem tokens]
// Rounds (kernels/normal/windows.h): token t of an owner has the slot [source][t % slots] there
// and belongs to round t / round_rows; with one round (T within the window) the slot is the
// token and nothing below waits for a credit.
// - push role p: warp g = p*W + w handles entries q = g, g+P*W, ... of (round, k, owner),
//   round-major, then k-major over the other ranks: the k-th row of y held for the owner in
//   that round (token = recv_src - owner*T) goes to the owner's data region slot [rank][token %
//   slots] (y bytes, then y_w), then __syncwarp + release-store of tag into the owner's row
//   flag [rank][token]. A row of round k >= 2 waits first for the owner's credit of round k - 2.
// - reduce item: one warp per token (reduce_token, or reduce_token_wide when kWide: more than
//   kNarrowRanks ranks), waiting per source row; with several rounds the block then counts the
//   tokens it finished and publishes the rounds finished in order (kernels/normal/rounds.cuh).
// Grid: ctx.normal_blocks blocks of kTransferThreads; deadlock-free for the same reasons as the
// dispatch transfer (push roles are claimed before any reduce item, the reduce items in token
// order, hence round by round, and a push warp's entries go round by round). The last block to
// finish stores the call's sequence number.
// Over a transport (Path a TransportPath) a push warp stages each row in its send slots and
// puts it with its flag (RowSender), and quiets before it leaves its role, as in the dispatch.
template <typename Element, typename Path, bool kWide>
__global__ void __launch_bounds__(kTransferThreads, 1)
    combine_transfer_kernel(const CombineTransferArgs args) {
  const Path path = PathOf<Path>::of(args.transport);
  extern __shared__ int64_t push_prefix[];  // [M + 1] first push entry of each round, then:
  __shared__ int claimed_item;
  const int tid = threadIdx.x;
  const int lane = tid % kWarpSize;
  const int warp = tid / kWarpSize;
  const int num_ranks = args.num_ranks;
  const int rank = args.rank;
  const int num_tokens = args.num_tokens;
  const RoundArgs& rounds = args.rounds;
  const bool reuses = reuses_slots(rounds);
  const uint64_t tag = *reinterpret_cast<const volatile uint64_t*>(args.seq) + 1;
  int* const plan_words = reinterpret_cast<int*>(push_prefix + kNormalMaxRounds + 1);
  const NormalPlan plan = NormalPlan::at(plan_words, num_ranks);

  for (int i = tid; i < normal_plan_words(num_ranks); i += kTransferThreads) {
    plan_words[i] = __ldg(args.plan_words + i);
  }
  __syncthreads();

  const int num_peers = num_ranks - 1;
  if (tid == 0) {
    // Entries of each round: its most rows sent to one owner, times the peers.
    int max_rows = 0;
    for (int r = 0; r < num_ranks; ++r) {
      if (r != rank) max_rows = max(max_rows, plan.recv_count[r]);
    }
    int64_t entries = 0;
    for (int k = 0; k <= rounds.num_rounds; ++k) {
      push_prefix[k] = entries;
      if (k < rounds.num_rounds) {
        // Without reuse every row fits in the slots: all in the first round's entries (a
        // window never has two rounds, but a second one would then hold none).
        const int levels = reuses ? __ldg(args.round_levels + k) : (k == 0 ? max_rows : 0);
        entries += static_cast<int64_t>(levels) * num_peers;
      }
    }
  }
  __syncthreads();
  const int num_push_items = num_peers > 0 ? args.num_push_blocks : 0;
  const int num_reduce_items = (num_tokens + kTokensPerItem - 1) / kTokensPerItem;
  const int num_items = num_push_items + num_reduce_items;
  const int64_t round_rows = rounds.round_rows;
  // Tokens of round k: all of them are reduced here.
  const auto round_tokens = [&](int k) {
    const int64_t rest = num_tokens - static_cast<int64_t>(k) * round_rows;
    return static_cast<int>(rest < round_rows ? rest : round_rows);
  };

  for (;;) {
    int item = claim_work_item(args.counters, &claimed_item);
    if (item >= num_items) break;

    if (item < num_push_items) {
      const int64_t num_push_warps = static_cast<int64_t>(args.num_push_blocks) * kTransferWarps;
      const int64_t num_entries = push_prefix[rounds.num_rounds];
      const int64_t push_warp = static_cast<int64_t>(item) * kTransferWarps + warp;
      RowSender<Path> sender(path, rank, args.wait, push_warp, num_push_warps,
                             args.region_bytes_per_row);
      int round = 0;
      for (int64_t q = push_warp; q < sender.end(num_entries); q += sender.stride(num_push_warps)) {
        const RoundEntry at_entry = round_entry(push_prefix, q, &round, rank, num_ranks);
        const int k = at_entry.level;
        const int owner = at_entry.peer;
        // The owner's rows of y in this round: its segment, or the part the plan found for the
        // round (clamped to the segment).
        const int segment_begin = plan.recv_prefix[owner];
        const int segment_end = segment_begin + plan.recv_count[owner];
        int begin = segment_begin;
        int end = segment_end;
        if (reuses) {
          const int32_t* bounds = args.round_bounds + owner * kRoundBoundsStride;
          begin = min(max(__ldg(bounds + round), segment_begin), segment_end);
          end = min(max(__ldg(bounds + round + 1), begin), segment_end);
        }
        const int row = begin + k;
        if (row >= end || row >= *plan.num_recv) continue;
        const int token = __ldg(args.recv_src + row) - owner * num_tokens;
        if (token < 0 || token >= num_tokens) continue;  // inconsistent handle: drop the row
        if (reuses) {
          wait_for_credit(sender, rounds, args.wait, WaitPhase::kCombineCredit, owner,
                          static_cast<int>(token / round_rows), tag, lane);
        }
        char* const rows = sender.rows(args.peer_rows, owner);
        const int64_t region_row =
            static_cast<int64_t>(rank) * rounds.slots + token_slot(rounds, token);
        const int64_t at = sender.next_row(region_row, lane);
        char* dst = rows + at * args.region_bytes_per_row;
        warp_copy_vectors<true>(reinterpret_cast<int4*>(dst),
                                reinterpret_cast<const int4*>(args.y + static_cast<int64_t>(row) *
                                                                           args.y_bytes_per_row),
                                args.y_bytes_per_row / kBytesPerVector, lane);
        float* dst_w = reinterpret_cast<float*>(dst + args.y_bytes_per_row);
        for (int c = lane; c < args.num_w; c += kWarpSize) {
          dst_w[c] = __ldg(args.y_w + static_cast<int64_t>(row) * args.num_w + c);
        }
        const auto flag_index = [&] {
          return static_cast<int64_t>(rank) * args.max_tokens + token;
        };
        sender.send(args.peer_row_flags, owner, region_row, at, flag_index, tag, lane);
      }
      sender.finish(lane);
      continue;
    }
    item -= num_push_items;

    const int begin = item * kTokensPerItem;
    const int end = min(num_tokens, begin + kTokensPerItem);
    for (int token = begin + warp; token < end; token += kTransferWarps) {
      if constexpr (kWide) {
        __shared__ int sources[kTransferWarps][kWarpSize];
        reduce_token_wide<Element>(args, token, tag, sources[warp], lane);
      } else {
        reduce_token<Element>(args, token, tag, lane);
      }
    }
    if (reuses) {
      count_finished(rounds, static_cast<int>(begin / round_rows), end - begin);
      if (warp == 0) {
        publish_finished_rounds(path, rounds, rank, num_ranks, rounds.num_rounds - 2, round_tokens,
                                tag, args.wait, lane);
      }
    }
  }

  finish_transfer_block(args.counters, kNormalCounterWords, args.seq, tag);
}

}  // namespace normal_combine
}  // namespace jax_ep
