// Protocol mutants: each breaks one rule of docs/transport.md ("The ordering contract the kernels
// must follow") on purpose, so that a GPU test can show the emulated transport catches it (a
// surviving mutant means the emulator is too weak). Kernels take one as a launch argument; it
// is kNone outside those tests.
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
};
// (A kernel that ends without its last quiet is no mutant here: the GPU tests run every rank in
// one launch, which ends only once every rank has received everything, so its puts have landed.
// The dropped quiet they catch is the one before a send slot is reused: kReuseBeforeQuiet.)

#if !defined(__CUDA_ARCH__)
inline Mutant mutant_named(const std::string& name) {
  static const std::pair<const char*, Mutant> kNames[] = {
      {"none", Mutant::kNone},
      {"no_fence", Mutant::kNoFence},
      {"signal_before_data", Mutant::kSignalBeforeData},
      {"reuse_before_quiet", Mutant::kReuseBeforeQuiet},
      {"unregistered_source", Mutant::kUnregisteredSource}};
  for (const auto& [mutant_name, mutant] : kNames) {
    if (name == mutant_name) return mutant;
  }
  throw std::invalid_argument(
      "mutant must be none, no_fence, signal_before_data, "
      "reuse_before_quiet or unregistered_source, not '" +
      name + "'");
}
#endif

// A region id that no rank registers (kUnregisteredSource's puts name it).
constexpr uint32_t kUnregisteredRegion = 7;

}  // namespace transport
}  // namespace jax_ep
