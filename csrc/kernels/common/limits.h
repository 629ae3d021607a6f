// Static limits and shared constants of the kernels, visible to host code (handlers, runtime).
#pragma once

#include <cstdint>

namespace jax_ep {

// Top-k slots per token: the row movers give one lane of a warp to each slot.
constexpr int kMaxTopk = 32;
// FP8 inputs carry one float32 scale per this many channels.
constexpr int kChannelsPerScale = 128;
// Unit of every row copy: rows are moved as 16-byte vectors, so row sizes are multiples of it.
constexpr int kBytesPerVector = 16;
constexpr int kWarpSize = 32;

static_assert(kMaxTopk <= kWarpSize, "one lane per top-k slot");

}  // namespace jax_ep
