// Normal-mode combine (jax_ep_combine_v2): the reverse of dispatch.
//
// Two kernels per call, on the caller's stream:
//   1. combine_plan_kernel (1 block): tagged barrier with every rank, and the segment of y rows
//      held for each owner rank (recv_src is sorted by src_rank * T + token).
//   2. combine_transfer_kernel (many blocks): pushes every y row (and y_w row) to its owner's
//      data region at [this rank][token] with one release flag per row, and reduces the tokens
//      of this rank in float32 as their rows arrive (own rows are read straight from y).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "kernels/common/copy.cuh"
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

// One warp per owner segment bound (R + 1 of them), plus threads for the barrier.
constexpr int kCombinePlanThreads = (kMaxRanks + 1) * kWarpSize;
constexpr int kTransferThreads = kNormalTransferThreads;
constexpr int kTransferWarps = kTransferThreads / kWarpSize;
// Tokens of one reduce work item: two per warp of the block.
constexpr int kTokensPerItem = 2 * kTransferWarps;
// 16-byte vectors each lane of a reducing warp loads per source before it adds.
constexpr int kReduceUnroll = 2;

struct CombinePlanArgs {
  const int32_t* recv_src;         // [C]
  const int32_t* num_recv_tokens;  // []
  int num_tokens;
  int capacity;
  int num_ranks;
  int rank;
  const uint64_t* seq;
  NormalPlan* plan;
  const uint64_t* barrier;            // this rank's barrier words [src]
  uint64_t* peer_barrier[kMaxRanks];  // every rank's barrier words
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

// Role: entry barrier of a combine and the owner segments of y. One block of
// kCombinePlanThreads: threads r < R release-store the tag into rank r's barrier word [rank];
// warp s <= R finds the first row whose recv_src >= s * T (rows of owner s are
// [bound[s], bound[s+1])); then threads r < R wait for rank r's barrier word (>= tag).
// Synchronisation: as the dispatch count exchange, a rank enters only after its previous call
// finished, so after the barrier every peer is done with its data region and row flags.
// Over a transport (Path a TransportPath), warp 0 signals the words instead (kSet, the tag),
// this rank's own included: every rank waits for all R words.
template <typename Path>
__global__ void __launch_bounds__(kCombinePlanThreads, 1)
    combine_plan_kernel(const CombinePlanArgs args) {
  const Path path = PathOf<Path>::of(args.transport);
  __shared__ int bounds[kMaxRanks + 1];
  const int tid = threadIdx.x;
  const int lane = tid % kWarpSize;
  const int warp = tid / kWarpSize;
  const int num_ranks = args.num_ranks;
  const uint64_t tag = *reinterpret_cast<const volatile uint64_t*>(args.seq) + 1;

  if constexpr (is_stores_path<Path>) {
    if (tid < num_ranks) st_release_sys(args.peer_barrier[tid] + args.rank, tag);
  } else if (warp == 0) {
    auto t = make_normal_transport(path, args.rank, 0, args.wait);
    const size_t word = path.args.layout.barrier + sizeof(uint64_t) * args.rank;
    for (int peer = 0; peer < num_ranks; ++peer) {
      t.signal(peer, in_normal_area(word), tag, transport::SignalOp::kSet, lane);
    }
  }

  const int num_valid = max(0, min(__ldg(args.num_recv_tokens), args.capacity));
  if (warp <= num_ranks) {
    const int bound = warp_lower_bound(args.recv_src, num_valid, warp * args.num_tokens, lane);
    if (lane == 0) bounds[warp] = bound;
  }
  __syncthreads();
  if (tid < num_ranks) {
    args.plan->recv_prefix[tid] = bounds[tid];
    args.plan->recv_count[tid] = max(0, bounds[tid + 1] - bounds[tid]);
  }
  if (tid == 0) args.plan->num_recv = num_valid;

  if (tid < num_ranks) wait_flag(args.wait, args.barrier + tid, tag, tid);
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
  const NormalPlan* plan;
  uint64_t* seq;
  uint32_t* work_counter;
  uint32_t* done_counter;
  const char* rows;  // data region: rows [src][token]
  const uint64_t* row_flags;
  char* peer_rows[kMaxRanks];
  uint64_t* peer_row_flags[kMaxRanks];
  int64_t region_bytes_per_row;
  int num_push_blocks;
  WaitContext wait;
  NormalTransportArgs transport;  // a transport path's (last: the stores path never reads it)
};

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

// combined[token] = sum over ranks r (ascending) with 0 <= send_pos[token, r] < C of that
// rank's row: y itself for this rank, the data region row [r][token] for the others (lane r
// first acquires its row flag). One warp, float32, rounded once.
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

  const char* own_row = args.y + static_cast<int64_t>(max(own_pos, 0)) * args.y_bytes_per_row;
  auto source_row = [&](int r) -> const char* {
    return r == rank ? own_row
                     : args.rows + (static_cast<int64_t>(r) * args.num_tokens + token) *
                                       args.region_bytes_per_row;
  };

  const int64_t num_vectors = args.y_bytes_per_row / kBytesPerVector;
  int4* out = reinterpret_cast<int4*>(args.combined + token * args.y_bytes_per_row);
  for (int64_t base = lane; base < num_vectors; base += kWarpSize * kReduceUnroll) {
    int4 loaded[kReduceUnroll][kMaxRanks];
#pragma unroll
    for (int r = 0; r < kMaxRanks; ++r) {
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
      for (int r = 0; r < kMaxRanks; ++r) {
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

// Role: the data movement of one combine, as work items claimed in this order:
//   [push roles] [reduce items of kTokensPerItem tokens]
// - push role p: warp g = p*W + w handles entries q = g, g+P*W, ... of (k, owner) in k-major
//   order over the other ranks: row recv_prefix[owner] + k of y (token = recv_src - owner*T)
//   goes to the owner's data region row [rank][token] (y bytes, then y_w), then __syncwarp +
//   release-store of tag into the owner's row flag [rank][token].
// - reduce item: one warp per token (reduce_token), waiting per source row.
// Grid: ctx.normal_blocks blocks of kTransferThreads; deadlock-free without co-residency for the
// same reason as the dispatch transfer (all push roles are claimed before any reduce item). The
// last block to finish stores the call's sequence number.
// Over a transport (Path a TransportPath) a push warp stages each row in its send slots and
// puts it with its flag (RowSender), and quiets before it leaves its role, as in the dispatch.
template <typename Element, typename Path>
__global__ void __launch_bounds__(kTransferThreads, 1)
    combine_transfer_kernel(const CombineTransferArgs args) {
  const Path path = PathOf<Path>::of(args.transport);
  __shared__ NormalPlan plan;
  __shared__ int claimed_item;
  const int tid = threadIdx.x;
  const int lane = tid % kWarpSize;
  const int warp = tid / kWarpSize;
  const int num_ranks = args.num_ranks;
  const int rank = args.rank;
  const int num_tokens = args.num_tokens;
  const uint64_t tag = *reinterpret_cast<const volatile uint64_t*>(args.seq) + 1;

  if (tid < static_cast<int>(sizeof(NormalPlan) / sizeof(int))) {
    reinterpret_cast<int*>(&plan)[tid] = __ldg(reinterpret_cast<const int*>(args.plan) + tid);
  }
  __syncthreads();

  const int num_peers = num_ranks - 1;
  int max_rows = 0;
  for (int r = 0; r < num_ranks; ++r) {
    if (r != rank) max_rows = max(max_rows, plan.recv_count[r]);
  }
  const int num_push_items = num_peers > 0 ? args.num_push_blocks : 0;
  const int num_reduce_items = (num_tokens + kTokensPerItem - 1) / kTokensPerItem;
  const int num_items = num_push_items + num_reduce_items;

  for (;;) {
    int item = claim_work_item(args.work_counter, &claimed_item);
    if (item >= num_items) break;

    if (item < num_push_items) {
      const int64_t num_push_warps = static_cast<int64_t>(args.num_push_blocks) * kTransferWarps;
      const int64_t num_entries = static_cast<int64_t>(max_rows) * num_peers;
      const int64_t push_warp = static_cast<int64_t>(item) * kTransferWarps + warp;
      RowSender<Path> sender(path, rank, args.wait, push_warp, num_push_warps,
                             args.region_bytes_per_row);
      for (int64_t q = push_warp; q < sender.end(num_entries); q += sender.stride(num_push_warps)) {
        const int k = static_cast<int>(q / num_peers);
        const int owner = (rank + 1 + static_cast<int>(q % num_peers)) % num_ranks;
        if (k >= plan.recv_count[owner]) continue;
        const int row = plan.recv_prefix[owner] + k;
        if (row >= plan.num_recv) continue;
        const int token = __ldg(args.recv_src + row) - owner * num_tokens;
        if (token < 0 || token >= num_tokens) continue;  // inconsistent handle: drop the row
        char* const rows = sender.rows(args.peer_rows, owner);
        const int64_t region_row = static_cast<int64_t>(rank) * num_tokens + token;
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

    const int end = min(num_tokens, (item + 1) * kTokensPerItem);
    for (int token = item * kTokensPerItem + warp; token < end; token += kTransferWarps) {
      reduce_token<Element>(args, token, tag, lane);
    }
  }

  finish_transfer_block(args.work_counter, args.done_counter, args.seq, tag);
}

// The transfer kernel of Element on the rank's path: stores, or a device transport.
template <typename Element>
void launch_transfer(const RankContext& ctx, const CombineTransferArgs& args, cudaStream_t stream) {
  switch (ctx.config.device_transport) {
    case DeviceTransport::kMapped:
      combine_transfer_kernel<Element, TransportPath<MappedTransport>>
          <<<ctx.normal_blocks, kTransferThreads, 0, stream>>>(args);
      break;
    case DeviceTransport::kEmulated:
      combine_transfer_kernel<Element, TransportPath<EmulatedTransport>>
          <<<ctx.normal_blocks, kTransferThreads, 0, stream>>>(args);
      break;
    default:  // stores (kNvshmem carries the low-latency ops only)
      combine_transfer_kernel<Element, StoresPath>
          <<<ctx.normal_blocks, kTransferThreads, 0, stream>>>(args);
  }
}

template <typename Transport>
cudaError_t preload_combine_kernels_over() {
  cudaFuncAttributes attributes;
  using Path = TransportPath<Transport>;
  CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attributes, combine_plan_kernel<Path>));
  CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attributes, combine_transfer_kernel<float, Path>));
  return cudaFuncGetAttributes(&attributes, combine_transfer_kernel<__nv_bfloat16, Path>);
}

}  // namespace

cudaError_t launch_combine(const RankContext& ctx, const CombineParams& params,
                           cudaStream_t stream) {
  const BufferConfig& config = ctx.config;
  const NormalLayout layout = normal_layout(config);
  char* workspace = ctx.workspace;

  CombinePlanArgs plan = {};
  plan.recv_src = params.recv_src;
  plan.num_recv_tokens = params.num_recv_tokens;
  plan.num_tokens = params.num_tokens;
  plan.capacity = params.capacity;
  plan.num_ranks = config.num_ranks;
  plan.rank = ctx.rank;
  plan.seq = reinterpret_cast<const uint64_t*>(workspace + layout.seq);
  plan.plan = reinterpret_cast<NormalPlan*>(workspace + layout.plan);
  plan.barrier = reinterpret_cast<const uint64_t*>(workspace + layout.barrier);
  for (int r = 0; r < config.num_ranks; ++r) {
    plan.peer_barrier[r] = reinterpret_cast<uint64_t*>(ctx.peer_workspaces[r] + layout.barrier);
  }
  plan.wait = {ctx.timeout_ns, ctx.timeout_record, ctx.rank,
               static_cast<int32_t>(WaitPhase::kCombineBarrier)};
  if (normal_over_transport(config)) plan.transport = normal_transport_args(ctx);
  switch (config.device_transport) {
    case DeviceTransport::kMapped:
      combine_plan_kernel<TransportPath<MappedTransport>>
          <<<1, kCombinePlanThreads, 0, stream>>>(plan);
      break;
    case DeviceTransport::kEmulated:
      combine_plan_kernel<TransportPath<EmulatedTransport>>
          <<<1, kCombinePlanThreads, 0, stream>>>(plan);
      break;
    default:  // stores (kNvshmem carries the low-latency ops only)
      combine_plan_kernel<StoresPath><<<1, kCombinePlanThreads, 0, stream>>>(plan);
  }
  CUDA_RETURN_IF_ERROR(cudaGetLastError());

  CombineTransferArgs args = {};
  args.y = static_cast<const char*>(params.y);
  args.y_bytes_per_row = static_cast<int64_t>(config.hidden) * config.dtype_bytes;
  args.y_w = params.y_w;
  args.num_w = params.num_w;
  args.send_pos = params.send_pos;
  args.recv_src = params.recv_src;
  args.num_tokens = params.num_tokens;
  args.capacity = params.capacity;
  args.num_ranks = config.num_ranks;
  args.rank = ctx.rank;
  args.max_tokens = config.max_tokens_per_rank;
  args.combined = static_cast<char*>(params.combined);
  args.combined_w = params.combined_w;
  args.plan = reinterpret_cast<const NormalPlan*>(workspace + layout.plan);
  args.seq = reinterpret_cast<uint64_t*>(workspace + layout.seq);
  args.work_counter = reinterpret_cast<uint32_t*>(workspace + layout.counters);
  args.done_counter = args.work_counter + 1;
  args.rows = workspace + layout.data;
  args.row_flags = reinterpret_cast<const uint64_t*>(workspace + layout.row_flags);
  for (int r = 0; r < config.num_ranks; ++r) {
    args.peer_rows[r] = ctx.peer_workspaces[r] + layout.data;
    args.peer_row_flags[r] = reinterpret_cast<uint64_t*>(ctx.peer_workspaces[r] + layout.row_flags);
  }
  args.region_bytes_per_row = combine_region_row_bytes(args.y_bytes_per_row, params.num_w);
  args.num_push_blocks = ctx.normal_push_blocks;
  args.wait = {ctx.timeout_ns, ctx.timeout_record, ctx.rank,
               static_cast<int32_t>(WaitPhase::kCombineArrival)};

  if (normal_over_transport(config)) args.transport = normal_transport_args(ctx);
  if (config.dtype_bytes == 4) {
    launch_transfer<float>(ctx, args, stream);
  } else {
    launch_transfer<__nv_bfloat16>(ctx, args, stream);
  }
  return cudaGetLastError();
}

int64_t combine_region_row_bytes(int64_t y_bytes_per_row, int num_w) {
  return region_row_bytes(y_bytes_per_row, num_w);
}

cudaError_t preload_combine_kernels() {
  cudaFuncAttributes attributes;
  CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attributes, combine_plan_kernel<StoresPath>));
  CUDA_RETURN_IF_ERROR(
      cudaFuncGetAttributes(&attributes, combine_transfer_kernel<float, StoresPath>));
  return cudaFuncGetAttributes(&attributes, combine_transfer_kernel<__nv_bfloat16, StoresPath>);
}

cudaError_t preload_combine_transport_kernels() {
  CUDA_RETURN_IF_ERROR(preload_combine_kernels_over<MappedTransport>());
  return preload_combine_kernels_over<EmulatedTransport>();
}

}  // namespace jax_ep
