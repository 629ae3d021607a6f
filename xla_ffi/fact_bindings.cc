// The kernels' constants, exported so that Python reads them instead of keeping a copy (the
// host half of their shared arithmetic is the test module's: xla_ffi/testing/layouts.cc).
#include <nanobind/nanobind.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <vector>

#include "common.h"
#include "kernels/api.h"
#include "targets.h"

namespace nb = nanobind;

namespace jax_ep {

void add_fact_functions(nb::module_& m) {
  m.def(
      "wait_phase_names",
      []() {
        nb::dict names;
        for (int32_t phase = 0; phase <= static_cast<int32_t>(WaitPhase::kLastPhase); ++phase) {
          names[nb::int_(phase)] = wait_phase_name(phase);
        }
        return names;
      },
      "WaitPhase value -> its name, as timeout records report it (read_errors).");
  m.def(
      "max_ranks", []() { return kMaxRanks; },
      "Most ranks in one EP group (kMaxRanks; per-peer tables are sized by the group's R).");
  // The reference backend needs these too, so Python keeps its own constants
  // (jax_ep.buffer.MAX_TOPK, MAX_LOW_LATENCY_HIDDEN, ERROR_COUNTERS: the public errors() keys);
  // tests/test_facts.py checks that they agree.
  m.def(
      "max_topk", []() { return kMaxTopk; },
      "Most top-k slots per token: the kernels keep a token's ids one per lane (kMaxTopk).");
  m.def(
      "max_low_latency_hidden", []() { return kMaxLowLatencyHidden; },
      "Most channels per token in low-latency mode: the dispatch stages a token in shared memory.");
  m.def(
      "error_counter_names",
      []() {
        nb::list names;
        for (const ErrorCounterField& counter : kErrorCounterFields) names.append(counter.name);
        return names;
      },
      "The error counters read_errors reports, in the order of ErrorCounters.");
  // The reference backend needs this one too, so Python keeps its own constant
  // (jax_ep.fp8.CHANNELS_PER_SCALE); tests/test_build.py checks that the two agree.
  m.def(
      "channels_per_scale", []() { return kChannelsPerScale; },
      "Channels per float32 scale of fp8 inputs (kChannelsPerScale).");
}

}  // namespace jax_ep
