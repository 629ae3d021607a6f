// The put path of the normal-mode kernels, TransportPath<T>, beside the store path it replaces
// over a device transport, StoresPath: the two paths by which those kernels cross ranks.
//
// StoresPath: a warp stores rows and release-stores flags straight into a peer's workspace
// through its mapping (dispatch.cu, combine.cu instantiate it). TransportPath<T> does the same
// through a device transport (transport/device_transport.cuh), for peers without a mapping: the
// flags and words stay where they are and keep their values, each store becomes a transport call
// (docs/transport.md, "The normal mode over a device transport"):
//   - a row is staged in this rank's send region (a put's source must be registered; x and y
//     are XLA operands, which are not), then put_signal sets its row flag at the peer;
//   - a count or barrier word is a signal (kSet).
// A kernel is written once, templated on its path; `if constexpr (is_stores_path<Path>)` keeps
// the stores kernels what they were. MakeNormalTransport is specialised with each transport's
// table of kernels (kernels/put_plugin.cuh): the mapped transport's in kernels/put_mapped.cu,
// NVSHMEM's in its plugin (plugins/nvshmem_transport_kernels.cu), the emulated transport's in
// the test module (xla_ffi/testing/emulated_kernels.cu).
#pragma once

#include <cstdint>
#include <type_traits>

#include "common/peer_field.cuh"
#include "common/sync.cuh"
#include "kernels/api.h"
#include "kernels/normal/workspace.h"
#include "transport/device_transport.cuh"

namespace jax_ep {

// What a normal kernel needs of the transport, filled from the rank's context.
struct NormalTransportArgs {
  char* const* region_bases = nullptr;  // device table [rank][kTransportRegions]
  const void* queue = nullptr;          // kEmulated: this rank's queue record (opaque here)
  uint32_t first_warp = 0;              // kEmulated: ring warp of push warp 0
  uint64_t send_region_bytes = 0;
  int max_slots_per_warp = 0;       // 0: as many as the send region holds (BufferConfig)
  NormalLayout layout;              // offsets in the normal-mode area, the same on every rank
  const int* pe_of_rank = nullptr;  // kNvshmem: [R] every rank's NVSHMEM PE (device memory)
};

inline NormalTransportArgs normal_transport_args(const RankContext& ctx) {
  NormalTransportArgs args;
  args.region_bases = ctx.transport_region_bases;
  args.queue = ctx.transport_queue;
  args.first_warp = ctx.normal_first_warp;
  args.send_region_bytes = normal_send_region_bytes(ctx.config);
  args.max_slots_per_warp = ctx.config.normal_send_slots;
  args.layout = normal_layout(ctx.config);
  args.pe_of_rank = ctx.pes_device;
  return args;
}

struct StoresPath {};

template <typename Transport>
struct TransportPath {
  NormalTransportArgs args;
};

template <typename Path>
inline constexpr bool is_stores_path = std::is_same_v<Path, StoresPath>;

// A kernel's path, from the transport arguments at the end of its launch arguments (unused, and
// left zero, on the stores path).
template <typename Path>
struct PathOf {
  static __device__ __forceinline__ Path of(const NormalTransportArgs& args) { return Path{args}; }
};
template <>
struct PathOf<StoresPath> {
  static __device__ __forceinline__ StoresPath of(const NormalTransportArgs&) { return {}; }
};

// The transport of one warp. `warp` is the warp's rank-wide index among the normal kernels'
// (emulated: it keys the warp's fences and quiet acknowledgements; the ring's first
// args.first_warp entries belong to the low-latency kernels).
template <typename Transport>
struct MakeNormalTransport;

template <typename Transport>
__device__ __forceinline__ Transport make_normal_transport(const TransportPath<Transport>& path,
                                                           int rank, uint32_t warp,
                                                           const WaitContext& wait) {
  return MakeNormalTransport<Transport>::make(path.args, rank, warp, wait);
}

// Byte `offset` of the normal-mode area (the puts' and signals' destinations) and of the send
// region (their sources).
__device__ __forceinline__ transport::SymmetricAddress in_normal_area(size_t offset) {
  return transport::SymmetricAddress{kNormalAreaRegion, offset};
}
__device__ __forceinline__ transport::SymmetricAddress in_send_region(size_t offset) {
  return transport::SymmetricAddress{kNormalSendRegion, offset};
}

// The send-region slots of one push warp. The region holds `num_slots` rows of this call's row
// size; the first `active_warps` push warps own `per_warp` consecutive slots each (at most
// max_slots_per_warp when that is set) and stage their rows in them in turn. A slot is
// restaged only after the quiet that covers its put (rule 3); the warp's last quiet (finish)
// frees them all before its push role ends. (The next call could not restage them earlier
// anyway: its exchange waits for every peer to finish this call, which needs every row's flag,
// and a flag is set after its row's bytes were read. The quiet keeps the rule local.)
struct SendSlots {
  int64_t first_slot = 0;
  int64_t per_warp = 0;
  int64_t used = 0;  // rows staged so far by this warp

  // How many of `num_push_warps` push warps get slots, for rows of `row_bytes`.
  static __device__ __forceinline__ int64_t active_warps(const NormalTransportArgs& a,
                                                         int64_t num_push_warps,
                                                         int64_t row_bytes) {
    const int64_t num_slots = static_cast<int64_t>(a.send_region_bytes) / row_bytes;
    return num_slots < num_push_warps ? num_slots : num_push_warps;
  }

  static __device__ __forceinline__ SendSlots of_warp(const NormalTransportArgs& a,
                                                      int64_t push_warp, int64_t active,
                                                      int64_t row_bytes) {
    SendSlots slots;
    const int64_t num_slots = static_cast<int64_t>(a.send_region_bytes) / row_bytes;
    slots.per_warp = active > 0 ? num_slots / active : 0;
    if (a.max_slots_per_warp > 0 && slots.per_warp > a.max_slots_per_warp) {
      slots.per_warp = a.max_slots_per_warp;
    }
    slots.first_slot = push_warp * slots.per_warp;
    return slots;
  }

  // The slot for the warp's next row, after a quiet when that slot still backs a put.
  template <typename Transport>
  __device__ __forceinline__ int64_t next(Transport& t, int lane) {
    const int64_t index = used % per_warp;
    if (used > 0 && index == 0 && transport::keeps(t, transport::Rule::kQuietBeforeReuse)) {
      t.quiet(lane);
    }
    ++used;
    return first_slot + index;
  }

  template <typename Transport>
  __device__ __forceinline__ void finish(Transport& t, int lane) {
    if (used > 0 && transport::keeps(t, transport::Rule::kQuietBeforeEnd)) t.quiet(lane);
  }
};

// How a push warp of a transfer kernel sends rows: `at = next_row(row)` is where it writes a
// row (a region row of `rows(peer_rows, peer)`), then `send` makes the row visible at the peer
// with its flag (entry flag_index() of the peer's row flags) set to the tag; `finish` once the
// warp has sent its last row. flag_index is a callable, evaluated where the flag is written (lane
// 0 of the stores path): so the stores kernels compile to the code they had before the paths. Push
// warp g takes the entries g, g + stride(P), ... below end(num_entries) (P: the push warps).
template <typename Path>
struct RowSender;

// Stores: the warp writes the peer's row itself, then release-stores its flag.
template <>
struct RowSender<StoresPath> {
  __device__ __forceinline__ RowSender(const StoresPath&, int /*rank*/, const WaitContext&,
                                       int64_t /*push_warp*/, int64_t /*num_push_warps*/,
                                       int64_t /*row_bytes*/) {}

  __device__ __forceinline__ int64_t end(int64_t num_entries) const { return num_entries; }
  __device__ __forceinline__ int64_t stride(int64_t num_push_warps) const { return num_push_warps; }
  __device__ __forceinline__ char* rows(const PeerField<char>& peer_rows, int peer) const {
    return peer_rows[peer];
  }
  __device__ __forceinline__ int64_t next_row(int64_t row, int /*lane*/) { return row; }
  template <typename FlagIndex>
  __device__ __forceinline__ void send(const PeerField<uint64_t>& peer_row_flags, int peer,
                                       int64_t /*row*/, int64_t /*at*/, FlagIndex flag_index,
                                       uint64_t tag, int lane) {
    __syncwarp();
    if (lane == 0) st_release_sys(peer_row_flags[peer] + flag_index(), tag);
  }
  __device__ __forceinline__ void flush(int /*lane*/) {}  // stores have landed
  __device__ __forceinline__ void finish(int /*lane*/) {}
};

// A transport: the warp stages the row in one of its send slots, then put_signal copies it to
// the peer's row and sets the row's flag there once the bytes have landed (rule 2 of
// docs/transport.md). Only the push warps that have slots push (all of them unless the rows
// are so large that the send region holds fewer rows than there are push warps).
template <typename Transport>
struct RowSender<TransportPath<Transport>> {
  Transport t;
  NormalTransportArgs a;
  SendSlots slots;
  int64_t num_active;  // push warps with slots
  int64_t row_bytes;
  bool active;

  __device__ __forceinline__ RowSender(const TransportPath<Transport>& path, int rank,
                                       const WaitContext& wait, int64_t push_warp,
                                       int64_t num_push_warps, int64_t row_bytes_)
      : t(make_normal_transport(path, rank, static_cast<uint32_t>(push_warp), wait)),
        a(path.args),
        row_bytes(row_bytes_) {
    num_active = SendSlots::active_warps(a, num_push_warps, row_bytes);
    active = push_warp < num_active;
    slots = SendSlots::of_warp(a, push_warp, num_active, row_bytes);
  }

  __device__ __forceinline__ int64_t end(int64_t num_entries) const {
    return active ? num_entries : 0;
  }
  __device__ __forceinline__ int64_t stride(int64_t /*num_push_warps*/) const { return num_active; }
  __device__ __forceinline__ char* rows(const PeerField<char>& /*peer_rows*/, int /*peer*/) {
    return t.local(in_send_region(0));
  }
  __device__ __forceinline__ int64_t next_row(int64_t /*row*/, int lane) {
    return slots.next(t, lane);
  }
  template <typename FlagIndex>
  __device__ __forceinline__ void send(const PeerField<uint64_t>& /*peer_row_flags*/, int peer,
                                       int64_t row, int64_t at, FlagIndex flag_index, uint64_t tag,
                                       int lane) {
    __syncwarp();  // every lane's staged bytes, before the put reads them
    const transport::SymmetricAddress dst = in_normal_area(a.layout.data + row * row_bytes);
    const uint64_t staged = static_cast<uint64_t>(at * row_bytes);
    const transport::SymmetricAddress src = in_send_region(staged);
    const transport::SymmetricAddress flag =
        in_normal_area(a.layout.row_flags + flag_index() * sizeof(uint64_t));
    t.put_signal(peer, dst, src, static_cast<uint64_t>(row_bytes), flag, tag,
                 transport::SignalOp::kSet, lane);
  }
  // Every put so far delivered (before a wait that may depend on them).
  __device__ __forceinline__ void flush(int lane) { t.quiet(lane); }
  __device__ __forceinline__ void finish(int lane) { slots.finish(t, lane); }
};

}  // namespace jax_ep
