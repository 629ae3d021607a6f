// Normal-mode dispatch (jax_ep_dispatch_v2) and cached dispatch (jax_ep_cached_dispatch_v2).
//
// Two kernels per call, on the caller's stream:
//   1. dispatch_plan_kernel (1 block): token -> rank masks, per-destination stream positions
//      (block scan), count exchange with every rank, send_pos / num_recv_tokens, the plan and
//      the inverse maps send_tokens[dst][position] = token.
//   2. dispatch_transfer_kernel (many blocks): pushes rows into the peers' data regions at their
//      final output row (one release flag per row), copies this rank's own rows straight from x,
//      zero-fills the padding rows, and copies arrived peer rows into the outputs as their flags
//      come in, so the local pass overlaps the transfer.
// The cached dispatch runs the same two kernels with routing taken from send_pos (mask
// send_pos >= 0) and an optional float32 payload `w` instead of ids/weights/src.
#include <cuda_runtime.h>

#include "kernels/common/copy.cuh"
#include "kernels/common/launch.h"
#include "kernels/common/limits.h"
#include "kernels/common/sync.cuh"
#include "kernels/normal.h"
#include "kernels/normal_workspace.h"

namespace jax_ep {
namespace {

constexpr int kPlanThreads = 1024;
constexpr int kPlanWarps = kPlanThreads / kWarpSize;
static_assert(kPlanWarps == kWarpSize, "the plan scan combines one total per warp in one warp");
static_assert(kMaxRanks * kMaxRanks <= kPlanThreads, "one thread per count-matrix entry");

constexpr int kTransferThreads = 512;
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
  int num_topk;
  int num_ranks;
  int rank;
  int num_experts;
  int num_local_experts;
  int max_tokens;
  int capacity;
  // Outputs of the dispatch (null in cached mode).
  int32_t* send_pos_out;                // [T, R]
  int32_t* num_recv_tokens;             // []
  int32_t* num_recv_tokens_per_expert;  // [E_loc], zeroed here for the transfer kernel
  // Workspace of this rank.
  const uint64_t* seq;
  NormalPlan* plan;
  int32_t* send_tokens;  // [kMaxRanks][T_max]
  uint8_t* token_masks;  // [T_max]
  const uint64_t* count_matrix;
  uint64_t* peer_count_matrix[kMaxRanks];  // every rank's count matrix (this one's included)
  ErrorCounters* errors;
  WaitContext wait;
};

// Role: routing summary and count exchange of one call; one block of kPlanThreads, thread i owns
// the consecutive tokens [i*n, (i+1)*n), n = ceil(T / kPlanThreads).
// Synchronisation: writes its count row (tag-stamped words, release) into every rank's matrix
// (the one of the tag's parity), then spins on all R x R words of its own. A rank writes its row
// for call e only after its previous kernels (call e-1) finished, and the transfer kernel pushes
// only after this kernel, so seeing every row of call e means no rank still reads its data
// region or row flags for call e-1: the exchange is also the barrier that lets a single data
// region be reused every call.
__global__ void __launch_bounds__(kPlanThreads, 1)
    dispatch_plan_kernel(const DispatchPlanArgs args) {
  __shared__ int warp_offsets[kPlanWarps][kMaxRanks];
  __shared__ int totals[kMaxRanks];
  __shared__ int matrix[kMaxRanks][kMaxRanks];
  __shared__ int dest_base[kMaxRanks];
  __shared__ int invalid_ids;

  const int tid = threadIdx.x;
  const int lane = tid % kWarpSize;
  const int warp = tid / kWarpSize;
  const int num_ranks = args.num_ranks;
  const int rank = args.rank;
  const int num_tokens = args.num_tokens;
  const bool routing = args.topk_idx != nullptr;
  const uint64_t tag = *reinterpret_cast<const volatile uint64_t*>(args.seq) + 1;

  if (tid == 0) invalid_ids = 0;
  if (routing) {
    for (int e = tid; e < args.num_local_experts; e += kPlanThreads) {
      args.num_recv_tokens_per_expert[e] = 0;
    }
  }

  // 1. Rank mask of every token (coalesced: token t by thread t mod kPlanThreads; all ids of a
  //    token are loaded before they are used, so each token costs one memory latency).
  int num_invalid = 0;
  for (int t = tid; t < num_tokens; t += kPlanThreads) {
    uint32_t mask = 0;
    if (routing) {
      const int32_t* row = args.topk_idx + static_cast<int64_t>(t) * args.num_topk;
      int ids[kMaxTopk];
#pragma unroll
      for (int k = 0; k < kMaxTopk; ++k) ids[k] = k < args.num_topk ? __ldg(row + k) : -1;
#pragma unroll
      for (int k = 0; k < kMaxTopk; ++k) {
        const int expert = ids[k];
        if (expert == -1) continue;
        if (expert < -1 || expert >= args.num_experts) {
          ++num_invalid;
          continue;
        }
        mask |= 1u << (expert / args.num_local_experts);
      }
    } else {
      const int32_t* row = args.send_pos + static_cast<int64_t>(t) * num_ranks;
      int pos[kMaxRanks];
#pragma unroll
      for (int r = 0; r < kMaxRanks; ++r) pos[r] = r < num_ranks ? __ldg(row + r) : -1;
#pragma unroll
      for (int r = 0; r < kMaxRanks; ++r) mask |= (pos[r] >= 0 ? 1u : 0u) << r;
    }
    args.token_masks[t] = static_cast<uint8_t>(mask);
  }
  __syncthreads();  // token_masks written, invalid_ids initialised
  if (num_invalid > 0) atomicAdd(&invalid_ids, num_invalid);

  // Counts of this thread's consecutive tokens [token_begin, token_end) per destination.
  const int tokens_per_thread = (num_tokens + kPlanThreads - 1) / kPlanThreads;
  const int token_begin = min(num_tokens, tid * tokens_per_thread);
  const int token_end = min(num_tokens, token_begin + tokens_per_thread);
  int count[kMaxRanks];
#pragma unroll
  for (int r = 0; r < kMaxRanks; ++r) count[r] = 0;
  for (int t = token_begin; t < token_end; ++t) {
    const uint32_t mask = args.token_masks[t];
#pragma unroll
    for (int r = 0; r < kMaxRanks; ++r) count[r] += (mask >> r) & 1u;
  }

  // 2. Exclusive scan of the counts over threads: offset[r] = this thread's first position in
  //    the stream to rank r. Warp scan, then one warp scans the warp totals.
  int offset[kMaxRanks];
#pragma unroll
  for (int r = 0; r < kMaxRanks; ++r) {
    int inclusive = count[r];
#pragma unroll
    for (int delta = 1; delta < kWarpSize; delta <<= 1) {
      const int other = __shfl_up_sync(0xffffffffu, inclusive, delta);
      if (lane >= delta) inclusive += other;
    }
    if (lane == kWarpSize - 1) warp_offsets[warp][r] = inclusive;
    offset[r] = inclusive - count[r];
  }
  __syncthreads();
  if (warp == 0) {
#pragma unroll
    for (int r = 0; r < kMaxRanks; ++r) {
      const int warp_total = warp_offsets[lane][r];
      int inclusive = warp_total;
#pragma unroll
      for (int delta = 1; delta < kWarpSize; delta <<= 1) {
        const int other = __shfl_up_sync(0xffffffffu, inclusive, delta);
        if (lane >= delta) inclusive += other;
      }
      warp_offsets[lane][r] = inclusive - warp_total;
      if (lane == kWarpSize - 1) totals[r] = inclusive;
    }
  }
  __syncthreads();
#pragma unroll
  for (int r = 0; r < kMaxRanks; ++r) offset[r] += warp_offsets[warp][r];

  // 3. Publish this rank's counts: entry [rank][dst] of every rank's matrix of this parity.
  const int64_t parity_offset = static_cast<int64_t>(tag & 1) * kCountMatrixStride;
  if (tid < num_ranks * num_ranks) {
    const int peer = tid / num_ranks;
    const int dst = tid % num_ranks;
    st_release_sys(args.peer_count_matrix[peer] + parity_offset + rank * kMaxRanks + dst,
                   pack_tagged_count(tag, static_cast<uint32_t>(totals[dst])));
  }

  // 4. While the counts travel: send_tokens[dst][position] = token.
  {
    int position[kMaxRanks];
#pragma unroll
    for (int r = 0; r < kMaxRanks; ++r) position[r] = offset[r];
    for (int t = token_begin; t < token_end; ++t) {
      const uint32_t mask = args.token_masks[t];
#pragma unroll
      for (int r = 0; r < kMaxRanks; ++r) {
        if ((mask >> r) & 1u) {
          args.send_tokens[static_cast<int64_t>(r) * args.max_tokens + position[r]] = t;
          ++position[r];
        }
      }
    }
  }

  // 5. Wait for every rank's row of this call.
  if (tid < num_ranks * num_ranks) {
    const int src = tid / num_ranks;
    const int dst = tid % num_ranks;
    matrix[src][dst] = static_cast<int>(wait_tagged_count(
        args.count_matrix + parity_offset + src * kMaxRanks + dst, tag, args.wait.timeout_ns,
        args.wait.record, rank, src, static_cast<WaitPhase>(args.wait.phase)));
  }
  __syncthreads();

  // 6. The plan: where this rank writes at each destination, where each source lands here.
  if (tid < num_ranks) {
    const int r = tid;
    int base = 0;
    for (int s = 0; s < rank; ++s) base += matrix[s][r];
    int prefix = 0;
    for (int s = 0; s < r; ++s) prefix += matrix[s][rank];
    dest_base[r] = base;
    args.plan->send_count[r] = matrix[rank][r];
    args.plan->dest_base[r] = base;
    args.plan->recv_count[r] = matrix[r][rank];
    args.plan->recv_prefix[r] = prefix;
  }
  if (tid == 0) {
    int num_recv = 0;
    for (int s = 0; s < num_ranks; ++s) num_recv += matrix[s][rank];
    args.plan->num_recv = num_recv;
    if (routing) {
      *args.num_recv_tokens = num_recv;
      if (num_recv > args.capacity) {
        atomicAdd(&args.errors->overflow_rows,
                  static_cast<unsigned long long>(num_recv - args.capacity));
      }
      if (invalid_ids > 0) {
        atomicAdd(&args.errors->invalid_expert_ids, static_cast<unsigned long long>(invalid_ids));
      }
    }
  }
  __syncthreads();

  // 7. send_pos[t, r] = row of token t at rank r (may be >= C), -1 when not sent.
  if (routing) {
    for (int t = token_begin; t < token_end; ++t) {
      const uint32_t mask = args.token_masks[t];
      int32_t* out = args.send_pos_out + static_cast<int64_t>(t) * num_ranks;
#pragma unroll
      for (int r = 0; r < kMaxRanks; ++r) {
        if (r < num_ranks) {
          const bool sent = (mask >> r) & 1u;
          out[r] = sent ? dest_base[r] + offset[r] : -1;
          offset[r] += sent ? 1 : 0;
        }
      }
    }
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
    const int owner = expert >= 0 ? expert / args.num_local_experts : -1;
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
__global__ void __launch_bounds__(kTransferThreads, 1)
    dispatch_transfer_kernel(const DispatchTransferArgs args) {
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
      for (int64_t q = static_cast<int64_t>(item) * kTransferWarps + warp; q < num_entries;
           q += num_push_warps) {
        const int pos = static_cast<int>(q / num_peers);
        const int dst = (rank + 1 + static_cast<int>(q % num_peers)) % num_ranks;
        if (pos >= send_valid[dst]) continue;
        const int token =
            __ldg(args.send_tokens + static_cast<int64_t>(dst) * args.max_tokens + pos);
        const RegionRow region = region_row(args, args.peer_rows[dst], plan.dest_base[dst] + pos);
        warp_copy_vectors<true>(reinterpret_cast<int4*>(region.x),
                                reinterpret_cast<const int4*>(args.x + static_cast<int64_t>(token) *
                                                                           args.x_bytes_per_row),
                                args.x_bytes_per_row / kBytesPerVector, lane);
        write_row_aux(args, token, dst, region.scales, region.ids, region.weights, region.src,
                      region.payload, nullptr, lane);
        __syncwarp();
        if (lane == 0) {
          st_release_sys(
              args.peer_row_flags[dst] + static_cast<int64_t>(rank) * args.max_tokens + pos, tag);
        }
      }
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
  args.max_tokens = config.max_tokens_per_rank;
  args.capacity = capacity;
  args.seq = reinterpret_cast<const uint64_t*>(ctx.workspace + layout.seq);
  args.plan = reinterpret_cast<NormalPlan*>(ctx.workspace + layout.plan);
  args.send_tokens = reinterpret_cast<int32_t*>(ctx.workspace + layout.send_tokens);
  args.token_masks = reinterpret_cast<uint8_t*>(ctx.workspace + layout.token_masks);
  args.count_matrix = reinterpret_cast<const uint64_t*>(ctx.workspace + layout.count_matrix);
  for (int r = 0; r < config.num_ranks; ++r) {
    args.peer_count_matrix[r] =
        reinterpret_cast<uint64_t*>(ctx.peer_workspaces[r] + layout.count_matrix);
  }
  args.errors = ctx.error_counters;
  args.wait = {ctx.timeout_ns, ctx.timeout_record, ctx.rank, static_cast<int32_t>(phase)};
  return args;
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
  return args;
}

cudaError_t launch_transfer(const RankContext& ctx, const DispatchTransferArgs& args,
                            cudaStream_t stream) {
  const size_t shared_bytes = sizeof(int) * args.num_shared_experts;
  dispatch_transfer_kernel<<<ctx.normal_blocks, kTransferThreads, shared_bytes, stream>>>(args);
  return cudaGetLastError();
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
  dispatch_plan_kernel<<<1, kPlanThreads, 0, stream>>>(plan);
  CUDA_RETURN_IF_ERROR(cudaGetLastError());

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
  dispatch_plan_kernel<<<1, kPlanThreads, 0, stream>>>(plan);
  CUDA_RETURN_IF_ERROR(cudaGetLastError());

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

cudaError_t preload_dispatch_kernels() {
  cudaFuncAttributes attributes;
  CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attributes, dispatch_plan_kernel));
  return cudaFuncGetAttributes(&attributes, dispatch_transfer_kernel);
}

}  // namespace jax_ep
