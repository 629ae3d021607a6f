// Host-side entry points of the normal-mode kernels (layout, dispatch, cached dispatch, combine).
//
// The FFI handlers fill one *Params struct per op with the XLA buffers of the call (already
// validated against the Buffer's configuration) and call the launcher, which enqueues the kernels
// on `stream` and returns the launch status. Nothing here synchronises with the host.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "runtime/context.h"

namespace jax_ep {

// jax_ep_layout_v2: routing statistics of topk_idx, no communication.
struct LayoutParams {
  const int32_t* topk_idx = nullptr;         // [T, K]
  int num_tokens = 0;                        // T
  int32_t* num_tokens_per_rank = nullptr;    // [R]
  int32_t* num_tokens_per_expert = nullptr;  // [E]
  bool* is_token_in_rank = nullptr;          // [T, R]
};
cudaError_t launch_layout(const RankContext& ctx, const LayoutParams& params, cudaStream_t stream);

// jax_ep_dispatch_v2. `x` rows are `x_bytes_per_row` bytes (H * element bytes); `x_scales` is
// [T, num_scales] (num_scales = 0 unless x is fp8).
struct DispatchParams {
  int num_tokens = 0;  // T
  int capacity = 0;    // C of this call
  const void* x = nullptr;
  int64_t x_bytes_per_row = 0;
  const float* x_scales = nullptr;
  int num_scales = 0;
  const int32_t* topk_idx = nullptr;              // [T, K]
  const float* topk_weights = nullptr;            // [T, K]
  void* recv_x = nullptr;                         // [C, H]
  float* recv_scales = nullptr;                   // [C, num_scales]
  int32_t* recv_topk_idx = nullptr;               // [C, K]
  float* recv_topk_weights = nullptr;             // [C, K]
  int32_t* num_recv_tokens = nullptr;             // []
  int32_t* num_recv_tokens_per_expert = nullptr;  // [E_loc]
  int32_t* send_pos = nullptr;                    // [T, R]
  int32_t* recv_src = nullptr;                    // [C]
};
cudaError_t launch_dispatch(const RankContext& ctx, const DispatchParams& params,
                            cudaStream_t stream);

// jax_ep_cached_dispatch_v2: moves x (+ scales, + w) along the routing of send_pos.
struct CachedDispatchParams {
  int num_tokens = 0;
  int capacity = 0;
  const void* x = nullptr;
  int64_t x_bytes_per_row = 0;
  const float* x_scales = nullptr;
  int num_scales = 0;
  const float* w = nullptr;  // [T, num_w]
  int num_w = 0;
  const int32_t* send_pos = nullptr;  // [T, R]
  void* recv_x = nullptr;
  float* recv_scales = nullptr;
  float* recv_w = nullptr;  // [C, num_w]
};
cudaError_t launch_cached_dispatch(const RankContext& ctx, const CachedDispatchParams& params,
                                   cudaStream_t stream);

// jax_ep_combine_v2. `y` holds elements of the Buffer's dtype (bf16 when dtype_bytes == 2,
// float32 when 4).
struct CombineParams {
  int num_tokens = 0;          // T (send_pos.shape[0])
  int capacity = 0;            // C
  const void* y = nullptr;     // [C, H]
  const float* y_w = nullptr;  // [C, num_w]
  int num_w = 0;
  const int32_t* send_pos = nullptr;         // [T, R]
  const int32_t* recv_src = nullptr;         // [C]
  const int32_t* num_recv_tokens = nullptr;  // []
  void* combined = nullptr;                  // [T, H]
  float* combined_w = nullptr;               // [T, num_w]
};
cudaError_t launch_combine(const RankContext& ctx, const CombineParams& params,
                           cudaStream_t stream);

// Bytes of the normal-mode data region (rows) of this Buffer, and the per-row bytes each op
// needs there: the handlers check `rows * row bytes <= normal_data_bytes`.
size_t normal_data_bytes(const BufferConfig& config);
int64_t dispatch_region_row_bytes(int64_t x_bytes_per_row, int num_scales, int num_topk);
int64_t cached_dispatch_region_row_bytes(int64_t x_bytes_per_row, int num_scales, int num_w);
int64_t combine_region_row_bytes(int64_t y_bytes_per_row, int num_w);

// The normal mode over a device transport (kernels/normal/transport.cuh): true for every
// device transport (kNvshmem's kernels are the plugin's, normal/nvshmem.h). Its two regions in
// the ops' table (RankContext::transport_region_bases), after the low-latency kernels' two (over
// kNvshmem both lie in the workspace, on the symmetric heap: this rank's addresses name the same
// bytes on every PE):
bool normal_over_transport(const BufferConfig& config);
constexpr uint32_t kNormalAreaRegion = 2;  // the normal-mode area (workspace offset 0,
                                           // normal_workspace_bytes): puts and signals land here
constexpr uint32_t kNormalSendRegion = 3;  // normal_send_region_bytes: rows staged for puts
// Warps of one rank's normal kernels that issue transport commands (each needs its own
// acknowledgement word in an emulated ring): the push warps of a transfer kernel.
uint32_t normal_transport_warps(const RankContext& ctx);

// Per-file kernel preloading (called by preload_normal_kernels()).
cudaError_t preload_layout_kernels();
// The code the driver loaded (or JIT-compiled from PTX) for the layout kernel on the current
// device: binaryVersion = the SASS architecture it runs (e.g. 90), ptxVersion = the virtual
// architecture it was compiled through (80 for code JIT-compiled from compute_80 PTX). Every
// kernel of the module is built for the same architectures.
cudaError_t layout_kernel_attributes(cudaFuncAttributes* attributes);
cudaError_t preload_dispatch_kernels();
cudaError_t preload_combine_kernels();
// The transport paths' kernels (normal_over_transport), for preload_normal_transport_kernels().
cudaError_t preload_dispatch_transport_kernels();
cudaError_t preload_combine_transport_kernels();

}  // namespace jax_ep
