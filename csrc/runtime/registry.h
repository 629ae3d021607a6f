// Process-wide registry: (buffer_id, device ordinal) -> RankContext.
// Written only by create_buffer/destroy_buffer (host, outside any XLA program); read by the FFI
// handlers, which XLA runs on one thread per device, so lookups take a shared lock.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "runtime/context.h"

namespace jax_ep {

// Allocates and zeroes the workspaces, builds the peer tables, preloads the kernels on every
// device of `groups` (each inner list = device ordinals of one EP group, in rank order).
// Returns "" on success, else a message naming what failed (device, CUDA error).
std::string create_buffer(int64_t buffer_id, const BufferConfig& config,
                          const std::vector<std::vector<int>>& groups);

// Bytes of the per-device workspace create_buffer allocates for `config`: the normal-mode region,
// plus the low-latency region (at low_latency_workspace_offset) when config.low_latency.
size_t workspace_bytes(const BufferConfig& config);

// Frees everything of `buffer_id` (synchronises its devices first). Unknown ids are ignored.
void destroy_buffer(int64_t buffer_id);

// nullptr when the Buffer is unknown or this device is not part of it.
const RankContext* find_rank_context(int64_t buffer_id, int device);

// Every rank of every group of `buffer_id` (group-major, rank order); empty when unknown.
// The pointers stay valid until destroy_buffer(buffer_id).
std::vector<const RankContext*> rank_contexts(int64_t buffer_id);

// Process-wide counts of FFI handler executions, and of those that ran while their stream was
// being captured into a CUDA graph (XLA command buffers). A test reads them to prove that the
// calls it checked really went through graph capture.
struct HandlerCallCounts {
  uint64_t calls;
  uint64_t captured;
};
void record_handler_call(bool stream_capturing);
HandlerCallCounts handler_call_counts();

}  // namespace jax_ep
