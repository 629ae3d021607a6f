// The executor of the CPU tests: "peers' regions" are host buffers, every operation is a
// synchronous memcpy, so issue order is landing order and complete() has nothing to wait for.
#pragma once

#include <cstdint>
#include <cstring>

#include "transport/emulator/executor.h"

namespace jax_ep {
namespace transport {

class HostMemcpyExecutor final : public TransportExecutor {
 public:
  void copy(void* dst, const void* src, uint64_t bytes) override { std::memmove(dst, src, bytes); }
  void write_signal(uint64_t* dst, uint64_t value) override {
    __atomic_store_n(dst, value, __ATOMIC_RELEASE);
  }
  void read(void* host_dst, const void* src, uint64_t bytes) override {
    std::memcpy(host_dst, src, bytes);
  }
  void complete() override {}
};

}  // namespace transport
}  // namespace jax_ep
