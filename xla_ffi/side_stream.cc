// The side streams of asynchronous ops and the "wait" target (side_stream.h).
#include "side_stream.h"

#include <cuda_runtime_api.h>
#include <nanobind/nanobind.h>

#include <map>
#include <mutex>
#include <sstream>
#include <utility>

#include "common.h"
#include "targets.h"

namespace jax_ep {
namespace {

struct SideStream {
  cudaStream_t stream = nullptr;
  cudaEvent_t fork = nullptr;
  cudaEvent_t join = nullptr;
};

std::mutex side_streams_mutex;
std::map<std::pair<int64_t, int32_t>, SideStream> side_streams;  // (buffer id, device) ->

// Restores the calling thread's current device when it goes out of scope.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    if (cudaGetDevice(&previous_) == cudaSuccess && previous_ != device) {
      set_ = cudaSetDevice(device) == cudaSuccess;
    }
  }
  ~DeviceGuard() {
    if (set_) cudaSetDevice(previous_);
  }

 private:
  int previous_ = -1;
  bool set_ = false;
};

ffi::Error create_side_stream(const char* op, int32_t device, SideStream* out) {
  DeviceGuard guard(device);
  int least = 0, greatest = 0;
  FFI_RETURN_IF_CUDA_ERROR(op, cudaDeviceGetStreamPriorityRange(&least, &greatest));
  FFI_RETURN_IF_CUDA_ERROR(
      op, cudaStreamCreateWithPriority(&out->stream, cudaStreamNonBlocking, greatest));
  FFI_RETURN_IF_CUDA_ERROR(op, cudaEventCreateWithFlags(&out->fork, cudaEventDisableTiming));
  FFI_RETURN_IF_CUDA_ERROR(op, cudaEventCreateWithFlags(&out->join, cudaEventDisableTiming));
  return ffi::Error::Success();
}

// The side stream of (buffer_id, device), created at its first use. Refuses a stream that XLA
// is capturing into a CUDA graph: the fork would leave the capture unjoined.
ffi::Error side_stream(const char* op, cudaStream_t xla_stream, int64_t buffer_id, int32_t device,
                       SideStream* out) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(xla_stream, &status) == cudaSuccess &&
      status != cudaStreamCaptureStatusNone) {
    std::ostringstream message;
    message << op << ": an asynchronous jax_ep op (Buffer(overlap=True)) cannot run inside a "
            << "CUDA graph capture (buffer " << buffer_id << ", device " << device << ")";
    return ffi::Error::Internal(message.str());
  }
  std::lock_guard<std::mutex> lock(side_streams_mutex);
  auto it = side_streams.find({buffer_id, device});
  if (it == side_streams.end()) {
    SideStream created;
    FFI_RETURN_IF_ERROR(create_side_stream(op, device, &created));
    it = side_streams.emplace(std::make_pair(buffer_id, device), created).first;
  }
  *out = it->second;
  return ffi::Error::Success();
}

// The wait target: XLA's stream waits for the side stream's last join; the results alias the
// first operands (the async op's results, operand_output_aliases), the rest of the operands
// only keep buffers alive until here (the async op's inputs) or order this call after others.
ffi::Error WaitImpl(cudaStream_t stream, int32_t device, int64_t buffer_id, ffi::RemainingArgs args,
                    ffi::RemainingRets rets) {
  const char* op = "wait";
  note_handler_call(stream);
  if (rets.size() > args.size()) {
    return ffi::Error::InvalidArgument("wait: more results than operands");
  }
  FFI_RETURN_IF_ERROR(wait_for_side_stream(op, stream, buffer_id, device));
  for (size_t i = 0; i < rets.size(); ++i) {
    auto arg = args.get<ffi::AnyBuffer>(i);
    auto ret = rets.get<ffi::AnyBuffer>(i);
    if (!arg.has_value() || !ret.has_value()) {
      return ffi::Error::InvalidArgument("wait: operands and results must be arrays");
    }
    ffi::AnyBuffer in = arg.value();
    ffi::Result<ffi::AnyBuffer> out = ret.value();
    if (in.size_bytes() != out->size_bytes()) {
      return ffi::Error::InvalidArgument("wait: result i must have operand i's size");
    }
    // XLA aliases each result with its operand; where it could not (the operand is used
    // elsewhere too), the result is a copy, made after the wait.
    if (in.untyped_data() != out->untyped_data() && in.size_bytes() > 0) {
      FFI_RETURN_IF_CUDA_ERROR(
          op, cudaMemcpyAsync(out->untyped_data(), in.untyped_data(), in.size_bytes(),
                              cudaMemcpyDeviceToDevice, stream));
    }
  }
  return ffi::Error::Success();
}

}  // namespace

ffi::Error fork_to_side_stream(const char* op, cudaStream_t xla_stream, int64_t buffer_id,
                               int32_t device, cudaStream_t* side) {
  SideStream s;
  FFI_RETURN_IF_ERROR(side_stream(op, xla_stream, buffer_id, device, &s));
  FFI_RETURN_IF_CUDA_ERROR(op, cudaEventRecord(s.fork, xla_stream));
  FFI_RETURN_IF_CUDA_ERROR(op, cudaStreamWaitEvent(s.stream, s.fork, 0));
  *side = s.stream;
  return ffi::Error::Success();
}

ffi::Error record_join(const char* op, int64_t buffer_id, int32_t device) {
  SideStream s;
  {
    std::lock_guard<std::mutex> lock(side_streams_mutex);
    auto it = side_streams.find({buffer_id, device});
    if (it == side_streams.end()) return ffi::Error::Internal("record_join: no side stream");
    s = it->second;
  }
  FFI_RETURN_IF_CUDA_ERROR(op, cudaEventRecord(s.join, s.stream));
  return ffi::Error::Success();
}

ffi::Error wait_for_side_stream(const char* op, cudaStream_t xla_stream, int64_t buffer_id,
                                int32_t device) {
  SideStream s;
  FFI_RETURN_IF_ERROR(side_stream(op, xla_stream, buffer_id, device, &s));
  FFI_RETURN_IF_CUDA_ERROR(op, cudaStreamWaitEvent(xla_stream, s.join, 0));
  return ffi::Error::Success();
}

void release_side_streams(int64_t buffer_id) {
  std::lock_guard<std::mutex> lock(side_streams_mutex);
  for (auto it = side_streams.begin(); it != side_streams.end();) {
    if (it->first.first != buffer_id) {
      ++it;
      continue;
    }
    DeviceGuard guard(it->first.second);
    cudaStreamSynchronize(it->second.stream);
    cudaEventDestroy(it->second.fork);
    cudaEventDestroy(it->second.join);
    cudaStreamDestroy(it->second.stream);
    it = side_streams.erase(it);
  }
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(WaitHandler, WaitImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // stream
                                  .Ctx<ffi::DeviceOrdinal>()                 // device
                                  .Attr<int64_t>("buffer_id")                // buffer_id
                                  .RemainingArgs()    // the async op's results, then any
                                  .RemainingRets());  // the same arrays (aliased)

void add_side_stream_targets(std::vector<FfiTarget>& targets) {
  targets.push_back(EP_FFI_TARGET("wait", WaitHandler));
}

void add_side_stream_functions(nanobind::module_& m) {
  m.def("release_side_streams", &release_side_streams, nanobind::arg("buffer_id"),
        "Destroys the side streams of a Buffer's asynchronous ops (after their work ends).");
}

}  // namespace jax_ep
