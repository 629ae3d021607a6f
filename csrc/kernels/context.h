// What a launcher gets for one rank: the Buffer's configuration and the rank's context (plain
// data, filled by the runtime's registry, read by the launchers of kernels/api.h).
//
// One Buffer = one EP group per slice of the mesh along the EP axis. For every device of the
// Buffer the runtime allocates one zeroed "workspace" of identical layout on every rank, so a
// peer's region is `peer_workspaces[peer] + the same offset`. The normal and low-latency modes
// carve their regions (and their own sequence words) out of that workspace; see
// workspace_bytes() (kernels/api.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "common/wait_phase.h"

namespace jax_ep {

// Most ranks in one EP group. Every per-peer table and loop is sized by the group's R at run
// time; this bound only keeps the wide dispatch plan's shared memory (about 48 B per rank,
// normal/dispatch_plan.cuh) inside the 48 KiB every GPU gives a block without opting in.
constexpr int kMaxRanks = 1024;
// Groups of at most this many ranks take the kernels' narrow paths: a token's destinations fit
// one byte, per-rank counters live in registers (normal/dispatch_plan.cuh, combine_transfer.cuh).
constexpr int kNarrowRanks = 8;

// Regions per rank in the ops' table of a device transport (RankContext::transport_region_bases):
// the low-latency kernels' two (kernels/low_latency_put/put_protocol.h), then the normal
// mode's two (kernels/normal/workspace.h).
constexpr int kTransportRegions = 4;

// How the ops reach their peers (JAX_EP_DEVICE_TRANSPORT). kStores: the kernels' own stores
// through peer mappings (NVLink). The others run the put-protocol kernels of
// kernels/low_latency_put/ and the normal-mode kernels' put path (kernels/normal/put_path.cuh),
// written for peers without a mapping (docs/transport.md), through the table of their transport
// (kernels/put_plugin.h): kMapped performs each put as stores through the peer mapping;
// kEmulated hands every command to a host proxy per rank, which delivers it with copy-engine
// copies, adversarially (the test module's); kNvshmem performs it with NVSHMEM's device API (the
// workspace on NVSHMEM's symmetric heap, JAX_EP_PEER_MAPPING=nvshmem; the NVSHMEM plugin's).
enum class DeviceTransport : int32_t { kStores = 0, kMapped = 1, kEmulated = 2, kNvshmem = 3 };

// Static configuration of a Buffer, identical on every rank.
struct BufferConfig {
  int num_ranks = 0;
  int num_experts = 0;          // global experts; num_experts % num_ranks == 0
  int hidden = 0;               // channels per token; multiple of 128
  int max_tokens_per_rank = 0;  // T_max
  int num_topk = 0;             // K
  int capacity = 0;             // normal-mode receive rows C_max (<= num_ranks * T_max)
  int dtype_bytes = 2;          // bytes per element of the Buffer's data dtype (bf16: 2, f32: 4)
  bool low_latency = false;     // allocate the low-latency regions too
  double timeout_s = 10.0;      // bound on every spin-wait
  // Grids (tuning, per process; 0: from the device). Python reads them from the JAX_EP_*
  // settings (jax_ep/settings.py).
  int normal_blocks = 0;       // normal-mode transfer kernels (default: one per SM)
  int normal_push_blocks = 0;  // of those, the pushing ones (default: a quarter)
  int low_latency_blocks = 0;  // low-latency launches (default: all SMs but 8)
  // Over a device transport: send slots per push warp of a normal transfer kernel (0: as many as
  // the send region holds; fewer makes a warp restage slots within a call, as tests want).
  int normal_send_slots = 0;
  // Rows of the normal-mode data region (0: kDefaultNormalWindowRows). A call that moves more
  // rows than its window holds streams them through it in rounds (kernels/normal/windows.h).
  int normal_window_rows = 0;
  DeviceTransport device_transport = DeviceTransport::kStores;
  uint64_t emulator_seed = 0;  // kEmulated: the proxies' seed (rank r uses seed + r)

  int num_local_experts() const { return num_experts / num_ranks; }
};

// Device-side counters of bad input, read by Buffer.check().
struct ErrorCounters {
  unsigned long long invalid_expert_ids;  // topk ids outside [-1, num_experts), treated as -1
  unsigned long long overflow_rows;       // rows not received because capacity was exceeded
  // Low-latency dispatch: (token, k) selections not sent because their source already filled
  // the T_max rows it has at that expert (only possible when a token repeats an expert in its
  // top-k). Counted by the sending rank.
  unsigned long long dropped_low_latency_rows;
};

// The error counters by the names Buffer.errors() reports them (read_errors' keys,
// _C.error_counter_names()), with the field of ErrorCounters each one reads.
struct ErrorCounterField {
  const char* name;
  unsigned long long ErrorCounters::* field;
};
inline constexpr ErrorCounterField kErrorCounterFields[] = {
    {"invalid_expert_ids", &ErrorCounters::invalid_expert_ids},
    {"overflow_rows", &ErrorCounters::overflow_rows},
    {"dropped_low_latency_rows", &ErrorCounters::dropped_low_latency_rows},
};

// Everything a launcher needs for one rank. Plain data: kernels receive copies of its fields.
struct RankContext {
  BufferConfig config;
  int group = 0;              // index of the EP group (slice of the mesh) in the Buffer
  int rank = 0;               // index along the EP axis
  int device = 0;             // CUDA device ordinal
  char* workspace = nullptr;  // this rank's workspace (device memory)
  size_t workspace_bytes = 0;
  bool symmetric_workspace = false;         // on NVSHMEM's symmetric heap (runtime/nvshmem_host.h)
  std::vector<char*> peer_workspaces;       // [R] every rank's workspace, as seen from this device
  char** peer_workspaces_device = nullptr;  // the same table in device memory
  ErrorCounters* error_counters = nullptr;  // device memory
  TimeoutRecord* timeout_record = nullptr;  // host-mapped; device pointer of the mapping
  TimeoutRecord* timeout_record_host = nullptr;
  uint64_t timeout_ns = 0;     // config.timeout_s in nanoseconds
  int num_sms = 0;             // multiprocessors of `device`
  int normal_blocks = 0;       // grid of the normal-mode transfer kernels
  int low_latency_blocks = 0;  // grid of the low-latency kernels (0: the default, see
                               // low_latency_grid_size)
  int normal_push_blocks = 0;  // of which the first ones send (push roles)
  // DeviceTransport other than kStores: the device table [R][kTransportRegions] of every
  // rank's transport regions (each inside that rank's workspace), and what this rank's kernels
  // read of a transport with a host side (the emulated transport's queue record: its ring in
  // pinned host memory; opaque here, made by the transport's start_rank, kernels/put_plugin.h).
  char** transport_region_bases = nullptr;
  const void* transport_queue = nullptr;
  // kEmulated: the ring's warp index of the normal-mode kernels' first warp (the low-latency
  // kernels' warps come first; every warp has its own acknowledgement word).
  uint32_t normal_first_warp = 0;
  std::vector<int> pes;       // [R] symmetric_workspace: every rank's NVSHMEM PE
  int* pes_device = nullptr;  // the same table in device memory (kNvshmem kernels read it)
};

}  // namespace jax_ep
