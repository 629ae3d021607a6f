// The emulated transport under the ops (JAX_EP_DEVICE_TRANSPORT=emulated), which only the test
// module carries: its table of put-protocol kernels (emulated_kernels.cu) with its host side (a
// ring, queue record and host proxy per rank), exported as jax_ep._C's transport tables are
// (kernels/put_plugin.h, kPutPluginSymbol) and handed to jax_ep._C by
// register_emulated_transport(); and the protocol mutants a test sets on a Buffer's ranks
// (transport/emulator/mutant.h), each breaking one rule so that the test shows the emulator
// catches it (tests/test_device_transport.py, through tests/multiprocess_digest.py); and what
// the proxies delivered (transport_traffic: benchmarks/traffic_counts.py).
//
// jax_ep._C owns the Buffers (its registry); this module owns the emulated ranks it starts for
// them, keyed by Buffer id, which is how set_transport_mutant finds a Buffer's ranks.
#include <dlfcn.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <exception>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "bindings.h"
#include "emulated.h"
#include "kernels/api.h"
#include "traffic_rows.h"
#include "transport/emulator/emulated_ranks.h"
#include "transport/emulator/mutant.h"

namespace nb = nanobind;

namespace jax_ep {
namespace {

// Commands in a rank's ring before its warps wait for the proxy.
constexpr uint64_t kEmulatorRingCapacity = 4096;

// One local rank of a Buffer over the emulated transport. Members go in reverse order: the proxy
// thread stops before the ring and the queue record are freed.
struct EmulatedRank {
  int64_t buffer_id = 0;
  int rank = 0;  // in the Buffer's EP group
  int device = 0;
  bool low_latency = false;
  transport::DeviceArena arena;
  transport::EmulatedQueue* queue = nullptr;  // device memory
  std::unique_ptr<transport::RankProxy> proxy;
};

std::mutex ranks_mutex;
std::vector<EmulatedRank*> live_ranks;  // guarded by ranks_mutex

// PutPlugin::start_rank: the rank's ring, queue record and proxy, which registers every rank's
// regions (an area the Buffer lacks is registered empty, so a command into it is reported).
int start_rank(int64_t buffer_id, const RankContext* ctx, char* const* region_table,
               const uint64_t* region_bytes, void** rank_out, const void** queue_out, char* error,
               size_t error_bytes) {
  try {
    const BufferConfig& config = ctx->config;
    std::vector<std::vector<std::pair<void*, uint64_t>>> regions(config.num_ranks);
    for (int r = 0; r < config.num_ranks; ++r) {
      for (int region = 0; region < kTransportRegions; ++region) {
        regions[r].emplace_back(region_table[kTransportRegions * r + region], region_bytes[region]);
      }
    }
    transport::ProxyOptions options;  // adversarial, as docs/transport.md describes
    options.ordering = transport::Ordering::kUnordered;
    options.seed = config.emulator_seed + static_cast<uint64_t>(ctx->rank);
    options.chunk_bytes = 1024;
    options.max_delay_steps = 4;
    options.snapshot_sources = true;
    options.log_deliveries = false;
    auto rank = std::make_unique<EmulatedRank>();
    rank->buffer_id = buffer_id;
    rank->rank = ctx->rank;
    rank->device = ctx->device;
    rank->low_latency = config.low_latency;
    transport::check_cuda(cudaSetDevice(ctx->device), "cudaSetDevice");
    // An acknowledgement word per issuing warp (each needs its own while it may run).
    uint32_t normal_first_warp = 0;
    const uint32_t num_warps = transport_warps(*ctx, &normal_first_warp);
    const transport::RingView ring =
        transport::make_ring(rank->arena, kEmulatorRingCapacity, num_warps);
    rank->queue = transport::make_queue(rank->arena, ring, transport::Mutant::kNone);
    rank->proxy = std::make_unique<transport::RankProxy>(ctx->rank, options, ring, regions);
    *queue_out = rank->queue;
    std::lock_guard<std::mutex> lock(ranks_mutex);
    live_ranks.push_back(rank.get());
    *rank_out = rank.release();
    return 0;
  } catch (const std::exception& e) {
    std::snprintf(error, error_bytes, "%s", e.what());
    return 1;
  }
}

// PutPlugin::stop_rank: after the rank's device is idle.
void stop_rank(void* state) {
  EmulatedRank* rank = static_cast<EmulatedRank*>(state);
  {
    std::lock_guard<std::mutex> lock(ranks_mutex);
    live_ranks.erase(std::remove(live_ranks.begin(), live_ranks.end(), rank), live_ranks.end());
  }
  delete rank;
}

// PutPlugin::take_errors.
void take_errors(void* state, void (*sink)(void*, const char*), void* context) {
  for (const std::string& e : static_cast<EmulatedRank*>(state)->proxy->take_errors()) {
    sink(context, e.c_str());
  }
}

const PutPlugin* emulated_put_plugin() {
  static const PutPlugin plugin = [] {
    PutPlugin table = emulated_put_kernels();
    table.start_rank = &start_rank;
    table.stop_rank = &stop_rank;
    table.take_errors = &take_errors;
    return table;
  }();
  return &plugin;
}

// Hands this module's table to jax_ep._C: _C loads this module's shared library (already loaded:
// the same handle) and reads its kPutPluginSymbol, as it loads the NVSHMEM plugin.
void register_emulated_transport() {
  Dl_info info = {};
  if (dladdr(reinterpret_cast<void*>(&register_emulated_transport), &info) == 0 ||
      info.dli_fname == nullptr) {
    throw std::runtime_error("jax_ep._C_testing: cannot find the path of its own library");
  }
  nb::module_::import_("jax_ep._C").attr("transport_plugin_load")(std::string(info.dli_fname));
}

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
    // Only the emulated transport carries a mutant (jax_ep._C's kernels have none).
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

// The ranks of Buffer `buffer_id` in this process; the caller holds ranks_mutex. Raises
// ValueError, saying what `what` needs, when there are none.
std::vector<EmulatedRank*> ranks_of(int64_t buffer_id, const char* what) {
  std::vector<EmulatedRank*> ranks;
  for (EmulatedRank* rank : live_ranks) {
    if (rank->buffer_id == buffer_id) ranks.push_back(rank);
  }
  if (ranks.empty()) {
    throw nb::value_error(("no jax_ep Buffer with id " + std::to_string(buffer_id) +
                           " runs over the emulated transport in this process (" + what +
                           " is the emulated transport's: set JAX_EP_DEVICE_TRANSPORT=emulated "
                           "and register_emulated_transport() before creating the Buffer)")
                              .c_str());
  }
  return ranks;
}

void set_transport_mutant(int64_t buffer_id, const std::string& name) {
  const transport::Mutant mutant = transport::mutant_named(name);
  std::lock_guard<std::mutex> lock(ranks_mutex);
  const std::vector<EmulatedRank*> ranks = ranks_of(buffer_id, "a protocol mutant");
  const std::string problem =
      mutant_problem(mutant, DeviceTransport::kEmulated, ranks[0]->low_latency);
  if (!problem.empty()) throw nb::value_error(problem.c_str());
  for (EmulatedRank* rank : ranks) {
    transport::check_cuda(cudaSetDevice(rank->device), "cudaSetDevice");
    transport::set_queue_mutant(rank->queue, mutant);
  }
}

// What the proxies of Buffer `buffer_id`'s ranks in this process delivered since the Buffer was
// made: a dict per (rank, destination) it sent to, ranks of the Buffer's EP group.
nb::list transport_traffic(int64_t buffer_id, double timeout_s) {
  const auto timeout = std::chrono::duration_cast<std::chrono::nanoseconds>(
      std::chrono::duration<double>(timeout_s));
  std::lock_guard<std::mutex> lock(ranks_mutex);
  nb::list rows;
  for (EmulatedRank* rank : ranks_of(buffer_id, "traffic")) {
    append_traffic_rows(rows, rank->rank, rank->proxy->traffic(timeout));
  }
  return rows;
}

}  // namespace

void add_emulated_transport_functions(nb::module_& m) {
  m.def("register_emulated_transport", &register_emulated_transport,
        "Hands the emulated transport (its put-protocol kernels and host proxies) to jax_ep._C, "
        "so that Buffers made after it may run over JAX_EP_DEVICE_TRANSPORT=emulated. Once per "
        "process; again is harmless.");
  m.def("mutant_names", &mutant_names, "Every protocol mutant's name, 'none' first.");
  m.def("check_transport_mutant", &check_transport_mutant, nb::arg("mutant"),
        nb::arg("device_transport"), nb::arg("low_latency"),
        "Raises ValueError when `mutant` cannot run under the ops of a Buffer over "
        "`device_transport` (BufferConfig's number: 0 stores, 1 mapped, 2 emulated, 3 nvshmem), "
        "naming why; an unknown name is a ValueError naming the known ones.");
  m.def("set_transport_mutant", &set_transport_mutant, nb::arg("buffer_id"), nb::arg("mutant"),
        "Makes the put-protocol kernels of the ops of Buffer `buffer_id` (its ranks in this "
        "process, over the emulated transport) break one rule of the protocol "
        "(transport/emulator/mutant.h), from its next op on: right after creation, before any "
        "op. Checked as check_transport_mutant.");
  m.def("transport_traffic", &transport_traffic, nb::arg("buffer_id"), nb::arg("timeout_s") = 60.0,
        "What the emulated transport's proxies delivered for Buffer `buffer_id`'s ranks in this "
        "process since it was made: [{src, dst, puts, bytes, signals}], src and dst ranks of its "
        "EP group (EmulatedQueueForTests.traffic()'s format). Call between ops (after their "
        "results are ready); waits up to `timeout_s` for the proxies to drain. Subtract an "
        "earlier reading for the traffic of the ops in between.");
}

}  // namespace jax_ep

// The table jax_ep._C reads from this module's library (kernels/put_plugins.cc).
extern "C" __attribute__((visibility("default"))) const jax_ep::PutPlugin* jax_ep_put_plugin() {
  return jax_ep::emulated_put_plugin();
}
