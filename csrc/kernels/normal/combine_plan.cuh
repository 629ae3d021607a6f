// The normal-mode combine's plan kernel (launcher: combine.cu), templated on the path by which it
// crosses ranks (normal/put_path.cuh). In a header so that the NVSHMEM plugin
// (plugins/nvshmem_transport_kernels.cu) instantiates it with its transport, as combine.cu does
// with the others.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/limits.h"
#include "common/peer_field.cuh"
#include "common/sync.cuh"
#include "kernels/normal/put_path.cuh"
#include "kernels/normal/windows.h"
#include "kernels/normal/workspace.h"

namespace jax_ep {
namespace normal_combine {

// One block; its warps take the owner segment bounds (R + 1 of them) in turn.
constexpr int kCombinePlanThreads = 512;
constexpr int kCombinePlanWarps = kCombinePlanThreads / kWarpSize;
// Dynamic shared memory: the R + 1 segment bounds, then the levels of the rounds.
inline size_t combine_plan_shared_bytes(int num_ranks) {
  return sizeof(int) * (static_cast<size_t>(num_ranks) + 1 + kNormalMaxRounds);
}
// Entries of round_bounds per owner.
constexpr int kRoundBoundsStride = kNormalMaxRounds + 1;

struct CombinePlanArgs {
  const int32_t* recv_src;         // [C]
  const int32_t* num_recv_tokens;  // []
  int num_tokens;
  int capacity;
  int num_ranks;
  int rank;
  const uint64_t* seq;
  int32_t* plan_words;               // NormalPlan::at(plan_words, R)
  int64_t round_rows;                // tokens of a round (NormalWindow of the call)
  int num_rounds;                    // > 1: fill round_bounds and round_levels
  int32_t* round_bounds;             // [R][kRoundBoundsStride]
  int32_t* round_levels;             // [kNormalMaxRounds]
  const uint64_t* barrier;           // this rank's barrier words [src]
  PeerField<uint64_t> peer_barrier;  // every rank's barrier words
  WaitContext wait;
  NormalTransportArgs transport;  // a transport path's (last: the stores path never reads it)
};

// First index i in [0, n] with values[i] >= key, for ascending `values`, by the whole warp: each
// round samples 32 evenly spaced entries and keeps the gap holding the bound (a 32-ary search:
// 3 dependent loads for 32k rows). Unsorted input gives some index in [0, n], never an access
// outside [0, n).
__device__ __forceinline__ int warp_lower_bound(const int32_t* values, int n, int key, int lane) {
  int lo = 0;
  int hi = n;
  while (hi > lo) {
    const int span = hi - lo;
    if (span <= kWarpSize) {
      const bool less = lane < span && __ldg(values + lo + lane) < key;
      return lo + __popc(__ballot_sync(0xffffffffu, less));
    }
    const int stride = (span + kWarpSize - 1) / kWarpSize;
    const int at = lo + lane * stride;
    const bool less = at < hi && __ldg(values + at) < key;
    const int num_less = __popc(__ballot_sync(0xffffffffu, less));
    const int new_lo = num_less > 0 ? lo + (num_less - 1) * stride + 1 : lo;
    hi = min(hi, lo + num_less * stride);
    lo = new_lo;
  }
  return lo;
}

// The rows of y by (owner, round) for a combine of several rounds: round_bounds[o][k] = first
// row (of the num_valid rows, sorted by owner * T + token) whose key (o, token / round_rows) is
// (o, k) or later, for k <= num_rounds; round_levels[k] = most rows of one owner (this rank
// excluded) in round k. Row i writes every key after row i - 1's up to its own, so each key is
// written once, in one pass over the rows. Keys of unsorted input are clamped, never written
// outside the table; the transfer kernel clamps what it reads to the owner's segment.
__device__ __forceinline__ void fill_round_bounds(const CombinePlanArgs& args, int num_valid,
                                                  int* levels) {
  const int num_keys = args.num_ranks * kRoundBoundsStride;
  const int64_t num_tokens = args.num_tokens;
  const auto key_of = [&](int row) {
    const int64_t src = __ldg(args.recv_src + row);
    const int64_t owner = src >= 0 ? src / num_tokens : 0;
    const int64_t key = owner * kRoundBoundsStride + (src - owner * num_tokens) / args.round_rows;
    return static_cast<int>(key < 0 ? 0 : (key > num_keys ? num_keys : key));
  };
  for (int i = threadIdx.x; i <= num_valid; i += kCombinePlanThreads) {
    const int previous = i == 0 ? -1 : key_of(i - 1);
    const int key = i == num_valid ? num_keys : key_of(i);
    for (int f = previous + 1; f <= key && f < num_keys; ++f) args.round_bounds[f] = i;
  }
  for (int k = threadIdx.x; k < kNormalMaxRounds; k += kCombinePlanThreads) levels[k] = 0;
  __syncthreads();
  for (int i = threadIdx.x; i < args.num_ranks * args.num_rounds; i += kCombinePlanThreads) {
    const int owner = i / args.num_rounds;
    const int k = i % args.num_rounds;
    if (owner == args.rank) continue;
    const int32_t* bounds = args.round_bounds + owner * kRoundBoundsStride;
    atomicMax(levels + k, max(0, bounds[k + 1] - bounds[k]));
  }
  __syncthreads();
  for (int k = threadIdx.x; k < args.num_rounds; k += kCombinePlanThreads) {
    args.round_levels[k] = levels[k];
  }
}

// Role: entry barrier of a combine and the owner segments of y. One block of
// kCombinePlanThreads: thread r (and r + threads, ...) release-stores the tag into rank r's
// barrier word [rank]; warp s (and s + warps, ...) finds the first row whose recv_src >= s * T
// (rows of owner s are [bound[s], bound[s+1]), s <= R); with several rounds the block fills
// the rows by (owner, round) (fill_round_bounds); then thread r waits for rank r's barrier word
// (>= tag).
// Synchronisation: as the dispatch count exchange, a rank enters only after its previous call
// finished, so after the barrier every peer is done with its data region and row flags.
// Over a transport (Path a TransportPath), warp 0 signals the words instead (kSet, the tag),
// this rank's own included: every rank waits for all R words.
template <typename Path>
__global__ void __launch_bounds__(kCombinePlanThreads, 1)
    combine_plan_kernel(const CombinePlanArgs args) {
  const Path path = PathOf<Path>::of(args.transport);
  extern __shared__ int bounds[];  // [R + 1], then [kNormalMaxRounds] levels
  const int tid = threadIdx.x;
  const int lane = tid % kWarpSize;
  const int warp = tid / kWarpSize;
  const int num_ranks = args.num_ranks;
  const uint64_t tag = *reinterpret_cast<const volatile uint64_t*>(args.seq) + 1;
  const NormalPlan plan = NormalPlan::at(args.plan_words, num_ranks);

  if constexpr (is_stores_path<Path>) {
    for (int r = tid; r < num_ranks; r += kCombinePlanThreads) {
      st_release_sys(args.peer_barrier[r] + args.rank, tag);
    }
  } else if (warp == 0) {
    auto t = make_normal_transport(path, args.rank, 0, args.wait);
    const size_t word = path.args.layout.barrier + sizeof(uint64_t) * args.rank;
    for (int peer = 0; peer < num_ranks; ++peer) {
      t.signal(peer, in_normal_area(word), tag, transport::SignalOp::kSet, lane);
    }
  }

  const int num_valid = max(0, min(__ldg(args.num_recv_tokens), args.capacity));
  for (int s = warp; s <= num_ranks; s += kCombinePlanWarps) {
    const int bound = warp_lower_bound(args.recv_src, num_valid, s * args.num_tokens, lane);
    if (lane == 0) bounds[s] = bound;
  }
  __syncthreads();
  for (int r = tid; r < num_ranks; r += kCombinePlanThreads) {
    plan.recv_prefix[r] = bounds[r];
    plan.recv_count[r] = max(0, bounds[r + 1] - bounds[r]);
  }
  if (tid == 0) *plan.num_recv = num_valid;
  if (args.num_rounds > 1) fill_round_bounds(args, num_valid, bounds + num_ranks + 1);

  for (int r = tid; r < num_ranks; r += kCombinePlanThreads) {
    wait_flag(args.wait, args.barrier + r, tag, r);
  }
}

}  // namespace normal_combine
}  // namespace jax_ep
