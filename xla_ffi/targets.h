// The FFI targets each handler file contributes, and the other parts of the nanobind module.
#pragma once

#include <nanobind/nanobind.h>

#include <vector>

// The XLA custom-call target of an op: "jax_ep_<op>_<version>". Bump the version whenever an
// operand, result, attribute or semantic changes: a program (or a persistent-cache entry)
// compiled against another version then fails to find its target instead of running the wrong
// kernel. Python reads the names from _C.target_names(), never spells them itself.
#define EP_TARGET_VERSION "v2"
#define EP_TARGET_NAME(op) "jax_ep_" op "_" EP_TARGET_VERSION

namespace jax_ep {

// One FFI target: the op as Python calls it ("layout"), its target name, its handler.
struct FfiTarget {
  const char* op;
  const char* name;
  void* handler;
};

#define EP_FFI_TARGET(op, handler) \
  ::jax_ep::FfiTarget { op, EP_TARGET_NAME(op), reinterpret_cast<void*>(handler) }

// Every op has two targets of one handler (EP_DEFINE_HANDLERS, common.h): "<op>", which XLA may
// capture in a command buffer (a CUDA graph on its compute stream), and "<op>_async", which
// launches the op on the Buffer's side stream and returns; the "wait" target joins it
// (side_stream.h).
#define EP_ADD_TARGETS(targets, op, handler)                         \
  do {                                                               \
    (targets).push_back(EP_FFI_TARGET(op, handler));                 \
    (targets).push_back(EP_FFI_TARGET(op "_async", handler##Async)); \
  } while (0)

// The normal mode's targets (normal_handlers.cc).
void add_normal_targets(std::vector<FfiTarget>& targets);
// The low-latency targets, fused ops and send/receive halves (low_latency_handlers.cc).
void add_low_latency_targets(std::vector<FfiTarget>& targets);
// The "wait" target of the asynchronous ops (side_stream.cc).
void add_side_stream_targets(std::vector<FfiTarget>& targets);
// release_side_streams (side_stream.cc).
void add_side_stream_functions(nanobind::module_& m);
// create_buffer / destroy_buffer / read_errors / workspace_bytes ... (runtime_bindings.cc).
void add_runtime_functions(nanobind::module_& m);
// The kernels' constants Python reads instead of copying: wait phases, rank limit, fp8 scale
// block (fact_bindings.cc).
void add_fact_functions(nanobind::module_& m);

}  // namespace jax_ep
