// FFI handlers of the low-latency (decode) mode: jax_ep_low_latency_dispatch_v2,
// jax_ep_low_latency_combine_v2 and their split halves ..._{dispatch,combine}_{send,recv}_v2
// (operands/results: docs/internals.md, "Low-latency mode").
//
// Each handler looks up the rank's context (failing if a previous call timed out), checks every
// operand and result against the Buffer's configuration, and enqueues one kernel on XLA's
// stream. All are command-buffer compatible: no host synchronisation and no host state per
// call (the sequence words that pick parity and tags live in device memory and are advanced by
// the kernels), so XLA may capture them into CUDA graphs and replay them.
#include <cuda_runtime_api.h>

#include <cstdint>

#include "common.h"
#include "kernels/api.h"
#include "targets.h"

namespace jax_ep {
namespace {

// The Buffer must have low-latency regions, and its static shape must fit the kernels.
ffi::Error check_low_latency_config(const char* op, const BufferConfig& config) {
  if (!config.low_latency) {
    return invalid_argument(op, "the Buffer was created with low_latency=False; create it with ",
                            "low_latency=True to use the low-latency ops");
  }
  if (config.num_topk > kMaxTopk) {
    return invalid_argument(op, "num_topk must be <= ", kMaxTopk, " in low-latency mode, got ",
                            config.num_topk);
  }
  if (config.hidden % kChannelsPerScale != 0) {
    return invalid_argument(op, "hidden must be a multiple of ", kChannelsPerScale, ", got ",
                            config.hidden);
  }
  if (config.hidden > kMaxLowLatencyHidden) {
    return invalid_argument(op, "hidden must be <= ", kMaxLowLatencyHidden,
                            " in low-latency mode, got ", config.hidden);
  }
  return ffi::Error::Success();
}

// Every low-latency handler's start: begin_call (common.h), then the Buffer's configuration.
ffi::Error begin_low_latency_call(const char* op, cudaStream_t stream, int64_t buffer_id,
                                  int32_t device, const RankContext** ctx) {
  FFI_RETURN_IF_ERROR(begin_call(op, stream, buffer_id, device, ctx));
  return check_low_latency_config(op, (*ctx)->config);
}

// The send half's result / the receive half's operand: [1] int32.
ffi::Error check_ticket(const char* op, const ffi::AnyBuffer& ticket) {
  return check_array(op, "ticket", ticket, {ffi::DataType::S32}, {1});
}

// Dispatch options and input x [T, H] bf16 (T <= T_max) of every launch, and topk_idx [T, K]
// where the launch reads it (fused op and send half; nullptr for the receive half).
ffi::Error check_dispatch_inputs(const char* op, const BufferConfig& config, bool use_fp8,
                                 bool round_scale, const ffi::AnyBuffer& x,
                                 const ffi::AnyBuffer* topk_idx, LowLatencyDispatchParams* params) {
  FFI_RETURN_IF_ERROR(check_array(op, "x", x, {ffi::DataType::BF16}, {kAnyDim, config.hidden}));
  const int64_t num_tokens = x.dimensions()[0];
  FFI_RETURN_IF_ERROR(check_num_tokens(op, "x", num_tokens, config));
  params->use_fp8 = use_fp8;
  params->round_scale = round_scale;
  params->x = x.untyped_data();
  params->num_tokens = static_cast<int>(num_tokens);
  if (topk_idx != nullptr) {
    FFI_RETURN_IF_ERROR(check_array(op, "topk_idx", *topk_idx, {ffi::DataType::S32},
                                    {num_tokens, config.num_topk}));
    params->topk_idx = static_cast<const int32_t*>(topk_idx->untyped_data());
  }
  return ffi::Error::Success();
}

// Dispatch results (fused op and receive half).
ffi::Error check_dispatch_results(const char* op, const BufferConfig& config, bool use_fp8,
                                  ffi::AnyBuffer recv_x, ffi::AnyBuffer recv_scales,
                                  ffi::AnyBuffer recv_count, ffi::AnyBuffer recv_src,
                                  ffi::AnyBuffer recv_k, LowLatencyDispatchParams* params) {
  const int64_t num_local = config.num_local_experts();
  const int64_t rows = static_cast<int64_t>(config.num_ranks) * config.max_tokens_per_rank;
  const int64_t num_scales = use_fp8 ? config.hidden / kChannelsPerScale : 0;
  FFI_RETURN_IF_ERROR(check_array(op, "recv_x", recv_x,
                                  {use_fp8 ? ffi::DataType::F8E4M3FN : ffi::DataType::BF16},
                                  {num_local, rows, config.hidden}));
  FFI_RETURN_IF_ERROR(check_array(op, "recv_scales", recv_scales, {ffi::DataType::F32},
                                  {num_local, rows, num_scales}));
  FFI_RETURN_IF_ERROR(check_array(op, "recv_count", recv_count, {ffi::DataType::S32}, {num_local}));
  FFI_RETURN_IF_ERROR(
      check_array(op, "recv_src", recv_src, {ffi::DataType::S32}, {num_local, rows}));
  FFI_RETURN_IF_ERROR(check_array(op, "recv_k", recv_k, {ffi::DataType::S32}, {num_local, rows}));
  params->recv_x = recv_x.untyped_data();
  params->recv_scales = static_cast<float*>(recv_scales.untyped_data());
  params->recv_count = static_cast<int32_t*>(recv_count.untyped_data());
  params->recv_src = static_cast<int32_t*>(recv_src.untyped_data());
  params->recv_k = static_cast<int32_t*>(recv_k.untyped_data());
  return ffi::Error::Success();
}

// The fused dispatch and its receive half: one binding, one body. The second operand is topk_idx
// for the fused op; for the receive half, the send half's ticket (its routing is in the
// workspace, from the send half).
template <LowLatencyHalves kHalves>
ffi::Error LowLatencyDispatchImpl(
    cudaStream_t stream, int32_t device, int64_t buffer_id, bool use_fp8, bool round_scale,
    ffi::AnyBuffer x, ffi::AnyBuffer topk_idx_or_ticket, ffi::Result<ffi::AnyBuffer> recv_x,
    ffi::Result<ffi::AnyBuffer> recv_scales, ffi::Result<ffi::AnyBuffer> recv_count,
    ffi::Result<ffi::AnyBuffer> recv_src, ffi::Result<ffi::AnyBuffer> recv_k) {
  static_assert(kHalves != LowLatencyHalves::kSend, "the send half has a binding of its own");
  constexpr bool kFused = kHalves == LowLatencyHalves::kBoth;
  const char* op =
      kFused ? EP_TARGET_NAME("low_latency_dispatch") : EP_TARGET_NAME("low_latency_dispatch_recv");
  const RankContext* ctx = nullptr;
  FFI_RETURN_IF_ERROR(begin_low_latency_call(op, stream, buffer_id, device, &ctx));
  LowLatencyDispatchParams params;
  FFI_RETURN_IF_ERROR(check_dispatch_inputs(op, ctx->config, use_fp8, round_scale, x,
                                            kFused ? &topk_idx_or_ticket : nullptr, &params));
  if (!kFused) FFI_RETURN_IF_ERROR(check_ticket(op, topk_idx_or_ticket));
  FFI_RETURN_IF_ERROR(check_dispatch_results(op, ctx->config, use_fp8, *recv_x, *recv_scales,
                                             *recv_count, *recv_src, *recv_k, &params));
  FFI_RETURN_IF_CUDA_ERROR(op, launch_low_latency_dispatch(*ctx, params, kHalves, stream));
  return ffi::Error::Success();
}

// The send halves' last operand `after` is never read: it is a result of the previous receive
// of the op (or a constant for the first send of a program), so that XLA runs the send after
// that receive. Only an operand orders custom calls for sure: XLA prunes unused values of an
// optimization barrier, and scheduled the sends of a chain before their receives.
ffi::Error LowLatencyDispatchSendImpl(cudaStream_t stream, int32_t device, int64_t buffer_id,
                                      bool use_fp8, bool round_scale, ffi::AnyBuffer x,
                                      ffi::AnyBuffer topk_idx, ffi::AnyBuffer /*after*/,
                                      ffi::Result<ffi::AnyBuffer> ticket) {
  const char* op = EP_TARGET_NAME("low_latency_dispatch_send");
  const RankContext* ctx = nullptr;
  FFI_RETURN_IF_ERROR(begin_low_latency_call(op, stream, buffer_id, device, &ctx));
  LowLatencyDispatchParams params;
  FFI_RETURN_IF_ERROR(
      check_dispatch_inputs(op, ctx->config, use_fp8, round_scale, x, &topk_idx, &params));
  FFI_RETURN_IF_ERROR(check_ticket(op, *ticket));
  params.ticket = static_cast<int32_t*>(ticket->untyped_data());
  FFI_RETURN_IF_CUDA_ERROR(
      op, launch_low_latency_dispatch(*ctx, params, LowLatencyHalves::kSend, stream));
  return ffi::Error::Success();
}

// Combine operands every launch reads: y and the dispatch handle.
ffi::Error check_combine_y_and_handle(const char* op, const BufferConfig& config,
                                      const ffi::AnyBuffer& y, const ffi::AnyBuffer& recv_src,
                                      const ffi::AnyBuffer& recv_k,
                                      const ffi::AnyBuffer& recv_count,
                                      LowLatencyCombineParams* params) {
  const int64_t num_local = config.num_local_experts();
  const int64_t rows = static_cast<int64_t>(config.num_ranks) * config.max_tokens_per_rank;
  FFI_RETURN_IF_ERROR(
      check_array(op, "y", y, {ffi::DataType::BF16}, {num_local, rows, config.hidden}));
  FFI_RETURN_IF_ERROR(
      check_array(op, "recv_src", recv_src, {ffi::DataType::S32}, {num_local, rows}));
  FFI_RETURN_IF_ERROR(check_array(op, "recv_k", recv_k, {ffi::DataType::S32}, {num_local, rows}));
  FFI_RETURN_IF_ERROR(check_array(op, "recv_count", recv_count, {ffi::DataType::S32}, {num_local}));
  params->y = y.untyped_data();
  params->recv_src = static_cast<const int32_t*>(recv_src.untyped_data());
  params->recv_k = static_cast<const int32_t*>(recv_k.untyped_data());
  params->recv_count = static_cast<const int32_t*>(recv_count.untyped_data());
  return ffi::Error::Success();
}

// Combine operands and result of the owner's reduction (fused op and receive half).
ffi::Error check_combine_tokens(const char* op, const BufferConfig& config,
                                const ffi::AnyBuffer& topk_idx, const ffi::AnyBuffer& topk_weights,
                                ffi::AnyBuffer out, LowLatencyCombineParams* params) {
  FFI_RETURN_IF_ERROR(
      check_array(op, "topk_idx", topk_idx, {ffi::DataType::S32}, {kAnyDim, config.num_topk}));
  const int64_t num_tokens = topk_idx.dimensions()[0];
  FFI_RETURN_IF_ERROR(check_num_tokens(op, "topk_idx", num_tokens, config));
  FFI_RETURN_IF_ERROR(check_array(op, "topk_weights", topk_weights, {ffi::DataType::F32},
                                  {num_tokens, config.num_topk}));
  FFI_RETURN_IF_ERROR(
      check_array(op, "out", out, {ffi::DataType::BF16}, {num_tokens, config.hidden}));
  params->topk_idx = static_cast<const int32_t*>(topk_idx.untyped_data());
  params->topk_weights = static_cast<const float*>(topk_weights.untyped_data());
  params->num_tokens = static_cast<int>(num_tokens);
  params->out = out.untyped_data();
  return ffi::Error::Success();
}

// The fused combine and its receive half, whose operands are the fused op's and then the send
// half's ticket (Ticket: nothing, or one ffi::AnyBuffer): one body.
template <typename... Ticket>
ffi::Error LowLatencyCombineImpl(cudaStream_t stream, int32_t device, int64_t buffer_id,
                                 ffi::AnyBuffer y, ffi::AnyBuffer topk_idx,
                                 ffi::AnyBuffer topk_weights, ffi::AnyBuffer recv_src,
                                 ffi::AnyBuffer recv_k, ffi::AnyBuffer recv_count, Ticket... ticket,
                                 ffi::Result<ffi::AnyBuffer> out) {
  static_assert(sizeof...(Ticket) <= 1, "one ticket at most");
  constexpr bool kFused = sizeof...(Ticket) == 0;
  const char* op =
      kFused ? EP_TARGET_NAME("low_latency_combine") : EP_TARGET_NAME("low_latency_combine_recv");
  const RankContext* ctx = nullptr;
  FFI_RETURN_IF_ERROR(begin_low_latency_call(op, stream, buffer_id, device, &ctx));
  LowLatencyCombineParams params;
  FFI_RETURN_IF_ERROR(
      check_combine_y_and_handle(op, ctx->config, y, recv_src, recv_k, recv_count, &params));
  FFI_RETURN_IF_ERROR(check_combine_tokens(op, ctx->config, topk_idx, topk_weights, *out, &params));
  if constexpr (!kFused) FFI_RETURN_IF_ERROR(check_ticket(op, ticket...));
  const LowLatencyHalves halves = kFused ? LowLatencyHalves::kBoth : LowLatencyHalves::kRecv;
  FFI_RETURN_IF_CUDA_ERROR(op, launch_low_latency_combine(*ctx, params, halves, stream));
  return ffi::Error::Success();
}

ffi::Error LowLatencyCombineSendImpl(cudaStream_t stream, int32_t device, int64_t buffer_id,
                                     ffi::AnyBuffer y, ffi::AnyBuffer recv_src,
                                     ffi::AnyBuffer recv_k, ffi::AnyBuffer recv_count,
                                     ffi::AnyBuffer /*after*/, ffi::Result<ffi::AnyBuffer> ticket) {
  const char* op = EP_TARGET_NAME("low_latency_combine_send");
  const RankContext* ctx = nullptr;
  FFI_RETURN_IF_ERROR(begin_low_latency_call(op, stream, buffer_id, device, &ctx));
  LowLatencyCombineParams params;
  FFI_RETURN_IF_ERROR(
      check_combine_y_and_handle(op, ctx->config, y, recv_src, recv_k, recv_count, &params));
  FFI_RETURN_IF_ERROR(check_ticket(op, *ticket));
  params.ticket = static_cast<int32_t*>(ticket->untyped_data());
  FFI_RETURN_IF_CUDA_ERROR(
      op, launch_low_latency_combine(*ctx, params, LowLatencyHalves::kSend, stream));
  return ffi::Error::Success();
}

// The bindings, rank first (bind_rank_call). A dispatch launch's attributes and first operand:
auto bind_dispatch() {
  return bind_rank_call()
      .Attr<bool>("use_fp8")      // use_fp8
      .Attr<bool>("round_scale")  // round_scale
      .Arg<ffi::AnyBuffer>();     // x [T, H] bf16
}

// The fused dispatch's and its receive half's.
auto bind_dispatch_to_results() {
  return bind_dispatch()
      .Arg<ffi::AnyBuffer>()   // topk_idx [T, K] s32 (fused) or ticket [1] s32 (receive half)
      .Ret<ffi::AnyBuffer>()   // recv_x [E_loc, R*T_max, H] f8/bf16
      .Ret<ffi::AnyBuffer>()   // recv_scales [E_loc, R*T_max, S'] f32
      .Ret<ffi::AnyBuffer>()   // recv_count [E_loc] s32
      .Ret<ffi::AnyBuffer>()   // recv_src [E_loc, R*T_max] s32
      .Ret<ffi::AnyBuffer>();  // recv_k [E_loc, R*T_max] s32
}

// The operands of the fused combine and of its receive half (which has the ticket after them).
auto bind_combine_reduction() {
  return bind_rank_call()
      .Arg<ffi::AnyBuffer>()   // y [E_loc, R*T_max, H] bf16
      .Arg<ffi::AnyBuffer>()   // topk_idx [T, K] s32
      .Arg<ffi::AnyBuffer>()   // topk_weights [T, K] f32
      .Arg<ffi::AnyBuffer>()   // recv_src [E_loc, R*T_max] s32
      .Arg<ffi::AnyBuffer>()   // recv_k [E_loc, R*T_max] s32
      .Arg<ffi::AnyBuffer>();  // recv_count [E_loc] s32
}

}  // namespace

EP_DEFINE_HANDLERS(LowLatencyDispatchHandler, LowLatencyDispatchImpl<LowLatencyHalves::kBoth>,
                   bind_dispatch_to_results());

EP_DEFINE_HANDLERS(LowLatencyDispatchSendHandler, LowLatencyDispatchSendImpl,
                   bind_dispatch()
                       .Arg<ffi::AnyBuffer>()    // topk_idx [T, K] s32
                       .Arg<ffi::AnyBuffer>()    // after (unread)
                       .Ret<ffi::AnyBuffer>());  // ticket [1] s32

EP_DEFINE_HANDLERS(LowLatencyDispatchRecvHandler, LowLatencyDispatchImpl<LowLatencyHalves::kRecv>,
                   bind_dispatch_to_results());

EP_DEFINE_HANDLERS(LowLatencyCombineHandler, LowLatencyCombineImpl<>,
                   bind_combine_reduction().Ret<ffi::AnyBuffer>());  // out [T, H] bf16

EP_DEFINE_HANDLERS(LowLatencyCombineSendHandler, LowLatencyCombineSendImpl,
                   bind_rank_call()
                       .Arg<ffi::AnyBuffer>()    // y [E_loc, R*T_max, H] bf16
                       .Arg<ffi::AnyBuffer>()    // recv_src [E_loc, R*T_max] s32
                       .Arg<ffi::AnyBuffer>()    // recv_k [E_loc, R*T_max] s32
                       .Arg<ffi::AnyBuffer>()    // recv_count [E_loc] s32
                       .Arg<ffi::AnyBuffer>()    // after (unread)
                       .Ret<ffi::AnyBuffer>());  // ticket [1] s32

EP_DEFINE_HANDLERS(LowLatencyCombineRecvHandler, LowLatencyCombineImpl<ffi::AnyBuffer>,
                   bind_combine_reduction()
                       .Arg<ffi::AnyBuffer>()    // ticket [1] s32
                       .Ret<ffi::AnyBuffer>());  // out [T, H] bf16

void add_low_latency_targets(std::vector<FfiTarget>& targets) {
  EP_ADD_TARGETS(targets, "low_latency_dispatch", LowLatencyDispatchHandler);
  EP_ADD_TARGETS(targets, "low_latency_dispatch_send", LowLatencyDispatchSendHandler);
  EP_ADD_TARGETS(targets, "low_latency_dispatch_recv", LowLatencyDispatchRecvHandler);
  EP_ADD_TARGETS(targets, "low_latency_combine", LowLatencyCombineHandler);
  EP_ADD_TARGETS(targets, "low_latency_combine_send", LowLatencyCombineSendHandler);
  EP_ADD_TARGETS(targets, "low_latency_combine_recv", LowLatencyCombineRecvHandler);
}

}  // namespace jax_ep
