// Process-wide registry: (buffer_id, device ordinal) -> RankContext.
// Written only by create_buffer/destroy_buffer (host, outside any XLA program); read by the FFI
// handlers, which XLA runs on one thread per device, so lookups take a shared lock.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kernels/api.h"

namespace jax_ep {

// Device ordinal of a rank that another process drives (multi-process meshes).
constexpr int kRemoteRank = -1;

// Allocates and zeroes the workspaces, builds the peer tables, preloads the kernels on every
// device of `groups` (each inner list = device ordinals of one EP group, in rank order;
// kRemoteRank for a rank of another process, whose workspace import_workspace_handles() maps
// later). Returns "" on success, else a message naming what failed (device, CUDA error).
// `pes` non-empty (shaped like `groups`): the NVSHMEM transport (runtime/nvshmem_host.h), the
// NVSHMEM PE of every rank; the workspace goes on the symmetric heap (a collective: every
// process creates its Buffers in the same order) and every peer table entry is the PE's copy.
std::string create_buffer(int64_t buffer_id, const BufferConfig& config,
                          const std::vector<std::vector<int>>& groups,
                          const std::vector<std::vector<int>>& pes = {});

// A CUDA IPC handle of one rank's workspace, for the processes driving the other ranks of its
// EP group (same host). `handle` holds the bytes of a cudaIpcMemHandle_t.
struct WorkspaceHandle {
  int group = 0;
  int rank = 0;
  std::string handle;
};

// The handles of every rank this process drives. "" or an error message.
std::string export_workspace_handles(int64_t buffer_id, std::vector<WorkspaceHandle>* handles);

// Maps the workspaces of other processes' ranks into every local rank of the same group and
// completes the peer tables. Every kRemoteRank of the Buffer must be covered by `handles`.
std::string import_workspace_handles(int64_t buffer_id,
                                     const std::vector<WorkspaceHandle>& handles);

// Waits for the Buffer's local devices and unmaps the imported workspaces. After every process
// did this (a cross-process barrier), destroy_buffer can free the local memory safely.
void release_peer_workspaces(int64_t buffer_id);

// The errors the host sides of the Buffer's device transport found since the last call ("rank r
// of EP group g: kind: message"), each once: the emulated transport's proxies; empty for other
// Buffers.
std::vector<std::string> take_transport_errors(int64_t buffer_id);

// Frees everything of `buffer_id` (synchronises its devices first). Unknown ids are ignored.
void destroy_buffer(int64_t buffer_id);

// nullptr when the Buffer is unknown or this device is not part of it.
const RankContext* find_rank_context(int64_t buffer_id, int device);

// Every rank of every group of `buffer_id` (group-major, rank order); empty when unknown.
// The pointers stay valid until destroy_buffer(buffer_id).
std::vector<const RankContext*> rank_contexts(int64_t buffer_id);

// Process-wide counts of FFI handler executions, and of those that ran while their stream was
// being captured into a CUDA graph (XLA command buffers). benchmarks/bench_step.py records them
// with its timings (how many of a program's calls ran in a graph), and a test reads them to prove
// that the calls it checked really went through graph capture.
struct HandlerCallCounts {
  uint64_t calls;
  uint64_t captured;
};
void record_handler_call(bool stream_capturing);
HandlerCallCounts handler_call_counts();

}  // namespace jax_ep
