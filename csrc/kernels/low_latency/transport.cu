// The low-latency dispatch and combine over a device transport: protocol in
// low_latency/transport.h, bodies in low_latency/transport_kernels.cuh, compiled here for
// MappedTransport and EmulatedTransport; the layout and the launchers.
#include "kernels/low_latency/transport.h"

#include <type_traits>

#include "kernels/low_latency/transport_kernels.cuh"
#include "kernels/preload.h"
#include "transport/emulated_transport.cuh"
#include "transport/mapped_transport.cuh"

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
    offset = align_up(offset + bytes, kLowLatencyAlignBytes);
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

namespace {

using transport::EmulatedTransport;
using transport::MappedTransport;
using transport_kernels::low_latency_transport_combine_kernel;
using transport_kernels::low_latency_transport_dispatch_kernel;
using transport_kernels::MakeTransport;

}  // namespace

namespace transport_kernels {

template <>
struct MakeTransport<MappedTransport> {
  static __device__ MappedTransport make(const LowLatencyTransportLaunch& l, const Warp& w,
                                         WaitPhase phase) {
    return MappedTransport{RegionTable{l.region_bases, l.regions_per_rank}, w.rank,
                           wait_of(l, w.rank, phase)};
  }
};

template <>
struct MakeTransport<EmulatedTransport> {
  static __device__ EmulatedTransport make(const LowLatencyTransportLaunch& l, const Warp& w,
                                           WaitPhase phase) {
    return EmulatedTransport{RegionTable{l.region_bases, l.regions_per_rank}, l.rings[w.index],
                             w.rank, static_cast<uint32_t>(w.warp), wait_of(l, w.rank, phase)};
  }
};

}  // namespace transport_kernels

namespace {

// The kernel of op `Op` (LowLatencyTransportDispatch or ...Combine) over `Transport`.
template <typename Transport, typename Op>
constexpr auto kernel_of() {
  if constexpr (std::is_same_v<Op, LowLatencyTransportDispatch>) {
    return low_latency_transport_dispatch_kernel<Transport>;
  } else {
    return low_latency_transport_combine_kernel<Transport>;
  }
}

// One launch of `op` over the transport `kind`: the kernel of the mapped or emulated transport,
// or the NVSHMEM plugin's.
template <typename Op>
cudaError_t launch_op(LowLatencyTransportKind kind, const LowLatencyTransportLaunch& l,
                      const Op& op, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(l.rank_count * l.layout.shape.warps_per_rank));
  if (kind == LowLatencyTransportKind::kNvshmem) {
    if constexpr (std::is_same_v<Op, LowLatencyTransportDispatch>) {
      return launch_low_latency_transport_dispatch_nvshmem(l, op, stream);
    } else {
      return launch_low_latency_transport_combine_nvshmem(l, op, stream);
    }
  }
  if (kind == LowLatencyTransportKind::kEmulated) {
    kernel_of<EmulatedTransport, Op>()<<<grid, kWarpSize, 0, stream>>>(l, op);
  } else {
    kernel_of<MappedTransport, Op>()<<<grid, kWarpSize, 0, stream>>>(l, op);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_low_latency_transport_dispatch(LowLatencyTransportKind kind,
                                                  const LowLatencyTransportLaunch& launch,
                                                  const LowLatencyTransportDispatch& op,
                                                  cudaStream_t stream) {
  return launch_op(kind, launch, op, stream);
}

cudaError_t launch_low_latency_transport_combine(LowLatencyTransportKind kind,
                                                 const LowLatencyTransportLaunch& launch,
                                                 const LowLatencyTransportCombine& op,
                                                 cudaStream_t stream) {
  return launch_op(kind, launch, op, stream);
}

cudaError_t preload_low_latency_transport_kernels() {
  cudaFuncAttributes attributes;
  for (const void* kernel :
       {reinterpret_cast<const void*>(low_latency_transport_dispatch_kernel<MappedTransport>),
        reinterpret_cast<const void*>(low_latency_transport_dispatch_kernel<EmulatedTransport>),
        reinterpret_cast<const void*>(low_latency_transport_combine_kernel<MappedTransport>),
        reinterpret_cast<const void*>(low_latency_transport_combine_kernel<EmulatedTransport>)}) {
    const cudaError_t err = cudaFuncGetAttributes(&attributes, kernel);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace jax_ep
