// Host entry points of the low-latency (decode) kernels, called by xla_ffi/low_latency_handlers.cc.
// Plain C++ (no CUDA syntax beyond the runtime types): the handlers are compiled by the host
// compiler. Shapes are validated by the handler; the launchers trust them.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "runtime/context.h"

namespace jax_ep {

// Operands and results of jax_ep_low_latency_dispatch_v1 (docs/internals.md), device pointers.
struct LowLatencyDispatchParams {
  const void* x = nullptr;            // [T, H] bf16
  const int32_t* topk_idx = nullptr;  // [T, K] global expert ids, -1 = none
  int num_tokens = 0;                 // T <= T_max
  bool use_fp8 = false;
  bool round_scale = false;
  void* recv_x = nullptr;         // [E_loc, R*T_max, H] e4m3 (use_fp8) or bf16
  float* recv_scales = nullptr;   // [E_loc, R*T_max, H/128] (use_fp8 only)
  int32_t* recv_count = nullptr;  // [E_loc]
  int32_t* recv_src = nullptr;    // [E_loc, R*T_max]
  int32_t* recv_k = nullptr;      // [E_loc, R*T_max]
};

// Operands and results of jax_ep_low_latency_combine_v1.
struct LowLatencyCombineParams {
  const void* y = nullptr;              // [E_loc, R*T_max, H] bf16
  const int32_t* topk_idx = nullptr;    // [T, K]
  const float* topk_weights = nullptr;  // [T, K]
  const int32_t* recv_src = nullptr;    // [E_loc, R*T_max] (dispatch handle)
  const int32_t* recv_k = nullptr;      // [E_loc, R*T_max]
  const int32_t* recv_count = nullptr;  // [E_loc]
  int num_tokens = 0;                   // T <= T_max
  void* out = nullptr;                  // [T, H] bf16
};

// One kernel launch each on `stream`; no host synchronisation, no host state per call
// (CUDA-graph replay safe). Return the launch error, if any.
cudaError_t launch_low_latency_dispatch(const RankContext& ctx,
                                        const LowLatencyDispatchParams& params,
                                        cudaStream_t stream);
cudaError_t launch_low_latency_combine(const RankContext& ctx,
                                       const LowLatencyCombineParams& params, cudaStream_t stream);

// Per-file kernel preloading (called by preload_low_latency_kernels()).
cudaError_t preload_low_latency_dispatch_kernels();
cudaError_t preload_low_latency_combine_kernels();

}  // namespace jax_ep
