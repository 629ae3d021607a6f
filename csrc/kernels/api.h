// The kernels' one header for the layers above them: the runtime (csrc/runtime/) and the FFI
// handlers (xla_ffi/) include this and nothing else of csrc/kernels/ (tests/test_include_layers.py
// checks). It declares every launcher with its parameters, the workspace a rank needs and the
// device transport's regions in it, kernel preloading, and the device transports' put-protocol
// kernels from other libraries (the NVSHMEM plugin, the test module's emulated transport).
//
// The handlers fill one *Params struct per op with the XLA buffers of the call (already validated
// against the Buffer's configuration) and call the launcher, which enqueues its kernels on
// `stream` and returns the launch status. Nothing here synchronises with the host, and no
// launcher keeps host state per call (CUDA-graph replay safe). Plain C++: the handlers and the
// runtime are compiled by the host compiler.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "common/limits.h"
#include "common/wait_phase.h"
#include "kernels/context.h"

namespace jax_ep {

// ---------------------------------------------------------------------------- normal mode
// (kernels/normal/: layout.cu, dispatch.cu, combine.cu)

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

// The per-row bytes each op needs in the normal-mode data region, and why a call cannot run in
// it, or "" when it can (its window: kernels/normal/windows.h): a dispatch or cached dispatch of
// `capacity` rows, a combine of `num_tokens` tokens, rows of `row_bytes` bytes.
std::string dispatch_window_problem(const RankContext& ctx, int64_t capacity, int64_t row_bytes);
std::string combine_window_problem(const RankContext& ctx, int64_t num_tokens, int64_t row_bytes);
int64_t dispatch_region_row_bytes(int64_t x_bytes_per_row, int num_scales, int num_topk);
int64_t cached_dispatch_region_row_bytes(int64_t x_bytes_per_row, int num_scales, int num_w);
int64_t combine_region_row_bytes(int64_t y_bytes_per_row, int num_w);

// ----------------------------------------------------------------------- low-latency mode
// (kernels/low_latency/: dispatch.cu, combine.cu, the store kernels; over a device transport,
// the put-protocol kernels of kernels/low_latency_put/)

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
// (CUDA-graph replay safe). Return the launch error, if any. Over a device transport they launch
// the *_put launchers below.
cudaError_t launch_low_latency_dispatch(const RankContext& ctx,
                                        const LowLatencyDispatchParams& params,
                                        LowLatencyHalves halves, cudaStream_t stream);
cudaError_t launch_low_latency_combine(const RankContext& ctx,
                                       const LowLatencyCombineParams& params,
                                       LowLatencyHalves halves, cudaStream_t stream);
// The same ops' put-protocol kernels (low_latency_put/put_ops.cu), one launch per rank through the
// table of the rank's transport.
cudaError_t launch_low_latency_dispatch_put(const RankContext& ctx,
                                            const LowLatencyDispatchParams& params,
                                            LowLatencyHalves halves, cudaStream_t stream);
cudaError_t launch_low_latency_combine_put(const RankContext& ctx,
                                           const LowLatencyCombineParams& params,
                                           LowLatencyHalves halves, cudaStream_t stream);

// ------------------------------------------------------------------------------ workspace
// (kernels/api.cc, kernels/normal/workspace.cu)

// Bytes of the per-device workspace the runtime allocates for `config`: the normal-mode area,
// plus the low-latency regions when config.low_latency, plus the device transport's area of the
// low-latency kernels when it has one, plus, last, the normal mode's send region when its ops
// run over a device transport.
size_t workspace_bytes(const BufferConfig& config);
// Byte offset in the workspace of the normal mode's sequence word (calls completed), which
// read_errors reports.
size_t normal_sequence_offset(const BufferConfig& config);

// ----------------------------------------------------------------------- device transport
// (kernels/api.cc; DeviceTransport other than kStores)

// Every rank's transport regions as seen from `ctx`'s device, [rank][kTransportRegions]: the
// low-latency kernels' two (null in a Buffer without them), the normal-mode area (the
// workspace's start) and its send region (the workspace's end); null for ranks not mapped yet.
// Over kNvshmem only this rank's row is read: its addresses are symmetric (the workspace is one
// allocation on the symmetric heap, so a region's offset in it names the same bytes at every PE).
std::vector<char*> transport_region_table(const RankContext& ctx);
// Bytes of each of those regions (the same for every rank); an area the Buffer lacks has 0, so
// that a command into it is reported.
void transport_region_bytes(const BufferConfig& config, uint64_t bytes[kTransportRegions]);
// Warps of one rank's kernels that issue transport commands (each needs its own acknowledgement
// word in an emulated ring): the low-latency kernels' first, then the normal kernels' push
// warps, from *normal_first_warp on.
uint32_t transport_warps(const RankContext& ctx, uint32_t* normal_first_warp);

// -------------------------------------------------------------------------------- loading
// (kernels/api.cc)

// Loads every kernel the ops of a Buffer of `config` may launch on the current device (no lazy
// loading mid-run, or under graph capture). Returns the first failure.
cudaError_t preload_kernels(const BufferConfig& config);
// The code the driver loaded (or JIT-compiled from PTX) for the layout kernel on the current
// device: binaryVersion = the SASS architecture it runs (e.g. 90), ptxVersion = the virtual
// architecture it was compiled through (80 for code JIT-compiled from compute_80 PTX). Every
// kernel of the module is built for the same architectures.
cudaError_t layout_kernel_attributes(cudaFuncAttributes* attributes);

// ----------------------------------------------------------- device transports' libraries
// (kernels/put_plugins.cc, kernels/put_plugin.h)

// The put-protocol kernels of a device transport other than the mapped one (jax_ep._C's own)
// live in another shared library, which exports their table: the NVSHMEM plugin
// libjax_ep_nvshmem.so beside jax_ep._C (csrc/plugins/nvshmem_transport_kernels.cu, built only
// where NVSHMEM is found; NVSHMEM's host library must be loaded first, RTLD_GLOBAL, as
// nvshmem_load does), or the test module jax_ep._C_testing (the emulated transport, with its
// host proxies and protocol mutants). Loads the library at `path` (once per transport) and keeps
// its table. "" or an error naming the path.
std::string transport_plugin_load(const std::string& path);
// "" when the ops of `device_transport` can launch in this process, else what to do (the test
// module or the NVSHMEM plugin not loaded).
std::string transport_plugin_missing(DeviceTransport device_transport);
// The CUDA library (a CUlibrary) holding the NVSHMEM plugin's kernels, loaded on the current
// device, for nvshmemx_culibrary_init: their NVSHMEM device state is theirs alone (no
// relocatable device code). "" or what failed.
std::string nvshmem_transport_library(void** library);

// The host side of `ctx`'s device transport (the emulated transport's proxy; none for the
// others), started once every peer is mapped, with every rank's regions (transport_region_table,
// transport_region_bytes): *rank is what stop and take_errors take, *queue what the rank's
// kernels read (RankContext::transport_queue); both null for a transport without a host side.
// "" or what failed.
std::string start_transport_rank(int64_t buffer_id, const RankContext& ctx,
                                 char* const* region_table, const uint64_t* region_bytes,
                                 void** rank, const void** queue);
// Stops it, after the rank's device is idle.
void stop_transport_rank(DeviceTransport device_transport, void* rank);
// The errors it found since the last call ("kind: message"), each once.
std::vector<std::string> take_transport_rank_errors(DeviceTransport device_transport, void* rank);

}  // namespace jax_ep
