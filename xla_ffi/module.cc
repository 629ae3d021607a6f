// nanobind module jax_ep._C: FFI target registrations and the host-side Buffer lifecycle.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "targets.h"

namespace nb = nanobind;

NB_MODULE(_C, m) {
  m.doc() = "jax_ep CUDA extension: XLA FFI handlers and the device runtime";
  m.def(
      "registrations",
      []() {
        nb::dict targets;
        jax_ep::add_normal_targets(targets);
        jax_ep::add_low_latency_targets(targets);
        return targets;
      },
      "FFI target name -> PyCapsule of the handler (register with platform='CUDA').");
  m.def(
      "cuda_architectures", []() { return std::string(JAX_EP_CUDA_ARCHS); },
      "The CMAKE_CUDA_ARCHITECTURES this module was built for, e.g. '90'.");
  jax_ep::add_runtime_functions(m);
}
