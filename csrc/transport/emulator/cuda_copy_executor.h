// The executor of the emulated transport on GPUs: every delivery is a cudaMemcpyAsync on one
// copy stream into the peer's mapped memory, signal words included, so no kernel writes them
// (our kernels may hold every SM) and stream order puts each signal after the data issued before
// it. CUDA failures are sticky: the first one is kept (error()) and later operations are skipped,
// since the proxy runs on a thread that cannot throw into the kernel's caller.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "transport/emulator/executor.h"

namespace jax_ep {
namespace transport {

class CudaCopyExecutor final : public TransportExecutor {
 public:
  // `stream`: a stream of the issuing rank's device (the current device of the constructing
  // thread), used for nothing else. `signal_slots`: pinned words holding signal values until
  // their copies have run. The operations may run on another thread (the proxy's): each makes
  // that device current there first.
  explicit CudaCopyExecutor(cudaStream_t stream, uint32_t signal_slots = 4096);
  ~CudaCopyExecutor() override;
  CudaCopyExecutor(const CudaCopyExecutor&) = delete;
  CudaCopyExecutor& operator=(const CudaCopyExecutor&) = delete;

  void copy(void* dst, const void* src, uint64_t bytes) override;
  void write_signal(uint64_t* dst, uint64_t value) override;
  void read(void* host_dst, const void* src, uint64_t bytes) override;
  void complete() override;

  // Empty while every CUDA call succeeded.
  const std::string& error() const { return error_; }

 private:
  bool ok(cudaError_t status, const char* what);
  // Makes the executor's device current on the calling thread; false (error kept) if it fails.
  bool on_device();

  cudaStream_t stream_;
  int device_ = 0;
  uint64_t* staging_ = nullptr;  // pinned host memory
  uint32_t slots_;
  // Reads land here (pinned), then in the caller's memory. A read straight into pageable
  // memory goes through the driver's own staging, which stalled behind a spinning kernel on
  // the H200 (the probe's proxies were stuck in it until the kernel's bounded wait trapped).
  // Allocated once: freeing pinned memory synchronises the device, which a kernel waiting for
  // this proxy would never let happen.
  char* read_staging_ = nullptr;
  uint32_t next_slot_ = 0;
  std::string error_;
};

}  // namespace transport
}  // namespace jax_ep
