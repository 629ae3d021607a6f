// Low-latency (decode) dispatch, jax_ep_low_latency_dispatch_v2: one copy of every (token, k)
// with a valid expert id lands in the block of that expert on the expert's rank, rows ordered by
// (source rank, source token, k). One cooperative launch of 512-thread blocks, at most one per SM
// (all SMs but kLowLatencyFreeSms by default: low_latency_grid_size).
// The same kernel body, compiled per LowLatencyHalves, also gives the split pair
// jax_ep_low_latency_dispatch_send_v2 (phases 0-4, then a ticket) and ..._recv_v2 (phases 5-6):
// see "Split" below.
//
// Per-rank words (layout in low_latency/layout.cuh, all double-buffered by call parity):
//   count word  [parity][e][s]  (tag << 32) | rows source s sends to local expert e. Published by
//               the last block of s at the very start of its launch (counts need only topk_idx),
//               so receivers know every output row position before any data arrives.
//   meta        [parity][e][s][slot] (token, k) of each row; a rank's own rows carry meta only
//               in the split pair (the fused op stores its own rows itself, phase 4b).
//   row flag    [parity][e][s][slot] (s remote) tag once that row, its scales and its meta landed.
//
// Phases of every block (W = all warps of the grid):
//   0. Each block owns an even share of the call's (token, k) pairs, [p0, p1) in (token, k)
//      order (low_latency/dispatch_send.cuh), and issues the asynchronous loads of its tokens'
//      x rows into shared memory (they fly during phases 1-2).
//   1. Block grid-1 histograms all of topk_idx and stores the count words at every rank.
//      Each block with pairs histograms the ids of the pairs before p0.
//   2. Warp 0 walks its pairs in order, 32 at a time: slot of (t, k) = rows of expert g from
//      pairs before it (histogram + running count; deterministic, no global atomics). It
//      remembers the destination row, meta and flag of remote pairs and the (expert, slot) of
//      own pairs (split send half: writes their local meta instead). Slots >= T_max (only
//      possible with duplicate ids) are dropped and counted in
//      ErrorCounters::dropped_low_latency_rows. Then the staged rows are complete (fp8: cast
//      to e4m3 in shared memory, scale per 128 channels, once per block and token).
//   3. Send (blocks with a remote pair): every remote pair's row is stored from shared memory
//      to its destination row, lanes on consecutive 16-byte vectors; the split send half's fp8
//      also stores each token's cast row to dispatch_own_rows (by the token's first own pair).
//   4. Release: block barrier; the thread of each remote pair stores its meta at the peer, fences
//      (.sys: every store of the block, ordered before it by the barrier, is then visible at the
//      peer) and stores the pair's row flag = tag there. No grid-wide counter, no last block.
//   4b. Fused op, blocks with an own pair: the block stores its own pairs' rows (from the same
//      staged rows) straight into recv_x / recv_scales, with recv_src / recv_k, at output row
//      (rows of lower ranks for that expert) + slot: it waits for the count words of the lower
//      ranks only (rank 0 never waits). So no receiving warp waits for a grid-wide "own meta
//      written" counter and loads a row's meta before its data, as the split receive half does.
//   5. Receive: every block waits for the count words of all (local expert, source) pairs and
//      builds the same plan in shared memory: the output rows of every source, and one
//      numbering of all receive rows, own rows first, then sources rank+1, rank+2, ... (mod R).
//      Units (row, chunk) go round-robin to all warps of the grid, whatever expert they belong
//      to (a skewed routing no longer piles one expert's rows onto its few warps): own rows
//      (split receive half only: bf16 copied from x, fp8 from the token's own row), then peer
//      rows: per row, wait for its flag, then copy rows, scales and meta from the region to the
//      outputs — so a row is copied out as soon as it lands, overlapping the transfer.
//      Then recv_count and the -1 fill of recv_src/recv_k past it, over all threads.
//      With few rows (T * K <= grid) the plan's block barriers cost more than they balance:
//      then warps w = e (mod E_loc) share expert e and wait only for its words (receive_expert).
//   6. The last block to finish advances the dispatch sequence word.
//
// Split (send launch = phases 0-4, receive launch = phases 5-6, same grid, one stream, no other
// split call of this op on this Buffer in between on this rank; fused calls may run in between:
// they use the other channel of the workspace, see low_latency/layout.cuh): both launches read
// the split channel's sequence word at their start and only phase 6 advances it, so both use the
// same tag and parity. The send launch never waits. The kernel boundary orders its own meta and
// own fp8 rows before every load of the receive launch, which copies the own rows (phase 5).
// Peer rows, meta, flags and count words are waited for exactly as in the fused launch (same
// bounded waits, phase "low-latency dispatch receive"). Phase 5 reads x for the bf16 own rows:
// the receive half takes x as an operand again.
//
// Memory ordering of a remote row: data stores (weak, every thread of the sending block) ->
// bar.sync -> the releasing thread's meta store -> fence.acq_rel.sys -> st.relaxed.sys flag
// (a release pattern; cumulative over the block's stores ordered before it by the barrier).
// Receiver: lane 0 ld.acquire.sys of the flag until it is >= tag -> __syncwarp -> ld.cg of the
// meta and the row (L2, never a stale L1 line).
//
// Parity safety: call n (per rank, counted by the sequence word, identical on all ranks because
// every rank runs the same calls in the same order) writes peers' words, meta, flags and rows of
// parity n % 2. A call is one fused launch or one send launch followed by its receive launch.
// Every call makes every rank wait for a count word that every other rank writes in that same
// call (phase 5 waits for every (e, s) word, by plan or by expert). So when a rank
// starts call n (phase 0), its call n-1 has finished phase 5 and seen every peer's call n-1
// count words, which each peer writes (phase 1) only after its call n-2 ended, phase 6 included
// (launches on one stream are serialised, and a split call's receive launch precedes the next
// call's first launch): all ranks have finished call n-2, the last user of parity n % 2. Row
// flags hold the full 64-bit tag and are waited with >=: a stale flag of call n-2 (or older: a
// slot may stay unused for many calls) is < n, and no rank can already hold a flag of call n+2.
// Count words are rewritten every call, so comparing their low 32 bits is safe for the same
// reason. The argument holds per channel (fused calls; split pairs), each channel with its own
// sequence words and regions. In the split channel a call is a send launch and its receive
// launch: two sends of this op without the first one's receive between them would reuse one tag
// and parity (XLA keeps the order only through data dependences: jax_ep/_ordering.py chains the
// split calls of one trace).
// Dispatch and combine keep separate sequence words and separate regions: the argument above
// then involves only the op's own call history, whatever the interleaving of dispatches and
// combines (forward, backward, dispatch-only programs).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/copy.cuh"
#include "common/fast_divisor.h"
#include "common/fp8_cast.cuh"
#include "common/launch.h"
#include "common/limits.h"
#include "common/phase_timeline.cuh"
#include "common/sync.cuh"
#include "kernels/api.h"
#include "kernels/low_latency/common.cuh"
#include "kernels/low_latency/dispatch_args.cuh"
#include "kernels/low_latency/dispatch_send.cuh"
#include "kernels/low_latency/layout.cuh"
#include "kernels/preload.h"

namespace jax_ep::ll_dispatch {
namespace {

// Moves vectors [v0, v_end) (lane-strided, at most 2 * kRecvPiecesPerLane per lane) from src to
// dst. kSourceIsInput: src is an XLA operand (x), else the region a peer wrote (ld.cg).
template <bool kSourceIsInput>
__device__ __forceinline__ void copy_unit_vectors(int4* dst, const int4* src, int v0, int v_end,
                                                  int lane) {
  constexpr int kVecsPerLane = 2 * kRecvPiecesPerLane;
  int4 v[kVecsPerLane];
#pragma unroll
  for (int m = 0; m < kVecsPerLane; ++m) {
    const int idx = v0 + m * kWarpSize + lane;
    v[m] = make_int4(0, 0, 0, 0);
    if (idx < v_end) v[m] = kSourceIsInput ? ld_nc_v4(src + idx) : ld_cg_v4(src + idx);
  }
#pragma unroll
  for (int m = 0; m < kVecsPerLane; ++m) {
    const int idx = v0 + m * kWarpSize + lane;
    if (idx < v_end) st_v4(dst + idx, v[m]);
  }
}

// Own row, bf16: copy token `token` of x to output row `row_index`, pieces [piece0, piece_end)
// (at most kRecvPiecesPerUnit). Whole warp, uniform arguments.
__device__ __forceinline__ void copy_own_bf16_row(const DispatchArgs& args, int token,
                                                  size_t row_index, int piece0, int piece_end,
                                                  int lane) {
  const int hidden = args.rank.layout.hidden;
  const int4* src = reinterpret_cast<const int4*>(args.x + static_cast<size_t>(token) * hidden);
  auto* dst =
      reinterpret_cast<int4*>(static_cast<__nv_bfloat16*>(args.recv_x) + row_index * hidden);
  copy_unit_vectors<true>(dst, src, 2 * piece0, 2 * piece_end, lane);
}

// Region row: copy pieces [piece0, piece_end) of a row of the region (and its scales) to output
// row `row_index`: a row a peer sent, or (fp8) this rank's own token cast by the send half. The
// data was written during this launch or the send launch, by other SMs: L2 loads (ld.cg).
template <bool kUseFp8>
__device__ __forceinline__ void copy_region_row(const DispatchArgs& args, const char* src_row,
                                                size_t row_index, int piece0, int piece_end,
                                                int lane) {
  const int hidden = args.rank.layout.hidden;
  if constexpr (kUseFp8) {
    const int4* src = reinterpret_cast<const int4*>(src_row);
    const float* src_scales = reinterpret_cast<const float*>(src_row + hidden);
    int4 v[kRecvPiecesPerLane];
    float scale[kRecvPiecesPerLane];
#pragma unroll
    for (int m = 0; m < kRecvPiecesPerLane; ++m) {
      const int piece = piece0 + m * kWarpSize + lane;
      v[m] = make_int4(0, 0, 0, 0);
      scale[m] = 0.0f;
      if (piece < piece_end) {
        v[m] = ld_cg_v4(src + piece);
        if (piece % kFp8PiecesPerScale == 0) scale[m] = ld_cg_f32(src_scales + piece / 8);
      }
    }
    auto* dst = reinterpret_cast<int4*>(static_cast<uint8_t*>(args.recv_x) + row_index * hidden);
    float* dst_scales = args.recv_scales + row_index * (hidden / kChannelsPerScale);
#pragma unroll
    for (int m = 0; m < kRecvPiecesPerLane; ++m) {
      const int piece = piece0 + m * kWarpSize + lane;
      if (piece < piece_end) {
        st_v4(dst + piece, v[m]);
        if (piece % kFp8PiecesPerScale == 0) dst_scales[piece / kFp8PiecesPerScale] = scale[m];
      }
    }
  } else {
    auto* dst =
        reinterpret_cast<int4*>(static_cast<__nv_bfloat16*>(args.recv_x) + row_index * hidden);
    copy_unit_vectors<false>(dst, reinterpret_cast<const int4*>(src_row), 2 * piece0, 2 * piece_end,
                             lane);
  }
}

// One receive work unit: pieces [chunk * chunk_pieces, +chunk_pieces) of the row of (local
// expert, source, slot), written to output row `out_row` of the expert's block (own rows, split
// receive half only: from x, or the fp8 row the send half cast; peer rows: from the region once
// their flag has the tag), and at chunk 0 its recv_src / recv_k. Whole warp, uniform arguments.
// The own meta and own fp8 rows were written by the send launch: the kernel boundary orders them
// before this launch.
template <bool kUseFp8>
__device__ __forceinline__ void receive_unit(const DispatchArgs& args, int expert, int src,
                                             int slot, int out_row, int chunk, uint64_t tag,
                                             int parity) {
  const LowLatencyRank& rk = args.rank;
  const LowLatencyLayout& layout = rk.layout;
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int me = rk.rank;
  const int max_tokens = layout.max_tokens;
  const int rows_per_expert = layout.num_ranks * max_tokens;
  const RowChunks& chunks = args.chunks;
  const int2* meta_base = reinterpret_cast<const int2*>(rk.local + layout.dispatch_meta);
  const uint64_t* flag_base =
      reinterpret_cast<const uint64_t*>(rk.local + layout.dispatch_row_flags);
  const size_t meta_index = layout.dispatch_meta_index(parity, expert, src, slot);
  const int2* meta = meta_base + meta_index;
  const size_t row_index = static_cast<size_t>(expert) * rows_per_expert + out_row;
  const int piece0 = chunk * chunks.chunk_pieces;
  const int piece_end = min(chunks.pieces, piece0 + chunks.chunk_pieces);
  if (src == me) {
    const int token = ld_cg_s32(&meta->x);
    const int k = ld_cg_s32(&meta->y);
    if (chunk == 0 && lane == 0) {
      args.recv_src[row_index] = src * max_tokens + token;
      args.recv_k[row_index] = k;
    }
    if (token < 0 || token >= args.num_tokens) return;  // guards x; not for well-formed meta
    if constexpr (kUseFp8) {
      copy_region_row<true>(args, rk.local + layout.dispatch_own_row_offset(token), row_index,
                            piece0, piece_end, lane);
    } else {
      copy_own_bf16_row(args, token, row_index, piece0, piece_end, lane);
    }
  } else {
    if (lane == 0) {
      wait_flag_at_least(flag_base + meta_index, tag, rk.timeout_ns, rk.timeout_record, me, src,
                         WaitPhase::kLowLatencyDispatchRecv);
    }
    __syncwarp();  // lane 0's acquire orders the whole warp's loads below
    int token = 0, k = 0;
    if (chunk == 0 && lane == 0) {  // issued before the row loads, consumed after them
      token = ld_cg_s32(&meta->x);
      k = ld_cg_s32(&meta->y);
    }
    const char* src_row = rk.local + layout.dispatch_row_offset(parity, expert, src, me, slot);
    copy_region_row<kUseFp8>(args, src_row, row_index, piece0, piece_end, lane);
    if (chunk == 0 && lane == 0) {
      args.recv_src[row_index] = src * max_tokens + token;
      args.recv_k[row_index] = k;
    }
  }
}

// Phase 5's plan, in shared memory; every block builds the same one. Pairs (p, e): source
// order p (source (rank + p) % R, own rows first) and local expert e, flattened p-major as
// i = p * E_loc + e. All receive rows are numbered in that order, so that the work units
// (row, chunk) of every expert and source can be spread evenly over all warps of the grid.
struct ReceivePlan {
  int* counts;       // [E_loc * R] rows of local expert e from source s, at e * R + s
  int* first_row;    // [E_loc * R] output row (within expert e's block) of source s's slot 0
  int* row_begin;    // [R * E_loc + 1] receive rows before pair i (exclusive prefix; last: total)
  int* expert_rows;  // [E_loc] rows of local expert e from all sources (its recv_count)
  int* scratch;      // [kLowLatencyWarps] the block scan's warp totals
};

// E_loc <= E: the expert totals fit in a fourth array of E ints.
__host__ __device__ constexpr size_t receive_plan_bytes(int num_experts) {
  return (4 * static_cast<size_t>(num_experts) + 1 + kLowLatencyWarps) * sizeof(int);
}

__device__ __forceinline__ ReceivePlan receive_plan_at(unsigned char* base, int num_pairs) {
  int* ints = reinterpret_cast<int*>(base);
  return {ints, ints + num_pairs, ints + 2 * num_pairs, ints + 3 * num_pairs + 1,
          ints + 4 * num_pairs + 1};
}

// Rows of pair i (source order p, expert e) of the plan.
__device__ __forceinline__ int plan_pair_rows(const ReceivePlan& plan, int i, int num_local,
                                              int num_ranks, int me) {
  const int p = i / num_local;
  const int expert = i - p * num_local;
  return plan.counts[expert * num_ranks + (me + p) % num_ranks];
}

// Phase 5, first part (whole block): waits for the count word of every (local expert, source),
// then fills `plan`. Ends with a block barrier.
__device__ __forceinline__ void build_receive_plan(const DispatchArgs& args,
                                                   const ReceivePlan& plan, uint64_t tag,
                                                   int parity) {
  const LowLatencyRank& rk = args.rank;
  const LowLatencyLayout& layout = rk.layout;
  const int num_ranks = layout.num_ranks;
  const int num_local = layout.num_local_experts;
  const int num_pairs = num_local * num_ranks;
  const int me = rk.rank;
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid % kWarpSize;
  const int warp = tid / kWarpSize;
  const uint64_t* words = reinterpret_cast<const uint64_t*>(rk.local + layout.dispatch_counts);
  for (int g = tid; g < num_pairs; g += blockDim.x) {  // g = e * R + s
    const int expert = g / num_ranks;
    const int src = g - expert * num_ranks;
    const uint32_t value = wait_tagged_count(
        words + layout.dispatch_count_index(parity, expert, src), tag, rk.timeout_ns,
        rk.timeout_record, me, src, WaitPhase::kLowLatencyDispatchRecv);
    plan.counts[g] = static_cast<int>(min(value, static_cast<uint32_t>(layout.max_tokens)));
  }
  __syncthreads();
  for (int expert = tid; expert < num_local; expert += blockDim.x) {
    int running = 0;
    for (int src = 0; src < num_ranks; ++src) {  // source-ascending order within the expert
      plan.first_row[expert * num_ranks + src] = running;
      running += plan.counts[expert * num_ranks + src];
    }
    plan.expert_rows[expert] = running;
  }
  // Exclusive prefix of the pairs' rows: thread t sums pairs [t * per, (t + 1) * per).
  const int per = ceil_div(num_pairs, static_cast<int>(blockDim.x));
  const int i0 = min(num_pairs, tid * per);
  const int i1 = min(num_pairs, i0 + per);
  int mine = 0;
  for (int i = i0; i < i1; ++i) mine += plan_pair_rows(plan, i, num_local, num_ranks, me);
  const int inclusive = warp_inclusive_sum(mine, lane);
  if (lane == kWarpSize - 1) plan.scratch[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {
    const int total = lane < kLowLatencyWarps ? plan.scratch[lane] : 0;
    const int scanned = warp_inclusive_sum(total, lane);
    __syncwarp();
    if (lane < kLowLatencyWarps) plan.scratch[lane] = scanned - total;  // exclusive
  }
  __syncthreads();
  int running = plan.scratch[warp] + inclusive - mine;
  for (int i = i0; i < i1; ++i) {
    plan.row_begin[i] = running;
    running += plan_pair_rows(plan, i, num_local, num_ranks, me);
  }
  if (tid == static_cast<int>(blockDim.x) - 1) plan.row_begin[num_pairs] = running;
  __syncthreads();
}

// The pair i of the plan that holds receive row `row` (< the total): the last i with
// row_begin[i] <= row (that pair is never empty). Warp-uniform.
__device__ __forceinline__ int plan_pair_of_row(const ReceivePlan& plan, int num_pairs, int row) {
  int lo = 0, hi = num_pairs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (plan.row_begin[mid] <= row) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// Phase 5, second part: the work units (row, chunk of <= kRecvPiecesPerUnit pieces) of every
// local expert and source, in the plan's row order, go round-robin to all W warps of the grid:
// unit u to warp u % W, consecutive units to the warps of one block, blocks counted from the
// first one that had no tokens to send. So own rows (split receive half) come first everywhere,
// and no warp holds more than ceil(units / W), whatever the skew of the routing (EP=1 on one
// H200, T=128 fp8, before the own fp8 rows: 17.0 us; 19.1 with consecutive units on different
// blocks). kOwnRowsPushed (fused op): the send half already stored the own rows (phase 4b), so
// the units start after them. Then recv_count and the -1 fill of recv_src / recv_k past it,
// spread the same way.
template <bool kUseFp8, bool kOwnRowsPushed>
__device__ __forceinline__ void receive_by_plan(const DispatchArgs& args, const ReceivePlan& plan,
                                                uint64_t tag, int parity) {
  const LowLatencyLayout& layout = args.rank.layout;
  const int num_ranks = layout.num_ranks;
  const int num_local = layout.num_local_experts;
  const int num_pairs = num_local * num_ranks;
  const int me = args.rank.rank;
  const int rows_per_expert = num_ranks * layout.max_tokens;
  const int num_warps = static_cast<int>(gridDim.x) * kLowLatencyWarps;
  // Blocks are counted from the first one without pairs (blocks [0, that) spent the send half
  // on their pairs), so the first units go to blocks that are idle by then.
  const int first_idle_block =
      min(static_cast<int>(gridDim.x),
          ceil_div(args.num_tokens * layout.num_topk, args.pairs_per_block));
  const int block_order =
      (static_cast<int>(blockIdx.x) - first_idle_block + static_cast<int>(gridDim.x)) %
      static_cast<int>(gridDim.x);
  const int first_unit = block_order * kLowLatencyWarps + static_cast<int>(threadIdx.x) / kWarpSize;
  const int num_chunks = args.chunks.num_chunks;
  const int unit_end = plan.row_begin[num_pairs] * num_chunks;
  const int own_units = kOwnRowsPushed ? plan.row_begin[num_local] * num_chunks : 0;

  for (int unit = own_units + first_unit; unit < unit_end; unit += num_warps) {
    const int row = static_cast<int>(args.by_chunks.divide(static_cast<uint32_t>(unit)));
    const int chunk = unit - row * num_chunks;
    const int pair = plan_pair_of_row(plan, num_pairs, row);
    const int p = static_cast<int>(args.by_local_experts.divide(static_cast<uint32_t>(pair)));
    const int expert = pair - p * num_local;
    const int src = me + p < num_ranks ? me + p : me + p - num_ranks;  // (me + p) % R
    const int slot = row - plan.row_begin[pair];
    const int out_row = plan.first_row[expert * num_ranks + src] + slot;
    receive_unit<kUseFp8>(args, expert, src, slot, out_row, chunk, tag, parity);
  }

  // recv_count, and -1 past it: entries (e, row) of [E_loc][R * T_max] over all threads.
  const int thread = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  const int num_threads = static_cast<int>(gridDim.x * blockDim.x);
  if (thread < num_local) args.recv_count[thread] = plan.expert_rows[thread];
  const int entries = num_local * rows_per_expert;  // E * T_max: far below 2^31
  for (int entry = thread; entry < entries; entry += num_threads) {
    const int expert =
        static_cast<int>(args.by_rows_per_expert.divide(static_cast<uint32_t>(entry)));
    const int row = entry - expert * rows_per_expert;
    if (row >= plan.expert_rows[expert]) {
      args.recv_src[entry] = -1;
      args.recv_k[entry] = -1;
    }
  }
}

// Phase 5 for few rows (T * K <= grid size, e.g. T=1): warps w = e (mod E_loc) share local
// expert e, wait only for e's R count words and need no block barrier, which the plan's
// construction costs (EP=1 on one H200, T=1 fp8, before the own fp8 rows: 5.4 us this way, 6.7 us
// by plan). With more rows the plan wins (T=16: 8.4 vs 9.3 us; T=128: 17.0 vs 21.2): here the
// busiest expert's few warps would do all its rows. This warp is number `sharer` of `num_sharers`
// on `expert`; units in the order own rows first (kOwnRowsPushed, fused op: none, the send half
// stored them), then sources rank+1, rank+2, ... (mod R).
template <bool kUseFp8, bool kOwnRowsPushed>
__device__ __forceinline__ void receive_expert(const DispatchArgs& args, int expert, int sharer,
                                               int num_sharers, uint64_t tag, int parity) {
  const LowLatencyRank& rk = args.rank;
  const LowLatencyLayout& layout = rk.layout;
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int num_ranks = layout.num_ranks;
  const int me = rk.rank;
  const int max_tokens = layout.max_tokens;
  const int rows_per_expert = num_ranks * max_tokens;

  // Rows of this expert from each source (lane s): present from the start of s's launch.
  int count = 0;
  if (lane < num_ranks) {
    const uint64_t* word = reinterpret_cast<const uint64_t*>(rk.local + layout.dispatch_counts) +
                           layout.dispatch_count_index(parity, expert, lane);
    const uint32_t value = wait_tagged_count(word, tag, rk.timeout_ns, rk.timeout_record, me, lane,
                                             WaitPhase::kLowLatencyDispatchRecv);
    count = static_cast<int>(min(value, static_cast<uint32_t>(max_tokens)));
  }
  const int inclusive = warp_inclusive_sum(count, lane);
  const int first_row = inclusive - count;  // output row of source `lane`'s slot 0
  const int total = __shfl_sync(kFullMask, inclusive, num_ranks - 1);
  // Work order: lane p describes source (me + p) % R; lanes >= R hold count 0.
  const int order_src = lane < num_ranks ? (me + lane) % num_ranks : lane;
  const int order_count = __shfl_sync(kFullMask, count, order_src);
  const int order_first_row = __shfl_sync(kFullMask, first_row, order_src);
  const int order_begin = warp_inclusive_sum(order_count, lane) - order_count;

  const int num_chunks = args.chunks.num_chunks;
  const int own_units = kOwnRowsPushed ? __shfl_sync(kFullMask, order_count, 0) * num_chunks : 0;
  for (int unit = own_units + sharer; unit < total * num_chunks; unit += num_sharers) {
    const int order_row = static_cast<int>(args.by_chunks.divide(static_cast<uint32_t>(unit)));
    const int chunk = unit - order_row * num_chunks;
    const int pos =
        __popc(__ballot_sync(kFullMask, lane < num_ranks && order_begin <= order_row)) - 1;
    const int slot = order_row - __shfl_sync(kFullMask, order_begin, pos);
    const int out_row = __shfl_sync(kFullMask, order_first_row, pos) + slot;
    receive_unit<kUseFp8>(args, expert, (me + pos) % num_ranks, slot, out_row, chunk, tag, parity);
  }

  if (sharer == 0 && lane == 0) args.recv_count[expert] = total;
  const size_t expert_row0 = static_cast<size_t>(expert) * rows_per_expert;
  for (int row = total + sharer * kWarpSize + lane; row < rows_per_expert;
       row += num_sharers * kWarpSize) {
    args.recv_src[expert_row0 + row] = -1;
    args.recv_k[expert_row0 + row] = -1;
  }
}

// Phase 5 by expert for every expert of this warp: warps w = e (mod E_loc) share expert e; with
// fewer warps than experts each warp takes experts w, w + W, ...
template <bool kUseFp8, bool kOwnRowsPushed>
__device__ __forceinline__ void receive_by_expert(const DispatchArgs& args, uint64_t tag,
                                                  int parity) {
  const int num_experts_local = args.rank.layout.num_local_experts;
  const int num_warps = static_cast<int>(gridDim.x) * kLowLatencyWarps;
  const int warp =
      static_cast<int>(blockIdx.x) * kLowLatencyWarps + static_cast<int>(threadIdx.x) / kWarpSize;
  if (num_warps >= num_experts_local) {
    const int expert = warp % num_experts_local;
    const int sharers = (num_warps - 1 - expert) / num_experts_local + 1;
    receive_expert<kUseFp8, kOwnRowsPushed>(args, expert, warp / num_experts_local, sharers, tag,
                                            parity);
  } else {
    for (int expert = warp; expert < num_experts_local; expert += num_warps) {
      receive_expert<kUseFp8, kOwnRowsPushed>(args, expert, 0, 1, tag, parity);
    }
  }
}

// Grid: low_latency_grid_size blocks (cooperative, at most one per SM; by default all SMs but
// kLowLatencyFreeSms), kLowLatencyThreads threads. kHalves picks the phases:
// kBoth (fused op) runs 0-6; kSend runs 0-4 and stores the ticket; kRecv runs 5-6. The send
// launch and the receive launch of one call read the same sequence word (only phase 6
// advances it), hence the same tag and parity. Dynamic shared memory: the send half's
// (carve_send_smem; not for kRecv), then phase 5's ReceivePlan (not for kSend).
template <bool kUseFp8, LowLatencyHalves kHalves>
__global__ void __launch_bounds__(kLowLatencyThreads, 1)
    low_latency_dispatch_kernel(const __grid_constant__ DispatchArgs args) {
  LowLatencyControl* control = low_latency_control(args.rank);
  const uint64_t seq = ld_volatile_u64(&control->dispatch_seq);
  const uint64_t tag = seq + 1;
  const int parity = static_cast<int>(seq & 1);
  timeline_begin();

  extern __shared__ __align__(16) unsigned char smem[];
  // Phases 0-4 (fused op: and 4b).
  if constexpr (runs_send_half(kHalves)) {
    send_half<kUseFp8, kHalves == LowLatencyHalves::kBoth>(args, smem, tag, parity);
  }

  if constexpr (runs_recv_half(kHalves)) {
    // Phase 5: the plan (after the send half's shared memory), own rows (split receive half
    // only), then peer rows as they land; recv_count, -1 fill.
    const size_t plan_offset =
        runs_send_half(kHalves)
            ? carve_send_smem(nullptr, args.pairs_per_block, args.rank.layout.num_topk,
                              args.num_experts, args.stage_tokens, args.rank.layout.hidden, kUseFp8)
                  .bytes
            : 0;
    // receive_expert gives each source a lane: groups of at most kWarpSize ranks.
    if (args.num_tokens * args.rank.layout.num_topk <= static_cast<int>(gridDim.x) &&
        args.rank.layout.num_ranks <= kWarpSize) {
      receive_by_expert<kUseFp8, runs_send_half(kHalves)>(args, tag, parity);
    } else {
      const ReceivePlan plan = receive_plan_at(smem + plan_offset, args.num_experts);
      build_receive_plan(args, plan, tag, parity);
      timeline_mark(5);
      receive_by_plan<kUseFp8, runs_send_half(kHalves)>(args, plan, tag, parity);
    }
    timeline_mark(6);
    // Phase 6.
    finish_launch(&control->dispatch_blocks_done, &control->dispatch_seq, seq);
  } else {
    store_ticket(args.ticket, tag);
  }
  timeline_mark(7);
  timeline_print(kUseFp8 ? "ll_dispatch_fp8" : "ll_dispatch_bf16", static_cast<int>(kHalves));
}

// Launches the phases kHalves of one dispatch call.
template <LowLatencyHalves kHalves>
cudaError_t launch_dispatch_halves(const RankContext& ctx, const LowLatencyDispatchParams& params,
                                   cudaStream_t stream) {
  int num_blocks = 0;
  cudaError_t err = low_latency_grid_size(ctx, &num_blocks);
  if (err != cudaSuccess) return err;

  DispatchArgs args = {};
  args.rank = make_low_latency_rank(ctx, kHalves);
  args.x = static_cast<const __nv_bfloat16*>(params.x);
  args.topk_idx = params.topk_idx;
  args.recv_x = params.recv_x;
  args.recv_scales = params.recv_scales;
  args.recv_count = params.recv_count;
  args.recv_src = params.recv_src;
  args.recv_k = params.recv_k;
  args.num_tokens = params.num_tokens;
  args.num_experts = ctx.config.num_experts;
  const int num_pairs = params.num_tokens * ctx.config.num_topk;
  args.pairs_per_block = num_pairs > 0 ? ceil_div(num_pairs, num_blocks) : 1;
  args.stage_tokens =
      send_stage_tokens(args.pairs_per_block, ctx.config.num_topk, ctx.config.hidden);
  args.round_scale = params.round_scale;
  args.ticket = params.ticket;
  args.chunks = row_chunks(ctx.config.hidden);
  args.by_chunks = FastDivisor(static_cast<uint32_t>(args.chunks.num_chunks));
  args.by_local_experts = FastDivisor(static_cast<uint32_t>(ctx.config.num_local_experts()));
  args.by_rows_per_expert =
      FastDivisor(static_cast<uint32_t>(ctx.config.num_ranks * ctx.config.max_tokens_per_rank));

  const size_t smem_bytes =
      (runs_send_half(kHalves)
           ? carve_send_smem(nullptr, args.pairs_per_block, ctx.config.num_topk, args.num_experts,
                             args.stage_tokens, ctx.config.hidden, params.use_fp8)
                 .bytes
           : 0) +
      (runs_recv_half(kHalves) ? receive_plan_bytes(args.num_experts) : 0);
  return params.use_fp8 ? launch_low_latency_kernel(low_latency_dispatch_kernel<true, kHalves>,
                                                    num_blocks, smem_bytes, stream, args)
                        : launch_low_latency_kernel(low_latency_dispatch_kernel<false, kHalves>,
                                                    num_blocks, smem_bytes, stream, args);
}

template <LowLatencyHalves kHalves>
cudaError_t preload_dispatch_halves() {
  cudaFuncAttributes attributes;
  const cudaError_t err =
      cudaFuncGetAttributes(&attributes, low_latency_dispatch_kernel<true, kHalves>);
  if (err != cudaSuccess) return err;
  return cudaFuncGetAttributes(&attributes, low_latency_dispatch_kernel<false, kHalves>);
}

}  // namespace
}  // namespace jax_ep::ll_dispatch

namespace jax_ep {

using ll_dispatch::launch_dispatch_halves;
using ll_dispatch::preload_dispatch_halves;

size_t low_latency_workspace_bytes(const BufferConfig& config) {
  return config.low_latency ? kLowLatencyNumChannels * make_low_latency_layout(config).total_bytes
                            : 0;
}

cudaError_t launch_low_latency_dispatch(const RankContext& ctx,
                                        const LowLatencyDispatchParams& params,
                                        LowLatencyHalves halves, cudaStream_t stream) {
  return launch_low_latency_op(
      ctx, halves, [&] { return launch_low_latency_dispatch_put(ctx, params, halves, stream); },
      [&](auto h) { return launch_dispatch_halves<decltype(h)::value>(ctx, params, stream); });
}

cudaError_t preload_low_latency_dispatch_kernels() {
  return preload_every_halves([](auto h) { return preload_dispatch_halves<decltype(h)::value>(); });
}

}  // namespace jax_ep
