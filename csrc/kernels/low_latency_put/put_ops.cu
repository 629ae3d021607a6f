// The low-latency ops of a Buffer over a device transport (low_latency_put/put_ops.h).
// Host code only: it fills the put-protocol kernels' launch structures from a RankContext and
// launches through the table of the rank's transport.
#include "kernels/low_latency_put/put_ops.h"

#include <cstdint>

#include "kernels/put_plugin.h"

namespace jax_ep {
namespace {

constexpr size_t kWordsBytes = 64;  // per channel
static_assert(static_cast<uint32_t>(LowLatencyHalves::kSend) == kTransportSendHalf &&
                  static_cast<uint32_t>(LowLatencyHalves::kRecv) == kTransportRecvHalf &&
                  static_cast<uint32_t>(LowLatencyHalves::kBoth) == kTransportBothHalves,
              "a launch's halves are LowLatencyHalves' value");

// `layout` with every offset moved past `workspace` bytes of its workspace region and `staging`
// bytes of its staging region.
LowLatencyTransportLayout shifted(LowLatencyTransportLayout layout, size_t workspace,
                                  size_t staging) {
  for (size_t* offset :
       {&layout.counts, &layout.combine_words, &layout.meta, &layout.rows, &layout.combine_rows}) {
    *offset += workspace;
  }
  for (size_t* offset : {&layout.staged_rows, &layout.staged_meta, &layout.combine_slots}) {
    *offset += staging;
  }
  return layout;
}

// The launch `launch` of the rank's transport's table (kernels/put_plugin.h).
template <typename Op>
cudaError_t launch_put(const RankContext& ctx, const LowLatencyTransportLaunch& l, const Op& op,
                       cudaStream_t stream,
                       int (*PutPlugin::*launch)(const LowLatencyTransportLaunch*, const Op*,
                                                 cudaStream_t)) {
  const PutPlugin* plugin = put_plugin(ctx.config.device_transport);
  if (plugin == nullptr) return cudaErrorNotSupported;  // create_buffer refuses it first
  return static_cast<cudaError_t>((plugin->*launch)(&l, &op, stream));
}

// A channel's words: per op (0 dispatch, 1 combine) a u64 sequence at 8 * op and a u32 finished
// count at 16 + 4 * op; the dispatch barrier at 24.
enum TransportOp { kDispatchOp = 0, kCombineOp = 1 };

// The launch of `op` by this rank alone (rank_base = rank, rank_count = 1: index 0 of every
// per-rank array) in the channel of `halves`.
LowLatencyTransportLaunch rank_launch(const RankContext& ctx, TransportOp op,
                                      LowLatencyHalves halves, int num_tokens,
                                      const int32_t* topk_idx, int32_t* ticket) {
  const LowLatencyTransportArea area = low_latency_transport_area(ctx.config);
  const int channel =
      halves == LowLatencyHalves::kBoth ? kTransportFusedChannel : kTransportSplitChannel;
  char* words =
      ctx.workspace + low_latency_transport_offset(ctx.config) + area.words + channel * kWordsBytes;
  LowLatencyTransportLaunch l;
  l.layout = area.channels[channel];
  l.halves = static_cast<uint32_t>(halves);  // LowLatencyHalves' values are the phase bits
  l.ticket = ticket;
  l.region_bases = ctx.transport_region_bases;
  l.regions_per_rank = kTransportRegions;
  l.queues[0] = ctx.transport_queue;
  l.rank_base = ctx.rank;
  l.rank_count = 1;
  l.sequence[0] = reinterpret_cast<uint64_t*>(words + 8 * op);
  l.finished[0] = reinterpret_cast<uint32_t*>(words + 16 + 4 * op);
  l.barrier[0] = reinterpret_cast<uint32_t*>(words + 24);
  l.timeout_ns = ctx.timeout_ns;
  l.timeout_record = ctx.timeout_record;
  l.num_tokens = num_tokens;
  l.topk_idx[0] = topk_idx;
  l.pe_of_rank = ctx.pes_device;
  return l;
}

}  // namespace

LowLatencyTransportArea low_latency_transport_area(const BufferConfig& config) {
  LowLatencyTransportShape shape;
  shape.num_ranks = config.num_ranks;
  shape.num_experts = config.num_experts;
  shape.num_topk = config.num_topk;
  shape.max_tokens = config.max_tokens_per_rank;
  shape.hidden = config.hidden;
  shape.warps_per_rank = kTransportOpWarps;
  const LowLatencyTransportLayout layout = make_low_latency_transport_layout(shape);
  const size_t workspace = align_up(layout.workspace_bytes, kPutAlignBytes);
  const size_t staging = align_up(layout.staging_bytes, kPutAlignBytes);
  LowLatencyTransportArea area;
  for (int c = 0; c < kTransportChannels; ++c) {
    area.channels[c] = shifted(layout, c * workspace, c * staging);
  }
  area.workspace_region_bytes = kTransportChannels * workspace;
  area.staging_region_bytes = kTransportChannels * staging;
  area.workspace_region = 0;
  area.staging_region = area.workspace_region_bytes;
  area.words = area.staging_region + area.staging_region_bytes;
  area.bytes = area.words + kTransportChannels * kWordsBytes;
  return area;
}

size_t low_latency_transport_bytes(const BufferConfig& config) {
  if (!config.low_latency || config.device_transport == DeviceTransport::kStores) return 0;
  return low_latency_transport_area(config).bytes;
}

std::vector<char*> low_latency_transport_region_table(const RankContext& ctx) {
  const LowLatencyTransportArea area = low_latency_transport_area(ctx.config);
  const size_t offset = low_latency_transport_offset(ctx.config);
  std::vector<char*> table(static_cast<size_t>(kTransportRegions) * ctx.config.num_ranks, nullptr);
  for (int r = 0; r < ctx.config.num_ranks; ++r) {
    char* workspace = ctx.config.low_latency ? ctx.peer_workspaces[r] : nullptr;
    table[kTransportRegions * r + kTransportWorkspace] =
        workspace != nullptr ? workspace + offset + area.workspace_region : nullptr;
    table[kTransportRegions * r + kTransportStaging] =
        workspace != nullptr ? workspace + offset + area.staging_region : nullptr;
  }
  return table;
}

cudaError_t launch_low_latency_dispatch_put(const RankContext& ctx,
                                            const LowLatencyDispatchParams& params,
                                            LowLatencyHalves halves, cudaStream_t stream) {
  LowLatencyTransportLaunch l =
      rank_launch(ctx, kDispatchOp, halves, params.num_tokens, params.topk_idx, params.ticket);
  l.error_counters[0] = ctx.error_counters;
  LowLatencyTransportDispatch op;
  op.use_fp8 = params.use_fp8;
  op.round_scale = params.round_scale;
  op.x[0] = params.x;
  op.recv_x[0] = params.recv_x;
  op.recv_scales[0] = params.recv_scales;
  op.recv_count[0] = params.recv_count;
  op.recv_src[0] = params.recv_src;
  op.recv_k[0] = params.recv_k;
  return launch_put(ctx, l, op, stream, &PutPlugin::low_latency_dispatch);
}

cudaError_t launch_low_latency_combine_put(const RankContext& ctx,
                                           const LowLatencyCombineParams& params,
                                           LowLatencyHalves halves, cudaStream_t stream) {
  const LowLatencyTransportLaunch l =
      rank_launch(ctx, kCombineOp, halves, params.num_tokens, params.topk_idx, params.ticket);
  LowLatencyTransportCombine op;
  op.y[0] = params.y;
  op.recv_src[0] = params.recv_src;
  op.recv_k[0] = params.recv_k;
  op.recv_count[0] = params.recv_count;
  op.topk_weights[0] = params.topk_weights;
  op.out[0] = params.out;
  return launch_put(ctx, l, op, stream, &PutPlugin::low_latency_combine);
}

}  // namespace jax_ep
