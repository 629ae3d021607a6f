// Helpers shared by the FFI handler files (normal_handlers.cc, low_latency_handlers.cc): error
// macros, the binding and the start every handler shares (bind_rank_call, begin_call: the
// registry lookup), and argument checks whose messages name the op, the argument, what was
// expected and what was passed.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <initializer_list>
#include <sstream>
#include <string>

#include "kernels/api.h"
#include "runtime/registry.h"
#include "side_stream.h"
#include "xla/ffi/api/ffi.h"

namespace jax_ep {

namespace ffi = ::xla::ffi;

// Returns `expr` (an ffi::Error) from the handler when it is an error.
#define FFI_RETURN_IF_ERROR(expr)         \
  do {                                    \
    ::xla::ffi::Error error_ = (expr);    \
    if (!error_.success()) return error_; \
  } while (0)

// Returns an ffi::Error naming the op and the failed call when `expr` (a cudaError_t) fails.
#define FFI_RETURN_IF_CUDA_ERROR(op, expr)                                         \
  do {                                                                             \
    const cudaError_t status_ = (expr);                                            \
    if (status_ != cudaSuccess) return ::jax_ep::cuda_error((op), #expr, status_); \
  } while (0)

// Defines the handler `name` of `impl` with the binding `...` twice: `name`, which XLA may
// capture in a command buffer, and `name##Async`, which launches `impl` on the Buffer's side
// stream and returns (side_stream.h; XLA never captures it). EP_ADD_TARGETS (targets.h)
// registers both.
#define EP_DEFINE_HANDLERS(name, impl, ...)                                  \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, impl, __VA_ARGS__,                     \
                                {::xla::ffi::Traits::kCmdBufferCompatible}); \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name##Async, ::jax_ep::OnSideStream<impl>::Call, __VA_ARGS__)

// The binding every handler starts with, the first three parameters of its implementation: XLA's
// stream, the device ordinal and the Buffer's id. Each handler appends its attributes, operands
// and results.
inline auto bind_rank_call() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()  // stream
      .Ctx<ffi::DeviceOrdinal>()                 // device
      .Attr<int64_t>("buffer_id");               // buffer_id
}

// An InvalidArgument error: "<op>: " and then `parts`, streamed.
template <typename... Parts>
ffi::Error invalid_argument(const char* op, const Parts&... parts) {
  std::ostringstream message;
  message << op << ": ";
  (message << ... << parts);
  return ffi::Error::InvalidArgument(message.str());
}

inline ffi::Error cuda_error(const char* op, const char* what, cudaError_t status) {
  std::ostringstream message;
  message << op << ": " << what << " failed: " << cudaGetErrorName(status) << " ("
          << cudaGetErrorString(status) << ")";
  return ffi::Error::Internal(message.str());
}

inline const char* dtype_name(ffi::DataType dtype) {
  switch (dtype) {
    case ffi::DataType::PRED:
      return "bool";
    case ffi::DataType::S8:
      return "int8";
    case ffi::DataType::S16:
      return "int16";
    case ffi::DataType::S32:
      return "int32";
    case ffi::DataType::S64:
      return "int64";
    case ffi::DataType::U8:
      return "uint8";
    case ffi::DataType::U32:
      return "uint32";
    case ffi::DataType::F16:
      return "float16";
    case ffi::DataType::BF16:
      return "bfloat16";
    case ffi::DataType::F32:
      return "float32";
    case ffi::DataType::F64:
      return "float64";
    case ffi::DataType::F8E4M3FN:
      return "float8_e4m3fn";
    case ffi::DataType::F8E5M2:
      return "float8_e5m2";
    default:
      return "an unsupported dtype";
  }
}

// Matches any extent in check_shape.
constexpr int64_t kAnyDim = -1;

inline std::string dims_string(const int64_t* dims, size_t rank) {
  std::ostringstream text;
  text << "[";
  for (size_t i = 0; i < rank; ++i) {
    if (i > 0) text << ", ";
    if (dims[i] == kAnyDim) {
      text << "*";
    } else {
      text << dims[i];
    }
  }
  text << "]";
  return text.str();
}

inline ffi::Error check_dtype(const char* op, const char* arg, const ffi::AnyBuffer& buffer,
                              std::initializer_list<ffi::DataType> allowed) {
  for (ffi::DataType dtype : allowed) {
    if (buffer.element_type() == dtype) return ffi::Error::Success();
  }
  std::ostringstream message;
  message << op << ": argument '" << arg << "' must have dtype ";
  bool first = true;
  for (ffi::DataType dtype : allowed) {
    message << (first ? "" : " or ") << dtype_name(dtype);
    first = false;
  }
  message << ", got " << dtype_name(buffer.element_type());
  return ffi::Error::InvalidArgument(message.str());
}

inline ffi::Error check_shape(const char* op, const char* arg, const ffi::AnyBuffer& buffer,
                              std::initializer_list<int64_t> expected) {
  const auto dims = buffer.dimensions();
  bool ok = dims.size() == expected.size();
  size_t i = 0;
  for (int64_t extent : expected) {
    if (!ok) break;
    ok = extent == kAnyDim || dims[i] == extent;
    ++i;
  }
  if (ok) return ffi::Error::Success();
  std::ostringstream message;
  message << op << ": argument '" << arg << "' must have shape "
          << dims_string(expected.begin(), expected.size()) << ", got "
          << dims_string(dims.begin(), dims.size());
  return ffi::Error::InvalidArgument(message.str());
}

// Checks dtype then shape.
inline ffi::Error check_array(const char* op, const char* arg, const ffi::AnyBuffer& buffer,
                              std::initializer_list<ffi::DataType> allowed,
                              std::initializer_list<int64_t> expected) {
  FFI_RETURN_IF_ERROR(check_dtype(op, arg, buffer, allowed));
  return check_shape(op, arg, buffer, expected);
}

// T (the leading extent of argument `arg`) must not exceed max_tokens_per_rank.
inline ffi::Error check_num_tokens(const char* op, const char* arg, int64_t num_tokens,
                                   const BufferConfig& config) {
  if (num_tokens <= config.max_tokens_per_rank) return ffi::Error::Success();
  return invalid_argument(
      op, "argument '", arg, "' has ", num_tokens,
      " tokens, more than the Buffer's max_tokens_per_rank=", config.max_tokens_per_rank);
}

// Counts this handler execution, noting whether XLA is capturing `stream` into a CUDA graph.
inline void note_handler_call(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  const bool capturing = cudaStreamIsCapturing(stream, &status) == cudaSuccess &&
                         status == cudaStreamCaptureStatusActive;
  record_handler_call(capturing);
}

// The RankContext of (buffer_id, device). Fails when the Buffer is unknown on this device, or
// when a previous call on it timed out (the kernel trapped, the device context is lost).
inline ffi::Error get_rank_context(const char* op, int64_t buffer_id, int32_t device,
                                   const RankContext** out) {
  const RankContext* ctx = find_rank_context(buffer_id, device);
  if (ctx == nullptr) {
    return invalid_argument(op, "no jax_ep Buffer with id ", buffer_id, " on device ", device,
                            " (was it closed, or created on other devices?)");
  }
  const volatile TimeoutRecord* record = ctx->timeout_record_host;
  if (record != nullptr && record->timed_out != 0) {
    std::ostringstream message;
    message << op << ": a previous call on this Buffer timed out: rank " << record->rank
            << " waited for rank " << record->peer << " in phase '"
            << wait_phase_name(record->phase) << "' (sequence " << record->seq
            << "); the GPU context is no longer usable, restart the process";
    return ffi::Error::Internal(message.str());
  }
  *out = ctx;
  return ffi::Error::Success();
}

// Every handler's start: counts the call (note_handler_call), then finds the rank's context,
// failing as get_rank_context does.
inline ffi::Error begin_call(const char* op, cudaStream_t stream, int64_t buffer_id, int32_t device,
                             const RankContext** ctx) {
  note_handler_call(stream);
  return get_rank_context(op, buffer_id, device, ctx);
}

}  // namespace jax_ep
