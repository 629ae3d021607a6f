// Host entry points of the low-latency (decode) kernels, called by xla_ffi/low_latency_handlers.cc.
// Plain C++ (no CUDA syntax beyond the runtime types): the handlers are compiled by the host
// compiler. Shapes are validated by the handler; the launchers trust them.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "runtime/context.h"

namespace jax_ep {

// Operands and results of jax_ep_low_latency_dispatch_v2 (docs/internals.md), device pointers.
// The split pair uses the same struct: the send half reads x and topk_idx and writes ticket (the
// recv_* results stay null); the receive half reads x (its own rows) and writes the recv_*
// results (topk_idx and ticket stay null).
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
  int32_t* ticket = nullptr;      // [1] (send half)
};

// Operands and results of jax_ep_low_latency_combine_v2. The send half reads y and the handle
// (recv_src, recv_k, recv_count) and writes ticket; the receive half reads everything but the
// ticket and writes out.
struct LowLatencyCombineParams {
  const void* y = nullptr;              // [E_loc, R*T_max, H] bf16
  const int32_t* topk_idx = nullptr;    // [T, K]
  const float* topk_weights = nullptr;  // [T, K]
  const int32_t* recv_src = nullptr;    // [E_loc, R*T_max] (dispatch handle)
  const int32_t* recv_k = nullptr;      // [E_loc, R*T_max]
  const int32_t* recv_count = nullptr;  // [E_loc]
  int num_tokens = 0;                   // T <= T_max
  void* out = nullptr;                  // [T, H] bf16
  int32_t* ticket = nullptr;            // [1] (send half)
};

// Which phases one launch runs: the fused op (kBoth), or one half of the split pair
// (jax_ep_low_latency_{dispatch,combine}_{send,recv}_v2). Per Buffer and op, a send must be
// followed by its receive before the next send of that op on this rank (the split channel's
// regions are double-buffered by call parity and its sequence word advances at the end of the
// receive). Fused calls run in their own channel and may come anywhere.
enum class LowLatencyHalves : int { kSend = 1, kRecv = 2, kBoth = 3 };

// One kernel launch each on `stream`; no host synchronisation, no host state per call
// (CUDA-graph replay safe). Return the launch error, if any.
cudaError_t launch_low_latency_dispatch(const RankContext& ctx,
                                        const LowLatencyDispatchParams& params,
                                        LowLatencyHalves halves, cudaStream_t stream);
cudaError_t launch_low_latency_combine(const RankContext& ctx,
                                       const LowLatencyCombineParams& params,
                                       LowLatencyHalves halves, cudaStream_t stream);

// Per-file kernel preloading (called by preload_low_latency_kernels()).
cudaError_t preload_low_latency_dispatch_kernels();
cudaError_t preload_low_latency_combine_kernels();

}  // namespace jax_ep
