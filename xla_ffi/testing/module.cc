// nanobind module jax_ep._C_testing: what only tests use (bindings.h), built beside jax_ep._C
// and shipped with it, so that one build serves `pip install '.[test]'` and the tests alike;
// jax_ep itself never imports it (tests/test_layers.py checks).
#include <dlfcn.h>
#include <execinfo.h>
#include <nanobind/nanobind.h>
#include <signal.h>
#include <unistd.h>

#include "bindings.h"

namespace nb = nanobind;

namespace {

// A crash on a thread of ours (the proxies) shows no Python stack: print the native one, each
// frame as module+offset (for addr2line on the same build), then hand the signal to the handler
// installed before (Python's faulthandler prints the Python stacks and dies of it).
struct sigaction g_previous_handlers[NSIG];

void print_native_stack(int signal_number) {
  void* frames[64];
  const int count = backtrace(frames, 64);
  dprintf(STDERR_FILENO, "native crash: signal %d; stack, innermost first:\n", signal_number);
  for (int i = 0; i < count; ++i) {
    Dl_info info = {};
    if (dladdr(frames[i], &info) != 0 && info.dli_fname != nullptr) {
      dprintf(STDERR_FILENO, "  #%d %s+0x%lx %s\n", i, info.dli_fname,
              static_cast<unsigned long>(static_cast<char*>(frames[i]) -
                                         static_cast<char*>(info.dli_fbase)),
              info.dli_sname != nullptr ? info.dli_sname : "");
    } else {
      dprintf(STDERR_FILENO, "  #%d %p\n", i, frames[i]);
    }
  }
  sigaction(signal_number, &g_previous_handlers[signal_number], nullptr);
  raise(signal_number);
}

void print_native_stack_on_crash() {
  struct sigaction action = {};
  action.sa_handler = print_native_stack;
  sigemptyset(&action.sa_mask);
  for (int s : {SIGSEGV, SIGBUS, SIGILL, SIGFPE}) sigaction(s, &action, &g_previous_handlers[s]);
}

}  // namespace

NB_MODULE(_C_testing, m) {
  m.doc() = "jax_ep's test extension: bindings that only tests use (never imported by jax_ep)";
  m.def("print_native_stack_on_crash", &print_native_stack_on_crash,
        "On SIGSEGV, SIGBUS, SIGILL or SIGFPE print the native stack to stderr, then run the "
        "handler installed before (tests' child processes).");
  jax_ep::add_emulated_queue_functions(m);
  jax_ep::add_low_latency_transport_functions(m);
  jax_ep::add_emulated_transport_functions(m);
  jax_ep::add_layout_functions(m);
}
