// What the host proxy needs from whoever moves the bytes: the proxy decides what is delivered
// when; an executor only performs it. The same proxy runs over host memcpy in the CPU tests
// (host_memcpy_executor.h) and over copy-engine copies on the GPU (cuda_copy_executor.h).
#pragma once

#include <cstdint>

namespace jax_ep {
namespace transport {

class TransportExecutor {
 public:
  virtual ~TransportExecutor() = default;
  // Delivers `bytes` from src to dst. May return before the bytes land, but copies and signal
  // writes must land in the order they were issued (one stream): the proxy relies on it to put
  // a signal after its data.
  virtual void copy(void* dst, const void* src, uint64_t bytes) = 0;
  // Writes one signal word (8 bytes, aligned) after every earlier copy.
  virtual void write_signal(uint64_t* dst, uint64_t value) = 0;
  // Reads memory into host memory now (source snapshots and their checks, a signal's start).
  virtual void read(void* host_dst, const void* src, uint64_t bytes) = 0;
  // Returns when everything issued so far has landed (before a quiet is acknowledged).
  virtual void complete() = 0;
};

}  // namespace transport
}  // namespace jax_ep
