// Pieces shared by the low-latency dispatch and combine kernels: the per-rank view of the
// regions that every kernel gets, the "last block" arrival, and the cooperative launch.
//
// Launch shape of both kernels: one block of kLowLatencyThreads per SM (all but
// kLowLatencyFreeSms), launched cooperatively so
// that every block is resident (blocks wait for words that other blocks of the same launch
// write). No host state per call: the sequence word that picks the call's parity and tag lives
// in device memory and is advanced by one block of the launch that runs the receive half, after
// every block read it (the last to finish; in the fused combine, the last to arrive).
//
// Each kernel body is compiled three times (LowLatencyHalves): the fused op, its send half and
// its receive half. The split pair runs the same phases as the fused launch, in two launches on
// one stream; the kernel boundary between them takes the place of the in-launch waits that only
// ordered this rank's own blocks (see the per-op comments).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "common/launch.h"
#include "common/limits.h"
#include "common/peer_field.cuh"
#include "common/sync.cuh"
#include "kernels/api.h"
#include "kernels/context.h"
#include "kernels/low_latency/layout.cuh"

namespace jax_ep {

constexpr int kLowLatencyThreads = 512;
constexpr int kLowLatencyWarps = kLowLatencyThreads / kWarpSize;

// LowLatencyHalves (kernels/api.h) picks the phases of one launch. The send half never
// waits for a peer; every wait is in the receive half.

__host__ __device__ constexpr bool runs_send_half(LowLatencyHalves halves) {
  return (static_cast<int>(halves) & static_cast<int>(LowLatencyHalves::kSend)) != 0;
}
__host__ __device__ constexpr bool runs_recv_half(LowLatencyHalves halves) {
  return (static_cast<int>(halves) & static_cast<int>(LowLatencyHalves::kRecv)) != 0;
}

template <LowLatencyHalves kHalves>
using HalvesConstant = std::integral_constant<LowLatencyHalves, kHalves>;

// The launcher of one op (dispatch or combine): over a device transport, `over_transport()` (the
// put-protocol kernels, low_latency_put/); with stores, `launch(HalvesConstant<h>{})` for the
// phases `halves` (each kernel body is compiled once per LowLatencyHalves).
template <typename OverTransport, typename Launch>
cudaError_t launch_low_latency_op(const RankContext& ctx, LowLatencyHalves halves,
                                  OverTransport over_transport, Launch launch) {
  if (ctx.config.device_transport != DeviceTransport::kStores) return over_transport();
  switch (halves) {
    case LowLatencyHalves::kSend:
      return launch(HalvesConstant<LowLatencyHalves::kSend>{});
    case LowLatencyHalves::kRecv:
      return launch(HalvesConstant<LowLatencyHalves::kRecv>{});
    case LowLatencyHalves::kBoth:
      break;
  }
  return launch(HalvesConstant<LowLatencyHalves::kBoth>{});
}

// Loads `kernel<kHalves>` for every LowLatencyHalves (`attributes_of(HalvesConstant<h>{})`
// returns cudaFuncGetAttributes' status for the instance of h); the first failure.
template <typename AttributesOf>
cudaError_t preload_every_halves(AttributesOf attributes_of) {
  cudaError_t err = attributes_of(HalvesConstant<LowLatencyHalves::kBoth>{});
  if (err == cudaSuccess) err = attributes_of(HalvesConstant<LowLatencyHalves::kSend>{});
  if (err == cudaSuccess) err = attributes_of(HalvesConstant<LowLatencyHalves::kRecv>{});
  return err;
}

// What a low-latency kernel knows about its rank. Plain data inside the kernel arguments.
struct LowLatencyRank {
  LowLatencyLayout layout;
  char* local = nullptr;  // this rank's low-latency region
  PeerField<char> peers;  // every rank's low-latency region (peers[rank] == local)
  ErrorCounters* errors = nullptr;
  TimeoutRecord* timeout_record = nullptr;
  uint64_t timeout_ns = 0;
  int rank = 0;
};

// `halves` picks the channel (low_latency/layout.cuh): fused calls 0, either split half 1.
inline LowLatencyRank make_low_latency_rank(const RankContext& ctx, LowLatencyHalves halves) {
  LowLatencyRank view;
  view.layout = make_low_latency_layout(ctx.config);
  const int channel = halves == LowLatencyHalves::kBoth ? 0 : 1;
  const size_t offset =
      low_latency_workspace_offset(ctx.config) + channel * view.layout.total_bytes;
  view.local = ctx.workspace + offset;
  view.peers = {ctx.peer_workspaces_device, offset};
  view.errors = ctx.error_counters;
  view.timeout_record = ctx.timeout_record;
  view.timeout_ns = ctx.timeout_ns;
  view.rank = ctx.rank;
  return view;
}

__device__ __forceinline__ LowLatencyControl* low_latency_control(const LowLatencyRank& view) {
  return reinterpret_cast<LowLatencyControl*>(view.local + view.layout.control);
}

// A word this rank's previous launch wrote (read once at kernel start).
__device__ __forceinline__ uint64_t ld_volatile_u64(const uint64_t* ptr) {
  return *reinterpret_cast<const volatile uint64_t*>(ptr);
}

// Orders this thread's earlier loads/stores (local and peer memory) before its later ones for
// every observer in the system (lighter than the sequentially consistent __threadfence_system).
__device__ __forceinline__ void fence_acq_rel_sys() {
  asm volatile("fence.acq_rel.sys;" ::: "memory");
}

// A strong store at system scope: a word that carries only its own value, or, after a fence, the
// store of a release that publishes what the fence ordered before it.
__device__ __forceinline__ void st_relaxed_sys(uint64_t* ptr, uint64_t value) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(ptr), "l"(value) : "memory");
}

// One arrival per block on `counter`, in two steps so that the atomic's round trip overlaps the
// block's other work. begin_arrival, after a block barrier that follows every write of the block
// to publish: thread 0 fences (cumulative over those writes, ordered before it by the barrier:
// one fence per block, as the dispatch's row flags) and adds the arrival; the count it saw stays
// in its register (other threads: 0). Every block calls it exactly once per launch.
__device__ __forceinline__ unsigned long long begin_arrival(unsigned long long* counter) {
  unsigned long long arrived_before = 0;
  if (threadIdx.x == 0) {
    fence_acq_rel_sys();
    arrived_before = atomicAdd(counter, 1ull);
  }
  return arrived_before;
}

// True in thread 0 of the block that arrived last (false elsewhere). That thread has then
// synchronised with every other block's writes (fence after the atomic: what it stores next
// releases them) and resets the counter, so the next launch finds it at 0.
__device__ __forceinline__ bool arrived_last(unsigned long long* counter,
                                             unsigned long long arrived_before) {
  if (threadIdx.x != 0 || arrived_before + 1 != gridDim.x) return false;
  fence_acq_rel_sys();
  *counter = 0;
  return true;
}

// Called once by every block of a dispatch launch that runs the receive half and of a split
// combine receive launch, as its last action (the fused combine advances its sequence word at
// its flag release instead): the last block to finish advances the sequence word (every block
// read it at its start, so none can see the new value in this launch) and clears the done
// counter.
__device__ __forceinline__ void finish_launch(unsigned long long* done_counter, uint64_t* seq_word,
                                              uint64_t seq) {
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned long long finished_before = atomicAdd(done_counter, 1ull);
    if (finished_before + 1 == gridDim.x) {
      *done_counter = 0;
      *seq_word = seq + 1;
    }
  }
}

// The send half's only result, the "ticket" [1] int32: the low 32 bits of the call's tag. Its
// value is informational; what matters is that the receive half takes it as an operand, so XLA
// runs the receive after the send and never drops the send.
__device__ __forceinline__ void store_ticket(int32_t* ticket, uint64_t tag) {
  if (blockIdx.x == 0 && threadIdx.x == 0) *ticket = static_cast<int32_t>(tag);
}

__device__ __forceinline__ int warp_inclusive_sum(int value, int lane) {
#pragma unroll
  for (int delta = 1; delta < kWarpSize; delta <<= 1) {
    const int other = __shfl_up_sync(0xffffffffu, value, delta);
    if (lane >= delta) value += other;
  }
  return value;
}

// SMs a low-latency launch leaves free. Its blocks fill an SM each (registers) and spin on
// peers, so a kernel of another stream that the peers wait for (XLA's asynchronous NCCL
// all-to-all of the low-latency backward, a user's collective) needs SMs of its own to make
// progress; on 2x H200, grad through the split halves timed out intermittently when all SMs
// were taken.
constexpr int kLowLatencyFreeSms = 8;

// Blocks of one low-latency launch: one per SM but kLowLatencyFreeSms, or
// JAX_EP_LOW_LATENCY_BLOCKS (ctx.low_latency_blocks, at most one per SM). On 2x H200 at T=128
// all 132 SMs give fp8 dispatch 23.7 us and combine 32 us, 124 give 24.7 and 35 us.
inline cudaError_t low_latency_grid_size(const RankContext& ctx, int* num_blocks) {
  int num_sms = 0;
  const cudaError_t err = device_num_sms(ctx.device, ctx.num_sms, &num_sms);
  if (err != cudaSuccess) return err;
  if (ctx.low_latency_blocks > 0) {
    *num_blocks = ctx.low_latency_blocks < num_sms ? ctx.low_latency_blocks : num_sms;
  } else {
    *num_blocks = num_sms > 2 * kLowLatencyFreeSms ? num_sms - kLowLatencyFreeSms : num_sms;
  }
  return cudaSuccess;
}

// Launches `kernel` cooperatively (all blocks co-resident) with kLowLatencyThreads per block.
template <typename Args>
cudaError_t launch_low_latency_kernel(void (*kernel)(Args), int num_blocks, size_t smem_bytes,
                                      cudaStream_t stream, const Args& args) {
  constexpr size_t kDefaultSmemBytes = 48 * 1024;
  if (smem_bytes > kDefaultSmemBytes) {
    const cudaError_t err = cudaFuncSetAttribute(
        kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem_bytes));
    if (err != cudaSuccess) return err;
  }
  return launch_cooperative(kernel, num_blocks, kLowLatencyThreads, smem_bytes, stream, args);
}

}  // namespace jax_ep
