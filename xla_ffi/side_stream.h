// Asynchronous ops (Buffer(overlap=True)): each op is two custom calls, its "<op>_async" target,
// which launches the op's kernels on a stream of the Buffer's own (the side stream) and returns,
// and the "wait" target, which makes XLA's stream wait for them. Between the two, XLA's stream
// runs whatever the program puts there (another micro-batch's experts): the op overlaps it.
//
// Per (Buffer, device) one side stream of the highest priority (its blocks are scheduled first
// whenever SMs free up) and two events: `fork`, recorded on XLA's stream before the launch (the
// side stream waits for it: the op's operands are ready), and `join`, recorded on the side
// stream after the launch (the wait target's stream waits for it). A Buffer's ops keep one
// order on its side stream (XLA runs custom calls in its schedule's order, the same on every
// rank), so they never run concurrently with each other; a wait that follows a later launch
// waits for that one too (a CUDA event wait takes the latest record): never too early.
//
// Neither target is command-buffer compatible: XLA runs them as thunks between its CUDA graphs,
// which a fork and a join across two calls need (a graph capture must join what it forks).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace jax_ep {

// Records `fork` on `xla_stream`, makes the Buffer's side stream on `device` wait for it
// (created at the first call) and returns it in `side`.
::xla::ffi::Error fork_to_side_stream(const char* op, cudaStream_t xla_stream, int64_t buffer_id,
                                      int32_t device, cudaStream_t* side);
// Records `join` on the side stream after the op's launches.
::xla::ffi::Error record_join(const char* op, int64_t buffer_id, int32_t device);
// Makes `xla_stream` wait for the last `join` of (buffer_id, device).
::xla::ffi::Error wait_for_side_stream(const char* op, cudaStream_t xla_stream, int64_t buffer_id,
                                       int32_t device);
// Destroys the side streams and events of `buffer_id` (Buffer.close()).
void release_side_streams(int64_t buffer_id);

// The "<op>_async" handler of `Impl` (which takes XLA's stream, the device ordinal and the
// buffer id first, as every handler of ours does): `Impl` launched on the side stream.
template <auto Impl>
struct OnSideStream;

template <typename... Rest, ::xla::ffi::Error (*Impl)(cudaStream_t, int32_t, int64_t, Rest...)>
struct OnSideStream<Impl> {
  static ::xla::ffi::Error Call(cudaStream_t stream, int32_t device, int64_t buffer_id,
                                Rest... rest) {
    cudaStream_t side = nullptr;
    ::xla::ffi::Error error = fork_to_side_stream("async op", stream, buffer_id, device, &side);
    if (!error.success()) return error;
    error = Impl(side, device, buffer_id, std::move(rest)...);
    if (!error.success()) return error;
    return record_join("async op", buffer_id, device);
  }
};

}  // namespace jax_ep
