// Normal-mode dispatch (jax_ep_dispatch_v2) and cached dispatch (jax_ep_cached_dispatch_v2).
//
// Two kernels per call, on the caller's stream:
//   1. dispatch_plan_kernel (cooperative; a block per kPlanTokensPerBlock tokens, at most one
//      per SM): token -> rank masks, per-destination stream positions (per-block counts, a scan
//      over blocks, then one inside each block), count exchange with every rank, send_pos /
//      num_recv_tokens, the plan and the inverse maps send_tokens[dst][position] = token.
//   2. dispatch_transfer_kernel (many blocks): pushes rows into the peers' data regions at their
//      final output row (one release flag per row), copies this rank's own rows straight from x,
//      zero-fills the padding rows, and copies arrived peer rows into the outputs as their flags
//      come in, so the local pass overlaps the transfer.
// The cached dispatch runs the same two kernels with routing taken from send_pos (mask
// send_pos >= 0) and an optional float32 payload `w` instead of ids/weights/src.
#include <cuda_runtime.h>

#include <algorithm>

#include "kernels/common/copy.cuh"
#include "kernels/common/fast_divisor.h"
#include "kernels/common/launch.h"
#include "kernels/common/limits.h"
#include "kernels/common/sync.cuh"
#include "kernels/normal/normal.h"
#include "kernels/normal/normal_transport.cuh"
#include "kernels/normal/normal_workspace.h"

namespace jax_ep {
namespace {

using transport::EmulatedTransport;
using transport::MappedTransport;

// One token per thread per round; the block size is the layout's unit of per-block counts.
constexpr int kPlanThreads = kPlanTokensPerBlock;
constexpr int kPlanWarps = kPlanThreads / kWarpSize;
static_assert(kPlanThreads % kWarpSize == 0, "whole warps: positions come from warp ballots");
static_assert(kMaxRanks * kMaxRanks <= kPlanThreads, "one thread per count-matrix entry");
static_assert(kMaxRanks <= 8, "a token's rank mask is one byte (token_masks)");
// Per-block count words a thread loads before it checks any, so the loads overlap.
constexpr int kPlanPrefixBatch = 4;
// Rounds whose masks a thread keeps in one register (a byte each); later rounds store theirs in
// token_masks and read them back (only when T > kPlanKeptRounds * kPlanThreads * blocks).
constexpr int kPlanKeptRounds = 4;

constexpr int kTransferThreads = kNormalTransferThreads;
constexpr int kTransferWarps = kTransferThreads / kWarpSize;
// Rows of one self / padding / receive work item: two rows per warp of the block.
constexpr int kRowsPerItem = 2 * kTransferWarps;
static_assert(kRowsPerItem % kTransferWarps == 0 && kRowsPerItem / kTransferWarps <= kWarpSize,
              "a warp acquires the flags of its rows of an item with one lane per row");
// Local experts counted in a shared-memory histogram per block; more go to global atomics.
constexpr int kTransferSharedExperts = 8192;

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
  NormalPlan* plan;
  int32_t* send_tokens;   // [kMaxRanks][T_max]
  uint8_t* token_masks;   // [T_max]
  uint64_t* plan_counts;  // [blocks][kMaxRanks]
  const uint64_t* count_matrix;
  uint64_t* peer_count_matrix[kMaxRanks];  // every rank's count matrix (this one's included)
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
// bound by its instruction latency, and unrolling them to kMaxRanks cost every rank count the
// work of 8).
// Over a transport (Path a TransportPath), warp 0 of the last block signals each entry of the
// row instead (kSet, the same tagged word) to every other rank; its own row it never reads.
template <int kRankSlots, typename Path>
__global__ void __launch_bounds__(kPlanThreads) dispatch_plan_kernel(const DispatchPlanArgs args) {
  const Path path = PathOf<Path>::of(args.transport);
  __shared__ int own_count[kMaxRanks];   // this block's tokens per destination
  __shared__ int block_base[kMaxRanks];  // first position of this block's tokens in each stream
  __shared__ int warp_counts[kPlanWarps][kMaxRanks];
  __shared__ int matrix[kMaxRanks][kMaxRanks];
  __shared__ int dest_base[kMaxRanks];

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

  if (tid < kMaxRanks) block_base[tid] = 0;
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
      st_relaxed_gpu(args.plan_counts + block * kMaxRanks + r,
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
    auto word_at = [&](int w) {
      return args.plan_counts + (w / num_ranks) * kMaxRanks + w % num_ranks;
    };
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
  const int64_t parity_offset = static_cast<int64_t>(tag & 1) * kCountMatrixStride;
  if constexpr (is_stores_path<Path>) {
    if (last_block && tid < num_ranks * num_ranks) {
      const int peer = tid / num_ranks;
      const int dst = tid % num_ranks;
      st_release_sys(
          args.peer_count_matrix[peer] + parity_offset + rank * kMaxRanks + dst,
          pack_tagged_count(tag, static_cast<uint32_t>(block_base[dst] + own_count[dst])));
    }
  } else if (last_block && warp == 0) {
    auto t = make_normal_transport(path, rank, 0, args.wait);
    for (int i = 0; i < num_ranks * num_ranks; ++i) {
      const int peer = i / num_ranks;
      const int dst = i % num_ranks;
      if (peer == rank) continue;
      const int64_t word = parity_offset + rank * kMaxRanks + dst;
      t.signal(peer, in_normal_area(path.args.layout.count_matrix + word * sizeof(uint64_t)),
               pack_tagged_count(tag, static_cast<uint32_t>(block_base[dst] + own_count[dst])),
               transport::SignalOp::kSet, lane);
    }
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
                                 args.count_matrix + parity_offset + src * kMaxRanks + dst, tag,
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
      args.plan->send_count[r] = matrix[rank][r];
      args.plan->dest_base[r] = base;
      args.plan->recv_count[r] = matrix[r][rank];
      args.plan->recv_prefix[r] = prefix;
    }
  }
  if (last_block && tid == 0) {
    int num_recv = 0;
    for (int s = 0; s < num_ranks; ++s) num_recv += matrix[s][rank];
    args.plan->num_recv = num_recv;
    if (routing) {
      *args.num_recv_tokens = num_recv;
      if (num_recv > args.capacity) {
        atomicAdd(&args.errors->overflow_rows,
                  static_cast<unsigned long long>(num_recv - args.capacity));
      }
    }
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
  const NormalPlan* plan;
  const int32_t* send_tokens;
  uint64_t* seq;
  uint32_t* work_counter;
  uint32_t* done_counter;
  const char* rows;  // data region
  const uint64_t* row_flags;
  // Every rank's data region and row flags (this one's included).
  char* peer_rows[kMaxRanks];
  uint64_t* peer_row_flags[kMaxRanks];
  int64_t region_bytes_per_row;
  int num_push_blocks;
  WaitContext wait;
  NormalTransportArgs transport;  // a transport path's (last: the stores path never reads it)
};

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
//   [push roles] [own rows] [padding rows] [peer rows, position-major over the peers]
// - push role p (the first num_push_blocks items): warp g = p*W + w pushes entries q = g, g+P*W,
//   ... of the list (position, peer) in position-major order: token send_tokens[peer][pos] to
//   row dest_base[peer] + pos of the peer's region (x row, then aux words with the ids made
//   local to the peer), then __syncwarp + release-stores tag into the peer's row flag
//   [rank][pos]. Rows at or past the peer's capacity are not sent.
// - own rows: x[token] -> recv row recv_prefix[rank] + pos, aux computed here.
// - padding rows [min(num_recv, C), C): x/scales/weights/payload 0, ids/src -1.
// - peer rows of source s, positions [l*kRowsPerItem, (l+1)*kRowsPerItem): each warp acquires
//   the row flags [s][pos] of its rows (bounded waits, one lane per row), then copies region
//   rows -> outputs.
// Grid: ctx.normal_blocks blocks of kTransferThreads. Deadlock freedom does not need all blocks
// to be resident: items are claimed in order, so every push role is claimed (by a running block
// that never waits) before any block can claim a waiting item. The last block to finish stores
// the call's sequence number (finish_transfer_block).
// Over a transport (Path a TransportPath) a push warp stages each row in its send slots and
// puts it with its flag (RowSender), and quiets before it leaves its role: the next call
// restages those slots. A quiet waits only for the proxy or the network, never for a receiver.
template <typename Path>
__global__ void __launch_bounds__(kTransferThreads, 1)
    dispatch_transfer_kernel(const DispatchTransferArgs args) {
  const Path path = PathOf<Path>::of(args.transport);
  extern __shared__ int histogram[];
  __shared__ NormalPlan plan;
  __shared__ int send_valid[kMaxRanks];  // rows sent to each rank that fit its capacity
  __shared__ int recv_valid[kMaxRanks];  // rows received from each rank that fit the capacity
  __shared__ int claimed_item;

  const int tid = threadIdx.x;
  const int lane = tid % kWarpSize;
  const int warp = tid / kWarpSize;
  const int num_ranks = args.num_ranks;
  const int rank = args.rank;
  const int capacity = args.capacity;
  const uint64_t tag = *reinterpret_cast<const volatile uint64_t*>(args.seq) + 1;

  static_assert(sizeof(NormalPlan) % sizeof(int) == 0, "plan is copied word by word");
  if (tid < static_cast<int>(sizeof(NormalPlan) / sizeof(int))) {
    reinterpret_cast<int*>(&plan)[tid] = __ldg(reinterpret_cast<const int*>(args.plan) + tid);
  }
  for (int e = tid; e < args.num_shared_experts; e += kTransferThreads) histogram[e] = 0;
  __syncthreads();
  if (tid < num_ranks) {
    send_valid[tid] = max(0, min(capacity - plan.dest_base[tid], plan.send_count[tid]));
    recv_valid[tid] = max(0, min(capacity - plan.recv_prefix[tid], plan.recv_count[tid]));
  }
  __syncthreads();

  const int num_peers = num_ranks - 1;
  int max_send = 0;
  int max_recv = 0;
  for (int r = 0; r < num_ranks; ++r) {
    if (r == rank) continue;
    max_send = max(max_send, send_valid[r]);
    max_recv = max(max_recv, recv_valid[r]);
  }
  const int num_valid = min(plan.num_recv, capacity);
  const int num_own = recv_valid[rank];
  const int num_push_items = num_peers > 0 ? args.num_push_blocks : 0;
  const int num_own_items = (num_own + kRowsPerItem - 1) / kRowsPerItem;
  const int num_pad_items = (capacity - num_valid + kRowsPerItem - 1) / kRowsPerItem;
  const int num_levels = (max_recv + kRowsPerItem - 1) / kRowsPerItem;
  const int num_items = num_push_items + num_own_items + num_pad_items + num_levels * num_peers;

  for (;;) {
    int item = claim_work_item(args.work_counter, &claimed_item);
    if (item >= num_items) break;

    if (item < num_push_items) {
      const int64_t num_push_warps = static_cast<int64_t>(args.num_push_blocks) * kTransferWarps;
      const int64_t num_entries = static_cast<int64_t>(max_send) * num_peers;
      const int64_t push_warp = static_cast<int64_t>(item) * kTransferWarps + warp;
      RowSender<Path> sender(path, rank, args.wait, push_warp, num_push_warps,
                             args.region_bytes_per_row);
      for (int64_t q = push_warp; q < sender.end(num_entries); q += sender.stride(num_push_warps)) {
        const int pos = static_cast<int>(q / num_peers);
        const int dst = (rank + 1 + static_cast<int>(q % num_peers)) % num_ranks;
        if (pos >= send_valid[dst]) continue;
        const int token =
            __ldg(args.send_tokens + static_cast<int64_t>(dst) * args.max_tokens + pos);
        char* const rows = sender.rows(args.peer_rows, dst);
        const int64_t row = plan.dest_base[dst] + pos;
        const int64_t at = sender.next_row(row, lane);
        const RegionRow region = region_row(args, rows, at);
        warp_copy_vectors<true>(reinterpret_cast<int4*>(region.x),
                                reinterpret_cast<const int4*>(args.x + static_cast<int64_t>(token) *
                                                                           args.x_bytes_per_row),
                                args.x_bytes_per_row / kBytesPerVector, lane);
        write_row_aux(args, token, dst, region.scales, region.ids, region.weights, region.src,
                      region.payload, nullptr, lane);
        const auto flag_index = [&] { return static_cast<int64_t>(rank) * args.max_tokens + pos; };
        sender.send(args.peer_row_flags, dst, row, at, flag_index, tag, lane);
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

    // Peer rows: level-major, so blocks follow the order in which the peers push.
    const int level = item / num_peers;
    const int src = (rank + 1 + item % num_peers) % num_ranks;
    const int end = min(recv_valid[src], (level + 1) * kRowsPerItem);
    const int first = level * kRowsPerItem + warp;
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
      const RegionRow region = region_row(args, const_cast<char*>(args.rows), row);
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
  }

  __syncthreads();
  for (int e = tid; e < args.num_shared_experts; e += kTransferThreads) {
    if (histogram[e] != 0) atomicAdd(&args.num_recv_tokens_per_expert[e], histogram[e]);
  }
  finish_transfer_block(args.work_counter, args.done_counter, args.seq, tag);
}

// Fields shared by the plan arguments of dispatch and cached dispatch.
DispatchPlanArgs make_plan_args(const RankContext& ctx, const NormalLayout& layout, int num_tokens,
                                int capacity, WaitPhase phase) {
  const BufferConfig& config = ctx.config;
  DispatchPlanArgs args = {};
  args.num_tokens = num_tokens;
  args.num_topk = config.num_topk;
  args.num_ranks = config.num_ranks;
  args.rank = ctx.rank;
  args.num_experts = config.num_experts;
  args.num_local_experts = config.num_local_experts();
  args.experts_per_rank = FastDivisor(static_cast<uint32_t>(config.num_local_experts()));
  args.max_tokens = config.max_tokens_per_rank;
  args.capacity = capacity;
  args.seq = reinterpret_cast<const uint64_t*>(ctx.workspace + layout.seq);
  args.plan = reinterpret_cast<NormalPlan*>(ctx.workspace + layout.plan);
  args.send_tokens = reinterpret_cast<int32_t*>(ctx.workspace + layout.send_tokens);
  args.token_masks = reinterpret_cast<uint8_t*>(ctx.workspace + layout.token_masks);
  args.plan_counts = reinterpret_cast<uint64_t*>(ctx.workspace + layout.plan_counts);
  args.count_matrix = reinterpret_cast<const uint64_t*>(ctx.workspace + layout.count_matrix);
  for (int r = 0; r < config.num_ranks; ++r) {
    args.peer_count_matrix[r] =
        reinterpret_cast<uint64_t*>(ctx.peer_workspaces[r] + layout.count_matrix);
  }
  args.errors = ctx.error_counters;
  args.wait = {ctx.timeout_ns, ctx.timeout_record, ctx.rank, static_cast<int32_t>(phase)};
  if (normal_over_transport(config)) args.transport = normal_transport_args(ctx);
  return args;
}

// The plan kernel of kRankSlots on the rank's path: stores, or a device transport.
template <int kRankSlots>
cudaError_t launch_plan_on_path(const RankContext& ctx, int num_blocks, cudaStream_t stream,
                                const DispatchPlanArgs& args) {
  switch (ctx.config.device_transport) {
    case DeviceTransport::kMapped:
      return launch_cooperative(dispatch_plan_kernel<kRankSlots, TransportPath<MappedTransport>>,
                                num_blocks, kPlanThreads, 0, stream, args);
    case DeviceTransport::kEmulated:
      return launch_cooperative(dispatch_plan_kernel<kRankSlots, TransportPath<EmulatedTransport>>,
                                num_blocks, kPlanThreads, 0, stream, args);
    default:  // stores (kNvshmem carries the low-latency ops only)
      return launch_cooperative(dispatch_plan_kernel<kRankSlots, StoresPath>, num_blocks,
                                kPlanThreads, 0, stream, args);
  }
}

// Grid of the plan: one block per kPlanTokensPerBlock tokens (so at most plan_block_slots()),
// at most one per SM (cooperative), at least one (it also runs the exchange when T = 0).
cudaError_t launch_plan(const RankContext& ctx, DispatchPlanArgs args, cudaStream_t stream) {
  int num_sms = 0;
  CUDA_RETURN_IF_ERROR(device_num_sms(ctx.device, ctx.num_sms, &num_sms));
  const int num_blocks =
      std::max(1, std::min(ceil_div(args.num_tokens, kPlanTokensPerBlock), num_sms));
  args.tokens_per_block = ceil_div(args.num_tokens, num_blocks);
  if (args.num_ranks <= 1) return launch_plan_on_path<1>(ctx, num_blocks, stream, args);
  if (args.num_ranks <= 2) return launch_plan_on_path<2>(ctx, num_blocks, stream, args);
  if (args.num_ranks <= 4) return launch_plan_on_path<4>(ctx, num_blocks, stream, args);
  static_assert(kMaxRanks == 8, "one instance per power of two up to kMaxRanks");
  return launch_plan_on_path<8>(ctx, num_blocks, stream, args);
}

DispatchTransferArgs make_transfer_args(const RankContext& ctx, const NormalLayout& layout,
                                        int num_tokens, int capacity, WaitPhase phase) {
  const BufferConfig& config = ctx.config;
  DispatchTransferArgs args = {};
  args.num_tokens = num_tokens;
  args.capacity = capacity;
  args.num_ranks = config.num_ranks;
  args.rank = ctx.rank;
  args.num_local_experts = config.num_local_experts();
  args.experts_per_rank = FastDivisor(static_cast<uint32_t>(config.num_local_experts()));
  args.max_tokens = config.max_tokens_per_rank;
  args.plan = reinterpret_cast<const NormalPlan*>(ctx.workspace + layout.plan);
  args.send_tokens = reinterpret_cast<const int32_t*>(ctx.workspace + layout.send_tokens);
  args.seq = reinterpret_cast<uint64_t*>(ctx.workspace + layout.seq);
  args.work_counter = reinterpret_cast<uint32_t*>(ctx.workspace + layout.counters);
  args.done_counter = args.work_counter + 1;
  args.rows = ctx.workspace + layout.data;
  args.row_flags = reinterpret_cast<const uint64_t*>(ctx.workspace + layout.row_flags);
  for (int r = 0; r < config.num_ranks; ++r) {
    args.peer_rows[r] = ctx.peer_workspaces[r] + layout.data;
    args.peer_row_flags[r] = reinterpret_cast<uint64_t*>(ctx.peer_workspaces[r] + layout.row_flags);
  }
  args.num_push_blocks = ctx.normal_push_blocks;
  args.wait = {ctx.timeout_ns, ctx.timeout_record, ctx.rank, static_cast<int32_t>(phase)};
  if (normal_over_transport(config)) args.transport = normal_transport_args(ctx);
  return args;
}

cudaError_t launch_transfer(const RankContext& ctx, const DispatchTransferArgs& args,
                            cudaStream_t stream) {
  const size_t shared_bytes = sizeof(int) * args.num_shared_experts;
  const int grid = ctx.normal_blocks;
  switch (ctx.config.device_transport) {
    case DeviceTransport::kMapped:
      dispatch_transfer_kernel<TransportPath<MappedTransport>>
          <<<grid, kTransferThreads, shared_bytes, stream>>>(args);
      break;
    case DeviceTransport::kEmulated:
      dispatch_transfer_kernel<TransportPath<EmulatedTransport>>
          <<<grid, kTransferThreads, shared_bytes, stream>>>(args);
      break;
    default:  // stores (kNvshmem carries the low-latency ops only)
      dispatch_transfer_kernel<StoresPath><<<grid, kTransferThreads, shared_bytes, stream>>>(args);
  }
  return cudaGetLastError();
}

template <typename Path>
cudaError_t preload_dispatch_kernels_on() {
  cudaFuncAttributes attributes;
  CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attributes, dispatch_plan_kernel<1, Path>));
  CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attributes, dispatch_plan_kernel<2, Path>));
  CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attributes, dispatch_plan_kernel<4, Path>));
  CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attributes, dispatch_plan_kernel<8, Path>));
  return cudaFuncGetAttributes(&attributes, dispatch_transfer_kernel<Path>);
}

}  // namespace

cudaError_t launch_dispatch(const RankContext& ctx, const DispatchParams& params,
                            cudaStream_t stream) {
  const NormalLayout layout = normal_layout(ctx.config);

  DispatchPlanArgs plan =
      make_plan_args(ctx, layout, params.num_tokens, params.capacity, WaitPhase::kDispatchCounts);
  plan.topk_idx = params.topk_idx;
  plan.send_pos_out = params.send_pos;
  plan.num_recv_tokens = params.num_recv_tokens;
  plan.num_recv_tokens_per_expert = params.num_recv_tokens_per_expert;
  CUDA_RETURN_IF_ERROR(launch_plan(ctx, plan, stream));

  DispatchTransferArgs transfer = make_transfer_args(ctx, layout, params.num_tokens,
                                                     params.capacity, WaitPhase::kDispatchArrival);
  transfer.x = static_cast<const char*>(params.x);
  transfer.x_bytes_per_row = params.x_bytes_per_row;
  transfer.x_scales = params.x_scales;
  transfer.num_scales = params.num_scales;
  transfer.topk_idx = params.topk_idx;
  transfer.topk_weights = params.topk_weights;
  transfer.num_topk = ctx.config.num_topk;
  transfer.recv_x = static_cast<char*>(params.recv_x);
  transfer.recv_scales = params.recv_scales;
  transfer.recv_topk_idx = params.recv_topk_idx;
  transfer.recv_topk_weights = params.recv_topk_weights;
  transfer.recv_src = params.recv_src;
  transfer.num_recv_tokens_per_expert = params.num_recv_tokens_per_expert;
  transfer.num_shared_experts = ctx.config.num_local_experts() < kTransferSharedExperts
                                    ? ctx.config.num_local_experts()
                                    : kTransferSharedExperts;
  transfer.region_bytes_per_row =
      dispatch_region_row_bytes(params.x_bytes_per_row, params.num_scales, ctx.config.num_topk);
  return launch_transfer(ctx, transfer, stream);
}

cudaError_t launch_cached_dispatch(const RankContext& ctx, const CachedDispatchParams& params,
                                   cudaStream_t stream) {
  const NormalLayout layout = normal_layout(ctx.config);

  DispatchPlanArgs plan =
      make_plan_args(ctx, layout, params.num_tokens, params.capacity, WaitPhase::kCombineBarrier);
  plan.send_pos = params.send_pos;
  CUDA_RETURN_IF_ERROR(launch_plan(ctx, plan, stream));

  DispatchTransferArgs transfer = make_transfer_args(ctx, layout, params.num_tokens,
                                                     params.capacity, WaitPhase::kCombineArrival);
  transfer.x = static_cast<const char*>(params.x);
  transfer.x_bytes_per_row = params.x_bytes_per_row;
  transfer.x_scales = params.x_scales;
  transfer.num_scales = params.num_scales;
  transfer.payload = params.w;
  transfer.num_payload = params.num_w;
  transfer.recv_x = static_cast<char*>(params.recv_x);
  transfer.recv_scales = params.recv_scales;
  transfer.recv_payload = params.recv_w;
  transfer.region_bytes_per_row =
      cached_dispatch_region_row_bytes(params.x_bytes_per_row, params.num_scales, params.num_w);
  return launch_transfer(ctx, transfer, stream);
}

size_t normal_data_bytes(const BufferConfig& config) { return normal_layout(config).data_bytes; }

int64_t dispatch_region_row_bytes(int64_t x_bytes_per_row, int num_scales, int num_topk) {
  return region_row_bytes(x_bytes_per_row, dispatch_aux_words(num_scales, num_topk));
}

int64_t cached_dispatch_region_row_bytes(int64_t x_bytes_per_row, int num_scales, int num_w) {
  return region_row_bytes(x_bytes_per_row, num_scales + num_w);
}

cudaError_t preload_dispatch_kernels() { return preload_dispatch_kernels_on<StoresPath>(); }

cudaError_t preload_dispatch_transport_kernels() {
  CUDA_RETURN_IF_ERROR(preload_dispatch_kernels_on<TransportPath<MappedTransport>>());
  return preload_dispatch_kernels_on<TransportPath<EmulatedTransport>>();
}

}  // namespace jax_ep
