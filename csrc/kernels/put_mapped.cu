// The mapped transport's put-protocol kernels (DeviceTransport::kMapped): both modes' kernels
// over MappedTransport (transport/mapped/mapped_transport.cuh), jax_ep._C's one built-in table
// (put_plugin.h).
#include "kernels/put_plugin.cuh"
#include "transport/mapped/mapped_transport.cuh"

namespace jax_ep {

namespace transport_kernels {

template <>
struct MakeTransport<transport::MappedTransport> {
  static __device__ transport::MappedTransport make(const LowLatencyTransportLaunch& l,
                                                    const Warp& w, WaitPhase phase) {
    return transport::MappedTransport{RegionTable{l.region_bases, l.regions_per_rank}, w.rank,
                                      wait_of(l, w.rank, phase)};
  }
};

}  // namespace transport_kernels

template <>
struct MakeNormalTransport<transport::MappedTransport> {
  static __device__ __forceinline__ transport::MappedTransport make(const NormalTransportArgs& a,
                                                                    int rank, uint32_t /*warp*/,
                                                                    const WaitContext& wait) {
    return transport::MappedTransport{transport::RegionTable{a.region_bases, kTransportRegions},
                                      rank, wait};
  }
};

const PutPlugin* mapped_put_plugin() {
  static const PutPlugin plugin =
      PutKernels<transport::MappedTransport>::table(DeviceTransport::kMapped);
  return &plugin;
}

}  // namespace jax_ep
