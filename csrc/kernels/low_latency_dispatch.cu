// Low-latency (decode) dispatch, jax_ep_low_latency_dispatch_v1: one copy of every (token, k)
// with a valid expert id lands in the block of that expert on the expert's rank, rows ordered by
// (source rank, source token, k). One cooperative launch, one block of 512 threads per SM.
//
// Per-rank words (layout in low_latency_layout.cuh, all double-buffered by call parity):
//   count word  [parity][e][s]  (tag << 32) | rows source s sends to local expert e. Published by
//               the last block of s at the very start of its launch (counts need only topk_idx),
//               so receivers know every output row position before any data arrives.
//   flag word   [parity][s]     tag once all rows and meta from source s are written here.
//   meta        [parity][e][s][slot] (token, k) of each row; a rank's own rows carry meta only:
//               its receiver reads them from x directly (no round trip through the region).
//
// Phases of every block (W = all warps of the grid):
//   1. Block grid-1 histograms all of topk_idx and stores the count words at every rank.
//      Each block with tokens (a contiguous range [t0, t1)) histograms the ids of tokens < t0.
//   2. Warp 0 walks its tokens in order: slot of (t, k) = rows of expert g from tokens < t
//      (histogram + running count; deterministic, no global atomics). It writes the meta of every
//      (t, k) (own rank: local meta; peers: their region) and remembers the destination row of
//      remote pairs. Slots >= T_max (only possible with duplicate ids) are dropped. Then the block
//      arrives on the local "meta written" counter.
//   3. Send: the block's threads read their tokens' 16-channel pieces once, cast to e4m3 (scale
//      per 128 channels via 8-lane shuffles) and store them to every remote destination row.
//   4. Receive own rows: warps w = e (mod E_loc) share local expert e. They wait for the count
//      words of e from all R sources, compute the output row of every source, and (after the
//      meta counter reaches the grid size) copy this rank's own rows from x, casting in place.
//      This overlaps with the remote data still in flight.
//   5. Every thread fences (its remote stores are then visible), the block arrives on the "sent"
//      counter; the last block release-stores the flag word at every peer.
//   6. Receive peer rows: per source, wait for its flag word once, then copy rows and scales from
//      the region into the outputs; fill recv_src/recv_k of rows past recv_count with -1.
//   7. The last block to finish advances the dispatch sequence word and clears the counters.
//
// Parity safety: call n (per rank, counted by the sequence word, identical on all ranks because
// every rank runs the same calls in the same order) writes peers' words, meta and rows of parity
// n % 2. Every call makes every rank wait for a count word that every other rank writes in that
// same call (phase 4 waits for all (e, s) words). So when a rank starts call n, its call n-1 has
// seen every peer's call n-1 count words, which each peer writes only after its call n-2 ended
// (launches on one stream are serialised): all ranks have finished call n-2, the last user of
// parity n % 2. Tags grow by one per call, so a stale word of call n-2 (tag n-2 < n) never
// satisfies a wait of call n, and no rank can already hold a word of call n+2 (count words are
// compared on the low 32 bits of the tag, which is safe for the same reason).
// Dispatch and combine keep separate sequence words and separate regions: the argument above
// then involves only the op's own call history, whatever the interleaving of dispatches and
// combines (forward, backward, dispatch-only programs).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/common/copy.cuh"
#include "kernels/common/fp8_cast.cuh"
#include "kernels/common/launch.h"
#include "kernels/common/limits.h"
#include "kernels/common/sync.cuh"
#include "kernels/low_latency_common.cuh"
#include "kernels/low_latency_launch.h"
#include "kernels/low_latency_layout.cuh"

namespace jax_ep {
namespace {

// A receive work unit is one warp moving at most kRecvPiecesPerLane 16-channel pieces per lane
// of one row (bf16 source: 2 loads per piece in flight per lane).
constexpr int kRecvPiecesPerLane = 4;
constexpr int kRecvPiecesPerUnit = kWarpSize * kRecvPiecesPerLane;

constexpr uint32_t kFullMask = 0xffffffffu;

struct DispatchArgs {
  LowLatencyRank rank;
  const __nv_bfloat16* x;   // [T, H]
  const int32_t* topk_idx;  // [T, K]
  void* recv_x;             // [E_loc, R*T_max, H] e4m3 or bf16
  float* recv_scales;       // [E_loc, R*T_max, H/128] (fp8 only)
  int32_t* recv_count;      // [E_loc]
  int32_t* recv_src;        // [E_loc, R*T_max]
  int32_t* recv_k;          // [E_loc, R*T_max]
  int num_tokens;           // T
  int num_experts;          // E
  int tokens_per_block;     // ceil(T / grid)
  bool round_scale;
};

// Phase 3: writes this block's tokens to every remote destination row in `row_of`
// ([n_tok][K], nullptr = not sent to a peer). Thread f of the flattened (token, piece) space
// handles 16 channels; the 8 lanes of a scale group hold the same token (H/16 % 8 == 0).
template <bool kUseFp8>
__device__ __forceinline__ void send_rows(const DispatchArgs& args, char* const* row_of, int t0,
                                          int n_tok) {
  const int hidden = args.rank.layout.hidden;
  const int num_topk = args.rank.layout.num_topk;
  const int pieces = hidden / kFp8ChannelsPerPiece;
  const int total = n_tok * pieces;
  for (int base = 0; base < total; base += blockDim.x) {  // uniform trip count: shuffles below
    const int f = base + static_cast<int>(threadIdx.x);
    const bool active = f < total;
    const int local_token = active ? f / pieces : 0;
    const int piece = f - local_token * pieces;
    int4 lo = make_int4(0, 0, 0, 0), hi = lo;
    if (active) {
      const int4* src =
          reinterpret_cast<const int4*>(args.x + static_cast<size_t>(t0 + local_token) * hidden) +
          2 * piece;
      lo = ld_nc_v4(src);
      hi = ld_nc_v4(src + 1);
    }
    char* const* rows = row_of + local_token * num_topk;
    if constexpr (kUseFp8) {
      const float amax = fp8_group_amax(active ? bf16_piece_amax(lo, hi) : 0.0f);
      const float scale = fp8_scale_from_amax(amax, args.round_scale);
      const int4 packed = bf16_piece_to_e4m3(lo, hi, 1.0f / scale);
      if (!active) continue;
      for (int k = 0; k < num_topk; ++k) {
        char* row = rows[k];
        if (row == nullptr) continue;
        st_v4(reinterpret_cast<int4*>(row) + piece, packed);
        if (piece % kFp8PiecesPerScale == 0) {
          reinterpret_cast<float*>(row + hidden)[piece / kFp8PiecesPerScale] = scale;
        }
      }
    } else {
      if (!active) continue;
      for (int k = 0; k < num_topk; ++k) {
        char* row = rows[k];
        if (row == nullptr) continue;
        st_v4(reinterpret_cast<int4*>(row) + 2 * piece, lo);
        st_v4(reinterpret_cast<int4*>(row) + 2 * piece + 1, hi);
      }
    }
  }
}

// Own row: read token `token` of x and write it (cast) to output row `row_index`, pieces
// [piece0, piece_end) — at most kRecvPiecesPerUnit, lane-strided. Whole warp, uniform arguments.
template <bool kUseFp8>
__device__ __forceinline__ void copy_own_row(const DispatchArgs& args, int token, size_t row_index,
                                             int piece0, int piece_end, int lane) {
  const int hidden = args.rank.layout.hidden;
  const int4* src = reinterpret_cast<const int4*>(args.x + static_cast<size_t>(token) * hidden);
  int4 lo[kRecvPiecesPerLane], hi[kRecvPiecesPerLane];
#pragma unroll
  for (int m = 0; m < kRecvPiecesPerLane; ++m) {
    const int piece = piece0 + m * kWarpSize + lane;
    lo[m] = hi[m] = make_int4(0, 0, 0, 0);
    if (piece < piece_end) {
      lo[m] = ld_nc_v4(src + 2 * piece);
      hi[m] = ld_nc_v4(src + 2 * piece + 1);
    }
  }
#pragma unroll
  for (int m = 0; m < kRecvPiecesPerLane; ++m) {
    if (piece0 + m * kWarpSize >= piece_end) break;  // warp-uniform
    const int piece = piece0 + m * kWarpSize + lane;
    const bool active = piece < piece_end;
    if constexpr (kUseFp8) {
      const float amax = fp8_group_amax(active ? bf16_piece_amax(lo[m], hi[m]) : 0.0f);
      const float scale = fp8_scale_from_amax(amax, args.round_scale);
      const int4 packed = bf16_piece_to_e4m3(lo[m], hi[m], 1.0f / scale);
      if (active) {
        auto* dst = static_cast<uint8_t*>(args.recv_x) + row_index * hidden;
        st_v4(reinterpret_cast<int4*>(dst) + piece, packed);
        if (piece % kFp8PiecesPerScale == 0) {
          args.recv_scales[row_index * (hidden / kChannelsPerScale) + piece / kFp8PiecesPerScale] =
              scale;
        }
      }
    } else if (active) {
      auto* dst = static_cast<__nv_bfloat16*>(args.recv_x) + row_index * hidden;
      st_v4(reinterpret_cast<int4*>(dst) + 2 * piece, lo[m]);
      st_v4(reinterpret_cast<int4*>(dst) + 2 * piece + 1, hi[m]);
    }
  }
}

// Peer row: copy pieces [piece0, piece_end) of a received region row (and its scales) to output
// row `row_index`. The data was written by a peer during this launch: L2 loads (ld.cg).
template <bool kUseFp8>
__device__ __forceinline__ void copy_peer_row(const DispatchArgs& args, const char* src_row,
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
    const int4* src = reinterpret_cast<const int4*>(src_row);
    int4 lo[kRecvPiecesPerLane], hi[kRecvPiecesPerLane];
#pragma unroll
    for (int m = 0; m < kRecvPiecesPerLane; ++m) {
      const int piece = piece0 + m * kWarpSize + lane;
      lo[m] = hi[m] = make_int4(0, 0, 0, 0);
      if (piece < piece_end) {
        lo[m] = ld_cg_v4(src + 2 * piece);
        hi[m] = ld_cg_v4(src + 2 * piece + 1);
      }
    }
    auto* dst =
        reinterpret_cast<int4*>(static_cast<__nv_bfloat16*>(args.recv_x) + row_index * hidden);
#pragma unroll
    for (int m = 0; m < kRecvPiecesPerLane; ++m) {
      const int piece = piece0 + m * kWarpSize + lane;
      if (piece < piece_end) {
        st_v4(dst + 2 * piece, lo[m]);
        st_v4(dst + 2 * piece + 1, hi[m]);
      }
    }
  }
}

// Phases 4 and 6 for local expert `expert`, shared by `num_sharers` warps of which this is number
// `sharer`. Work units (row, chunk of <= kRecvPiecesPerUnit pieces) are numbered in the order:
// own rows first, then sources rank+1, rank+2, ... (mod R); the own pass takes the own rows, the
// peer pass the rest plus recv_count and the -1 fill. `waited` (bit s) remembers which arrival
// this warp has already observed.
template <bool kUseFp8>
__device__ __forceinline__ void receive_expert(const DispatchArgs& args, int expert, int sharer,
                                               int num_sharers, bool peer_pass, uint64_t tag,
                                               int parity, uint32_t& waited) {
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
  const int own_count = __shfl_sync(kFullMask, order_count, 0);

  const int pieces = layout.hidden / kFp8ChannelsPerPiece;
  const int num_chunks = ceil_div(pieces, kRecvPiecesPerUnit);
  const int chunk_pieces =
      ceil_div(ceil_div(pieces, num_chunks), kFp8PiecesPerScale) * kFp8PiecesPerScale;
  const int unit_begin = peer_pass ? own_count * num_chunks : 0;
  const int unit_end = (peer_pass ? total : own_count) * num_chunks;
  LowLatencyControl* control = low_latency_control(rk);
  const uint64_t* flags = reinterpret_cast<const uint64_t*>(rk.local + layout.dispatch_flags);
  const int2* meta_base = reinterpret_cast<const int2*>(rk.local + layout.dispatch_meta);

  for (int unit = unit_begin + ((sharer - unit_begin % num_sharers) + num_sharers) % num_sharers;
       unit < unit_end; unit += num_sharers) {
    const int order_row = unit / num_chunks;
    const int chunk = unit - order_row * num_chunks;
    const int pos =
        __popc(__ballot_sync(kFullMask, lane < num_ranks && order_begin <= order_row)) - 1;
    const int src = (me + pos) % num_ranks;
    const int slot = order_row - __shfl_sync(kFullMask, order_begin, pos);
    const int out_row = __shfl_sync(kFullMask, order_first_row, pos) + slot;
    if (!(waited & (1u << src))) {
      if (lane == 0) {
        if (src == me) {  // own meta: written by every block of this launch in phase 2
          wait_flag_at_least(reinterpret_cast<const uint64_t*>(&control->dispatch_blocks_meta),
                             gridDim.x, rk.timeout_ns, rk.timeout_record, me, me,
                             WaitPhase::kLowLatencyDispatchRecv);
        } else {
          wait_flag_at_least(flags + layout.flag_index(parity, src), tag, rk.timeout_ns,
                             rk.timeout_record, me, src, WaitPhase::kLowLatencyDispatchRecv);
        }
      }
      __syncwarp();
      waited |= 1u << src;
    }
    const int2* meta = meta_base + layout.dispatch_meta_index(parity, expert, src, slot);
    const int token = ld_cg_s32(&meta->x);
    const int k = ld_cg_s32(&meta->y);
    const size_t row_index = static_cast<size_t>(expert) * rows_per_expert + out_row;
    if (chunk == 0 && lane == 0) {
      args.recv_src[row_index] = src * max_tokens + token;
      args.recv_k[row_index] = k;
    }
    const int piece0 = chunk * chunk_pieces;
    const int piece_end = min(pieces, piece0 + chunk_pieces);
    if (src == me) {
      if (token < 0 || token >= args.num_tokens) continue;  // guards x; not for well-formed meta
      copy_own_row<kUseFp8>(args, token, row_index, piece0, piece_end, lane);
    } else {
      const char* src_row = rk.local + layout.dispatch_row_offset(parity, expert, src, me, slot);
      copy_peer_row<kUseFp8>(args, src_row, row_index, piece0, piece_end, lane);
    }
  }

  if (peer_pass) {
    if (sharer == 0 && lane == 0) args.recv_count[expert] = total;
    const size_t expert_row0 = static_cast<size_t>(expert) * rows_per_expert;
    for (int row = total + sharer * kWarpSize + lane; row < rows_per_expert;
         row += num_sharers * kWarpSize) {
      args.recv_src[expert_row0 + row] = -1;
      args.recv_k[expert_row0 + row] = -1;
    }
  }
}

// Phases 4 / 6 for every expert of this warp: warps w = e (mod E_loc) share expert e; with fewer
// warps than experts each warp takes experts w, w + W, ...
template <bool kUseFp8>
__device__ __forceinline__ void receive_pass(const DispatchArgs& args, bool peer_pass, uint64_t tag,
                                             int parity, uint32_t& waited) {
  const int num_experts_local = args.rank.layout.num_local_experts;
  const int num_warps = static_cast<int>(gridDim.x) * kLowLatencyWarps;
  const int warp =
      static_cast<int>(blockIdx.x) * kLowLatencyWarps + static_cast<int>(threadIdx.x) / kWarpSize;
  if (num_warps >= num_experts_local) {
    const int expert = warp % num_experts_local;
    const int sharers = (num_warps - 1 - expert) / num_experts_local + 1;
    receive_expert<kUseFp8>(args, expert, warp / num_experts_local, sharers, peer_pass, tag, parity,
                            waited);
  } else {
    for (int expert = warp; expert < num_experts_local; expert += num_warps) {
      receive_expert<kUseFp8>(args, expert, 0, 1, peer_pass, tag, parity, waited);
    }
  }
}

// Grid: one block per SM (cooperative), kLowLatencyThreads threads. Dynamic shared memory:
// row_of [tokens_per_block][K] pointers, the block's ids [tokens_per_block][K], then two int
// histograms of E entries.
template <bool kUseFp8>
__global__ void __launch_bounds__(kLowLatencyThreads, 1)
    low_latency_dispatch_kernel(const __grid_constant__ DispatchArgs args) {
  extern __shared__ __align__(16) unsigned char smem[];
  const LowLatencyRank& rk = args.rank;
  const LowLatencyLayout& layout = rk.layout;
  const int num_ranks = layout.num_ranks;
  const int num_local = layout.num_local_experts;
  const int max_tokens = layout.max_tokens;
  const int num_topk = layout.num_topk;
  const int num_experts = args.num_experts;
  const int me = rk.rank;
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid % kWarpSize;

  LowLatencyControl* control = low_latency_control(rk);
  const uint64_t seq = ld_volatile_u64(&control->dispatch_seq);
  const uint64_t tag = seq + 1;
  const int parity = static_cast<int>(seq & 1);

  char** row_of = reinterpret_cast<char**>(smem);
  int* block_ids = reinterpret_cast<int*>(row_of + args.tokens_per_block * num_topk);
  int* hist_before = block_ids + args.tokens_per_block * num_topk;
  int* hist_total = hist_before + num_experts;

  const int t0 = min(args.num_tokens, static_cast<int>(blockIdx.x) * args.tokens_per_block);
  const int t1 = min(args.num_tokens, t0 + args.tokens_per_block);
  const int n_tok = t1 - t0;
  const bool is_publisher = blockIdx.x == gridDim.x - 1;

  // Phase 1: histograms; the publisher releases the count words at every rank.
  if (n_tok > 0 || is_publisher) {
    for (int g = tid; g < num_experts; g += blockDim.x) {
      hist_before[g] = 0;
      hist_total[g] = 0;
    }
    for (int p = tid; p < n_tok * num_topk; p += blockDim.x) {
      block_ids[p] = __ldg(args.topk_idx + static_cast<size_t>(t0) * num_topk + p);
    }
    __syncthreads();
    const int before_end = t0 * num_topk;
    const int scan_end = is_publisher ? args.num_tokens * num_topk : before_end;
    for (int p = tid; p < scan_end; p += blockDim.x) {
      const int g = __ldg(args.topk_idx + p);
      if (g < 0 || g >= num_experts) continue;
      if (n_tok > 0 && p < before_end) atomicAdd(hist_before + g, 1);
      if (is_publisher) atomicAdd(hist_total + g, 1);
    }
    __syncthreads();
    if (is_publisher) {
      for (int g = tid; g < num_experts; g += blockDim.x) {
        const int dst = g / num_local;
        const int expert = g - dst * num_local;
        const uint32_t count = static_cast<uint32_t>(min(hist_total[g], max_tokens));
        uint64_t* word = reinterpret_cast<uint64_t*>(rk.peers[dst] + layout.dispatch_counts) +
                         layout.dispatch_count_index(parity, expert, me);
        st_relaxed_sys(word, pack_tagged_count(tag, count));
      }
    }
  }

  // Phase 2: slots, meta and destination rows of this block's tokens (warp 0, token order).
  if (tid < kWarpSize && n_tok > 0) {
    unsigned long long invalid_ids = 0;
    for (int t = t0; t < t1; ++t) {
      char* row = nullptr;
      if (lane < num_topk) {
        const int g = block_ids[(t - t0) * num_topk + lane];
        if (g >= 0 && g < num_experts) {
          const int slot = atomicAdd(hist_before + g, 1);
          if (slot < max_tokens) {
            const int dst = g / num_local;
            const int expert = g - dst * num_local;
            int2* meta = reinterpret_cast<int2*>(rk.peers[dst] + layout.dispatch_meta) +
                         layout.dispatch_meta_index(parity, expert, me, slot);
            *meta = make_int2(t, lane);
            if (dst != me)
              row = rk.peers[dst] + layout.dispatch_row_offset(parity, expert, me, dst, slot);
          }
        } else if (g != -1) {
          ++invalid_ids;
        }
        row_of[(t - t0) * num_topk + lane] = row;
      }
      __syncwarp();  // token t's slots are taken before token t + 1's
    }
#pragma unroll
    for (int mask = kWarpSize / 2; mask > 0; mask >>= 1) {
      invalid_ids += __shfl_xor_sync(kFullMask, invalid_ids, mask);
    }
    if (lane == 0 && invalid_ids > 0 && rk.errors != nullptr) {
      atomicAdd(&rk.errors->invalid_expert_ids, invalid_ids);
    }
    __threadfence();  // own meta visible before the block's arrival below
  }
  __syncthreads();
  if (tid == 0) atomicAdd(&control->dispatch_blocks_meta, 1ull);

  // Phase 3: send remote rows.
  send_rows<kUseFp8>(args, row_of, t0, n_tok);

  // Phase 4: own rows, while the remote rows travel.
  uint32_t waited = 0;
  receive_pass<kUseFp8>(args, /*peer_pass=*/false, tag, parity, waited);

  // Phase 5: after every block's remote stores are visible, tell every peer.
  if (arrive_and_check_last(&control->dispatch_blocks_sent)) {
    if (tid < num_ranks && tid != me) {
      uint64_t* flag = reinterpret_cast<uint64_t*>(rk.peers[tid] + layout.dispatch_flags) +
                       layout.flag_index(parity, me);
      st_release_sys(flag, tag);
    }
  }

  // Phase 6: peer rows, recv_count, -1 fill.
  receive_pass<kUseFp8>(args, /*peer_pass=*/true, tag, parity, waited);

  // Phase 7.
  finish_launch(&control->dispatch_blocks_done, &control->dispatch_seq, seq,
                &control->dispatch_blocks_meta);
}

}  // namespace

size_t low_latency_workspace_bytes(const BufferConfig& config) {
  return config.low_latency ? make_low_latency_layout(config).total_bytes : 0;
}

size_t low_latency_workspace_offset(const BufferConfig& config) {
  return align_up(normal_workspace_bytes(config), kLowLatencyAlignBytes);
}

cudaError_t launch_low_latency_dispatch(const RankContext& ctx,
                                        const LowLatencyDispatchParams& params,
                                        cudaStream_t stream) {
  int num_blocks = 0;
  cudaError_t err = low_latency_grid_size(ctx, &num_blocks);
  if (err != cudaSuccess) return err;

  DispatchArgs args = {};
  args.rank = make_low_latency_rank(ctx);
  args.x = static_cast<const __nv_bfloat16*>(params.x);
  args.topk_idx = params.topk_idx;
  args.recv_x = params.recv_x;
  args.recv_scales = params.recv_scales;
  args.recv_count = params.recv_count;
  args.recv_src = params.recv_src;
  args.recv_k = params.recv_k;
  args.num_tokens = params.num_tokens;
  args.num_experts = ctx.config.num_experts;
  args.tokens_per_block = (params.num_tokens + num_blocks - 1) / num_blocks;
  args.round_scale = params.round_scale;

  const size_t smem_bytes = static_cast<size_t>(args.tokens_per_block) * ctx.config.num_topk *
                                (sizeof(char*) + sizeof(int)) +
                            2 * static_cast<size_t>(ctx.config.num_experts) * sizeof(int);
  return params.use_fp8 ? launch_low_latency_kernel(low_latency_dispatch_kernel<true>, num_blocks,
                                                    smem_bytes, stream, args)
                        : launch_low_latency_kernel(low_latency_dispatch_kernel<false>, num_blocks,
                                                    smem_bytes, stream, args);
}

cudaError_t preload_low_latency_dispatch_kernels() {
  cudaFuncAttributes attributes;
  cudaError_t err = cudaFuncGetAttributes(&attributes, low_latency_dispatch_kernel<true>);
  if (err != cudaSuccess) return err;
  return cudaFuncGetAttributes(&attributes, low_latency_dispatch_kernel<false>);
}

// Errors are left in cudaGetLastError() for the caller (runtime/registry) to report.
void preload_low_latency_kernels() {
  if (preload_low_latency_dispatch_kernels() != cudaSuccess) return;
  preload_low_latency_combine_kernels();
}

}  // namespace jax_ep
