// A HostProxy on a thread of its own, as it runs next to one rank's kernels: the thread polls
// the rings and delivers until stop(); the rank's other threads wait for it to drain and take
// the errors it found (for Buffer.check()). Regions, queues and options are set up before
// start(); from start() to stop() only this thread touches the HostProxy.
#pragma once

#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>
#include <vector>

#include "transport/emulator/host_proxy.h"

namespace jax_ep {
namespace transport {

class ProxyThread {
 public:
  // `proxy` is not owned and must outlive this object.
  explicit ProxyThread(HostProxy* proxy) : proxy_(proxy) {}
  ~ProxyThread() { stop(); }
  ProxyThread(const ProxyThread&) = delete;
  ProxyThread& operator=(const ProxyThread&) = delete;

  void start();
  // Delivers every command published before the call, then joins the thread. Idempotent.
  void stop();
  bool running() const { return thread_.joinable(); }
  // True once every command published before the call has been delivered (quiets
  // acknowledged); false if that takes longer than `timeout` or the thread is not running.
  bool wait_drained(std::chrono::nanoseconds timeout);
  // The errors found since the last call, each returned once.
  std::vector<ProxyError> take_errors();

 private:
  void loop();
  void publish_errors();

  HostProxy* proxy_;
  std::thread thread_;
  std::atomic<bool> stop_requested_{false};
  // Rounds that found the rings empty and nothing pending: a waiter that sees this advance by
  // two knows a whole such round started after it began waiting.
  std::atomic<uint64_t> idle_rounds_{0};
  std::mutex errors_mutex_;
  std::vector<ProxyError> errors_;  // found, not yet taken
  size_t errors_published_ = 0;     // of proxy_->errors(); the thread's while it runs
};

}  // namespace transport
}  // namespace jax_ep
