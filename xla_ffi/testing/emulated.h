// The emulated transport of the test module (emulated_kernels.cu, emulated_transport.cc): its
// put-protocol kernels, which jax_ep._C launches for JAX_EP_DEVICE_TRANSPORT=emulated once
// register_emulated_transport() has handed it the table, and the tests launch directly
// (low_latency_transport.cc).
#pragma once

#include "kernels/put_plugin.h"

namespace jax_ep {

// The table of the emulated transport's kernels (launches and preload; no host side).
PutPlugin emulated_put_kernels();

}  // namespace jax_ep
