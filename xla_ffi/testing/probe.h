// The transport probe (test module jax_ep._C_testing): an all-to-all exchange between emulated
// ranks on one GPU, written once against the device transport interface
// (transport/device_transport.cuh) and run over either transport.
// It is the GPU test of the transports themselves: the emulated transport's device side, its
// rings in pinned memory, the host proxy on its thread and the copy-engine executor, before any
// dispatch or combine kernel relies on them (tests/test_transport_gpu.py).
//
// Every rank stages rows for every rank (itself included) in its send region, puts them into the
// receiver's receive region, fences, and advances the receiver's signal word for this source by
// the rows it put; a receiving warp waits for that word, then copies the rows it sees into an
// output array, which the host compares with the rows that were sent. Mutants break one rule of
// docs/transport.md each, so a test can show that the emulated transport catches it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "transport/emulator/host_proxy.h"
#include "transport/emulator/mutant.h"

namespace jax_ep {
namespace transport {

enum class ProbeTransport { kMapped = 0, kEmulated = 1 };

struct ProbeConfig {
  ProbeTransport transport = ProbeTransport::kEmulated;
  Mutant mutant = Mutant::kNone;
  int num_ranks = 2;       // emulated ranks, all on the current device
  int warps_per_rank = 4;  // one warp per block
  int rows = 16;           // rows each rank sends to each rank
  int row_bytes = 512;     // a multiple of 16
  int rounds = 3;          // launches; signals accumulate and staged rows are reused
  ProxyOptions proxy;      // emulated: ordering, seed (rank r's proxy uses seed + r), tearing
  double receive_timeout_s = 2.0;     // a receiver gives up (and counts a timeout) after this
  double transport_timeout_s = 10.0;  // the transport's own bounded waits (they trap)
};

struct ProbeResult {
  uint64_t bad_rows = 0;  // rows a receiver saw that differ from what was sent
  uint64_t timeouts = 0;  // (round, receiver, source) whose signal never arrived in time
  std::vector<std::string> proxy_errors;  // every proxy's, as "kind: message"
  std::string cuda_error;                 // empty when every CUDA call succeeded
  double seconds = 0;  // wall time of all rounds (the emulator's speed is no performance figure)
};

ProbeResult run_transport_probe(const ProbeConfig& config);

}  // namespace transport
}  // namespace jax_ep
