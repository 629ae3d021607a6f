// jax_ep_layout_v2: routing statistics of one rank's top-k ids (no communication).
#include <cuda_runtime.h>

#include "common/fast_divisor.h"
#include "common/launch.h"
#include "common/limits.h"
#include "kernels/api.h"
#include "kernels/preload.h"

namespace jax_ep {
namespace {

constexpr int kLayoutThreads = 256;
// Experts counted in a shared-memory histogram per block (the rest go straight to global
// atomics); 8192 x 4 bytes stays well inside the default 48 KiB of dynamic shared memory.
constexpr int kLayoutSharedExperts = 8192;

struct LayoutArgs {
  const int32_t* topk_idx;  // [T, K]
  int num_tokens;
  int num_topk;
  int num_ranks;
  int num_experts;
  FastDivisor experts_per_rank;    // expert id -> its rank
  int num_shared_experts;          // min(E, kLayoutSharedExperts)
  int32_t* num_tokens_per_rank;    // [R], zeroed by the launcher
  int32_t* num_tokens_per_expert;  // [E], zeroed by the launcher
  bool* is_token_in_rank;          // [T, R]
  ErrorCounters* errors;
};

// Role: one thread per token finds its distinct ranks (ids outside [-1, E) count as -1 and are
// counted as invalid) and adds its (token, expert) pairs and ranks to per-block histograms.
// Grid: ceil(T / kLayoutThreads) blocks. Synchronisation: block-local shared histograms flushed
// with global atomics into outputs the launcher zeroed on the same stream. Dynamic shared memory:
// num_shared_experts, then R ints.
__global__ void __launch_bounds__(kLayoutThreads) layout_kernel(const LayoutArgs args) {
  extern __shared__ int expert_histogram[];
  int* const rank_histogram = expert_histogram + args.num_shared_experts;  // [R]
  __shared__ int invalid_ids;
  for (int e = threadIdx.x; e < args.num_shared_experts; e += blockDim.x) expert_histogram[e] = 0;
  for (int r = threadIdx.x; r < args.num_ranks; r += blockDim.x) rank_histogram[r] = 0;
  if (threadIdx.x == 0) invalid_ids = 0;
  __syncthreads();

  const int token = blockIdx.x * blockDim.x + threadIdx.x;
  if (token < args.num_tokens) {
    int ranks[kMaxTopk];  // distinct ranks of the token
    int num_ranks = 0;
    int num_invalid = 0;
    const int32_t* ids = args.topk_idx + static_cast<int64_t>(token) * args.num_topk;
    for (int k = 0; k < args.num_topk; ++k) {
      const int expert = __ldg(ids + k);
      if (expert == -1) continue;
      if (expert < -1 || expert >= args.num_experts) {
        ++num_invalid;
        continue;
      }
      const int r = static_cast<int>(args.experts_per_rank.divide(static_cast<uint32_t>(expert)));
      bool seen = false;
      for (int i = 0; i < num_ranks; ++i) seen |= ranks[i] == r;
      if (!seen) ranks[num_ranks++] = r;
      if (expert < args.num_shared_experts) {
        atomicAdd(&expert_histogram[expert], 1);
      } else {
        atomicAdd(&args.num_tokens_per_expert[expert], 1);
      }
    }
    bool* in_rank = args.is_token_in_rank + static_cast<int64_t>(token) * args.num_ranks;
    for (int r = 0; r < args.num_ranks; ++r) in_rank[r] = false;
    for (int i = 0; i < num_ranks; ++i) {
      in_rank[ranks[i]] = true;
      atomicAdd(&rank_histogram[ranks[i]], 1);
    }
    if (num_invalid > 0) atomicAdd(&invalid_ids, num_invalid);
  }
  __syncthreads();

  for (int e = threadIdx.x; e < args.num_shared_experts; e += blockDim.x) {
    if (expert_histogram[e] != 0) atomicAdd(&args.num_tokens_per_expert[e], expert_histogram[e]);
  }
  for (int r = threadIdx.x; r < args.num_ranks; r += blockDim.x) {
    if (rank_histogram[r] != 0) atomicAdd(&args.num_tokens_per_rank[r], rank_histogram[r]);
  }
  if (threadIdx.x == 0 && invalid_ids != 0) {
    atomicAdd(&args.errors->invalid_expert_ids, static_cast<unsigned long long>(invalid_ids));
  }
}

}  // namespace

cudaError_t launch_layout(const RankContext& ctx, const LayoutParams& params, cudaStream_t stream) {
  const BufferConfig& config = ctx.config;
  CUDA_RETURN_IF_ERROR(
      cudaMemsetAsync(params.num_tokens_per_rank, 0, sizeof(int32_t) * config.num_ranks, stream));
  CUDA_RETURN_IF_ERROR(cudaMemsetAsync(params.num_tokens_per_expert, 0,
                                       sizeof(int32_t) * config.num_experts, stream));
  if (params.num_tokens == 0) return cudaSuccess;

  LayoutArgs args;
  args.topk_idx = params.topk_idx;
  args.num_tokens = params.num_tokens;
  args.num_topk = config.num_topk;
  args.num_ranks = config.num_ranks;
  args.num_experts = config.num_experts;
  args.experts_per_rank = FastDivisor(static_cast<uint32_t>(config.num_local_experts()));
  args.num_shared_experts =
      config.num_experts < kLayoutSharedExperts ? config.num_experts : kLayoutSharedExperts;
  args.num_tokens_per_rank = params.num_tokens_per_rank;
  args.num_tokens_per_expert = params.num_tokens_per_expert;
  args.is_token_in_rank = params.is_token_in_rank;
  args.errors = ctx.error_counters;

  const int num_blocks = ceil_div(params.num_tokens, kLayoutThreads);
  const size_t shared_bytes = sizeof(int) * (args.num_shared_experts + config.num_ranks);
  layout_kernel<<<num_blocks, kLayoutThreads, shared_bytes, stream>>>(args);
  return cudaGetLastError();
}

cudaError_t preload_layout_kernels() {
  cudaFuncAttributes attributes;
  return cudaFuncGetAttributes(&attributes, layout_kernel);
}

cudaError_t layout_kernel_attributes(cudaFuncAttributes* attributes) {
  return cudaFuncGetAttributes(attributes, layout_kernel);
}

}  // namespace jax_ep
