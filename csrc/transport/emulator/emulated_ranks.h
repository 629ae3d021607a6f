// Several ranks on one GPU for the GPU tests of the transports: their memory, and for the emulated
// transport each rank's ring, proxy, copy executor and proxy thread (the transport probe, probe.h,
// and the low-latency ops over a transport share them).
#pragma once

#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "transport/emulator/command_ring.h"
#include "transport/emulator/cuda_copy_executor.h"
#include "transport/emulator/host_proxy.h"
#include "transport/emulator/proxy_thread.h"

namespace jax_ep {
namespace transport {

// Throws std::runtime_error naming `what` on a CUDA failure.
void check_cuda(cudaError_t status, const char* what);

// Every allocation of one test object, freed (after a device synchronisation) when it goes.
class DeviceArena {
 public:
  DeviceArena() = default;
  ~DeviceArena();
  DeviceArena(const DeviceArena&) = delete;
  DeviceArena& operator=(const DeviceArena&) = delete;

  void* device_zeroed(size_t bytes);
  // Pinned host memory mapped into the device, zeroed: the same pointer on both sides (UVA).
  void* pinned_zeroed(size_t bytes);

 private:
  std::vector<void*> device_;
  std::vector<void*> pinned_;
};

// A stream that is destroyed with its owner.
struct OwnedStream {
  OwnedStream();  // non-blocking: it never waits for the legacy default stream
  ~OwnedStream();
  OwnedStream(const OwnedStream&) = delete;
  OwnedStream& operator=(const OwnedStream&) = delete;
  cudaStream_t stream = nullptr;
};

// A ring of `capacity` slots (a power of two) for `num_warps` warps, in `arena`.
RingView make_ring(DeviceArena& arena, uint64_t capacity, uint32_t num_warps);

// A rank's queue record in device memory (what its kernels read: command_ring.h, EmulatedQueue),
// in `arena`, on the current device.
EmulatedQueue* make_queue(DeviceArena& arena, const RingView& ring, Mutant mutant);
// Sets the mutant of a record made by make_queue (before the kernels that read it run).
void set_queue_mutant(EmulatedQueue* queue, Mutant mutant);

// One emulated rank's proxy on its own thread, executing through copy-engine copies on a stream
// of its own. Members are destroyed in reverse order: the thread stops first.
class RankProxy {
 public:
  // `regions[rank][region]` = (base, bytes) of every rank's registered regions.
  RankProxy(int rank, const ProxyOptions& options, const RingView& ring,
            const std::vector<std::vector<std::pair<void*, uint64_t>>>& regions);

  struct Report {
    std::string cuda_error;           // the executor's first CUDA failure, empty if none
    std::vector<std::string> errors;  // the proxy's, as "kind: message (where)"
    std::string state;                // what it held when stopped (HostProxy::state)
  };
  // Delivers what was published, stops the thread and reports what went wrong.
  Report stop();
  // While it runs: the errors found since the last call ("kind: message"), each once (the
  // executor's CUDA failure is the proxy thread's until stop() reports it).
  std::vector<std::string> take_errors();
  // What the proxy delivered since it started, per destination rank (HostProxy::traffic),
  // once every command published before the call is delivered; throws if that takes longer
  // than `timeout`. Call between ops, while no kernel publishes: the proxy thread then writes
  // no count. (No reset: a reader subtracts an earlier reading, and never writes the counts.)
  std::map<int32_t, TrafficCount> traffic(std::chrono::nanoseconds timeout);

 private:
  OwnedStream copy_stream_;
  std::unique_ptr<CudaCopyExecutor> executor_;
  std::unique_ptr<HostProxy> proxy_;
  std::unique_ptr<ProxyThread> thread_;
};

// Stops every proxy and describes each ("rank r: state; errors"): appended to the message of a
// kernel that failed, so that a hang trapped by a bounded wait says what the proxies saw.
std::string stop_and_describe(std::vector<std::unique_ptr<RankProxy>>& proxies);

}  // namespace transport
}  // namespace jax_ep
