// Low-latency (decode) combine, jax_ep_low_latency_combine_v2:
//   out[t] = sum over k with a valid id of w[t, k] * y[e_k][row of (t, k)], float32, rounded once.
// One cooperative launch of 512-thread blocks, at most one per SM (all SMs but
// kLowLatencyFreeSms by default: low_latency_grid_size). The same kernel body, compiled per
// LowLatencyHalves, also gives the split pair jax_ep_low_latency_combine_send_v2 (phase 1 and
// the arrival/release of phase 3, then a ticket) and ..._recv_v2 (phases 2, the wait of 3, 4, 5).
//
// Expert outputs of rows that came from a peer are pushed into that peer's combine region at
// [parity][token][k]; rows of this rank's own tokens are not moved at all: the owner reads them
// straight from y, finding the row of (t, k) in the dispatch handle (rows of an expert are sorted
// by (recv_src, recv_k), so 16 lanes searching recv_src/recv_k together find it in one round up
// to 16 rows, two up to 256).
//
// Phases of every block (W = all warps of the grid):
//   1. Send: warps w = e (mod E_loc) share local expert e; its units (valid row, chunk of <= 1024
//      channels) are spread over them. recv_count[e], recv_src and recv_k of a unit's row are
//      loaded together (no grid-wide prefix, no barrier before the first store); rows whose
//      source rank is a peer are copied from y to the peer's region (16-byte loads,
//      kSendVecsPerLane in flight per lane). Rows of this rank's own tokens are skipped.
//   2. Owner, first pass of the block's range of the flattened (token, vector) space of out (an
//      even share per block; a pass covers at most 1024 vectors of at most 4 tokens): one warp
//      per (t, k) of the pass's tokens resolves it to a row of y (own expert) or of the local
//      region (peer expert); the block sums the own rows into float32 registers while the
//      pushed rows are still in flight.
//   3. Arrival, begun right after phase 1's block barrier: thread 0 fences and adds the block's
//      arrival to the "sent" counter; the atomic's answer is awaited only after the first pass's
//      own rows are summed (phase 2). There the block that arrived last stores the combine flag
//      word [parity][me] = tag at every peer and advances the combine sequence word (every
//      block read it before arriving). Then the block waits for the flag word of every peer
//      (every block, even without a range).
//   4. The block adds the peer rows, rounds to bf16 and stores its part of out; further passes
//      likewise.
//   5. Split receive launch only (it has no arrival): the last block to finish advances the
//      sequence word.
//
// Split (send launch, then receive launch, same grid, one stream, no other split call of this op
// on this Buffer in between on this rank; fused calls use the other channel of the workspace and
// may run in between): both read the split channel's sequence word at their start and only phase 5
// advances it, so both use the same tag and parity. The send launch runs phase 1, then every
// block arrives on the "sent" counter and the last one releases the flag words, as in phase 3
// (without advancing the sequence word); it never waits. The receive launch sums the own rows (read
// from y, an operand again), waits for every peer's flag word (same bounded wait, phase
// "low-latency combine receive"), adds the peer rows and advances the sequence word. Releasing the
// flags right after the arrival, instead of after the first own-row sum as the fused op does,
// publishes the same stores (all of phase 1's) a little earlier.
//
// Parity safety: as for dispatch (low_latency/dispatch.cu), with the combine sequence word and
// the flag words of phase 3 as the words every rank waits for from every other rank in every
// call: a rank starts combine n only after its combine n-1 saw every peer's flag of n-1, which a
// peer publishes only after its combine n-2 ended, the last reader of the parity n % 2 region.
// The argument holds per channel; in the split channel a call is a send launch and its receive
// launch (which does the waiting and the advancing), and each send must follow the previous
// split call's receive, as for dispatch.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/copy.cuh"
#include "common/launch.h"
#include "common/limits.h"
#include "common/phase_timeline.cuh"
#include "common/sync.cuh"
#include "kernels/api.h"
#include "kernels/low_latency/common.cuh"
#include "kernels/low_latency/layout.cuh"
#include "kernels/preload.h"

namespace jax_ep {
namespace {

constexpr uint32_t kFullMask = 0xffffffffu;
constexpr int kBf16PerVector = kBytesPerVector / 2;
// Send unit: one warp moves at most kWarpSize * kSendVecsPerLane vectors of one row.
constexpr int kSendVecsPerLane = 4;
// Owner: vectors (8 channels) per thread per pass (a pass covers 8192 channels), and rows whose
// loads are in flight together (8: all rows of a top-8 token in one round trip).
constexpr int kOwnerVecsPerThread = 2;
constexpr int kOwnerRowsInFlight = 8;

struct CombineArgs {
  LowLatencyRank rank;
  const __nv_bfloat16* y;     // [E_loc, R*T_max, H]
  const int32_t* topk_idx;    // [T, K]
  const float* topk_weights;  // [T, K]
  const int32_t* recv_src;    // [E_loc, R*T_max]
  const int32_t* recv_k;      // [E_loc, R*T_max]
  const int32_t* recv_count;  // [E_loc]
  __nv_bfloat16* out;         // [T, H]
  int num_tokens;
  int num_experts;
  int32_t* ticket;  // [1] (send half alone)
};

// Rows summed into one output token, split by where they are read from.
struct TokenSources {
  const __nv_bfloat16* entry_row[kMaxTopk];
  float entry_weight[kMaxTopk];
  int entry_kind[kMaxTopk];  // 0 none, 1 own (y), 2 peer (region)
  const __nv_bfloat16* rows[2][kMaxTopk];
  float weights[2][kMaxTopk];
  int count[2];
};

// Lanes that search for one (token, k) row: a warp resolves two at once, so a block resolves
// all K rows of up to 4 top-8 tokens in one round.
constexpr int kFindLanes = 16;
constexpr int kFindersPerWarp = kWarpSize / kFindLanes;

// Row of an expert's block of y holding (source key, k), or -1. Valid rows [0, count) are sorted
// by (recv_src, recv_k) (dispatch order); each round probes kFindLanes evenly spaced rows (two
// rounds cover 256 rows), and the last round's probe of the answer is reused, not loaded again.
// The kFindLanes lanes of `group` (lane `g_lane` of it), uniform arguments; in bounds whatever
// the handle holds.
__device__ __forceinline__ int group_find_row(const int32_t* src_col, const int32_t* k_col,
                                              int count, int src_key, int k, int g_lane,
                                              uint32_t group) {
  auto key = [&](int i) {
    return static_cast<int64_t>(__ldg(src_col + i)) * kMaxTopk + __ldg(k_col + i);
  };
  const int64_t target = static_cast<int64_t>(src_key) * kMaxTopk + k;
  int lo = 0, hi = count;  // rows < lo are below target, rows >= hi are not
  while (hi - lo > kFindLanes) {
    const int step = ceil_div(hi - lo, kFindLanes);
    const int probe = lo + g_lane * step;
    const int num_below = __popc(__ballot_sync(group, probe < hi && key(probe) < target) & group);
    if (num_below == 0) {
      hi = lo;
      break;
    }
    hi = min(hi, lo + num_below * step);
    lo += (num_below - 1) * step + 1;
  }
  const int probe = lo + g_lane;
  const int64_t probe_key = probe < hi ? key(probe) : INT64_MAX;
  const int num_below = __popc(__ballot_sync(group, probe_key < target) & group);
  const int found = lo + num_below;
  const int first_lane = __ffs(group) - 1;
  const int64_t found_key =
      __shfl_sync(group, probe_key, first_lane + min(num_below, kFindLanes - 1));
  if (found < hi) return found_key == target ? found : -1;  // lane num_below probed `found`
  return found < count && key(found) == target ? found : -1;
}

// Input loads issued in program order (asm volatile), so the compiler cannot sink them below a
// use of an earlier load: the metadata loads of phase 1 then fly together.
__device__ __forceinline__ int ld_nc_s32(const int32_t* ptr) {
  int v;
  asm volatile("ld.global.nc.s32 %0, [%1];" : "=r"(v) : "l"(ptr));
  return v;
}

// Phase 1 for local expert `expert`, shared by `num_sharers` warps of which this is number
// `sharer`. Units (valid row j, chunk c), numbered j * chunks + c; the warp takes units
// sharer + i * num_sharers, 32 per round (lane l resolves the l-th one). The row index of a unit
// is known without recv_count (any row < R*T_max is in bounds), so recv_count, recv_src and
// recv_k are loaded together; then the warp copies the remote units of the round from y to the
// owners' regions (16-byte loads, kSendVecsPerLane in flight per lane). Rows of this rank's own
// tokens are skipped.
__device__ __forceinline__ void send_expert_rows(const CombineArgs& args, int expert, int sharer,
                                                 int num_sharers, int parity) {
  const LowLatencyRank& rk = args.rank;
  const LowLatencyLayout& layout = rk.layout;
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int max_tokens = layout.max_tokens;
  const int rows_per_expert = layout.num_ranks * max_tokens;
  const int vecs = layout.hidden / kBf16PerVector;
  const int num_chunks = ceil_div(vecs, kWarpSize * kSendVecsPerLane);
  const int chunk_vecs = ceil_div(vecs, num_chunks);
  const size_t expert_row0 = static_cast<size_t>(expert) * rows_per_expert;
  const int units_in_bounds = rows_per_expert * num_chunks;

  const int count_raw = ld_nc_s32(args.recv_count + expert);
  for (int round_base = sharer;; round_base += kWarpSize * num_sharers) {
    const int unit = round_base + lane * num_sharers;
    const int row = unit / num_chunks;
    int src_key = -1, k = -1;
    if (unit < units_in_bounds) {
      src_key = ld_nc_s32(args.recv_src + expert_row0 + row);
      k = ld_nc_s32(args.recv_k + expert_row0 + row);
    }
    const int units = min(max(count_raw, 0), rows_per_expert) * num_chunks;
    if (round_base >= units) break;  // warp-uniform
    const int chunk = unit - row * num_chunks;
    const int owner = src_key / max_tokens;
    int dst = -1, slot_offset = 0;
    if (unit < units && src_key >= 0 && k >= 0 && k < layout.num_topk && owner < layout.num_ranks &&
        owner != rk.rank) {
      dst = owner;
      slot_offset = (src_key - owner * max_tokens) * layout.num_topk + k;  // token * K + k
    }
    for (uint32_t todo = __ballot_sync(kFullMask, dst >= 0); todo != 0; todo &= todo - 1) {
      const int from = __ffs(todo) - 1;
      const int src_row = __shfl_sync(kFullMask, row, from);
      const int to = __shfl_sync(kFullMask, dst, from);
      const int to_slot = __shfl_sync(kFullMask, slot_offset, from);
      const int vec0 = __shfl_sync(kFullMask, chunk, from) * chunk_vecs;
      const int vec_end = min(vecs, vec0 + chunk_vecs);
      const int4* src =
          reinterpret_cast<const int4*>(args.y + (expert_row0 + src_row) * layout.hidden);
      int4* dst_row = reinterpret_cast<int4*>(
          rk.peers[to] +
          layout.combine_row_offset(parity, to_slot / layout.num_topk, to_slot % layout.num_topk));
      int4 v[kSendVecsPerLane];
#pragma unroll
      for (int m = 0; m < kSendVecsPerLane; ++m) {
        const int vec = vec0 + m * kWarpSize + lane;
        v[m] = make_int4(0, 0, 0, 0);
        if (vec < vec_end) v[m] = ld_nc_v4(src + vec);
      }
#pragma unroll
      for (int m = 0; m < kSendVecsPerLane; ++m) {
        const int vec = vec0 + m * kWarpSize + lane;
        if (vec < vec_end) st_v4(dst_row + vec, v[m]);
      }
    }
  }
}

// Phase 1 for every expert of this warp: warps w = e (mod E_loc) share expert e; with fewer warps
// than experts each warp takes experts w, w + W, ...
__device__ __forceinline__ void send_rows(const CombineArgs& args, int parity) {
  const int num_local = args.rank.layout.num_local_experts;
  const int num_warps = static_cast<int>(gridDim.x) * kLowLatencyWarps;
  const int warp =
      static_cast<int>(blockIdx.x) * kLowLatencyWarps + static_cast<int>(threadIdx.x) / kWarpSize;
  if (num_warps >= num_local) {
    const int expert = warp % num_local;
    const int sharers = (num_warps - 1 - expert) / num_local + 1;
    send_expert_rows(args, expert, warp / num_local, sharers, parity);
  } else {
    for (int expert = warp; expert < num_local; expert += num_warps) {
      send_expert_rows(args, expert, 0, 1, parity);
    }
  }
}

// Owner work split: the flattened (token, vector) space of out is cut into one contiguous range
// per block (at least kOwnerMinVecs vectors, so that few tokens still spread over several
// blocks), processed in passes of at most kOwnerPassVecs vectors and kOwnerPassTokens tokens.
// So every block reads about the same bytes whatever T is (before 2026-12-02 a block owned whole
// tokens: at T=128 on 124 blocks, 4 blocks summed two tokens' 16 rows, and at T=1 one block read
// all 8 rows).
constexpr int kOwnerPassVecs = kLowLatencyThreads * kOwnerVecsPerThread;
constexpr int kOwnerPassTokens = 4;
constexpr int kOwnerMinVecs = 256;

// Phase 2 setup: where the K rows of tokens t0 .. t0 + n - 1 (n <= kOwnerPassTokens) are read
// from. Finder f (kFindLanes lanes) resolves the (token, k) pairs f, f + finders, ...
// (i = token * K + k), then warp i compacts token i's entries into sources[i]'s own / peer
// lists (k order kept). `recv_counts`: the handle's counts, in shared memory. Block-wide, ends
// synchronised.
__device__ __forceinline__ void find_token_sources(const CombineArgs& args, const int* recv_counts,
                                                   int t0, int n, int parity,
                                                   TokenSources* sources) {
  const LowLatencyRank& rk = args.rank;
  const LowLatencyLayout& layout = rk.layout;
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize;
  const int num_topk = layout.num_topk;
  const int num_local = layout.num_local_experts;
  const int rows_per_expert = layout.num_ranks * layout.max_tokens;
  const int g_lane = lane % kFindLanes;
  const uint32_t group = ((1u << kFindLanes) - 1) << (lane - g_lane);
  constexpr int kFinders = kLowLatencyWarps * kFindersPerWarp;

  for (int i = warp * kFindersPerWarp + lane / kFindLanes; i < n * num_topk; i += kFinders) {
    const int token = t0 + i / num_topk;
    const int k = i % num_topk;
    TokenSources& src = sources[i / num_topk];
    const size_t idx = static_cast<size_t>(token) * num_topk + k;
    const int g = __ldg(args.topk_idx + idx);
    int kind = 0;
    const __nv_bfloat16* row = nullptr;
    if (g >= 0 && g < args.num_experts) {
      const int owner = g / num_local;
      const int expert = g - owner * num_local;
      if (owner == rk.rank) {
        const size_t expert_row0 = static_cast<size_t>(expert) * rows_per_expert;
        const int r = group_find_row(args.recv_src + expert_row0, args.recv_k + expert_row0,
                                     recv_counts[expert], rk.rank * layout.max_tokens + token, k,
                                     g_lane, group);
        if (r >= 0) {
          kind = 1;
          row = args.y + (expert_row0 + r) * layout.hidden;
        }
      } else {
        kind = 2;
        row = reinterpret_cast<const __nv_bfloat16*>(rk.local +
                                                     layout.combine_row_offset(parity, token, k));
      }
    }
    if (g_lane == 0) {
      src.entry_row[k] = row;
      src.entry_weight[k] = __ldg(args.topk_weights + idx);
      src.entry_kind[k] = kind;
    }
  }
  __syncthreads();
  if (warp < n) {
    TokenSources& src = sources[warp];
    const int kind = lane < num_topk ? src.entry_kind[lane] : 0;
    const uint32_t lanes_below = (1u << lane) - 1;
#pragma unroll
    for (int list = 0; list < 2; ++list) {
      const uint32_t members = __ballot_sync(kFullMask, kind == list + 1);
      if (kind == list + 1) {
        const int pos = __popc(members & lanes_below);
        src.rows[list][pos] = src.entry_row[lane];
        src.weights[list][pos] = src.entry_weight[lane];
      }
      if (lane == 0) src.count[list] = __popc(members);
    }
  }
  __syncthreads();
}

// acc[j] += w * row[vec[j]] over the rows of list `list` of sources[j] (j < kOwnerVecsPerThread;
// sources[j] == nullptr: nothing), with kOwnerRowsInFlight rows' loads issued together for all j.
// kInput: rows are XLA operands (y), else rows a peer wrote during this launch.
template <bool kInput>
__device__ __forceinline__ void accumulate_rows(
    float (&acc)[kOwnerVecsPerThread][kBf16PerVector],
    const TokenSources* const (&sources)[kOwnerVecsPerThread],
    const int (&vec)[kOwnerVecsPerThread], int list) {
  int num_rows = 0;
#pragma unroll
  for (int j = 0; j < kOwnerVecsPerThread; ++j) {
    if (sources[j] != nullptr) num_rows = max(num_rows, sources[j]->count[list]);
  }
  for (int r0 = 0; r0 < num_rows; r0 += kOwnerRowsInFlight) {
    int4 v[kOwnerRowsInFlight][kOwnerVecsPerThread];
#pragma unroll
    for (int a = 0; a < kOwnerRowsInFlight; ++a) {
#pragma unroll
      for (int j = 0; j < kOwnerVecsPerThread; ++j) {
        v[a][j] = make_int4(0, 0, 0, 0);
        if (sources[j] != nullptr && r0 + a < sources[j]->count[list]) {
          const int4* ptr = reinterpret_cast<const int4*>(sources[j]->rows[list][r0 + a]) + vec[j];
          v[a][j] = kInput ? ld_nc_v4(ptr) : ld_cg_v4(ptr);
        }
      }
    }
#pragma unroll
    for (int a = 0; a < kOwnerRowsInFlight; ++a) {
#pragma unroll
      for (int j = 0; j < kOwnerVecsPerThread; ++j) {
        if (sources[j] == nullptr || r0 + a >= sources[j]->count[list]) continue;
        const float w = sources[j]->weights[list][r0 + a];
        const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&v[a][j]);
#pragma unroll
        for (int c = 0; c < kBf16PerVector / 2; ++c) {
          const float2 f = __bfloat1622float2(pairs[c]);
          acc[j][2 * c] = fmaf(w, f.x, acc[j][2 * c]);
          acc[j][2 * c + 1] = fmaf(w, f.y, acc[j][2 * c + 1]);
        }
      }
    }
  }
}

// Phase 3, release: thread 0 of the block that arrived last on the "sent" counter (arrival begun
// by begin_arrival after phase 1) stores the combine flag [parity][me] = tag at every peer,
// after arrived_last's fence (cumulative over every block's rows: fence, atomic / atomic, fence,
// store). kAdvanceSeq (fused op: every block read the sequence word before it arrived): it also
// advances the sequence word, so the launch needs no second grid-wide count at its end.
template <bool kAdvanceSeq>
__device__ __forceinline__ void release_flags_if_last(const CombineArgs& args,
                                                      LowLatencyControl* control,
                                                      unsigned long long arrived_before,
                                                      uint64_t seq, int parity, int num_ranks,
                                                      int me) {
  if (!arrived_last(&control->combine_blocks_sent, arrived_before)) return;
  const LowLatencyRank& rk = args.rank;
  for (int peer = 0; peer < num_ranks; ++peer) {
    if (peer == me) continue;
    st_relaxed_sys(reinterpret_cast<uint64_t*>(rk.peers[peer] + rk.layout.combine_flags) +
                       rk.layout.flag_index(parity, me),
                   seq + 1);
  }
  if constexpr (kAdvanceSeq) control->combine_seq = seq + 1;
}

// Phase 3, second part: the block waits for the flag word of every peer (acquire), then
// synchronises so that every thread may read the rows the peers pushed.
__device__ __forceinline__ void wait_peer_flags(const CombineArgs& args, uint64_t tag, int parity,
                                                int num_ranks, int me) {
  const LowLatencyRank& rk = args.rank;
  for (int peer = static_cast<int>(threadIdx.x); peer < num_ranks;
       peer += static_cast<int>(blockDim.x)) {
    if (peer == me) continue;
    const uint64_t* flag = reinterpret_cast<const uint64_t*>(rk.local + rk.layout.combine_flags) +
                           rk.layout.flag_index(parity, peer);
    wait_flag_at_least(flag, tag, rk.timeout_ns, rk.timeout_record, me, peer,
                       WaitPhase::kLowLatencyCombineRecv);
  }
  __syncthreads();
}

// Phases 2-4 (the owner's reduction) over this block's range of the (token, vector) space.
// kReleaseHere: this launch also ran phase 1 (fused op) and began the block's arrival after it
// (`arrived_before`); the last block releases the flags inside the first pass, after its own
// rows are summed, so the atomic's round trip is hidden; otherwise the send launch already
// released them.
template <bool kReleaseHere>
__device__ __forceinline__ void reduce_tokens(const CombineArgs& args, const int* recv_counts,
                                              LowLatencyControl* control,
                                              unsigned long long arrived_before, uint64_t seq,
                                              int num_ranks, int me) {
  __shared__ TokenSources sources[kOwnerPassTokens];
  const int tid = static_cast<int>(threadIdx.x);
  const uint64_t tag = seq + 1;
  const int parity = static_cast<int>(seq & 1);

  // Phase 3 (run inside the first pass, after the own rows are summed).
  auto release_and_wait_peers = [&]() {
    if constexpr (kReleaseHere) {
      release_flags_if_last<true>(args, control, arrived_before, seq, parity, num_ranks, me);
    }
    wait_peer_flags(args, tag, parity, num_ranks, me);
  };

  // Phases 2 and 4.
  const int vecs = args.rank.layout.hidden / kBf16PerVector;
  const int total = args.num_tokens * vecs;
  const int share = max(ceil_div(total, static_cast<int>(gridDim.x)), kOwnerMinVecs);
  const int begin = min(total, static_cast<int>(blockIdx.x) * share);
  const int end = min(total, begin + share);
  bool peers_arrived = false;
  for (int v0 = begin; v0 < end;) {
    const int t0 = v0 / vecs;
    const int v1 = min(min(end, v0 + kOwnerPassVecs), (t0 + kOwnerPassTokens) * vecs);
    find_token_sources(args, recv_counts, t0, (v1 - 1) / vecs - t0 + 1, parity, sources);
    if (v0 == begin) timeline_mark(2);
    const TokenSources* src[kOwnerVecsPerThread];
    int vec[kOwnerVecsPerThread];
#pragma unroll
    for (int j = 0; j < kOwnerVecsPerThread; ++j) {
      const int v = v0 + tid + j * kLowLatencyThreads;
      src[j] = v < v1 ? &sources[v / vecs - t0] : nullptr;
      vec[j] = v - (v / vecs) * vecs;
    }
    float acc[kOwnerVecsPerThread][kBf16PerVector] = {};
    accumulate_rows<true>(acc, src, vec, 0);
    if (!peers_arrived) {  // block-uniform
      timeline_mark(3);
      release_and_wait_peers();
      timeline_mark(4);
      peers_arrived = true;
    }
    accumulate_rows<false>(acc, src, vec, 1);
#pragma unroll
    for (int j = 0; j < kOwnerVecsPerThread; ++j) {
      const int v = v0 + tid + j * kLowLatencyThreads;
      if (v >= v1) continue;
      int4 packed;
      __nv_bfloat162* pairs = reinterpret_cast<__nv_bfloat162*>(&packed);
#pragma unroll
      for (int c = 0; c < kBf16PerVector / 2; ++c) {
        pairs[c] = __floats2bfloat162_rn(acc[j][2 * c], acc[j][2 * c + 1]);
      }
      st_v4(reinterpret_cast<int4*>(args.out) + v, packed);
    }
    __syncthreads();  // `sources` is rebuilt for the next pass
    v0 = v1;
  }
  // Every block waits for every peer, also without tokens: the parity argument needs every call
  // to observe every peer's flag before it ends.
  if (!peers_arrived) release_and_wait_peers();
  timeline_mark(5);
}

// Grid: low_latency_grid_size blocks (cooperative, at most one per SM; by default all SMs but
// kLowLatencyFreeSms), kLowLatencyThreads threads. Dynamic shared memory (receive half): the
// handle's recv_count, E_loc ints.
// kHalves picks the phases: kBoth (fused op) runs 1-4; kSend runs 1 and the arrival/flag release
// of 3, then stores the ticket; kRecv runs 2, the wait of 3, 4 and 5. The send launch and the
// receive launch of one call read the same sequence word (only phase 5 advances it).
template <LowLatencyHalves kHalves>
__global__ void __launch_bounds__(kLowLatencyThreads, 1)
    low_latency_combine_kernel(const __grid_constant__ CombineArgs args) {
  const int num_ranks = args.rank.layout.num_ranks;
  const int me = args.rank.rank;

  LowLatencyControl* control = low_latency_control(args.rank);
  const uint64_t seq = ld_volatile_u64(&control->combine_seq);
  const uint64_t tag = seq + 1;
  const int parity = static_cast<int>(seq & 1);

  // The handle's counts for phase 2, loaded first so that they fly during phase 1.
  extern __shared__ int recv_counts[];  // [E_loc] (receive half)
  if constexpr (runs_recv_half(kHalves)) {
    const LowLatencyLayout& layout = args.rank.layout;
    const int rows_per_expert = layout.num_ranks * layout.max_tokens;
    for (int e = static_cast<int>(threadIdx.x); e < layout.num_local_experts; e += blockDim.x) {
      recv_counts[e] = min(max(__ldg(args.recv_count + e), 0), rows_per_expert);
    }
  }

  timeline_begin();
  // Phase 1.
  if constexpr (runs_send_half(kHalves)) send_rows(args, parity);
  timeline_mark(1);

  __syncthreads();  // phase 1's stores (arrival), recv_counts
  // Phase 3's arrival (fused op and send half).
  unsigned long long arrived_before = 0;
  if constexpr (runs_send_half(kHalves)) {
    arrived_before = begin_arrival(&control->combine_blocks_sent);
  }
  if constexpr (runs_recv_half(kHalves)) {
    // Phases 2-4.
    reduce_tokens<runs_send_half(kHalves)>(args, recv_counts, control, arrived_before, seq,
                                           num_ranks, me);
    timeline_mark(6);
    // Phase 5 (the fused op advanced the sequence word at its release).
    if constexpr (!runs_send_half(kHalves)) {
      finish_launch(&control->combine_blocks_done, &control->combine_seq, seq);
    }
  } else {
    // Phase 3, send half: publish this call's rows now; the receive launch waits for them.
    release_flags_if_last<false>(args, control, arrived_before, seq, parity, num_ranks, me);
    store_ticket(args.ticket, tag);
  }
  timeline_mark(7);
  timeline_print("ll_combine", static_cast<int>(kHalves));
}

// Launches the phases kHalves of one combine call.
template <LowLatencyHalves kHalves>
cudaError_t launch_combine_halves(const RankContext& ctx, const LowLatencyCombineParams& params,
                                  cudaStream_t stream) {
  int num_blocks = 0;
  const cudaError_t err = low_latency_grid_size(ctx, &num_blocks);
  if (err != cudaSuccess) return err;

  CombineArgs args = {};
  args.rank = make_low_latency_rank(ctx, kHalves);
  args.y = static_cast<const __nv_bfloat16*>(params.y);
  args.topk_idx = params.topk_idx;
  args.topk_weights = params.topk_weights;
  args.recv_src = params.recv_src;
  args.recv_k = params.recv_k;
  args.recv_count = params.recv_count;
  args.out = static_cast<__nv_bfloat16*>(params.out);
  args.num_tokens = params.num_tokens;
  args.num_experts = ctx.config.num_experts;
  args.ticket = params.ticket;

  const size_t smem_bytes =
      runs_recv_half(kHalves) ? ctx.config.num_local_experts() * sizeof(int) : 0;
  return launch_low_latency_kernel(low_latency_combine_kernel<kHalves>, num_blocks, smem_bytes,
                                   stream, args);
}

}  // namespace

cudaError_t launch_low_latency_combine(const RankContext& ctx,
                                       const LowLatencyCombineParams& params,
                                       LowLatencyHalves halves, cudaStream_t stream) {
  return launch_low_latency_op(
      ctx, halves, [&] { return launch_low_latency_combine_put(ctx, params, halves, stream); },
      [&](auto h) { return launch_combine_halves<decltype(h)::value>(ctx, params, stream); });
}

cudaError_t preload_low_latency_combine_kernels() {
  return preload_every_halves([](auto h) {
    cudaFuncAttributes attributes;
    return cudaFuncGetAttributes(&attributes, low_latency_combine_kernel<decltype(h)::value>);
  });
}

}  // namespace jax_ep
