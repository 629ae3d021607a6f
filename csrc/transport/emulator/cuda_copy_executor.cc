#include "transport/emulator/cuda_copy_executor.h"

#include <algorithm>
#include <cstring>

namespace jax_ep {
namespace transport {
namespace {

constexpr uint64_t kReadStagingBytes = uint64_t{1} << 20;  // a read is split into such pieces

}  // namespace

CudaCopyExecutor::CudaCopyExecutor(cudaStream_t stream, uint32_t signal_slots)
    : stream_(stream), slots_(signal_slots == 0 ? 1 : signal_slots) {
  ok(cudaGetDevice(&device_), "cudaGetDevice");
  ok(cudaHostAlloc(reinterpret_cast<void**>(&staging_), slots_ * sizeof(uint64_t),
                   cudaHostAllocDefault),
     "cudaHostAlloc");
  ok(cudaHostAlloc(reinterpret_cast<void**>(&read_staging_), kReadStagingBytes,
                   cudaHostAllocDefault),
     "cudaHostAlloc (reads)");
}

CudaCopyExecutor::~CudaCopyExecutor() {
  if (staging_ != nullptr) {
    cudaStreamSynchronize(stream_);
    cudaFreeHost(staging_);
  }
  if (read_staging_ != nullptr) cudaFreeHost(read_staging_);
}

bool CudaCopyExecutor::ok(cudaError_t status, const char* what) {
  if (status == cudaSuccess) return true;
  if (error_.empty()) {
    error_ = std::string(what) + ": " + cudaGetErrorName(status) + " (" +
             cudaGetErrorString(status) + ")";
  }
  return false;
}

bool CudaCopyExecutor::on_device() {
  // A new thread starts on device 0; the proxy's thread is not the one that built us.
  thread_local int current = -1;
  if (current == device_) return true;
  if (!ok(cudaSetDevice(device_), "cudaSetDevice")) return false;
  current = device_;
  return true;
}

void CudaCopyExecutor::copy(void* dst, const void* src, uint64_t bytes) {
  if (!error_.empty() || !on_device()) return;
  ok(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream_), "cudaMemcpyAsync (data)");
}

void CudaCopyExecutor::write_signal(uint64_t* dst, uint64_t value) {
  if (!error_.empty() || staging_ == nullptr || !on_device()) return;
  // A staging word may be rewritten only once the copy that reads it has run.
  if (next_slot_ == slots_) {
    complete();
    next_slot_ = 0;
  }
  uint64_t* word = staging_ + next_slot_++;
  *word = value;
  ok(cudaMemcpyAsync(dst, word, sizeof(uint64_t), cudaMemcpyDefault, stream_),
     "cudaMemcpyAsync (signal)");
}

void CudaCopyExecutor::read(void* host_dst, const void* src, uint64_t bytes) {
  if (!error_.empty() || read_staging_ == nullptr || !on_device()) return;
  for (uint64_t done = 0; done < bytes; done += kReadStagingBytes) {
    const uint64_t piece = std::min(kReadStagingBytes, bytes - done);
    if (!ok(cudaMemcpyAsync(read_staging_, static_cast<const char*>(src) + done, piece,
                            cudaMemcpyDefault, stream_),
            "cudaMemcpyAsync (read)") ||
        !ok(cudaStreamSynchronize(stream_), "cudaStreamSynchronize (read)")) {
      return;
    }
    std::memcpy(static_cast<char*>(host_dst) + done, read_staging_, piece);
  }
}

void CudaCopyExecutor::complete() {
  if (!error_.empty() || !on_device()) return;
  ok(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
}

}  // namespace transport
}  // namespace jax_ep
