#include "transport/emulator/proxy_thread.h"

#include <algorithm>

namespace jax_ep {
namespace transport {
namespace {

// Deliveries per round between polls, so that new commands are seen while old ones drain.
constexpr int kStepsPerRound = 64;
// Idle that long, the thread sleeps between rounds instead of spinning, each sleep twice the
// one before up to the longest: a Buffer between calls should not hold a core (tests run 32
// ranks of several Buffers each on 16 cores; an idle thread that woke every 50 us took a tenth
// of one), and a kernel's first command then waits at most one sleep.
constexpr auto kSpinBeforeSleeping = std::chrono::milliseconds(1);
constexpr auto kFirstSleep = std::chrono::microseconds(50);
constexpr auto kLongestSleep = std::chrono::microseconds(2000);

}  // namespace

void ProxyThread::start() {
  if (running()) return;
  stop_requested_.store(false, std::memory_order_relaxed);
  thread_ = std::thread([this] { loop(); });
}

void ProxyThread::stop() {
  if (!running()) return;
  stop_requested_.store(true, std::memory_order_release);
  thread_.join();
  publish_errors();  // anything found in the last round
}

void ProxyThread::loop() {
  auto idle_since = std::chrono::steady_clock::now();
  std::chrono::microseconds sleep = kFirstSleep;
  while (true) {
    // Read before the poll: a stop requested after a publish sees that publish polled here.
    const bool stopping = stop_requested_.load(std::memory_order_acquire);
    const uint64_t polled = proxy_->poll();
    int steps = 0;
    while (steps < kStepsPerRound && proxy_->step()) ++steps;
    publish_errors();
    if (polled > 0 || steps > 0 || !proxy_->idle()) {
      idle_since = std::chrono::steady_clock::now();
      sleep = kFirstSleep;
      continue;
    }
    idle_rounds_.fetch_add(1, std::memory_order_release);
    if (stopping) return;
    if (std::chrono::steady_clock::now() - idle_since < kSpinBeforeSleeping) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(sleep);
      sleep = std::min(2 * sleep, kLongestSleep);
    }
  }
}

void ProxyThread::publish_errors() {
  const std::vector<ProxyError>& found = proxy_->errors();
  if (found.size() == errors_published_) return;
  std::lock_guard<std::mutex> lock(errors_mutex_);
  errors_.insert(errors_.end(), found.begin() + static_cast<std::ptrdiff_t>(errors_published_),
                 found.end());
  errors_published_ = found.size();
}

bool ProxyThread::wait_drained(std::chrono::nanoseconds timeout) {
  if (!running()) return false;
  const uint64_t start = idle_rounds_.load(std::memory_order_acquire);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (idle_rounds_.load(std::memory_order_acquire) < start + 2) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
  return true;
}

std::vector<ProxyError> ProxyThread::take_errors() {
  std::lock_guard<std::mutex> lock(errors_mutex_);
  std::vector<ProxyError> taken;
  taken.swap(errors_);
  return taken;
}

}  // namespace transport
}  // namespace jax_ep
