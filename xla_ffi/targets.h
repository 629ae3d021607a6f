// What each handler file contributes to the nanobind module.
#pragma once

#include <nanobind/nanobind.h>

namespace jax_ep {

// Adds "jax_ep_<op>_v2" -> capsule entries (normal_handlers.cc).
void add_normal_targets(nanobind::dict& targets);
// Adds the low-latency targets, fused ops and send/receive halves (low_latency_handlers.cc).
void add_low_latency_targets(nanobind::dict& targets);
// create_buffer / destroy_buffer / read_errors / workspace_bytes ... (runtime_bindings.cc).
void add_runtime_functions(nanobind::module_& m);
// EmulatedQueueForTests and the ring stress test: the transport's host proxy on CPU
// (transport_bindings.cc).
void add_transport_test_functions(nanobind::module_& m);

}  // namespace jax_ep
