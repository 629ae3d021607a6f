// Protocol mutants: each breaks one rule of docs/transport.md ("The ordering contract the kernels
// must follow") on purpose, so that a GPU test can show the emulated transport catches it (a
// surviving mutant means the emulator is too weak); lost_signals is a network fault instead,
// for the bounded waits to end in an error naming the rank waited for. Only the emulated
// transport carries one (emulated_transport.cuh; the rank's EmulatedQueue), and only the test
// module jax_ep._C_testing builds that: jax_ep._C's kernels have no mutant (device_transport.cuh,
// keeps()).
#pragma once

#include <cstdint>
#if !defined(__CUDA_ARCH__)
#include <stdexcept>
#include <string>
#include <utility>
#endif

namespace jax_ep {
namespace transport {

enum class Mutant : int32_t {
  kNone = 0,
  kNoFence = 1,             // a signal may overtake the puts it is meant to cover (rule 2)
  kSignalBeforeData = 2,    // a signal is sent before its puts (rule 2)
  kReuseBeforeQuiet = 3,    // a send slot is rewritten before the quiet that covers it (rule 3)
  kUnregisteredSource = 4,  // puts name a source region nobody registered (rule 1)
  kNoFinalQuiet = 5,        // a send half ends without the quiet that covers its puts (rule 3)
  // Not a broken rule but a network fault: no signal of this rank to another rank lands (its
  // puts do), as from a link or a host that died. The receivers' bounded waits must end.
  kLostSignals = 6,
};
// kNoFinalQuiet shows only with a launch per rank (the ops under JAX_EP_DEVICE_TRANSPORT, one
// process per rank): a launch of every rank ends only once every rank has received everything,
// so its puts have landed. With a launch per rank, the next call restages a source that the
// transport may still be reading.

#if !defined(__CUDA_ARCH__)
namespace detail {
inline const std::pair<const char*, Mutant> kMutantNames[] = {
    {"none", Mutant::kNone},
    {"no_fence", Mutant::kNoFence},
    {"signal_before_data", Mutant::kSignalBeforeData},
    {"reuse_before_quiet", Mutant::kReuseBeforeQuiet},
    {"unregistered_source", Mutant::kUnregisteredSource},
    {"no_final_quiet", Mutant::kNoFinalQuiet},
    {"lost_signals", Mutant::kLostSignals}};
}  // namespace detail

inline Mutant mutant_named(const std::string& name) {
  std::string known;
  for (const auto& [mutant_name, mutant] : detail::kMutantNames) {
    if (name == mutant_name) return mutant;
    known += known.empty() ? mutant_name : std::string(", ") + mutant_name;
  }
  throw std::invalid_argument("mutant must be one of " + known + ", not '" + name + "'");
}
#endif

// A region id that no rank registers (kUnregisteredSource's puts name it).
constexpr uint32_t kUnregisteredRegion = 7;

}  // namespace transport
}  // namespace jax_ep
