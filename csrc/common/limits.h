// Static limits, shared constants and size arithmetic of the kernels, visible to host code
// (handlers, runtime).
#pragma once

#include <cstddef>
#include <cstdint>

// Functions of both host and device code (layouts the host computes and kernels index).
#if defined(__CUDACC__)
#define JAX_EP_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define JAX_EP_HOST_DEVICE inline
#endif

namespace jax_ep {

// Top-k slots per token: the row movers give one lane of a warp to each slot.
constexpr int kMaxTopk = 32;
// Channels per token in low-latency mode: the dispatch's send half stages at least one token in
// shared memory (bf16 row, fp8 cast and scales: ~3H bytes) beside ~24 bytes per expert of
// histograms and receive plan, all under the 227 KiB of an SM (at 32768: E up to ~5000).
constexpr int kMaxLowLatencyHidden = 32768;
// FP8 inputs carry one float32 scale per this many channels.
constexpr int kChannelsPerScale = 128;
// Unit of every row copy: rows are moved as 16-byte vectors, so row sizes are multiples of it.
constexpr int kBytesPerVector = 16;
constexpr int kWarpSize = 32;

static_assert(kMaxTopk <= kWarpSize, "one lane per top-k slot");

constexpr size_t align_up(size_t value, size_t alignment) {
  return (value + alignment - 1) / alignment * alignment;
}

}  // namespace jax_ep
