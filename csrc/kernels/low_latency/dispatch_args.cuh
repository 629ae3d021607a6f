// What every block of a low-latency dispatch launch knows: the kernel arguments, and the facts of
// the launch that the host computes once (see low_latency/dispatch.cu for the protocol).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "common/fast_divisor.h"
#include "common/fp8_cast.cuh"
#include "common/launch.h"
#include "common/limits.h"
#include "kernels/low_latency/common.cuh"

namespace jax_ep::ll_dispatch {

constexpr int kBf16PerVector = kBytesPerVector / 2;
constexpr uint32_t kFullMask = 0xffffffffu;

// A receive work unit is one warp moving at most kRecvPiecesPerLane 16-channel pieces per lane
// of one row (bf16: 2 vectors per piece, all 2 * kRecvPiecesPerLane loads in flight per lane).
constexpr int kRecvPiecesPerLane = 4;
constexpr int kRecvPiecesPerUnit = kWarpSize * kRecvPiecesPerLane;

// How a row splits into receive units: chunks of at most kRecvPiecesPerUnit pieces, whole scale
// groups each.
struct RowChunks {
  int pieces;        // 16-channel pieces of a row
  int num_chunks;    // units per row
  int chunk_pieces;  // pieces per unit (the last one may have fewer)
};

__host__ __device__ inline RowChunks row_chunks(int hidden) {
  RowChunks c;
  c.pieces = hidden / kFp8ChannelsPerPiece;
  c.num_chunks = ceil_div(c.pieces, kRecvPiecesPerUnit);
  c.chunk_pieces =
      ceil_div(ceil_div(c.pieces, c.num_chunks), kFp8PiecesPerScale) * kFp8PiecesPerScale;
  return c;
}

struct DispatchArgs {
  LowLatencyRank rank;
  const __nv_bfloat16* x;   // [T, H]
  const int32_t* topk_idx;  // [T, K]
  void* recv_x;             // [E_loc, R*T_max, H] e4m3 or bf16
  float* recv_scales;       // [E_loc, R*T_max, H/128] (fp8 only)
  int32_t* recv_count;      // [E_loc]
  int32_t* recv_src;        // [E_loc, R*T_max]
  int32_t* recv_k;          // [E_loc, R*T_max]
  int num_tokens;           // T
  int num_experts;          // E
  int pairs_per_block;      // ceil(T * K / grid): the (token, k) pairs each block sends
  int stage_tokens;         // tokens of x the send half holds in shared memory at once
  bool round_scale;
  // Facts of the launch computed once on the host (the receive loop would divide per unit).
  RowChunks chunks;                // row_chunks(H)
  FastDivisor by_chunks;           // num_chunks
  FastDivisor by_local_experts;    // E_loc
  FastDivisor by_rows_per_expert;  // R * T_max
  int32_t* ticket;                 // [1] (send half alone)
};

}  // namespace jax_ep::ll_dispatch
