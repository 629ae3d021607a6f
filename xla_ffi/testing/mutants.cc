// Protocol mutants under the ops (transport/mutant.h): a test makes the put-protocol kernels of a
// Buffer's ops break one rule, so that it shows the emulated transport catches it
// (tests/test_device_transport.py, through tests/multiprocess_digest.py). The mutant is set on
// the Buffer's rank contexts after creation, before its first op: jax_ep._C's registry holds
// them, reached through its capsule (runtime/registry.h, RuntimeApi).
#include <Python.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "bindings.h"
#include "runtime/registry.h"
#include "transport/mutant.h"

namespace nb = nanobind;

namespace jax_ep {
namespace {

// Why `mutant` cannot run under the ops of a Buffer over `device_transport` (with or without the
// low-latency regions), or "".
std::string mutant_problem(transport::Mutant mutant, DeviceTransport device_transport,
                           bool low_latency) {
  if (mutant == transport::Mutant::kNone) return "";
  if (device_transport == DeviceTransport::kStores) {
    return "a protocol mutant breaks the put-protocol kernels of a device transport: set "
           "JAX_EP_DEVICE_TRANSPORT too";
  }
  if (device_transport != DeviceTransport::kEmulated) {
    // Over the others, unregistered_source would index the region table past its end.
    return "a protocol mutant is for the emulated transport, which must catch it: set "
           "JAX_EP_DEVICE_TRANSPORT=emulated";
  }
  if (mutant == transport::Mutant::kNoFence && !low_latency) {
    return "the protocol mutant no_fence breaks the low-latency put-protocol kernels only (the "
           "normal kernels issue no fence): create the Buffer with low_latency=True";
  }
  return "";
}

std::vector<std::string> mutant_names() {
  std::vector<std::string> names;
  for (const auto& [name, mutant] : transport::detail::kMutantNames) names.push_back(name);
  return names;
}

void check_transport_mutant(const std::string& name, int device_transport, bool low_latency) {
  const std::string problem = mutant_problem(
      transport::mutant_named(name), static_cast<DeviceTransport>(device_transport), low_latency);
  if (!problem.empty()) throw nb::value_error(problem.c_str());
}

// jax_ep._C's registry (this module's own copy of the runtime holds no Buffer).
const RuntimeApi& runtime_api() {
  nb::object capsule = nb::module_::import_("jax_ep._C").attr(kRuntimeApiAttribute);
  const void* pointer = PyCapsule_GetPointer(capsule.ptr(), kRuntimeApiName);
  if (pointer == nullptr) throw nb::python_error();
  const RuntimeApi& api = *static_cast<const RuntimeApi*>(pointer);
  if (api.rank_context_bytes != sizeof(RankContext)) {
    throw std::runtime_error("jax_ep._C and jax_ep._C_testing come from different builds");
  }
  return api;
}

void set_transport_mutant(int64_t buffer_id, const std::string& name) {
  const transport::Mutant mutant = transport::mutant_named(name);
  const RuntimeApi& api = runtime_api();
  std::vector<RankContext*> contexts(api.rank_contexts(buffer_id, nullptr, 0));
  if (contexts.empty()) {
    throw nb::value_error(("no jax_ep Buffer with id " + std::to_string(buffer_id)).c_str());
  }
  api.rank_contexts(buffer_id, contexts.data(), static_cast<int>(contexts.size()));
  const BufferConfig& config = contexts[0]->config;
  const std::string problem = mutant_problem(mutant, config.device_transport, config.low_latency);
  if (!problem.empty()) throw nb::value_error(problem.c_str());
  for (RankContext* ctx : contexts) ctx->transport_mutant = mutant;
}

}  // namespace

void add_mutant_functions(nb::module_& m) {
  m.def("mutant_names", &mutant_names, "Every protocol mutant's name, 'none' first.");
  m.def("check_transport_mutant", &check_transport_mutant, nb::arg("mutant"),
        nb::arg("device_transport"), nb::arg("low_latency"),
        "Raises ValueError when `mutant` cannot run under the ops of a Buffer over "
        "`device_transport` (BufferConfig's number: 0 stores, 1 mapped, 2 emulated, 3 nvshmem), "
        "naming why; an unknown name is a ValueError naming the known ones.");
  m.def("set_transport_mutant", &set_transport_mutant, nb::arg("buffer_id"), nb::arg("mutant"),
        "Makes the put-protocol kernels of the ops of Buffer `buffer_id` (its ranks in this "
        "process) break one rule of the protocol (transport/mutant.h), from its next op on: "
        "right after creation, before any op. Checked as check_transport_mutant.");
}

}  // namespace jax_ep
