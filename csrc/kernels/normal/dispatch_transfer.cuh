// The normal-mode dispatch's transfer kernel (launcher: dispatch.cu): the data movement of a
// dispatch or cached dispatch, templated on the path by which it crosses ranks
// (normal/put_path.cuh). In a header so that the NVSHMEM plugin
// (plugins/nvshmem_transport_kernels.cu) instantiates it with its transport, as dispatch.cu does
// with the others.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/copy.cuh"
#include "common/fast_divisor.h"
#include "common/limits.h"
#include "common/peer_field.cuh"
#include "common/sync.cuh"
#include "kernels/normal/put_path.cuh"
#include "kernels/normal/rounds.cuh"
#include "kernels/normal/windows.h"
#include "kernels/normal/workspace.h"

namespace jax_ep {
namespace normal_dispatch {

constexpr int kTransferThreads = kNormalTransferThreads;
constexpr int kTransferWarps = kTransferThreads / kWarpSize;
// Rows of one self / padding / receive work item: two rows per warp of the block.
constexpr int kRowsPerItem = 2 * kTransferWarps;
static_assert(kRowsPerItem % kTransferWarps == 0 && kRowsPerItem / kTransferWarps <= kWarpSize,
              "a warp acquires the flags of its rows of an item with one lane per row");
static_assert(kNormalRoundUnit % kRowsPerItem == 0, "a receive item lies in one round");
// Local experts counted in a shared-memory histogram per block; more go to global atomics.
constexpr int kTransferSharedExperts = 8192;
// Dynamic shared memory of a block: the first entry of each round's pushes (int64), then the
// histogram, then the plan's words, each rank's rows that fit the capacity (sent there, received
// from there), and the first receive item of each round.
constexpr size_t kTransferSharedBytes = 48 * 1024;  // what a block gets without opting in
constexpr size_t kTransferRoundTableBytes =
    (sizeof(int64_t) + sizeof(int)) * (kNormalMaxRounds + 1);
inline size_t transfer_plan_shared_bytes(int num_ranks) {
  return sizeof(int) * (normal_plan_words(num_ranks) + 2 * static_cast<size_t>(num_ranks)) +
         kTransferRoundTableBytes;
}
// Local experts of the shared histogram: all of them up to kTransferSharedExperts, as many as fit
// beside the plan.
inline int transfer_shared_experts(int num_local_experts, int num_ranks) {
  const int fit = static_cast<int>((kTransferSharedBytes - transfer_plan_shared_bytes(num_ranks)) /
                                   sizeof(int));
  const int limit = fit < kTransferSharedExperts ? fit : kTransferSharedExperts;
  return num_local_experts < limit ? num_local_experts : limit;
}
inline size_t transfer_shared_bytes(int num_shared_experts, int num_ranks) {
  return sizeof(int) * static_cast<size_t>(num_shared_experts) +
         transfer_plan_shared_bytes(num_ranks);
}
static_assert(4 * (1 + 6 * kMaxRanks) + kTransferRoundTableBytes < kTransferSharedBytes,
              "the plan fits beside no histogram");

struct DispatchTransferArgs {
  // This rank's rows (XLA operands).
  const char* x;  // [T, x_bytes_per_row]
  int64_t x_bytes_per_row;
  const float* x_scales;  // [T, S']
  int num_scales;
  const int32_t* topk_idx;    // [T, K]; routing mode only (else null and num_topk = 0)
  const float* topk_weights;  // [T, K]
  int num_topk;
  const float* payload;  // [T, K']; cached mode only (else null and num_payload = 0)
  int num_payload;
  int num_tokens;
  int capacity;
  int num_ranks;
  int rank;
  int num_local_experts;
  FastDivisor experts_per_rank;  // expert id -> its rank
  int max_tokens;
  // Outputs.
  char* recv_x;  // [C, x_bytes_per_row]
  float* recv_scales;
  int32_t* recv_topk_idx;
  float* recv_topk_weights;
  int32_t* recv_src;
  float* recv_payload;
  int32_t* num_recv_tokens_per_expert;  // zeroed by the plan kernel
  int num_shared_experts;               // local experts counted in shared memory
  // Workspace of this rank.
  const int32_t* plan_words;  // NormalPlan::at(plan_words, R)
  const int32_t* send_tokens;
  uint64_t* seq;
  uint32_t* counters;  // kNormalCounterWords: next work item, finished blocks, then the rounds'
  const char* rows;    // data region
  const uint64_t* row_flags;
  // Every rank's data region and row flags (this one's included).
  PeerField<char> peer_rows;
  PeerField<uint64_t> peer_row_flags;
  int64_t region_bytes_per_row;
  int num_push_blocks;
  RoundArgs rounds;  // the window: output row o at slot o % slots, in round o / round_rows
  WaitContext wait;
  NormalTransportArgs transport;  // a transport path's (last: the stores path never reads it)
};

// The part of rows [begin, begin + count) (a rank's segment of some rank's output rows) that lies
// in round k, as offsets into the segment: [lo, hi), empty when hi <= lo.
struct RoundSpan {
  int lo;
  int hi;
};
__device__ __forceinline__ RoundSpan round_span(int64_t round_rows, int round, int begin,
                                                int count) {
  const int64_t first = static_cast<int64_t>(round) * round_rows - begin;
  const int64_t last = first + round_rows;
  return {static_cast<int>(first > 0 ? first : 0), static_cast<int>(last < count ? last : count)};
}

// True in the lowest lane of [0, num_topk) whose `local` equals this lane's: a row that lists one
// expert at several k counts once in num_recv_tokens_per_expert. Every lane < num_topk calls it.
__device__ __forceinline__ bool first_lane_with(int local, int num_topk, int lane) {
  const uint32_t topk_lanes = num_topk >= kWarpSize ? 0xffffffffu : (1u << num_topk) - 1;
  const uint32_t same = __match_any_sync(topk_lanes, local);
  return (same & ((1u << lane) - 1)) == 0;
}

__device__ __forceinline__ void count_local_expert(const DispatchTransferArgs& args, int* histogram,
                                                   int local_expert) {
  if (local_expert < args.num_shared_experts) {
    atomicAdd(&histogram[local_expert], 1);
  } else {
    atomicAdd(&args.num_recv_tokens_per_expert[local_expert], 1);
  }
}

// Writes the aux words of `token` as rank `dst_rank` receives them: scales, top-k ids made local
// to dst_rank (-1 elsewhere, invalid ids included), weights (0 where the id is -1), source index;
// or, in cached mode, scales and payload. `histogram` != null: count the local ids (own rows).
__device__ __forceinline__ void write_row_aux(const DispatchTransferArgs& args, int token,
                                              int dst_rank, float* scales, int32_t* ids,
                                              float* weights, int32_t* src, float* payload,
                                              int* histogram, int lane) {
  const float* in_scales = args.x_scales + static_cast<int64_t>(token) * args.num_scales;
  for (int c = lane; c < args.num_scales; c += kWarpSize) scales[c] = __ldg(in_scales + c);
  if (lane < args.num_topk) {
    const int64_t at = static_cast<int64_t>(token) * args.num_topk + lane;
    const int expert = __ldg(args.topk_idx + at);
    const int owner =
        expert >= 0 ? static_cast<int>(args.experts_per_rank.divide(static_cast<uint32_t>(expert)))
                    : -1;
    const bool here = expert >= 0 && owner == dst_rank;
    const int local = here ? expert - owner * args.num_local_experts : -1;
    ids[lane] = local;
    weights[lane] = here ? __ldg(args.topk_weights + at) : 0.0f;
    const bool first = first_lane_with(local, args.num_topk, lane);
    if (histogram != nullptr && here && first) count_local_expert(args, histogram, local);
  }
  if (args.num_topk > 0 && lane == 0) *src = args.rank * args.num_tokens + token;
  const float* in_payload = args.payload + static_cast<int64_t>(token) * args.num_payload;
  for (int c = lane; c < args.num_payload; c += kWarpSize) payload[c] = __ldg(in_payload + c);
}

// Output row pointers of row `row` (aux outputs are null-safe: their loops run 0 times).
struct OutputRow {
  int4* x;
  float* scales;
  int32_t* ids;
  float* weights;
  int32_t* src;
  float* payload;
};

__device__ __forceinline__ OutputRow output_row(const DispatchTransferArgs& args, int64_t row) {
  OutputRow out;
  out.x = reinterpret_cast<int4*>(args.recv_x + row * args.x_bytes_per_row);
  out.scales = args.recv_scales + row * args.num_scales;
  out.ids = args.recv_topk_idx + row * args.num_topk;
  out.weights = args.recv_topk_weights + row * args.num_topk;
  out.src = args.recv_src + row;
  out.payload = args.recv_payload + row * args.num_payload;
  return out;
}

// Region row `row` of the data region starting at `rows`: [x bytes][scales][ids][weights][src]
// (routing) or [x bytes][scales][payload] (cached).
struct RegionRow {
  char* x;
  float* scales;
  int32_t* ids;
  float* weights;
  int32_t* src;
  float* payload;
};

__device__ __forceinline__ RegionRow region_row(const DispatchTransferArgs& args, char* rows,
                                                int64_t row) {
  RegionRow region;
  region.x = rows + row * args.region_bytes_per_row;
  region.scales = reinterpret_cast<float*>(region.x + args.x_bytes_per_row);
  region.ids = reinterpret_cast<int32_t*>(region.scales + args.num_scales);
  region.weights = reinterpret_cast<float*>(region.ids + args.num_topk);
  region.src = reinterpret_cast<int32_t*>(region.weights + args.num_topk);
  region.payload = region.scales + args.num_scales;  // cached mode has no ids/weights/src
  return region;
}

// Role: the whole data movement of one call, as work items claimed in this order:
//   [push roles] [own rows] [padding rows] [peer rows, round-major, then position-major over
//   the peers]
// Rounds (kernels/normal/windows.h): output row o of a rank is the region's slot o % slots and
// belongs to round o / round_rows; with one round (every call whose capacity fits the window)
// the slot is the row itself and nothing below waits for a credit.
// - push role p (the first num_push_blocks items): warp g = p*W + w pushes entries q = g, g+P*W,
//   ... of the list (round, position, peer), round-major, then position-major: token
//   send_tokens[peer][pos] to the slot of row dest_base[peer] + pos of the peer's region (x
//   row, then aux words with the ids made local to the peer), then __syncwarp + release-stores
//   tag into the peer's row flag [rank][pos]. A row of round k >= 2 waits first for the peer's
//   credit of round k - 2. Rows at or past the peer's capacity are not sent.
// - own rows: x[token] -> recv row recv_prefix[rank] + pos, aux computed here.
// - padding rows [min(num_recv, C), C): x/scales/weights/payload 0, ids/src -1.
// - peer rows of round k and source s, positions [l*kRowsPerItem, (l+1)*kRowsPerItem) of the
//   source's rows in that round: each warp acquires the row flags [s][pos] of its rows (bounded
//   waits, one lane per row), then copies region slots -> outputs. With several rounds the
//   block then counts the rows it finished, and publishes the rounds finished in order
//   (kernels/normal/rounds.cuh).
// Grid: ctx.normal_blocks blocks of kTransferThreads. Items are claimed in order, so every push
// role is claimed before any block claims a receive item, and every receive item of a round
// before any of the next. One round: no push role waits, so deadlock freedom does not need all
// blocks resident. Several rounds: a push warp's entries go round by round, so by induction
// over rounds every row of round k is sent once every rank finished round k - 2, and the
// receive items of round k are claimed by blocks that run; a push role that waits needs the
// other blocks of its rank to run, which they do (one block per SM, at most one per SM). The
// last block to finish stores the call's sequence number (finish_transfer_block).
// Over a transport (Path a TransportPath) a push warp stages each row in its send slots and
// puts it with its flag (RowSender), and quiets before it leaves its role: the next call
// restages those slots. A quiet waits only for the proxy or the network, never for a receiver.
template <typename Path>
__global__ void __launch_bounds__(kTransferThreads, 1)
    dispatch_transfer_kernel(const DispatchTransferArgs args) {
  const Path path = PathOf<Path>::of(args.transport);
  extern __shared__ int64_t push_prefix[];  // [M + 1] first push entry of each round, then:
  __shared__ int claimed_item;

  const int tid = threadIdx.x;
  const int lane = tid % kWarpSize;
  const int warp = tid / kWarpSize;
  const int num_ranks = args.num_ranks;
  const int rank = args.rank;
  const int capacity = args.capacity;
  const RoundArgs& rounds = args.rounds;
  const int64_t round_rows = rounds.round_rows;
  const uint64_t tag = *reinterpret_cast<const volatile uint64_t*>(args.seq) + 1;
  int* const histogram = reinterpret_cast<int*>(push_prefix + kNormalMaxRounds + 1);
  int* const plan_words = histogram + args.num_shared_experts;
  const NormalPlan plan = NormalPlan::at(plan_words, num_ranks);
  int* const send_valid = plan_words + normal_plan_words(num_ranks);  // [R] rows sent to each
                                                                      // rank that fit its capacity
  int* const recv_valid = send_valid + num_ranks;   // [R] rows received from each rank that fit
  int* const item_prefix = recv_valid + num_ranks;  // [M + 1] first receive item of each round

  for (int i = tid; i < normal_plan_words(num_ranks); i += kTransferThreads) {
    plan_words[i] = __ldg(args.plan_words + i);
  }
  for (int e = tid; e < args.num_shared_experts; e += kTransferThreads) histogram[e] = 0;
  for (int k = tid; k <= kNormalMaxRounds; k += kTransferThreads) {
    push_prefix[k] = 0;
    item_prefix[k] = 0;
  }
  __syncthreads();
  for (int r = tid; r < num_ranks; r += kTransferThreads) {
    send_valid[r] = max(0, min(capacity - plan.dest_base[r], plan.send_count[r]));
    recv_valid[r] = max(0, min(capacity - plan.recv_prefix[r], plan.recv_count[r]));
  }
  __syncthreads();
  // Each round's levels: most rows sent to one peer, most receive items of one peer (slots
  // [k] of the prefix tables, scanned below).
  for (int r = tid; r < num_ranks; r += kTransferThreads) {
    if (r == rank) continue;
    for (int k = 0; k < rounds.num_rounds; ++k) {
      const RoundSpan sent = round_span(round_rows, k, plan.dest_base[r], send_valid[r]);
      const RoundSpan received = round_span(round_rows, k, plan.recv_prefix[r], recv_valid[r]);
      if (sent.hi > sent.lo) {
        atomicMax(reinterpret_cast<unsigned long long*>(push_prefix + k),
                  static_cast<unsigned long long>(sent.hi - sent.lo));
      }
      if (received.hi > received.lo) {
        atomicMax(item_prefix + k, (received.hi - received.lo + kRowsPerItem - 1) / kRowsPerItem);
      }
    }
  }
  __syncthreads();
  const int num_peers = num_ranks - 1;
  if (tid == 0) {
    int64_t entries = 0;
    int items = 0;
    for (int k = 0; k <= rounds.num_rounds; ++k) {
      const int64_t round_entries = k < rounds.num_rounds ? push_prefix[k] * num_peers : 0;
      const int round_items = k < rounds.num_rounds ? item_prefix[k] * num_peers : 0;
      push_prefix[k] = entries;
      item_prefix[k] = items;
      entries += round_entries;
      items += round_items;
    }
  }
  __syncthreads();

  const int num_valid = min(*plan.num_recv, capacity);
  const int num_own = recv_valid[rank];
  // Peer rows of round k here: the round's rows below num_valid, less this rank's own segment.
  const auto round_peer_rows = [&](int k) {
    const RoundSpan all = round_span(round_rows, k, 0, num_valid);
    const RoundSpan own = round_span(round_rows, k, plan.recv_prefix[rank], num_own);
    return max(0, all.hi - all.lo) - max(0, own.hi - own.lo);
  };
  // Rounds a sender waits for: those below the last two holding rows here.
  const int credited_rounds =
      max(0, static_cast<int>((num_valid + round_rows - 1) / round_rows) - 2);
  const bool reuses = reuses_slots(rounds);
  if (reuses && warp == 0) {
    publish_finished_rounds(path, rounds, rank, num_ranks, credited_rounds, round_peer_rows, tag,
                            args.wait, lane);
  }

  const int num_push_items = num_peers > 0 ? args.num_push_blocks : 0;
  const int num_own_items = (num_own + kRowsPerItem - 1) / kRowsPerItem;
  const int num_pad_items = (capacity - num_valid + kRowsPerItem - 1) / kRowsPerItem;
  const int num_items =
      num_push_items + num_own_items + num_pad_items + item_prefix[rounds.num_rounds];

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
        const int dst = at_entry.peer;
        const RoundSpan span = round_span(round_rows, round, plan.dest_base[dst], send_valid[dst]);
        const int pos = span.lo + at_entry.level;
        if (pos >= span.hi) continue;
        if (reuses) {
          wait_for_credit(sender, rounds, args.wait, WaitPhase::kDispatchCredit, dst, round, tag,
                          lane);
        }
        const int token =
            __ldg(args.send_tokens + static_cast<int64_t>(dst) * args.max_tokens + pos);
        char* const rows = sender.rows(args.peer_rows, dst);
        const int64_t row = plan.dest_base[dst] + pos;
        const int64_t slot = row < rounds.slots ? row : row % rounds.slots;
        const int64_t at = sender.next_row(slot, lane);
        const RegionRow region = region_row(args, rows, at);
        warp_copy_vectors<true>(reinterpret_cast<int4*>(region.x),
                                reinterpret_cast<const int4*>(args.x + static_cast<int64_t>(token) *
                                                                           args.x_bytes_per_row),
                                args.x_bytes_per_row / kBytesPerVector, lane);
        write_row_aux(args, token, dst, region.scales, region.ids, region.weights, region.src,
                      region.payload, nullptr, lane);
        const auto flag_index = [&] { return static_cast<int64_t>(rank) * args.max_tokens + pos; };
        sender.send(args.peer_row_flags, dst, slot, at, flag_index, tag, lane);
      }
      sender.finish(lane);
      continue;
    }
    item -= num_push_items;

    if (item < num_own_items) {
      const int end = min(num_own, (item + 1) * kRowsPerItem);
      for (int pos = item * kRowsPerItem + warp; pos < end; pos += kTransferWarps) {
        const int token =
            __ldg(args.send_tokens + static_cast<int64_t>(rank) * args.max_tokens + pos);
        const OutputRow out = output_row(args, plan.recv_prefix[rank] + pos);
        warp_copy_vectors<true>(out.x,
                                reinterpret_cast<const int4*>(args.x + static_cast<int64_t>(token) *
                                                                           args.x_bytes_per_row),
                                args.x_bytes_per_row / kBytesPerVector, lane);
        write_row_aux(args, token, rank, out.scales, out.ids, out.weights, out.src, out.payload,
                      histogram, lane);
      }
      continue;
    }
    item -= num_own_items;

    if (item < num_pad_items) {
      const int end = min(capacity, num_valid + (item + 1) * kRowsPerItem);
      for (int row = num_valid + item * kRowsPerItem + warp; row < end; row += kTransferWarps) {
        const OutputRow out = output_row(args, row);
        warp_zero_vectors(out.x, args.x_bytes_per_row / kBytesPerVector, lane);
        for (int c = lane; c < args.num_scales; c += kWarpSize) out.scales[c] = 0.0f;
        if (lane < args.num_topk) {
          out.ids[lane] = -1;
          out.weights[lane] = 0.0f;
        }
        if (args.num_topk > 0 && lane == 0) *out.src = -1;
        for (int c = lane; c < args.num_payload; c += kWarpSize) out.payload[c] = 0.0f;
      }
      continue;
    }
    item -= num_pad_items;

    // Peer rows: round-major, then level-major, so blocks follow the order in which the peers
    // push.
    int round = 0;
    const RoundEntry at_item = round_entry(item_prefix, item, &round, rank, num_ranks);
    const int src = at_item.peer;
    const RoundSpan span = round_span(round_rows, round, plan.recv_prefix[src], recv_valid[src]);
    const int begin = span.lo + at_item.level * kRowsPerItem;
    const int end = min(span.hi, begin + kRowsPerItem);
    const int first = begin + warp;
    {
      // Lane j acquires the flag of this warp's j-th row of the item, all rows at once.
      const int pos = first + lane * kTransferWarps;
      if (lane < kRowsPerItem / kTransferWarps && pos < end) {
        wait_flag(args.wait, args.row_flags + static_cast<int64_t>(src) * args.max_tokens + pos,
                  tag, src);
      }
      __syncwarp();  // orders those acquires before every lane's loads of the rows
    }
    for (int pos = first; pos < end; pos += kTransferWarps) {
      const int64_t row = plan.recv_prefix[src] + pos;
      const int64_t slot = row < rounds.slots ? row : row % rounds.slots;
      const RegionRow region = region_row(args, const_cast<char*>(args.rows), slot);
      const OutputRow out = output_row(args, row);
      warp_copy_vectors<false>(out.x, reinterpret_cast<const int4*>(region.x),
                               args.x_bytes_per_row / kBytesPerVector, lane);
      for (int c = lane; c < args.num_scales; c += kWarpSize) {
        out.scales[c] = ld_cg_f32(region.scales + c);
      }
      if (lane < args.num_topk) {
        const int local = ld_cg_s32(region.ids + lane);
        out.ids[lane] = local;
        out.weights[lane] = ld_cg_f32(region.weights + lane);
        const bool first = first_lane_with(local, args.num_topk, lane);
        if (first && local >= 0 && local < args.num_local_experts) {
          count_local_expert(args, histogram, local);
        }
      }
      if (args.num_topk > 0 && lane == 0) *out.src = ld_cg_s32(region.src);
      for (int c = lane; c < args.num_payload; c += kWarpSize) {
        out.payload[c] = ld_cg_f32(region.payload + c);
      }
    }
    if (reuses) {
      count_finished(rounds, round, max(0, end - begin));
      if (warp == 0) {
        publish_finished_rounds(path, rounds, rank, num_ranks, credited_rounds, round_peer_rows,
                                tag, args.wait, lane);
      }
    }
  }

  __syncthreads();
  for (int e = tid; e < args.num_shared_experts; e += kTransferThreads) {
    if (histogram[e] != 0) atomicAdd(&args.num_recv_tokens_per_expert[e], histogram[e]);
  }
  finish_transfer_block(args.counters, kNormalCounterWords, args.seq, tag);
}

}  // namespace normal_dispatch
}  // namespace jax_ep
