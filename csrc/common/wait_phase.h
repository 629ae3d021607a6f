// The phases of the kernels' bounded waits, their names, and the record a wait that timed out
// leaves in host-mapped memory (sync.cuh writes it; the handlers and Buffer.errors() read it).
#pragma once

#include <cstddef>
#include <cstdint>

namespace jax_ep {

// Which wait timed out. Values are stable; their names: wait_phase_name.
enum class WaitPhase : int32_t {
  kNone = 0,
  kDispatchCounts = 1,   // normal dispatch: waiting for a peer's per-rank counts
  kDispatchArrival = 2,  // normal dispatch: waiting for a peer's "rows written" flag
  kCombineBarrier = 3,   // normal combine / cached dispatch: waiting for a peer to enter
  kCombineArrival = 4,   // normal combine / cached dispatch: waiting for a peer's rows
  kLowLatencyDispatchRecv = 5,
  kLowLatencyCombineRecv = 6,
  kDispatchCredit = 7,  // normal dispatch of several rounds: waiting for a peer to free slots
  kCombineCredit = 8,   // normal combine of several rounds: waiting for a peer to free slots
  kLastPhase = kCombineCredit,  // _C.wait_phase_names() lists phases up to this one
};

// The one spelling of each wait phase, by value: timeout errors of the handlers and, through
// _C.wait_phase_names(), of Python.
inline constexpr const char* kWaitPhaseNames[] = {
    "none",                             // kNone
    "dispatch count exchange",          // kDispatchCounts
    "dispatch arrival",                 // kDispatchArrival
    "combine/cached-dispatch barrier",  // kCombineBarrier
    "combine/cached-dispatch arrival",  // kCombineArrival
    "low-latency dispatch receive",     // kLowLatencyDispatchRecv
    "low-latency combine receive",      // kLowLatencyCombineRecv
    "dispatch window credit",           // kDispatchCredit
    "combine window credit",            // kCombineCredit
};
static_assert(sizeof(kWaitPhaseNames) / sizeof(kWaitPhaseNames[0]) ==
                  static_cast<size_t>(WaitPhase::kLastPhase) + 1,
              "one name per wait phase");

inline const char* wait_phase_name(int32_t phase) {
  return phase >= 0 && phase <= static_cast<int32_t>(WaitPhase::kLastPhase) ? kWaitPhaseNames[phase]
                                                                            : "unknown";
}

// Written by a kernel (plain stores + __threadfence_system) into host-mapped memory before it
// traps, so the host can name the culprit even after the CUDA context is lost.
struct TimeoutRecord {
  int32_t timed_out;  // 1 once a wait expired
  int32_t rank;       // the waiting rank
  int32_t peer;       // the rank it waited for
  int32_t phase;      // WaitPhase
  uint64_t seq;       // the call's sequence number (per mode)
};

}  // namespace jax_ep
