#include "transport/emulator/emulated_ranks.h"

#include <cstring>
#include <stdexcept>

namespace jax_ep {
namespace transport {

void check_cuda(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorName(status) + " (" +
                             cudaGetErrorString(status) + ")");
  }
}

DeviceArena::~DeviceArena() {
  cudaDeviceSynchronize();
  for (void* p : device_) cudaFree(p);
  for (void* p : pinned_) cudaFreeHost(p);
}

void* DeviceArena::device_zeroed(size_t bytes) {
  void* p = nullptr;
  check_cuda(cudaMalloc(&p, bytes), "cudaMalloc");
  device_.push_back(p);
  // cudaMemset runs on the legacy default stream, asynchronously, and our kernels run on
  // non-blocking streams, which never wait for it: a kernel launched right after could read the
  // memory before it is zeroed (the probe did: a ring's reserve counter, uninitialised).
  check_cuda(cudaMemsetAsync(p, 0, bytes, cudaStreamLegacy), "cudaMemset");
  check_cuda(cudaStreamSynchronize(cudaStreamLegacy), "cudaStreamSynchronize (zeroed)");
  return p;
}

void* DeviceArena::pinned_zeroed(size_t bytes) {
  void* p = nullptr;
  check_cuda(cudaHostAlloc(&p, bytes, cudaHostAllocMapped | cudaHostAllocPortable),
             "cudaHostAlloc");
  pinned_.push_back(p);
  std::memset(p, 0, bytes);
  void* device = nullptr;
  check_cuda(cudaHostGetDevicePointer(&device, p, 0), "cudaHostGetDevicePointer");
  if (device != p) throw std::runtime_error("pinned memory without unified addressing");
  return p;
}

OwnedStream::OwnedStream() {
  check_cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
}

OwnedStream::~OwnedStream() {
  if (stream != nullptr) cudaStreamDestroy(stream);
}

RingView make_ring(DeviceArena& arena, uint64_t capacity, uint32_t num_warps) {
  RingView ring;
  ring.slots =
      static_cast<TransportCommand*>(arena.pinned_zeroed(capacity * sizeof(TransportCommand)));
  ring.capacity = capacity;
  ring.reserve = static_cast<uint64_t*>(arena.device_zeroed(sizeof(uint64_t)));  // device atomics
  ring.consumed = static_cast<uint64_t*>(arena.pinned_zeroed(sizeof(uint64_t)));
  ring.acks = static_cast<uint64_t*>(arena.pinned_zeroed(num_warps * sizeof(uint64_t)));
  ring.num_warps = num_warps;
  return ring;
}

EmulatedQueue* make_queue(DeviceArena& arena, const RingView& ring, Mutant mutant) {
  EmulatedQueue* queue = static_cast<EmulatedQueue*>(arena.device_zeroed(sizeof(EmulatedQueue)));
  const EmulatedQueue record{ring, mutant};
  check_cuda(cudaMemcpy(queue, &record, sizeof(record), cudaMemcpyHostToDevice),
             "cudaMemcpy (queue record)");
  return queue;
}

void set_queue_mutant(EmulatedQueue* queue, Mutant mutant) {
  check_cuda(cudaMemcpy(&queue->mutant, &mutant, sizeof(mutant), cudaMemcpyHostToDevice),
             "cudaMemcpy (queue mutant)");
}

RankProxy::RankProxy(int rank, const ProxyOptions& options, const RingView& ring,
                     const std::vector<std::vector<std::pair<void*, uint64_t>>>& regions)
    : executor_(std::make_unique<CudaCopyExecutor>(copy_stream_.stream)),
      proxy_(std::make_unique<HostProxy>(rank, options, executor_.get())),
      thread_(std::make_unique<ProxyThread>(proxy_.get())) {
  for (size_t peer = 0; peer < regions.size(); ++peer) {
    for (size_t region = 0; region < regions[peer].size(); ++region) {
      proxy_->register_region(static_cast<int>(peer), static_cast<uint32_t>(region),
                              regions[peer][region].first, regions[peer][region].second);
    }
  }
  proxy_->add_queue(ring);
  thread_->start();
}

RankProxy::Report RankProxy::stop() {
  thread_->stop();
  Report report;
  report.cuda_error = executor_->error();
  for (const ProxyError& e : thread_->take_errors()) report.errors.push_back(e.message);
  report.state = proxy_->state();
  return report;
}

std::vector<std::string> RankProxy::take_errors() {
  std::vector<std::string> errors;
  for (const ProxyError& e : thread_->take_errors()) {
    errors.push_back(std::string(proxy_error_name(e.kind)) + ": " + e.message);
  }
  return errors;
}

std::map<int32_t, TrafficCount> RankProxy::traffic(std::chrono::nanoseconds timeout) {
  if (!thread_->wait_drained(timeout)) {
    throw std::runtime_error(
        "traffic: the proxy did not deliver what was published within the timeout (is an op "
        "still running?)");
  }
  return proxy_->traffic();  // the thread's writes happen before its idle rounds (release)
}

std::string stop_and_describe(std::vector<std::unique_ptr<RankProxy>>& proxies) {
  std::string text;
  for (size_t r = 0; r < proxies.size(); ++r) {
    const RankProxy::Report report = proxies[r]->stop();
    text += "\n  rank " + std::to_string(r) + ": " + report.state;
    if (!report.cuda_error.empty()) text += "; cuda: " + report.cuda_error;
    for (const std::string& e : report.errors) text += "; " + e;
  }
  return text;
}

}  // namespace transport
}  // namespace jax_ep
