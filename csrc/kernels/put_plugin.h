// A device transport's put-protocol kernels as one table of functions (DeviceTransport other than
// kStores). jax_ep._C builds the mapped transport's table in (put_mapped.cu) and takes the others
// from shared libraries that export kPutPluginSymbol (put_plugins.cc): the NVSHMEM plugin
// (plugins/nvshmem_transport_kernels.cu) and the test module jax_ep._C_testing, whose emulated
// transport is the only one with a host side (its proxies) and protocol mutants. The launchers
// of both modes launch through the table of the rank's transport; its host side is started by
// the runtime (kernels/api.h: start_transport_rank).
//
// Both ends come from one build (each links this library statically): the table carries the
// sizes it was built with, and a table of another build is refused.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "kernels/context.h"

namespace jax_ep {

struct LowLatencyTransportLaunch;
struct LowLatencyTransportDispatch;
struct LowLatencyTransportCombine;
namespace normal_dispatch {
struct DispatchPlanArgs;
struct DispatchTransferArgs;
}  // namespace normal_dispatch
namespace normal_combine {
struct CombinePlanArgs;
struct CombineTransferArgs;
}  // namespace normal_combine

// The function a plugin exports (extern "C"): `const PutPlugin* jax_ep_put_plugin()`.
inline constexpr const char* kPutPluginSymbol = "jax_ep_put_plugin";

struct PutPlugin {
  uint32_t table_bytes = sizeof(PutPlugin);  // where it was built: one build, one layout
  uint32_t rank_context_bytes = sizeof(RankContext);
  DeviceTransport device_transport = DeviceTransport::kStores;  // the transport it implements

  // The launches, each on `stream`, returning a cudaError_t. The low-latency put-protocol
  // kernels (low_latency_put/put_protocol.h): rank_count * warps_per_rank one-warp blocks.
  int (*low_latency_dispatch)(const LowLatencyTransportLaunch*, const LowLatencyTransportDispatch*,
                              cudaStream_t) = nullptr;
  int (*low_latency_combine)(const LowLatencyTransportLaunch*, const LowLatencyTransportCombine*,
                             cudaStream_t) = nullptr;
  // The normal mode's kernels on the put path (normal/put_path.cuh), with the grids and dynamic
  // shared memory the launchers chose: the plan cooperatively, rank_slots its kRankSlots (1, 2,
  // 4 or 8; 0: the wide plan); element_bytes the combine's y element (2: bfloat16, 4: float32;
  // the wide reduction past kNarrowRanks ranks).
  int (*dispatch_plan)(int rank_slots, int num_blocks, size_t shared_bytes,
                       const normal_dispatch::DispatchPlanArgs*, cudaStream_t) = nullptr;
  int (*dispatch_transfer)(int num_blocks, size_t shared_bytes,
                           const normal_dispatch::DispatchTransferArgs*, cudaStream_t) = nullptr;
  int (*combine_plan)(size_t shared_bytes, const normal_combine::CombinePlanArgs*,
                      cudaStream_t) = nullptr;
  int (*combine_transfer)(int element_bytes, int num_blocks, size_t shared_bytes,
                          const normal_combine::CombineTransferArgs*, cudaStream_t) = nullptr;

  // Loads every kernel above on the current device (a cudaError_t); null: not preloaded.
  int (*preload)() = nullptr;
  // NVSHMEM: the CUDA library (a CUlibrary) of the kernels, for nvshmemx_culibrary_init. 0, or
  // nonzero with a message in `error`. Null for the others.
  int (*library)(void** library, char* error, size_t error_bytes) = nullptr;

  // The host side of one rank (null for a transport without one), started once every peer of
  // `ctx` is mapped, with the table of every rank's regions [rank][kTransportRegions] and their
  // bytes: 0 and the rank's state in *rank and the record its kernels read in *queue
  // (RankContext::transport_queue), or nonzero with a message in `error`.
  int (*start_rank)(int64_t buffer_id, const RankContext* ctx, char* const* region_table,
                    const uint64_t* region_bytes, void** rank, const void** queue, char* error,
                    size_t error_bytes) = nullptr;
  // Stops it (after the rank's device is idle) and frees what start_rank made.
  void (*stop_rank)(void* rank) = nullptr;
  // Hands each error found since the last call, once, to `sink`.
  void (*take_errors)(void* rank, void (*sink)(void* context, const char* error),
                      void* context) = nullptr;
};

// The table of `device_transport`'s kernels: the mapped transport's always, the others' once
// loaded; nullptr otherwise.
const PutPlugin* put_plugin(DeviceTransport device_transport);
// The mapped transport's table (put_mapped.cu), which the test module also launches directly.
const PutPlugin* mapped_put_plugin();

}  // namespace jax_ep
