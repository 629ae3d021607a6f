// The bodies of the low-latency put-protocol dispatch and combine (protocol in
// low_latency_put/put_protocol.h), templates on the transport. A translation unit includes this,
// specialises MakeTransport for its transport and instantiates the kernels for it:
// kernels/put_mapped.cu (mapped), plugins/nvshmem_transport_kernels.cu (NVSHMEM's device API,
// built only with NVSHMEM's headers), and the test module's emulated kernels
// (xla_ffi/testing/emulated_kernels.cu), each through kernels/put_plugin.cuh. One warp per block.
#pragma once

#include <cuda_bf16.h>

#include "common/copy.cuh"
#include "common/fp8_cast.cuh"
#include "common/sync.cuh"
#include "kernels/low_latency_put/put_protocol.h"
#include "transport/device_transport.cuh"

namespace jax_ep {
namespace transport_kernels {

using transport::keeps;
using transport::RegionTable;
using transport::Rule;
using transport::SignalOp;
using transport::SymmetricAddress;

constexpr uint32_t kFullMask = 0xffffffffu;

struct Warp {
  int rank;   // global rank
  int index;  // rank - rank_base: the launch's per-rank arrays
  int warp;   // within the rank
  int lane;
};

__device__ __forceinline__ Warp this_warp(const LowLatencyTransportLaunch& l) {
  const int per_rank = l.layout.shape.warps_per_rank;
  const int index = static_cast<int>(blockIdx.x) / per_rank;
  return Warp{l.rank_base + index, index, static_cast<int>(blockIdx.x) % per_rank,
              static_cast<int>(threadIdx.x)};
}

__device__ __forceinline__ SymmetricAddress in_workspace(size_t offset) {
  return SymmetricAddress{kTransportWorkspace, offset};
}
__device__ __forceinline__ SymmetricAddress in_staging(size_t offset) {
  return SymmetricAddress{kTransportStaging, offset};
}

__device__ __forceinline__ WaitContext wait_of(const LowLatencyTransportLaunch& l, int rank,
                                               WaitPhase phase) {
  return WaitContext{l.timeout_ns, l.timeout_record, rank, static_cast<int32_t>(phase)};
}

template <typename Transport>
struct MakeTransport;

// Lane 0 waits until the word at `address` of this rank reaches `value`; returns the word to
// every lane (acquire: what landed before the word is visible after).
template <typename Transport>
__device__ __forceinline__ uint64_t wait_and_read(const Transport& t, SymmetricAddress address,
                                                  uint64_t value, int peer, int lane) {
  uint64_t word = 0;
  if (lane == 0) {
    t.wait(address, value, peer);
    word = ld_acquire_sys(reinterpret_cast<const uint64_t*>(t.local(address)));
  }
  __syncwarp();
  return __shfl_sync(kFullMask, word, 0);
}

// Every warp of this rank arrives; returns once all have (the staged rows are then complete).
// The counter only grows: call n waits for warps_per_rank * n arrivals.
__device__ __forceinline__ void rank_barrier(uint32_t* counter, uint32_t target,
                                             const WaitContext& wait, int lane) {
  __syncwarp();
  if (lane == 0) {
    __threadfence_system();  // this warp's staged rows, before anyone puts them
    atomicAdd(counter, 1u);
    const uint64_t start = global_timer_ns();
    while (static_cast<int32_t>(ld_acquire_sys(reinterpret_cast<const int32_t*>(counter)) -
                                static_cast<int32_t>(target)) < 0) {
      if (global_timer_ns() - start > wait.timeout_ns) {
        report_timeout_and_trap(wait.record, wait.rank, wait.rank,
                                static_cast<WaitPhase>(wait.phase), target);
      }
    }
  }
  __syncwarp();
}

// This call's tag: the rank's completed calls of the op, plus one.
__device__ __forceinline__ uint64_t call_tag(const LowLatencyTransportLaunch& l, const Warp& w) {
  return *reinterpret_cast<volatile const uint64_t*>(l.sequence[w.index]) + 1;
}

// The last warp of the rank to get here advances the op's sequence word to `tag`. Every warp read
// the word at its start, before this; the next launch of the op on this rank's stream reads it
// after.
__device__ __forceinline__ void finish_call(const LowLatencyTransportLaunch& l, const Warp& w,
                                            uint64_t tag) {
  __syncwarp();
  if (w.lane == 0) {
    __threadfence();
    uint32_t* finished = l.finished[w.index];
    if (atomicAdd(finished, 1u) == static_cast<uint32_t>(l.layout.shape.warps_per_rank - 1)) {
      *reinterpret_cast<volatile uint32_t*>(finished) = 0;
      *reinterpret_cast<volatile uint64_t*>(l.sequence[w.index]) = tag;
    }
  }
}

// What every warp of a launch starts from: who it is, the layout, this call's tag and parity.
struct CallFrame {
  Warp w;
  const LowLatencyTransportLayout& layout;
  const LowLatencyTransportShape& s;
  int warps;  // per rank
  int local;  // experts per rank
  uint64_t tag;
  int parity;
  int lane;
};

__device__ __forceinline__ CallFrame frame_of(const LowLatencyTransportLaunch& l) {
  const Warp w = this_warp(l);
  const uint64_t tag = call_tag(l, w);
  return CallFrame{w,
                   l.layout,
                   l.layout.shape,
                   l.layout.shape.warps_per_rank,
                   l.layout.shape.num_local(),
                   tag,
                   static_cast<int>(tag & 1),
                   w.lane};
}

// A send half launched alone ends after its phases: it stores its tag as the ticket (XLA orders
// the receive after it through that result). False when the launch runs a receive half too.
__device__ __forceinline__ bool ends_after_send(const LowLatencyTransportLaunch& l, const Warp& w,
                                                uint64_t tag) {
  if (l.halves != kTransportSendHalf) return false;
  if (w.index == 0 && w.warp == 0 && w.lane == 0 && l.ticket != nullptr) {
    *l.ticket = static_cast<int32_t>(tag);
  }
  return true;
}

// One token's fp8 message: e4m3 channels, then one float scale per 128 channels. Eight aligned
// lanes hold one scale group (16 channels each).
__device__ __forceinline__ void stage_fp8(char* message, const int4* x_row, int hidden,
                                          bool round_scale, int lane) {
  const int pieces = hidden / kFp8ChannelsPerPiece;
  float* scales = reinterpret_cast<float*>(message + hidden);
  for (int base = 0; base < pieces; base += kWarpSize) {
    const int piece = base + lane;
    const bool has = piece < pieces;
    int4 lo = make_int4(0, 0, 0, 0);
    int4 hi = lo;
    if (has) {
      lo = ld_nc_v4(x_row + 2 * piece);
      hi = ld_nc_v4(x_row + 2 * piece + 1);
    }
    const float amax = fp8_group_amax(has ? bf16_piece_amax(lo, hi) : 0.0f);
    const float scale = fp8_scale_from_amax(amax, round_scale);
    if (has) {
      st_v4(reinterpret_cast<int4*>(message) + piece, bf16_piece_to_e4m3(lo, hi, 1.0f / scale));
      if (piece % kFp8PiecesPerScale == 0) scales[piece / kFp8PiecesPerScale] = scale;
    }
  }
}

template <typename Transport>
__global__ void __launch_bounds__(kWarpSize)
    low_latency_transport_dispatch_kernel(LowLatencyTransportLaunch l,
                                          LowLatencyTransportDispatch op) {
  const CallFrame frame = frame_of(l);
  const auto& [w, layout, s, warps, local, tag, parity, lane] = frame;
  Transport t = MakeTransport<Transport>::make(l, w, WaitPhase::kLowLatencyDispatchRecv);
  const int32_t* topk_idx = l.topk_idx[w.index];
  const size_t message_bytes = op.use_fp8 ? s.fp8_message_bytes() : s.row_bytes();

  const int vectors_per_row = static_cast<int>(s.row_bytes() / kBytesPerVector);
  if (l.halves & kTransportSendHalf) {
    // A. Stage each token's message once, and (token, k) of its selections; count the ids
    // outside [-1, E) of this warp's tokens (the puts below treat them as -1).
    const int4* x = static_cast<const int4*>(op.x[w.index]);
    unsigned long long invalid = 0;
    for (int token = w.warp; token < l.num_tokens; token += warps) {
      for (int k = lane; k < s.num_topk; k += kWarpSize) {
        const int id = topk_idx[token * s.num_topk + k];
        invalid += (id < -1 || id >= s.num_experts) ? 1 : 0;
      }
      char* message = t.local(in_staging(layout.staged_row_at(token)));
      const int4* x_row = x + static_cast<int64_t>(token) * vectors_per_row;
      if (op.use_fp8) {
        stage_fp8(message, x_row, s.hidden, op.round_scale, lane);
      } else {
        warp_copy_vectors<true>(reinterpret_cast<int4*>(message), x_row, vectors_per_row, lane);
      }
      for (int k = lane; k < s.num_topk; k += kWarpSize) {
        *reinterpret_cast<int4*>(t.local(in_staging(layout.staged_meta_at(token, k)))) =
            make_int4(token, k, 0, 0);
      }
    }
    // B. Every warp's staged rows are complete before any of them is put.
    rank_barrier(l.barrier[w.index], static_cast<uint32_t>(warps * tag),
                 wait_of(l, w.rank, WaitPhase::kLowLatencyDispatchRecv), lane);

    // C. Put: this warp's global experts, their (token, k) pairs in order.
    const int pairs = l.num_tokens * s.num_topk;
    unsigned long long dropped = 0;  // the same on every lane: the loop below is warp-uniform
    for (int expert = w.warp; expert < s.num_experts; expert += warps) {
      const int dst = expert / local;
      const int local_expert = expert % local;
      int sent = 0;
      for (int base = 0; base < pairs; base += kWarpSize) {
        const int pair = base + lane;
        uint32_t match = __ballot_sync(kFullMask, pair < pairs && topk_idx[pair] == expert);
        while (match != 0) {
          const int first = __ffs(match) - 1;
          match &= match - 1;
          if (sent == s.max_tokens) {  // past T_max rows (repeated experts): dropped, counted
            ++dropped;
            continue;
          }
          const int token = (base + first) / s.num_topk;
          const int k = (base + first) % s.num_topk;
          t.put(dst, in_workspace(layout.row_at(parity, local_expert, w.rank, sent)),
                in_staging(layout.staged_row_at(token)), message_bytes, lane);
          t.put(dst, in_workspace(layout.meta_at(parity, local_expert, w.rank, sent)),
                in_staging(layout.staged_meta_at(token, k)), 16, lane);
          ++sent;
        }
      }
      // The count says "these rows landed": it must not overtake them.
      t.fence(lane);
      t.signal(dst, in_workspace(layout.count_word(parity, local_expert, w.rank)),
               pack_tagged_count(tag, static_cast<uint32_t>(sent)), SignalOp::kSet, lane);
    }
    // D. Every put of this warp has landed: the next call may restage.
    if (keeps(t, Rule::kQuietBeforeEnd)) t.quiet(lane);
    ErrorCounters* counters = l.error_counters[w.index];
    if (counters != nullptr) {
      for (int delta = kWarpSize / 2; delta > 0; delta /= 2) {
        invalid += __shfl_xor_sync(kFullMask, invalid, delta);
      }
      if (lane == 0 && invalid != 0) atomicAdd(&counters->invalid_expert_ids, invalid);
      if (lane == 0 && dropped != 0) atomicAdd(&counters->dropped_low_latency_rows, dropped);
    }
  }
  if (ends_after_send(l, w, tag)) return;
  // E. Receive: units (local expert, source).
  const int rows_per_expert = s.num_ranks * s.max_tokens;
  const int scales_per_row = s.hidden / kChannelsPerScale;
  for (int unit = w.warp; unit < local * s.num_ranks; unit += warps) {
    const int expert = unit / s.num_ranks;
    const int source = unit % s.num_ranks;
    uint32_t offset = 0;
    uint32_t count = 0;
    for (int earlier = 0; earlier <= source; ++earlier) {
      const uint64_t word =
          wait_and_read(t, in_workspace(layout.count_word(parity, expert, earlier)),
                        pack_tagged_count(tag, 0), earlier, lane);
      if (earlier < source) {
        offset += static_cast<uint32_t>(word);
      } else {
        count = static_cast<uint32_t>(word);
      }
    }
    const size_t first_row = static_cast<size_t>(expert) * rows_per_expert + offset;
    for (uint32_t i = 0; i < count; ++i) {
      const char* message = t.local(in_workspace(layout.row_at(parity, expert, source, i)));
      const size_t row = first_row + i;
      if (op.use_fp8) {
        warp_copy_vectors<false>(
            reinterpret_cast<int4*>(static_cast<char*>(op.recv_x[w.index]) + row * s.hidden),
            reinterpret_cast<const int4*>(message), s.hidden / static_cast<int>(kBytesPerVector),
            lane);
        const float* scales = reinterpret_cast<const float*>(message + s.hidden);
        for (int g = lane; g < scales_per_row; g += kWarpSize) {
          op.recv_scales[w.index][row * scales_per_row + g] = ld_cg_f32(scales + g);
        }
      } else {
        warp_copy_vectors<false>(
            reinterpret_cast<int4*>(static_cast<char*>(op.recv_x[w.index]) + row * s.row_bytes()),
            reinterpret_cast<const int4*>(message), vectors_per_row, lane);
      }
      if (lane == 0) {
        const int* meta = reinterpret_cast<const int*>(
            t.local(in_workspace(layout.meta_at(parity, expert, source, i))));
        op.recv_src[w.index][row] = source * s.max_tokens + ld_cg_s32(meta);
        op.recv_k[w.index][row] = ld_cg_s32(meta + 1);
      }
    }
    if (source == s.num_ranks - 1) {
      const uint32_t total = offset + count;
      if (lane == 0) op.recv_count[w.index][expert] = static_cast<int32_t>(total);
      for (int row = static_cast<int>(total) + lane; row < rows_per_expert; row += kWarpSize) {
        op.recv_src[w.index][static_cast<size_t>(expert) * rows_per_expert + row] = -1;
        op.recv_k[w.index][static_cast<size_t>(expert) * rows_per_expert + row] = -1;
      }
    }
  }
  finish_call(l, w, tag);
}

template <typename Transport>
__global__ void __launch_bounds__(kWarpSize)
    low_latency_transport_combine_kernel(LowLatencyTransportLaunch l,
                                         LowLatencyTransportCombine op) {
  const CallFrame frame = frame_of(l);
  const auto& [w, layout, s, warps, local, tag, parity, lane] = frame;
  Transport t = MakeTransport<Transport>::make(l, w, WaitPhase::kLowLatencyCombineRecv);
  const int rows_per_expert = s.num_ranks * s.max_tokens;
  const int vectors_per_row = static_cast<int>(s.row_bytes() / kBytesPerVector);

  if (l.halves & kTransportSendHalf) {
    // A. Send: units (local expert, destination rank); the rows of an expert are ordered by
    // source rank, so those of `dst` are one range [lo, lo + n).
    int used = 0;  // this warp's combine slots used since its last quiet
    for (int unit = w.warp; unit < local * s.num_ranks; unit += warps) {
      const int expert = unit / s.num_ranks;
      const int dst = unit % s.num_ranks;
      const int32_t* recv_src =
          op.recv_src[w.index] + static_cast<size_t>(expert) * rows_per_expert;
      const int32_t* recv_k = op.recv_k[w.index] + static_cast<size_t>(expert) * rows_per_expert;
      const int rows = op.recv_count[w.index][expert];
      int lo = 0;
      int n = 0;
      for (int base = 0; base < rows; base += kWarpSize) {
        const int row = base + lane;
        const int source = row < rows ? recv_src[row] / s.max_tokens : s.num_ranks;
        lo += __popc(__ballot_sync(kFullMask, source < dst));
        n += __popc(__ballot_sync(kFullMask, source == dst));
      }
      const int4* y = static_cast<const int4*>(op.y[w.index]) +
                      static_cast<int64_t>(expert) * rows_per_expert * vectors_per_row;
      const SymmetricAddress word = in_workspace(layout.combine_word(parity, w.rank, expert));
      if (!keeps(t, Rule::kSignalAfterData)) t.signal(dst, word, tag, SignalOp::kSet, lane);
      for (int row = lo; row < lo + n; ++row) {
        if (used == s.combine_slots) {  // rule 3: a slot is reused only after a quiet
          if (keeps(t, Rule::kQuietBeforeReuse)) t.quiet(lane);
          used = 0;
        }
        const SymmetricAddress slot = in_staging(layout.combine_slot_at(w.warp, used++));
        warp_copy_vectors<true>(reinterpret_cast<int4*>(t.local(slot)),
                                y + static_cast<int64_t>(row) * vectors_per_row, vectors_per_row,
                                lane);
        const int token = recv_src[row] % s.max_tokens;
        t.put(dst, in_workspace(layout.combine_row_at(parity, token, recv_k[row])), slot,
              s.row_bytes(), lane);
      }
      if (keeps(t, Rule::kSignalAfterData)) {
        t.fence(lane);
        t.signal(dst, word, tag, SignalOp::kSet, lane);
      }
    }
    // Every slot's put has landed: the next call may rewrite the slots.
    if (keeps(t, Rule::kQuietBeforeEnd)) t.quiet(lane);
  }
  if (ends_after_send(l, w, tag)) return;

  // B. Hear from every rank this call (parity safety), each warp its share of the words.
  for (int unit = w.warp; unit < s.num_ranks * local; unit += warps) {
    const int source = unit / local;
    wait_and_read(t, in_workspace(layout.combine_word(parity, source, unit % local)), tag, source,
                  lane);
  }

  // C. Sum: out[token] = sum over valid k of w[token, k] * row (token, k).
  const int32_t* topk_idx = l.topk_idx[w.index];
  const float* weights = op.topk_weights[w.index];
  const int vectors = vectors_per_row;
  int4* out = static_cast<int4*>(op.out[w.index]);
  for (int token = w.warp; token < l.num_tokens; token += warps) {
    for (int k = 0; k < s.num_topk; ++k) {  // the rows this token needs have landed
      const int expert = topk_idx[token * s.num_topk + k];
      if (expert < 0 || expert >= s.num_experts) continue;
      wait_and_read(t, in_workspace(layout.combine_word(parity, expert / local, expert % local)),
                    tag, expert / local, lane);
    }
    for (int v = lane; v < vectors; v += kWarpSize) {
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int k = 0; k < s.num_topk; ++k) {
        const int expert = topk_idx[token * s.num_topk + k];
        if (expert < 0 || expert >= s.num_experts) continue;
        const float weight = weights[token * s.num_topk + k];
        const int4 packed = ld_cg_v4(reinterpret_cast<const int4*>(t.local(
                                         in_workspace(layout.combine_row_at(parity, token, k)))) +
                                     v);
        const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&packed);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float2 f = __bfloat1622float2(pairs[i]);
          acc[2 * i] += weight * f.x;
          acc[2 * i + 1] += weight * f.y;
        }
      }
      int4 result;
      __nv_bfloat162* packed = reinterpret_cast<__nv_bfloat162*>(&result);
#pragma unroll
      for (int i = 0; i < 4; ++i) packed[i] = __floats2bfloat162_rn(acc[2 * i], acc[2 * i + 1]);
      out[static_cast<int64_t>(token) * vectors + v] = result;
    }
  }
  finish_call(l, w, tag);
}

}  // namespace transport_kernels
}  // namespace jax_ep
