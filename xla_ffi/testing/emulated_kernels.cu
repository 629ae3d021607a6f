// The emulated transport's put-protocol kernels (DeviceTransport::kEmulated): both modes'
// kernels over EmulatedTransport (transport/emulator/emulated_transport.cuh), built only into the
// test module. Each warp's transport comes from its rank's queue record (the ring and the
// protocol mutant, device memory; RankContext::transport_queue), so these instances are the only
// ones with a mutant. emulated_transport.cc adds the host side and hands the table to jax_ep._C.
#include "emulated.h"
#include "kernels/put_plugin.cuh"
#include "transport/emulator/emulated_transport.cuh"

namespace jax_ep {

namespace transport_kernels {

template <>
struct MakeTransport<transport::EmulatedTransport> {
  static __device__ transport::EmulatedTransport make(const LowLatencyTransportLaunch& l,
                                                      const Warp& w, WaitPhase phase) {
    return transport::EmulatedTransport::of_queue(
        RegionTable{l.region_bases, l.regions_per_rank}, l.queues[w.index], w.rank,
        static_cast<uint32_t>(w.warp), wait_of(l, w.rank, phase));
  }
};

}  // namespace transport_kernels

// A push warp's index in the ring: after the low-latency kernels' warps (args.first_warp).
template <>
struct MakeNormalTransport<transport::EmulatedTransport> {
  static __device__ __forceinline__ transport::EmulatedTransport make(const NormalTransportArgs& a,
                                                                      int rank, uint32_t warp,
                                                                      const WaitContext& wait) {
    return transport::EmulatedTransport::of_queue(
        transport::RegionTable{a.region_bases, kTransportRegions}, a.queue, rank,
        a.first_warp + warp, wait);
  }
};

PutPlugin emulated_put_kernels() {
  return PutKernels<transport::EmulatedTransport>::table(DeviceTransport::kEmulated);
}

}  // namespace jax_ep
