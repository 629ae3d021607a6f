// FFI handlers of the normal mode: jax_ep_layout_v2, jax_ep_dispatch_v2,
// jax_ep_cached_dispatch_v2, jax_ep_combine_v2 (operands/results: docs/internals.md).
//
// Each handler looks up the rank's context, checks every operand and result against the
// Buffer's configuration, and enqueues the launcher's kernels on XLA's stream. No host
// synchronisation, no host state per call (sequence words live in device memory), so all are
// command-buffer compatible: XLA captures them into its CUDA graphs with the XLA work around
// them. Without the trait every call split XLA's graphs and was enqueued thunk by thunk (one
// H200, normal step at T=4096: 53 us of host time per step, more than a third of its kernels).
#include <cuda_runtime_api.h>

#include <cstdint>

#include "common.h"
#include "kernels/api.h"
#include "targets.h"

namespace jax_ep {
namespace {

// The Buffer's data dtype D.
ffi::DataType buffer_dtype(const BufferConfig& config) {
  return config.dtype_bytes == 4 ? ffi::DataType::F32 : ffi::DataType::BF16;
}

// C (leading extent of `capacity_arg`) must not exceed the Buffer's capacity.
ffi::Error check_capacity(const char* op, const char* arg, int64_t capacity,
                          const BufferConfig& config) {
  if (capacity <= config.capacity) return ffi::Error::Success();
  return invalid_argument(op, "argument '", arg, "' has ", capacity,
                          " rows, more than the Buffer's capacity=", config.capacity);
}

// The call must run in the Buffer's window (`problem`: the launcher's reason, or "").
ffi::Error check_window(const char* op, const std::string& problem) {
  if (problem.empty()) return ffi::Error::Success();
  return invalid_argument(op, problem);
}

// A weight operand (w, y_w) has no columns or one per top-k slot.
ffi::Error check_weight_columns(const char* op, const char* arg, int64_t num_w,
                                const BufferConfig& config) {
  if (num_w == 0 || num_w == config.num_topk) return ffi::Error::Success();
  return invalid_argument(op, "argument '", arg, "' must have 0 or num_topk=", config.num_topk,
                          " columns, got ", num_w);
}

// The rows both dispatches move (Params: DispatchParams or CachedDispatchParams): x [T, W] and
// its scales [T, S'], into recv_x [C, W] and its scales [C, S'].
template <typename Params>
void set_rows(int64_t num_tokens, int64_t capacity, const ffi::AnyBuffer& x,
              int64_t x_bytes_per_row, const ffi::AnyBuffer& x_scales, int64_t num_scales,
              ffi::AnyBuffer& recv_x, ffi::AnyBuffer& recv_scales, Params* params) {
  params->num_tokens = static_cast<int>(num_tokens);
  params->capacity = static_cast<int>(capacity);
  params->x = x.untyped_data();
  params->x_bytes_per_row = x_bytes_per_row;
  params->x_scales = static_cast<const float*>(x_scales.untyped_data());
  params->num_scales = static_cast<int>(num_scales);
  params->recv_x = recv_x.untyped_data();
  params->recv_scales = static_cast<float*>(recv_scales.untyped_data());
}

ffi::Error LayoutImpl(cudaStream_t stream, int32_t device, int64_t buffer_id,
                      ffi::AnyBuffer topk_idx, ffi::Result<ffi::AnyBuffer> num_tokens_per_rank,
                      ffi::Result<ffi::AnyBuffer> num_tokens_per_expert,
                      ffi::Result<ffi::AnyBuffer> is_token_in_rank) {
  const char* op = EP_TARGET_NAME("layout");
  const RankContext* ctx = nullptr;
  FFI_RETURN_IF_ERROR(begin_call(op, stream, buffer_id, device, &ctx));
  const BufferConfig& config = ctx->config;
  const int64_t num_tokens = topk_idx.dimensions().size() == 2 ? topk_idx.dimensions()[0] : 0;
  const int64_t num_ranks = config.num_ranks;

  FFI_RETURN_IF_ERROR(
      check_array(op, "topk_idx", topk_idx, {ffi::DataType::S32}, {kAnyDim, config.num_topk}));
  FFI_RETURN_IF_ERROR(check_num_tokens(op, "topk_idx", num_tokens, config));
  FFI_RETURN_IF_ERROR(check_array(op, "num_tokens_per_rank", *num_tokens_per_rank,
                                  {ffi::DataType::S32}, {num_ranks}));
  FFI_RETURN_IF_ERROR(check_array(op, "num_tokens_per_expert", *num_tokens_per_expert,
                                  {ffi::DataType::S32}, {config.num_experts}));
  FFI_RETURN_IF_ERROR(check_array(op, "is_token_in_rank", *is_token_in_rank, {ffi::DataType::PRED},
                                  {num_tokens, num_ranks}));

  LayoutParams params;
  params.topk_idx = static_cast<const int32_t*>(topk_idx.untyped_data());
  params.num_tokens = static_cast<int>(num_tokens);
  params.num_tokens_per_rank = static_cast<int32_t*>(num_tokens_per_rank->untyped_data());
  params.num_tokens_per_expert = static_cast<int32_t*>(num_tokens_per_expert->untyped_data());
  params.is_token_in_rank = static_cast<bool*>(is_token_in_rank->untyped_data());
  FFI_RETURN_IF_CUDA_ERROR(op, launch_layout(*ctx, params, stream));
  return ffi::Error::Success();
}

ffi::Error DispatchImpl(cudaStream_t stream, int32_t device, int64_t buffer_id, ffi::AnyBuffer x,
                        ffi::AnyBuffer x_scales, ffi::AnyBuffer topk_idx,
                        ffi::AnyBuffer topk_weights, ffi::Result<ffi::AnyBuffer> recv_x,
                        ffi::Result<ffi::AnyBuffer> recv_scales,
                        ffi::Result<ffi::AnyBuffer> recv_topk_idx,
                        ffi::Result<ffi::AnyBuffer> recv_topk_weights,
                        ffi::Result<ffi::AnyBuffer> num_recv_tokens,
                        ffi::Result<ffi::AnyBuffer> num_recv_tokens_per_expert,
                        ffi::Result<ffi::AnyBuffer> send_pos,
                        ffi::Result<ffi::AnyBuffer> recv_src) {
  const char* op = EP_TARGET_NAME("dispatch");
  const RankContext* ctx = nullptr;
  FFI_RETURN_IF_ERROR(begin_call(op, stream, buffer_id, device, &ctx));
  const BufferConfig& config = ctx->config;
  const int64_t hidden = config.hidden;
  const int64_t num_topk = config.num_topk;
  const int64_t num_ranks = config.num_ranks;

  FFI_RETURN_IF_ERROR(
      check_array(op, "x", x, {buffer_dtype(config), ffi::DataType::F8E4M3FN}, {kAnyDim, hidden}));
  const int64_t num_tokens = x.dimensions()[0];
  FFI_RETURN_IF_ERROR(check_num_tokens(op, "x", num_tokens, config));
  const bool fp8 = x.element_type() == ffi::DataType::F8E4M3FN;
  const int64_t num_scales = fp8 ? hidden / kChannelsPerScale : 0;
  FFI_RETURN_IF_ERROR(
      check_array(op, "x_scales", x_scales, {ffi::DataType::F32}, {num_tokens, num_scales}));
  FFI_RETURN_IF_ERROR(
      check_array(op, "topk_idx", topk_idx, {ffi::DataType::S32}, {num_tokens, num_topk}));
  FFI_RETURN_IF_ERROR(
      check_array(op, "topk_weights", topk_weights, {ffi::DataType::F32}, {num_tokens, num_topk}));

  FFI_RETURN_IF_ERROR(check_array(op, "recv_x", *recv_x, {x.element_type()}, {kAnyDim, hidden}));
  const int64_t capacity = recv_x->dimensions()[0];
  FFI_RETURN_IF_ERROR(check_capacity(op, "recv_x", capacity, config));
  FFI_RETURN_IF_ERROR(
      check_array(op, "recv_scales", *recv_scales, {ffi::DataType::F32}, {capacity, num_scales}));
  FFI_RETURN_IF_ERROR(
      check_array(op, "recv_topk_idx", *recv_topk_idx, {ffi::DataType::S32}, {capacity, num_topk}));
  FFI_RETURN_IF_ERROR(check_array(op, "recv_topk_weights", *recv_topk_weights, {ffi::DataType::F32},
                                  {capacity, num_topk}));
  FFI_RETURN_IF_ERROR(
      check_array(op, "num_recv_tokens", *num_recv_tokens, {ffi::DataType::S32}, {}));
  FFI_RETURN_IF_ERROR(check_array(op, "num_recv_tokens_per_expert", *num_recv_tokens_per_expert,
                                  {ffi::DataType::S32}, {config.num_local_experts()}));
  FFI_RETURN_IF_ERROR(
      check_array(op, "send_pos", *send_pos, {ffi::DataType::S32}, {num_tokens, num_ranks}));
  FFI_RETURN_IF_ERROR(check_array(op, "recv_src", *recv_src, {ffi::DataType::S32}, {capacity}));

  const int64_t x_bytes_per_row = hidden * static_cast<int64_t>(ffi::ByteWidth(x.element_type()));
  FFI_RETURN_IF_ERROR(
      check_window(op, dispatch_window_problem(
                           *ctx, capacity,
                           dispatch_region_row_bytes(x_bytes_per_row, static_cast<int>(num_scales),
                                                     static_cast<int>(num_topk)))));

  DispatchParams params;
  set_rows(num_tokens, capacity, x, x_bytes_per_row, x_scales, num_scales, *recv_x, *recv_scales,
           &params);
  params.topk_idx = static_cast<const int32_t*>(topk_idx.untyped_data());
  params.topk_weights = static_cast<const float*>(topk_weights.untyped_data());
  params.recv_topk_idx = static_cast<int32_t*>(recv_topk_idx->untyped_data());
  params.recv_topk_weights = static_cast<float*>(recv_topk_weights->untyped_data());
  params.num_recv_tokens = static_cast<int32_t*>(num_recv_tokens->untyped_data());
  params.num_recv_tokens_per_expert =
      static_cast<int32_t*>(num_recv_tokens_per_expert->untyped_data());
  params.send_pos = static_cast<int32_t*>(send_pos->untyped_data());
  params.recv_src = static_cast<int32_t*>(recv_src->untyped_data());
  FFI_RETURN_IF_CUDA_ERROR(op, launch_dispatch(*ctx, params, stream));
  return ffi::Error::Success();
}

ffi::Error CachedDispatchImpl(cudaStream_t stream, int32_t device, int64_t buffer_id,
                              ffi::AnyBuffer x, ffi::AnyBuffer x_scales, ffi::AnyBuffer w,
                              ffi::AnyBuffer send_pos, ffi::AnyBuffer recv_src,
                              ffi::AnyBuffer num_recv_tokens, ffi::Result<ffi::AnyBuffer> recv_x,
                              ffi::Result<ffi::AnyBuffer> recv_scales,
                              ffi::Result<ffi::AnyBuffer> recv_w) {
  const char* op = EP_TARGET_NAME("cached_dispatch");
  const RankContext* ctx = nullptr;
  FFI_RETURN_IF_ERROR(begin_call(op, stream, buffer_id, device, &ctx));
  const BufferConfig& config = ctx->config;
  const int64_t num_ranks = config.num_ranks;

  FFI_RETURN_IF_ERROR(
      check_array(op, "x", x, {buffer_dtype(config), ffi::DataType::F32, ffi::DataType::F8E4M3FN},
                  {kAnyDim, kAnyDim}));
  const int64_t num_tokens = x.dimensions()[0];
  const int64_t width = x.dimensions()[1];
  FFI_RETURN_IF_ERROR(check_num_tokens(op, "x", num_tokens, config));
  const int64_t x_bytes_per_row = width * static_cast<int64_t>(ffi::ByteWidth(x.element_type()));
  if (width <= 0 || x_bytes_per_row % kBytesPerVector != 0) {
    return invalid_argument(op, "argument 'x' must have rows of a positive multiple of ",
                            kBytesPerVector, " bytes, got ", width, " x ",
                            dtype_name(x.element_type()));
  }
  const bool fp8 = x.element_type() == ffi::DataType::F8E4M3FN;
  if (fp8 && width % kChannelsPerScale != 0) {
    return invalid_argument(op, "float8 argument 'x' must have a multiple of ", kChannelsPerScale,
                            " columns, got ", width);
  }
  const int64_t num_scales = fp8 ? width / kChannelsPerScale : 0;
  FFI_RETURN_IF_ERROR(
      check_array(op, "x_scales", x_scales, {ffi::DataType::F32}, {num_tokens, num_scales}));
  FFI_RETURN_IF_ERROR(check_array(op, "w", w, {ffi::DataType::F32}, {num_tokens, kAnyDim}));
  const int64_t num_w = w.dimensions()[1];
  FFI_RETURN_IF_ERROR(check_weight_columns(op, "w", num_w, config));
  FFI_RETURN_IF_ERROR(
      check_array(op, "send_pos", send_pos, {ffi::DataType::S32}, {num_tokens, num_ranks}));
  FFI_RETURN_IF_ERROR(check_array(op, "recv_src", recv_src, {ffi::DataType::S32}, {kAnyDim}));
  const int64_t capacity = recv_src.dimensions()[0];
  FFI_RETURN_IF_ERROR(check_capacity(op, "recv_src", capacity, config));
  FFI_RETURN_IF_ERROR(
      check_array(op, "num_recv_tokens", num_recv_tokens, {ffi::DataType::S32}, {}));
  FFI_RETURN_IF_ERROR(check_array(op, "recv_x", *recv_x, {x.element_type()}, {capacity, width}));
  FFI_RETURN_IF_ERROR(
      check_array(op, "recv_scales", *recv_scales, {ffi::DataType::F32}, {capacity, num_scales}));
  FFI_RETURN_IF_ERROR(check_array(op, "recv_w", *recv_w, {ffi::DataType::F32}, {capacity, num_w}));
  FFI_RETURN_IF_ERROR(check_window(
      op, dispatch_window_problem(
              *ctx, capacity,
              cached_dispatch_region_row_bytes(x_bytes_per_row, static_cast<int>(num_scales),
                                               static_cast<int>(num_w)))));

  CachedDispatchParams params;
  set_rows(num_tokens, capacity, x, x_bytes_per_row, x_scales, num_scales, *recv_x, *recv_scales,
           &params);
  params.w = static_cast<const float*>(w.untyped_data());
  params.num_w = static_cast<int>(num_w);
  params.send_pos = static_cast<const int32_t*>(send_pos.untyped_data());
  params.recv_w = static_cast<float*>(recv_w->untyped_data());
  FFI_RETURN_IF_CUDA_ERROR(op, launch_cached_dispatch(*ctx, params, stream));
  return ffi::Error::Success();
}

ffi::Error CombineImpl(cudaStream_t stream, int32_t device, int64_t buffer_id, ffi::AnyBuffer y,
                       ffi::AnyBuffer y_w, ffi::AnyBuffer send_pos, ffi::AnyBuffer recv_src,
                       ffi::AnyBuffer num_recv_tokens, ffi::Result<ffi::AnyBuffer> combined,
                       ffi::Result<ffi::AnyBuffer> combined_w) {
  const char* op = EP_TARGET_NAME("combine");
  const RankContext* ctx = nullptr;
  FFI_RETURN_IF_ERROR(begin_call(op, stream, buffer_id, device, &ctx));
  const BufferConfig& config = ctx->config;
  const int64_t hidden = config.hidden;
  const int64_t num_ranks = config.num_ranks;

  FFI_RETURN_IF_ERROR(check_array(op, "y", y, {buffer_dtype(config)}, {kAnyDim, hidden}));
  const int64_t capacity = y.dimensions()[0];
  FFI_RETURN_IF_ERROR(check_capacity(op, "y", capacity, config));
  FFI_RETURN_IF_ERROR(check_array(op, "y_w", y_w, {ffi::DataType::F32}, {capacity, kAnyDim}));
  const int64_t num_w = y_w.dimensions()[1];
  FFI_RETURN_IF_ERROR(check_weight_columns(op, "y_w", num_w, config));
  FFI_RETURN_IF_ERROR(
      check_array(op, "send_pos", send_pos, {ffi::DataType::S32}, {kAnyDim, num_ranks}));
  const int64_t num_tokens = send_pos.dimensions()[0];
  FFI_RETURN_IF_ERROR(check_num_tokens(op, "send_pos", num_tokens, config));
  FFI_RETURN_IF_ERROR(check_array(op, "recv_src", recv_src, {ffi::DataType::S32}, {capacity}));
  FFI_RETURN_IF_ERROR(
      check_array(op, "num_recv_tokens", num_recv_tokens, {ffi::DataType::S32}, {}));
  FFI_RETURN_IF_ERROR(
      check_array(op, "combined", *combined, {buffer_dtype(config)}, {num_tokens, hidden}));
  FFI_RETURN_IF_ERROR(
      check_array(op, "combined_w", *combined_w, {ffi::DataType::F32}, {num_tokens, num_w}));
  const int64_t y_bytes_per_row = hidden * config.dtype_bytes;
  FFI_RETURN_IF_ERROR(check_window(
      op,
      combine_window_problem(*ctx, num_tokens,
                             combine_region_row_bytes(y_bytes_per_row, static_cast<int>(num_w)))));

  CombineParams params;
  params.num_tokens = static_cast<int>(num_tokens);
  params.capacity = static_cast<int>(capacity);
  params.y = y.untyped_data();
  params.y_w = static_cast<const float*>(y_w.untyped_data());
  params.num_w = static_cast<int>(num_w);
  params.send_pos = static_cast<const int32_t*>(send_pos.untyped_data());
  params.recv_src = static_cast<const int32_t*>(recv_src.untyped_data());
  params.num_recv_tokens = static_cast<const int32_t*>(num_recv_tokens.untyped_data());
  params.combined = combined->untyped_data();
  params.combined_w = static_cast<float*>(combined_w->untyped_data());
  FFI_RETURN_IF_CUDA_ERROR(op, launch_combine(*ctx, params, stream));
  return ffi::Error::Success();
}

}  // namespace

EP_DEFINE_HANDLERS(LayoutHandler, LayoutImpl,
                   bind_rank_call()
                       .Arg<ffi::AnyBuffer>()    // topk_idx [T, K] s32
                       .Ret<ffi::AnyBuffer>()    // num_tokens_per_rank [R] s32
                       .Ret<ffi::AnyBuffer>()    // num_tokens_per_expert [E] s32
                       .Ret<ffi::AnyBuffer>());  // is_token_in_rank [T, R] pred

EP_DEFINE_HANDLERS(DispatchHandler, DispatchImpl,
                   bind_rank_call()
                       .Arg<ffi::AnyBuffer>()    // x [T, H] D or f8e4m3fn
                       .Arg<ffi::AnyBuffer>()    // x_scales [T, S'] f32
                       .Arg<ffi::AnyBuffer>()    // topk_idx [T, K] s32
                       .Arg<ffi::AnyBuffer>()    // topk_weights [T, K] f32
                       .Ret<ffi::AnyBuffer>()    // recv_x [C, H] dtype of x
                       .Ret<ffi::AnyBuffer>()    // recv_scales [C, S'] f32
                       .Ret<ffi::AnyBuffer>()    // recv_topk_idx [C, K] s32
                       .Ret<ffi::AnyBuffer>()    // recv_topk_weights [C, K] f32
                       .Ret<ffi::AnyBuffer>()    // num_recv_tokens [] s32
                       .Ret<ffi::AnyBuffer>()    // num_recv_tokens_per_expert [E_loc]
                       .Ret<ffi::AnyBuffer>()    // send_pos [T, R] s32
                       .Ret<ffi::AnyBuffer>());  // recv_src [C] s32

EP_DEFINE_HANDLERS(CachedDispatchHandler, CachedDispatchImpl,
                   bind_rank_call()
                       .Arg<ffi::AnyBuffer>()    // x [T, W] D, f32 or f8e4m3fn
                       .Arg<ffi::AnyBuffer>()    // x_scales [T, S'] f32
                       .Arg<ffi::AnyBuffer>()    // w [T, K'] f32
                       .Arg<ffi::AnyBuffer>()    // send_pos [T, R] s32
                       .Arg<ffi::AnyBuffer>()    // recv_src [C] s32
                       .Arg<ffi::AnyBuffer>()    // num_recv_tokens [] s32
                       .Ret<ffi::AnyBuffer>()    // recv_x [C, W] dtype of x
                       .Ret<ffi::AnyBuffer>()    // recv_scales [C, S'] f32
                       .Ret<ffi::AnyBuffer>());  // recv_w [C, K'] f32

EP_DEFINE_HANDLERS(CombineHandler, CombineImpl,
                   bind_rank_call()
                       .Arg<ffi::AnyBuffer>()    // y [C, H] D
                       .Arg<ffi::AnyBuffer>()    // y_w [C, K'] f32
                       .Arg<ffi::AnyBuffer>()    // send_pos [T, R] s32
                       .Arg<ffi::AnyBuffer>()    // recv_src [C] s32
                       .Arg<ffi::AnyBuffer>()    // num_recv_tokens [] s32
                       .Ret<ffi::AnyBuffer>()    // combined [T, H] D
                       .Ret<ffi::AnyBuffer>());  // combined_w [T, K'] f32

void add_normal_targets(std::vector<FfiTarget>& targets) {
  EP_ADD_TARGETS(targets, "layout", LayoutHandler);
  EP_ADD_TARGETS(targets, "dispatch", DispatchHandler);
  EP_ADD_TARGETS(targets, "cached_dispatch", CachedDispatchHandler);
  EP_ADD_TARGETS(targets, "combine", CombineHandler);
}

}  // namespace jax_ep
