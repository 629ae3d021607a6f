// The low-latency (decode) put-protocol dispatch and combine, over a device transport
// (transport/device_transport.cuh): for peers without a peer mapping (ranks on other hosts),
// written to the rules of docs/transport.md ("The ordering contract the kernels must follow"). Same
// results as the mapped kernels (low_latency/dispatch.cu, low_latency/combine.cu), simpler
// protocol:
//
// Dispatch, call tag n (n >= 1, parity n % 2), per rank r:
//   A. Stage: each token's message (bf16 row, or e4m3 row + one float scale per 128 channels)
//      once in the send region, and (token, k) of each of its K selections.
//   B. Barrier of r's warps (the staged rows are what the puts read).
//   C. Put: warp w takes global experts e = w, w + W, ...: walks r's (token, k) pairs in order,
//      puts the token's message and (token, k) into slot j of (local expert, source r) at the
//      expert's rank (slots >= T_max are dropped, as in the mapped kernel), then fences and sets
//      the count word (n << 32 | rows) there: rule 2, a signal after its data; counts by puts.
//   D. Quiet (rule 3: the staged rows are rewritten by the next call, after this quiet).
//   E. Receive: units (local expert e, source s) go round-robin to the warps: wait for the count
//      words of e from sources 0..s (the rows of s follow those of earlier sources), copy s's
//      rows to the outputs; the unit of s = R - 1 writes recv_count and the -1 tail.
//
// Combine, call tag m (its own sequence), per rank r:
//   A. Send: units (local expert e, destination rank d) round-robin to the warps: the rows of
//      e that came from d (a contiguous range: rows are ordered by source) are staged one by one
//      in the warp's own slots (quiet before a slot is reused) and put into (token, k) of d's
//      combine rows; then fence and set word (r, e) at d to m.
//   B. Quiet; then every warp waits for its share of the R * E_loc words of this call, so that
//      every rank hears from every rank each call (the parity argument of
//      low_latency/dispatch.cu needs it).
//   C. Sum: warp w takes tokens w, w + W, ...: out[t] = sum over valid k of w[t, k] * row (t, k),
//      after waiting for the word of (t, k)'s expert.
//
// Parity safety: as for the mapped kernels, every call waits for a word that every rank writes
// in that call, so a rank that starts call n + 2 knows every peer finished call n.
//
// A launch may run several ranks (rank_count consecutive ranks from rank_base, warps_per_rank
// one-warp blocks each): the GPU tests run every rank of an emulated group in one launch on one
// GPU, or each rank in a launch of its own (rank_count 1, as an op would) on its own stream.
// The kernels of each transport are launched through its table (kernels/put_plugin.h).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "common/limits.h"  // JAX_EP_HOST_DEVICE
#include "common/wait_phase.h"
#include "kernels/context.h"  // ErrorCounters

namespace jax_ep {

constexpr int kTransportMaxRanksPerLaunch = 8;
// Alignment of every array in the regions (as the store kernels' regions).
constexpr size_t kPutAlignBytes = 256;

// Which phases a launch runs (LowLatencyTransportLaunch::halves): the split pair's send half
// (dispatch A-D, combine A and its quiet; then the ticket), its receive half (dispatch E,
// combine B-C; then the sequence word advances), or both (the fused op).
constexpr uint32_t kTransportSendHalf = 1;
constexpr uint32_t kTransportRecvHalf = 2;
constexpr uint32_t kTransportBothHalves = kTransportSendHalf | kTransportRecvHalf;

// The two symmetric regions of every rank.
enum LowLatencyTransportRegion : uint32_t {
  kTransportWorkspace = 0,  // written by peers: count words, combine words, received rows
  kTransportStaging = 1,    // written by this rank only: what its puts read
};

struct LowLatencyTransportShape {
  int num_ranks = 0;
  int num_experts = 0;  // global
  int num_topk = 0;
  int max_tokens = 0;  // T_max
  int hidden = 0;      // a multiple of 128
  int warps_per_rank = 0;
  int combine_slots = 8;  // staging slots per warp for combine rows

  JAX_EP_HOST_DEVICE int num_local() const { return num_experts / num_ranks; }
  // Bytes of one message in the regions: a bf16 row, or e4m3 bytes then float scales.
  JAX_EP_HOST_DEVICE size_t row_bytes() const { return 2 * static_cast<size_t>(hidden); }
  JAX_EP_HOST_DEVICE size_t fp8_message_bytes() const {
    const size_t bytes = static_cast<size_t>(hidden) + hidden / kChannelsPerScale * 4;
    return (bytes + 15) / 16 * 16;
  }
};

// Byte offsets in the two regions (every rank the same).
struct LowLatencyTransportLayout {
  LowLatencyTransportShape shape;
  // workspace
  size_t counts = 0;         // u64 [2][E_loc][R]    (n << 32) | rows of (local expert, source)
  size_t combine_words = 0;  // u64 [2][R][E_loc]    m once source s's rows of expert e landed
  size_t meta = 0;           // int4 [2][E_loc][R][T_max]  (token, k) of each received row
  size_t rows = 0;           // [2][E_loc][R][T_max] messages
  size_t combine_rows = 0;   // [2][T_max][K] bf16 rows
  size_t workspace_bytes = 0;
  // staging
  size_t staged_rows = 0;    // [T_max] messages
  size_t staged_meta = 0;    // int4 [T_max][K]
  size_t combine_slots = 0;  // [R ranks' warps][combine_slots] bf16 rows, per warp of a rank
  size_t staging_bytes = 0;

  JAX_EP_HOST_DEVICE size_t count_word(int parity, int expert, int source) const {
    const int local = shape.num_local();
    return counts + ((static_cast<size_t>(parity) * local + expert) * shape.num_ranks + source) * 8;
  }
  JAX_EP_HOST_DEVICE size_t combine_word(int parity, int source, int expert) const {
    const int local = shape.num_local();
    return combine_words +
           ((static_cast<size_t>(parity) * shape.num_ranks + source) * local + expert) * 8;
  }
  JAX_EP_HOST_DEVICE size_t slot_index(int parity, int expert, int source, int slot) const {
    const size_t block =
        (static_cast<size_t>(parity) * shape.num_local() + expert) * shape.num_ranks + source;
    return block * shape.max_tokens + slot;
  }
  JAX_EP_HOST_DEVICE size_t meta_at(int parity, int expert, int source, int slot) const {
    return meta + slot_index(parity, expert, source, slot) * 16;
  }
  JAX_EP_HOST_DEVICE size_t row_at(int parity, int expert, int source, int slot) const {
    return rows + slot_index(parity, expert, source, slot) * shape.row_bytes();
  }
  JAX_EP_HOST_DEVICE size_t combine_row_at(int parity, int token, int k) const {
    const size_t row =
        (static_cast<size_t>(parity) * shape.max_tokens + token) * shape.num_topk + k;
    return combine_rows + row * shape.row_bytes();
  }
  JAX_EP_HOST_DEVICE size_t staged_row_at(int token) const {
    return staged_rows + static_cast<size_t>(token) * shape.row_bytes();
  }
  JAX_EP_HOST_DEVICE size_t staged_meta_at(int token, int k) const {
    return staged_meta + (static_cast<size_t>(token) * shape.num_topk + k) * 16;
  }
  JAX_EP_HOST_DEVICE size_t combine_slot_at(int warp, int slot) const {
    const size_t index = static_cast<size_t>(warp) * shape.combine_slots + slot;
    return combine_slots + index * shape.row_bytes();
  }
};

LowLatencyTransportLayout make_low_latency_transport_layout(const LowLatencyTransportShape& shape);

// Per-rank arrays of one launch, indexed by rank - rank_base.
struct LowLatencyTransportLaunch {
  LowLatencyTransportLayout layout;
  char* const* region_bases = nullptr;  // device array [rank][region] of every rank's regions
  int regions_per_rank = 2;  // columns of region_bases (the ops' table has the normal mode's too)
  // Each rank's state of its transport that is not in the regions, opaque here: the emulated
  // transport's queue record (ring and mutant, device memory); null for the others.
  const void* queues[kTransportMaxRanksPerLaunch] = {};
  int rank_base = 0;
  int rank_count = 1;
  // Per rank, in device memory, the op's own words: calls completed (this call's tag is that
  // plus one; the last warp to finish advances it, so the host keeps no state per call) and the
  // warps that finished this call.
  uint64_t* sequence[kTransportMaxRanksPerLaunch];
  uint32_t* finished[kTransportMaxRanksPerLaunch];
  uint64_t timeout_ns = 0;
  TimeoutRecord* timeout_record = nullptr;               // host-mapped, or nullptr
  uint32_t* barrier[kTransportMaxRanksPerLaunch];        // dispatch: each rank's warp counter
  int num_tokens = 0;                                    // T <= T_max, the same on every rank
  const int32_t* topk_idx[kTransportMaxRanksPerLaunch];  // [T, K]
  // Dispatch: where each rank counts ids outside [-1, E) and selections dropped past T_max
  // (device memory, as the mapped kernels count them), or nullptr: not counted.
  ErrorCounters* error_counters[kTransportMaxRanksPerLaunch] = {};
  uint32_t halves = kTransportBothHalves;
  const int* pe_of_rank = nullptr;  // kNvshmem: [R] every rank's NVSHMEM PE (device memory)
  int32_t* ticket = nullptr;        // [1] a send half alone stores its call's tag there (XLA orders
                                    // the receive after it through this result)
};

struct LowLatencyTransportDispatch {
  bool use_fp8 = false;
  bool round_scale = false;
  const void* x[kTransportMaxRanksPerLaunch];        // bf16 [T, H]
  void* recv_x[kTransportMaxRanksPerLaunch];         // [E_loc, R * T_max, H] bf16 or e4m3
  float* recv_scales[kTransportMaxRanksPerLaunch];   // [E_loc, R * T_max, H / 128] (fp8)
  int32_t* recv_count[kTransportMaxRanksPerLaunch];  // [E_loc]
  int32_t* recv_src[kTransportMaxRanksPerLaunch];    // [E_loc, R * T_max]
  int32_t* recv_k[kTransportMaxRanksPerLaunch];      // [E_loc, R * T_max]
};

struct LowLatencyTransportCombine {
  const void* y[kTransportMaxRanksPerLaunch];            // bf16 [E_loc, R * T_max, H]
  const int32_t* recv_src[kTransportMaxRanksPerLaunch];  // the dispatch handle's
  const int32_t* recv_k[kTransportMaxRanksPerLaunch];
  const int32_t* recv_count[kTransportMaxRanksPerLaunch];
  const float* topk_weights[kTransportMaxRanksPerLaunch];  // [T, K]
  void* out[kTransportMaxRanksPerLaunch];                  // bf16 [T, H]
};

}  // namespace jax_ep
