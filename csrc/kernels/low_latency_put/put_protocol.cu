// The layout of the low-latency put-protocol kernels' regions (low_latency_put/put_protocol.h);
// their bodies are low_latency_put/put_kernels.cuh, instantiated per transport in its table
// (kernels/put_plugin.cuh).
#include "kernels/low_latency_put/put_protocol.h"

namespace jax_ep {

LowLatencyTransportLayout make_low_latency_transport_layout(const LowLatencyTransportShape& shape) {
  LowLatencyTransportLayout layout;
  layout.shape = shape;
  const size_t ranks = static_cast<size_t>(shape.num_ranks);
  const size_t local = static_cast<size_t>(shape.num_local());
  const size_t tokens = static_cast<size_t>(shape.max_tokens);
  const size_t topk = static_cast<size_t>(shape.num_topk);
  const size_t row = shape.row_bytes();
  size_t offset = 0;
  auto carve = [&offset](size_t bytes) {
    const size_t start = offset;
    offset = align_up(offset + bytes, kPutAlignBytes);
    return start;
  };
  layout.counts = carve(2 * local * ranks * sizeof(uint64_t));
  layout.combine_words = carve(2 * ranks * local * sizeof(uint64_t));
  layout.meta = carve(2 * local * ranks * tokens * 16);
  layout.rows = carve(2 * local * ranks * tokens * row);
  layout.combine_rows = carve(2 * tokens * topk * row);
  layout.workspace_bytes = offset;
  offset = 0;
  layout.staged_rows = carve(tokens * row);
  layout.staged_meta = carve(tokens * topk * 16);
  layout.combine_slots =
      carve(static_cast<size_t>(shape.warps_per_rank) * shape.combine_slots * row);
  layout.staging_bytes = offset;
  return layout;
}

}  // namespace jax_ep
