// Size of the normal-mode area, its sequence word, and its send region over a device transport.
#include "kernels/normal/workspace.h"

#include <sstream>
#include <string>

#include "kernels/api.h"

namespace jax_ep {

size_t normal_workspace_bytes(const BufferConfig& config) {
  return normal_layout(config).total_bytes;
}

size_t normal_sequence_offset(const BufferConfig& config) { return normal_layout(config).seq; }

bool normal_over_transport(const BufferConfig& config) {
  return config.device_transport != DeviceTransport::kStores;
}

// As large as the data region: each push warp has at least one slot for a row of any size the
// handlers take (they need a window of at least kMinNormalWindowRows rows in the data region).
size_t normal_send_region_bytes(const BufferConfig& config) {
  return normal_over_transport(config) ? normal_layout(config).data_bytes : 0;
}

namespace {

// Why `window` (of `extent` rows or tokens, rows of `row_bytes`) cannot run on `ctx`, or "".
std::string window_problem(const RankContext& ctx, const NormalWindow& window, int64_t extent,
                           int64_t row_bytes, const char* unit) {
  std::ostringstream message;
  if (!window.fits) {
    const BufferConfig& config = ctx.config;
    message << "streams " << extent << " " << unit << " through a window of " << window.slots
            << " rows of " << row_bytes << " bytes, more than " << kNormalMaxRounds
            << " rounds; the communication buffer holds " << normal_layout(config).data_bytes
            << " bytes (sized for hidden=" << config.hidden
            << ", dtype_bytes=" << config.dtype_bytes << ", capacity=" << config.capacity
            << ", normal_window_rows=" << config.normal_window_rows
            << "): raise JAX_EP_NORMAL_WINDOW_ROWS";
  } else if (window.num_rounds > 2 && ctx.normal_blocks <= ctx.normal_push_blocks) {
    message << "streams its rows in " << window.num_rounds
            << " rounds, which needs more normal-mode blocks (" << ctx.normal_blocks
            << ") than pushing blocks (" << ctx.normal_push_blocks
            << "): lower JAX_EP_NORMAL_PUSH_BLOCKS or raise JAX_EP_NORMAL_BLOCKS";
  }
  return message.str();
}

}  // namespace

std::string dispatch_window_problem(const RankContext& ctx, int64_t capacity, int64_t row_bytes) {
  return window_problem(ctx, dispatch_window(ctx.config, capacity, row_bytes), capacity, row_bytes,
                        "rows");
}

std::string combine_window_problem(const RankContext& ctx, int64_t num_tokens, int64_t row_bytes) {
  return window_problem(ctx, combine_window(ctx.config, num_tokens, row_bytes), num_tokens,
                        row_bytes, "tokens");
}

uint32_t normal_publisher_warp(const RankContext& ctx) {
  return static_cast<uint32_t>(ctx.normal_push_blocks) * (kNormalTransferThreads / kWarpSize);
}

uint32_t normal_transport_warps(const RankContext& ctx) {
  return normal_publisher_warp(ctx) + static_cast<uint32_t>(ctx.normal_blocks);
}

}  // namespace jax_ep
