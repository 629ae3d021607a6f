// The parts of the test extension module jax_ep._C_testing (module.cc), one function per file.
// What only tests use lives here, not in the user's jax_ep._C: the device transports' host proxy
// on CPU and their probe on a GPU, the low-latency put-protocol kernels with every rank on one
// GPU, the emulated transport under the ops with its protocol mutants (handed to jax_ep._C on
// request), and the kernels' host arithmetic. Tests import it; jax_ep never does.
#pragma once

#include <nanobind/nanobind.h>

namespace jax_ep {

// EmulatedQueueForTests, transport_ring_stress, transport_probe (emulated_queue.cc).
void add_emulated_queue_functions(nanobind::module_& m);
// LowLatencyTransportForTests, low_latency_transport_layout (low_latency_transport.cc).
void add_low_latency_transport_functions(nanobind::module_& m);
// register_emulated_transport, mutant_names, check_transport_mutant, set_transport_mutant,
// transport_traffic (emulated_transport.cc).
void add_emulated_transport_functions(nanobind::module_& m);
// low_latency_layout, fast_divide (layouts.cc).
void add_layout_functions(nanobind::module_& m);

}  // namespace jax_ep
