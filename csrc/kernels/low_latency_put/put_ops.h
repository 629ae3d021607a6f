// The low-latency ops of a Buffer over a device transport (BufferConfig::device_transport
// other than kStores): the put-protocol kernels of low_latency_put/put_protocol.h, one launch per
// rank through the table of the rank's transport (kernels/put_plugin.h), with their regions and
// sequence words carved out of the Buffer's workspace. The launchers are kernels/api.h's
// launch_low_latency_{dispatch,combine}_put, for the fused ops and the split halves.
//
// The area at low_latency_transport_offset(config) of every rank's workspace:
//   [workspace region][staging region][words]
// so rank r's regions are peer_workspaces[r] + the same offsets, the same for every rank, and a
// workspace mapped into another process (CUDA IPC) carries its regions with it. Each region
// holds two channels, as the mapped kernels keep them: the fused ops' and the split halves'
// (a fused call may come between a send and its receive). A channel is a layout whose offsets
// are shifted past the other's; each has its own words.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "kernels/api.h"
#include "kernels/context.h"
#include "kernels/low_latency_put/put_protocol.h"

namespace jax_ep {

// One-warp blocks per rank of an op's launch: the layout's combine slots depend on it, so it is
// fixed (every rank must agree), not a tuning knob.
constexpr int kTransportOpWarps = 32;

// The channels of an area: the fused ops', the split halves'.
constexpr int kTransportFusedChannel = 0;
constexpr int kTransportSplitChannel = 1;
constexpr int kTransportChannels = 2;

struct LowLatencyTransportArea {
  LowLatencyTransportLayout channels[kTransportChannels];  // offsets within the regions
  size_t workspace_region_bytes = 0;                       // both channels
  size_t staging_region_bytes = 0;
  size_t workspace_region = 0;  // offsets from the area's start
  size_t staging_region = 0;
  size_t words = 0;  // per channel, 64 bytes: u64 dispatch sequence, u64 combine sequence, u32
                     // dispatch finished, u32 combine finished, u32 dispatch barrier
  size_t bytes = 0;
};

LowLatencyTransportArea low_latency_transport_area(const BufferConfig& config);
// The area's offset in the workspace (after the low-latency regions; kernels/api.cc places the
// areas) and its bytes (0 without a device transport or without low_latency).
size_t low_latency_transport_offset(const BufferConfig& config);
size_t low_latency_transport_bytes(const BufferConfig& config);

// Every rank's two regions as seen from `ctx`'s device, in the ops' table (kTransportRegions
// columns per rank): table[kTransportRegions * r + region], region 0 the workspace region, 1 the
// staging region; null for ranks whose workspace is not mapped yet, and in a Buffer without the
// low-latency regions.
std::vector<char*> low_latency_transport_region_table(const RankContext& ctx);

}  // namespace jax_ep
