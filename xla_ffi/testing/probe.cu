#include "probe.h"

#include <cuda_runtime_api.h>

#include <chrono>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "common/copy.cuh"
#include "common/sync.cuh"
#include "transport/emulator/emulated_ranks.h"
#include "transport/emulator/emulated_transport.cuh"
#include "transport/mapped/mapped_transport.cuh"

namespace jax_ep {
namespace transport {
namespace {

// The regions every emulated rank registers.
constexpr uint32_t kSendRegion = 0;
constexpr uint32_t kReceiveRegion = 1;
constexpr uint32_t kSignalRegion = 2;
constexpr uint32_t kNumRegions = 3;
constexpr int kMaxProbeRanks = 8;
constexpr int kMaxProbeWarps = 32;
constexpr uint64_t kRingCapacity = 1024;

struct ProbeArgs {
  RegionTable regions;
  RingView rings[kMaxProbeRanks];  // emulated: rank r's ring (device pointers)
  int num_ranks;
  int warps_per_rank;
  int rows;
  int row_bytes;
  uint32_t round;
  Mutant mutant;
  uint64_t receive_timeout_ns;
  uint64_t transport_timeout_ns;
  int4* out;                     // [receiver][source][rows][row_bytes / 16]
  unsigned long long* timeouts;  // one counter
};

// The 32-bit word `word` of the row that `source` sends to `receiver` in `round`: distinct for
// every field, so a row landing in the wrong place or from the wrong round is seen.
__host__ __device__ inline uint32_t probe_word(int source, int receiver, int row, uint32_t round,
                                               uint32_t word) {
  uint32_t h = static_cast<uint32_t>(source) * 0x9E3779B1u ^
               static_cast<uint32_t>(receiver) * 0x85EBCA77u ^
               static_cast<uint32_t>(row) * 0xC2B2AE3Du ^ round * 0x27D4EB2Fu ^ word * 0x165667B1u;
  h ^= h >> 15;
  h *= 0x2C1B3C6Du;
  h ^= h >> 12;
  return h;
}

__device__ __forceinline__ int4 probe_vector(int source, int receiver, int row, uint32_t round,
                                             int vector, bool garbage) {
  const uint32_t w = 4u * static_cast<uint32_t>(vector);
  const uint32_t flip = garbage ? 0xFFFFFFFFu : 0u;
  return make_int4(static_cast<int>(probe_word(source, receiver, row, round, w) ^ flip),
                   static_cast<int>(probe_word(source, receiver, row, round, w + 1) ^ flip),
                   static_cast<int>(probe_word(source, receiver, row, round, w + 2) ^ flip),
                   static_cast<int>(probe_word(source, receiver, row, round, w + 3) ^ flip));
}

__device__ __forceinline__ WaitContext wait_of(const ProbeArgs& a, int rank) {
  return WaitContext{a.transport_timeout_ns, nullptr, rank, static_cast<int32_t>(WaitPhase::kNone)};
}

template <typename Transport>
struct MakeTransport;

template <>
struct MakeTransport<MappedTransport> {
  static __device__ MappedTransport make(const ProbeArgs& a, int rank, int /*warp*/) {
    return MappedTransport{a.regions, rank, wait_of(a, rank)};
  }
};

template <>
struct MakeTransport<EmulatedTransport> {
  static __device__ EmulatedTransport make(const ProbeArgs& a, int rank, int warp) {
    return EmulatedTransport{a.regions, a.rings[rank], rank, static_cast<uint32_t>(warp),
                             wait_of(a, rank)};
  }
};

// Lane 0 spins (acquire) until *word >= value or the deadline; the whole warp gets the answer.
// Not the trapping wait of sync.cuh: a mutant that loses a signal must end the probe, not the
// CUDA context.
__device__ __forceinline__ bool wait_or_give_up(const uint64_t* word, uint64_t value,
                                                uint64_t timeout_ns, int lane) {
  int arrived = 0;
  if (lane == 0) {
    const uint64_t start = global_timer_ns();
    while (true) {
      arrived = ld_acquire_sys(word) >= value ? 1 : 0;
      if (arrived || global_timer_ns() - start > timeout_ns) break;
    }
  }
  __syncwarp();
  return __shfl_sync(0xffffffffu, arrived, 0) != 0;
}

// One warp per block: block b is warp (b % warps_per_rank) of rank (b / warps_per_rank).
template <typename Transport>
__global__ void __launch_bounds__(kWarpSize) probe_kernel(ProbeArgs a) {
  const int rank = static_cast<int>(blockIdx.x) / a.warps_per_rank;
  const int warp = static_cast<int>(blockIdx.x) % a.warps_per_rank;
  const int lane = static_cast<int>(threadIdx.x);
  const int vectors = a.row_bytes / static_cast<int>(kBytesPerVector);
  const uint64_t row_bytes = static_cast<uint64_t>(a.row_bytes);
  Transport t = MakeTransport<Transport>::make(a, rank, warp);
  auto staged_at = [&](int peer, int row) {
    return SymmetricAddress{kSendRegion, (static_cast<uint64_t>(peer) * a.rows + row) * row_bytes};
  };

  for (int peer = 0; peer < a.num_ranks; ++peer) {
    const SymmetricAddress signal{kSignalRegion, static_cast<uint64_t>(rank) * sizeof(uint64_t)};
    uint64_t mine = 0;  // rows this warp puts to `peer`; the warps' shares add up to a.rows
    for (int row = warp; row < a.rows; row += a.warps_per_rank) ++mine;
    if (mine == 0) continue;
    if (a.mutant == Mutant::kSignalBeforeData) t.signal(peer, signal, mine, SignalOp::kAdd, lane);
    for (int row = warp; row < a.rows; row += a.warps_per_rank) {
      const SymmetricAddress staged = staged_at(peer, row);
      int4* slot = reinterpret_cast<int4*>(t.local(staged));
      for (int v = lane; v < vectors; v += kWarpSize) {
        slot[v] = probe_vector(rank, peer, row, a.round, v, false);
      }
      const SymmetricAddress source{
          a.mutant == Mutant::kUnregisteredSource ? kUnregisteredRegion : kSendRegion,
          staged.offset};
      const SymmetricAddress destination{kReceiveRegion,
                                         (static_cast<uint64_t>(rank) * a.rows + row) * row_bytes};
      t.put(peer, destination, source, row_bytes, lane);
    }
    if (a.mutant != Mutant::kSignalBeforeData) {
      // The signal must not overtake this warp's puts to `peer`: fence (rule 2).
      if (a.mutant != Mutant::kNoFence) t.fence(lane);
      t.signal(peer, signal, mine, SignalOp::kAdd, lane);
    }
  }
  if (a.mutant == Mutant::kReuseBeforeQuiet) {  // rule 3: slots are reused after quiet only
    for (int peer = 0; peer < a.num_ranks; ++peer) {
      for (int row = warp; row < a.rows; row += a.warps_per_rank) {
        int4* slot = reinterpret_cast<int4*>(t.local(staged_at(peer, row)));
        for (int v = lane; v < vectors; v += kWarpSize) {
          slot[v] = probe_vector(rank, peer, row, a.round, v, true);
        }
      }
    }
  }
  t.quiet(lane);

  // Receive: this warp takes sources warp, warp + warps_per_rank, ...; the rows of a source are
  // read only after its signal word says all of them have landed.
  const uint64_t expected = static_cast<uint64_t>(a.rows) * (a.round + 1);
  for (int source = warp; source < a.num_ranks; source += a.warps_per_rank) {
    const uint64_t* word = reinterpret_cast<const uint64_t*>(
        t.local({kSignalRegion, static_cast<uint64_t>(source) * sizeof(uint64_t)}));
    if (!wait_or_give_up(word, expected, a.receive_timeout_ns, lane)) {
      if (lane == 0) atomicAdd(a.timeouts, 1ull);
      continue;
    }
    const uint64_t first = static_cast<uint64_t>(source) * a.rows * row_bytes;
    const int64_t count = static_cast<int64_t>(a.rows) * vectors;
    warp_copy_vectors<false>(a.out + (static_cast<int64_t>(rank) * a.num_ranks + source) * count,
                             reinterpret_cast<const int4*>(t.local({kReceiveRegion, first})), count,
                             lane);
  }
}

void validate(const ProbeConfig& c) {
  auto require = [](bool ok, const char* message) {
    if (!ok) throw std::invalid_argument(message);
  };
  require(c.num_ranks >= 1 && c.num_ranks <= kMaxProbeRanks, "num_ranks: 1 to 8");
  require(c.warps_per_rank >= 1 && c.warps_per_rank <= kMaxProbeWarps, "warps_per_rank: 1 to 32");
  require(c.rows >= 1, "rows: at least 1");
  require(c.row_bytes > 0 && c.row_bytes % static_cast<int>(kBytesPerVector) == 0,
          "row_bytes: a positive multiple of 16");
  require(c.rounds >= 1, "rounds: at least 1");
  require(c.receive_timeout_s > 0 && c.transport_timeout_s > 0, "timeouts: positive");
}

}  // namespace

ProbeResult run_transport_probe(const ProbeConfig& config) {
  validate(config);
  const int ranks = config.num_ranks;
  const uint64_t row_bytes = static_cast<uint64_t>(config.row_bytes);
  const uint64_t exchange_bytes = static_cast<uint64_t>(ranks) * config.rows * row_bytes;
  const uint64_t region_bytes[kNumRegions] = {exchange_bytes, exchange_bytes,
                                              static_cast<uint64_t>(ranks) * sizeof(uint64_t)};
  ProbeResult result;
  DeviceArena memory;

  ProbeArgs args = {};
  std::vector<char*> bases(static_cast<size_t>(ranks) * kNumRegions);
  std::vector<std::vector<std::pair<void*, uint64_t>>> regions(ranks);
  for (int r = 0; r < ranks; ++r) {
    for (uint32_t region = 0; region < kNumRegions; ++region) {
      char* base = static_cast<char*>(memory.device_zeroed(region_bytes[region]));
      bases[r * kNumRegions + region] = base;
      regions[r].emplace_back(base, region_bytes[region]);
    }
  }
  char** device_bases = static_cast<char**>(memory.device_zeroed(bases.size() * sizeof(char*)));
  check_cuda(
      cudaMemcpy(device_bases, bases.data(), bases.size() * sizeof(char*), cudaMemcpyHostToDevice),
      "cudaMemcpy (region table)");
  args.regions = RegionTable{device_bases, static_cast<int>(kNumRegions)};
  args.num_ranks = ranks;
  args.warps_per_rank = config.warps_per_rank;
  args.rows = config.rows;
  args.row_bytes = config.row_bytes;
  args.mutant = config.mutant;
  args.receive_timeout_ns = static_cast<uint64_t>(config.receive_timeout_s * 1e9);
  args.transport_timeout_ns = static_cast<uint64_t>(config.transport_timeout_s * 1e9);
  const uint64_t out_bytes = static_cast<uint64_t>(ranks) * exchange_bytes;
  args.out = static_cast<int4*>(memory.device_zeroed(out_bytes));
  args.timeouts = static_cast<unsigned long long*>(memory.device_zeroed(sizeof(uint64_t)));

  const bool emulated = config.transport == ProbeTransport::kEmulated;
  std::vector<std::unique_ptr<RankProxy>> proxies;
  if (emulated) {
    for (int r = 0; r < ranks; ++r) {
      args.rings[r] =
          make_ring(memory, kRingCapacity, static_cast<uint32_t>(config.warps_per_rank));
      ProxyOptions options = config.proxy;
      options.seed = config.proxy.seed + static_cast<uint64_t>(r);
      options.log_deliveries = false;
      proxies.push_back(std::make_unique<RankProxy>(r, options, args.rings[r], regions));
    }
  }

  OwnedStream kernel_stream;
  const size_t vectors_per_row = row_bytes / kBytesPerVector;
  std::vector<int4> seen(out_bytes / sizeof(int4));
  const auto start = std::chrono::steady_clock::now();
  try {
    for (int round = 0; round < config.rounds; ++round) {
      args.round = static_cast<uint32_t>(round);
      const dim3 grid(static_cast<unsigned>(ranks * config.warps_per_rank));
      if (emulated) {
        probe_kernel<EmulatedTransport><<<grid, kWarpSize, 0, kernel_stream.stream>>>(args);
      } else {
        probe_kernel<MappedTransport><<<grid, kWarpSize, 0, kernel_stream.stream>>>(args);
      }
      check_cuda(cudaGetLastError(), "probe kernel launch");
      check_cuda(cudaMemcpyAsync(seen.data(), args.out, out_bytes, cudaMemcpyDeviceToHost,
                                 kernel_stream.stream),
                 "cudaMemcpyAsync (rows seen)");
      check_cuda(cudaStreamSynchronize(kernel_stream.stream), "probe kernel");
      for (int receiver = 0; receiver < ranks; ++receiver) {
        for (int source = 0; source < ranks; ++source) {
          for (int row = 0; row < config.rows; ++row) {
            const int4* got =
                seen.data() +
                ((static_cast<size_t>(receiver) * ranks + source) * config.rows + row) *
                    vectors_per_row;
            bool same = true;
            for (size_t v = 0; v < vectors_per_row && same; ++v) {
              const uint32_t w = 4u * static_cast<uint32_t>(v);
              const uint32_t r = static_cast<uint32_t>(round);
              same =
                  static_cast<uint32_t>(got[v].x) == probe_word(source, receiver, row, r, w) &&
                  static_cast<uint32_t>(got[v].y) == probe_word(source, receiver, row, r, w + 1) &&
                  static_cast<uint32_t>(got[v].z) == probe_word(source, receiver, row, r, w + 2) &&
                  static_cast<uint32_t>(got[v].w) == probe_word(source, receiver, row, r, w + 3);
            }
            result.bad_rows += same ? 0 : 1;
          }
        }
      }
      // A receiver that gave up leaves the last round's rows: clear them so none passes as seen.
      check_cuda(cudaMemsetAsync(args.out, 0, out_bytes, kernel_stream.stream),
                 "cudaMemsetAsync (rows seen)");
    }
  } catch (const std::runtime_error& e) {  // a kernel that trapped: what did the proxies see?
    throw std::runtime_error(std::string(e.what()) + "; the proxies:" + stop_and_describe(proxies));
  }
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  check_cuda(cudaMemcpy(&result.timeouts, args.timeouts, sizeof(uint64_t), cudaMemcpyDeviceToHost),
             "cudaMemcpy (timeouts)");
  for (std::unique_ptr<RankProxy>& p : proxies) {
    RankProxy::Report report = p->stop();
    if (result.cuda_error.empty()) result.cuda_error = report.cuda_error;
    result.proxy_errors.insert(result.proxy_errors.end(), report.errors.begin(),
                               report.errors.end());
  }
  return result;
}

}  // namespace transport
}  // namespace jax_ep
