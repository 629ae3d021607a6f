// jax_ep._C_testing.EmulatedQueueForTests: the host proxy of the emulated transport over host
// memory, for the CPU tests of its queue logic (tests/test_transport_emulator.py). Python stands
// in for the kernels: it pushes commands into the same rings, with the same layout, as the
// device side of EmulatedTransport does, and numpy arrays stand in for every rank's registered
// regions. The proxy runs either step by step from Python or on its own thread (ProxyThread), as
// it does next to the kernels. jax_ep._C_testing.transport_probe: the same proxy behind real
// kernels on a GPU (probe.h; tests/test_transport_gpu.py).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "bindings.h"
#include "probe.h"
#include "traffic_rows.h"
#include "transport/emulator/command_ring.h"
#include "transport/emulator/host_memcpy_executor.h"
#include "transport/emulator/host_proxy.h"
#include "transport/emulator/proxy_thread.h"

namespace nb = nanobind;

namespace jax_ep {
namespace {

using transport::CommandOp;
using transport::HostProxy;
using transport::RingView;
using transport::SignalOp;
using transport::TransportCommand;

using ByteArray = nb::ndarray<uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

// Host memory of one ring (all four parts host memory here; see RingView).
struct HostRing {
  HostRing(uint64_t capacity, uint32_t num_warps)
      : slots(capacity),
        acks(num_warps, 0),
        view{slots.data(), capacity, &reserve, &consumed, acks.data(), num_warps} {}
  std::vector<TransportCommand> slots;
  uint64_t reserve = 0;
  uint64_t consumed = 0;
  std::vector<uint64_t> acks;
  RingView view;
};

class EmulatedQueueForTests {
 public:
  EmulatedQueueForTests(int rank, int num_queues, uint64_t capacity, uint32_t num_warps,
                        const std::string& ordering, uint64_t seed, uint64_t chunk_bytes,
                        uint32_t max_delay_steps, bool snapshot_sources)
      : rank_(rank), num_warps_(num_warps), fence_pending_(num_warps, false) {
    if (num_queues < 1 || capacity == 0 || (capacity & (capacity - 1)) != 0) {
      throw std::invalid_argument("num_queues >= 1 and capacity a power of two");
    }
    if (chunk_bytes % 16 != 0) throw std::invalid_argument("chunk_bytes: a multiple of 16");
    transport::ProxyOptions options;
    options.ordering = transport::ordering_named(ordering);
    options.seed = seed;
    options.chunk_bytes = chunk_bytes;
    options.max_delay_steps = max_delay_steps;
    options.snapshot_sources = snapshot_sources;
    proxy_ = std::make_unique<HostProxy>(rank, options, &executor_);
    thread_ = std::make_unique<transport::ProxyThread>(proxy_.get());
    for (int q = 0; q < num_queues; ++q) {
      rings_.push_back(std::make_unique<HostRing>(capacity, num_warps));
      proxy_->add_queue(rings_.back()->view);
    }
  }

  void register_region(int rank, uint32_t region, ByteArray array, nb::handle owner) {
    proxy_->register_region(rank, region, array.data(), array.shape(0));
    owners_.push_back(nb::borrow(owner));  // the proxy writes into it until we are gone
  }

  uint64_t put(uint32_t warp, int peer, uint32_t dst_region, uint64_t dst_offset,
               uint32_t src_region, uint64_t src_offset, uint64_t bytes) {
    TransportCommand c = {};
    c.op = static_cast<uint32_t>(CommandOp::kPut);
    fill_put(c, peer, dst_region, dst_offset, src_region, src_offset, bytes);
    return push(warp, c);
  }

  uint64_t put_signal(uint32_t warp, int peer, uint32_t dst_region, uint64_t dst_offset,
                      uint32_t src_region, uint64_t src_offset, uint64_t bytes,
                      uint32_t signal_region, uint64_t signal_offset, uint64_t value, bool add) {
    TransportCommand c = {};
    c.op = static_cast<uint32_t>(CommandOp::kPutSignal);
    fill_put(c, peer, dst_region, dst_offset, src_region, src_offset, bytes);
    fill_signal(c, signal_region, signal_offset, value, add);
    return push(warp, c);
  }

  uint64_t signal(uint32_t warp, int peer, uint32_t signal_region, uint64_t signal_offset,
                  uint64_t value, bool add) {
    TransportCommand c = {};
    c.op = static_cast<uint32_t>(CommandOp::kSignal);
    c.peer = peer;
    fill_signal(c, signal_region, signal_offset, value, add);
    return push(warp, c);
  }

  // As the device's fence(): marks the warp's next command.
  void fence(uint32_t warp) { fence_pending_.at(warp) = true; }

  uint64_t quiet(uint32_t warp) {
    TransportCommand c = {};
    c.op = static_cast<uint32_t>(CommandOp::kQuiet);
    c.peer = rank_;
    return push(warp, c);
  }

  // What the device's quiet() spins on: acks[warp] >= position + 1.
  bool quiet_done(uint32_t warp, uint64_t position) const {
    const uint64_t ack = __atomic_load_n(&ring_of(warp).acks.at(warp), __ATOMIC_ACQUIRE);
    return ack >= position + 1;
  }

  uint64_t poll() { return stepping()->poll(); }
  bool step() { return stepping()->step(); }
  uint64_t run(uint64_t max_steps) { return stepping()->run_until_idle(max_steps); }
  bool idle() { return stepping()->idle(); }
  std::string state() { return stepping()->state(); }

  // The proxy on its own thread (ProxyThread): pushes keep going, poll/step/run are refused.
  void start_thread() { thread_->start(); }
  void stop_thread() {
    nb::gil_scoped_release release;
    thread_->stop();
  }
  bool thread_running() const { return thread_->running(); }
  bool wait_drained(double timeout_s) {
    nb::gil_scoped_release release;
    return thread_->wait_drained(std::chrono::nanoseconds(static_cast<int64_t>(timeout_s * 1e9)));
  }
  // (kind, queue, position, message) of the errors the thread found since the last call.
  std::vector<std::tuple<std::string, int, uint64_t, std::string>> take_errors() {
    return error_rows(thread_->take_errors());
  }

  // (kind, queue, position, warp, peer, offset, bytes, value); kind: data / signal / quiet_ack.
  std::vector<std::tuple<std::string, int, uint64_t, uint32_t, int, uint64_t, uint64_t, uint64_t>>
  deliveries() {
    static const char* kinds[] = {"data", "signal", "quiet_ack"};
    std::vector<std::tuple<std::string, int, uint64_t, uint32_t, int, uint64_t, uint64_t, uint64_t>>
        out;
    for (const transport::Delivery& d : stepping()->deliveries()) {
      out.emplace_back(kinds[d.kind], d.queue, d.position, d.warp, d.peer, d.offset, d.bytes,
                       d.value);
    }
    return out;
  }

  // One dict per destination rank the proxy delivered to since the last reset: src (this
  // rank), dst, puts (rows), bytes, signals (HostProxy::traffic()).
  nb::list traffic() {
    nb::list out;
    append_traffic_rows(out, rank_, stepping()->traffic());
    return out;
  }
  void reset_traffic() { stepping()->reset_traffic(); }

  // (kind, queue, position, message).
  std::vector<std::tuple<std::string, int, uint64_t, std::string>> errors() {
    return error_rows(stepping()->errors());
  }

 private:
  static std::vector<std::tuple<std::string, int, uint64_t, std::string>> error_rows(
      const std::vector<transport::ProxyError>& errors) {
    std::vector<std::tuple<std::string, int, uint64_t, std::string>> out;
    for (const transport::ProxyError& e : errors) {
      out.emplace_back(transport::proxy_error_name(e.kind), e.queue, e.position, e.message);
    }
    return out;
  }

  // The proxy, for calls from Python: only while no thread owns it.
  HostProxy* stepping() {
    if (thread_->running()) {
      throw std::logic_error("the proxy thread owns the proxy: stop_thread() first");
    }
    return proxy_.get();
  }

  static void fill_put(TransportCommand& c, int peer, uint32_t dst_region, uint64_t dst_offset,
                       uint32_t src_region, uint64_t src_offset, uint64_t bytes) {
    c.peer = peer;
    c.dst_region = dst_region;
    c.dst_offset = dst_offset;
    c.src_region = src_region;
    c.src_offset = src_offset;
    c.bytes = bytes;
  }

  static void fill_signal(TransportCommand& c, uint32_t region, uint64_t offset, uint64_t value,
                          bool add) {
    c.signal_region = region;
    c.signal_offset = offset;
    c.signal_value = value;
    c.signal_op = static_cast<uint32_t>(add ? SignalOp::kAdd : SignalOp::kSet);
  }

  HostRing& ring_of(uint32_t warp) const { return *rings_[warp % rings_.size()]; }

  uint64_t push(uint32_t warp, TransportCommand c) {
    if (warp >= num_warps_) throw std::out_of_range("warp beyond num_warps");
    c.warp = warp;
    if (fence_pending_[warp]) c.flags |= transport::kFenceBefore;
    fence_pending_[warp] = false;
    HostRing& ring = ring_of(warp);
    if (!thread_->running()) {
      // A full ring: the device would wait for the proxy; here nobody else runs it.
      while (ring.reserve - ring.consumed >= ring.view.capacity) proxy_->poll();
      return transport::host_push_command(ring.view, c);
    }
    nb::gil_scoped_release release;  // waits while the thread frees slots
    return transport::host_push_command(ring.view, c);
  }

  int rank_;
  uint32_t num_warps_;
  std::vector<bool> fence_pending_;
  transport::HostMemcpyExecutor executor_;
  std::vector<std::unique_ptr<HostRing>> rings_;
  std::unique_ptr<HostProxy> proxy_;
  std::vector<nb::object> owners_;
  // Last: destroyed first, so the thread stops before what it writes into goes away.
  std::unique_ptr<transport::ProxyThread> thread_;
};

// Producers on their own threads push `commands_per_producer` puts each through one small ring
// while the proxy runs on its ProxyThread: the ring's claim / publish / consume protocol under
// real concurrency, with wrap-around. Each put copies a distinct 16-byte source row to a
// distinct destination row. Returns the destination (as bytes) and the proxy's error count.
std::tuple<nb::bytes, uint64_t> ring_stress(int producers, uint64_t commands_per_producer,
                                            uint64_t capacity, uint64_t seed) {
  const uint64_t rows = producers * commands_per_producer;
  std::vector<uint8_t> src(rows * 16), dst(rows * 16, 0);
  for (uint64_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>((i * 131 + 7) >> 4);
  HostRing ring(capacity, static_cast<uint32_t>(producers));
  transport::HostMemcpyExecutor executor;
  transport::ProxyOptions options;
  options.seed = seed;
  options.log_deliveries = false;
  HostProxy proxy(0, options, &executor);
  proxy.register_region(0, 0, src.data(), src.size());
  proxy.register_region(1, 0, dst.data(), dst.size());
  proxy.add_queue(ring.view);
  {
    nb::gil_scoped_release release;
    transport::ProxyThread thread(&proxy);
    thread.start();
    std::vector<std::thread> threads;
    for (int p = 0; p < producers; ++p) {
      threads.emplace_back([&, p] {
        for (uint64_t i = 0; i < commands_per_producer; ++i) {
          const uint64_t row = i * producers + p;
          TransportCommand c = {};
          c.op = static_cast<uint32_t>(CommandOp::kPut);
          c.warp = static_cast<uint32_t>(p);
          c.peer = 1;
          c.src_offset = row * 16;
          c.dst_offset = row * 16;
          c.bytes = 16;
          transport::host_push_command(ring.view, c);
        }
      });
    }
    for (std::thread& t : threads) t.join();
    thread.stop();  // delivers everything pushed
  }
  return {nb::bytes(reinterpret_cast<const char*>(dst.data()), dst.size()), proxy.errors().size()};
}

// The transport probe (probe.h) on the current GPU; a dict of what the receivers saw.
nb::dict transport_probe(const std::string& transport_name, const std::string& mutant,
                         int num_ranks, int warps_per_rank, int rows, int row_bytes, int rounds,
                         const std::string& ordering, uint64_t seed, uint64_t chunk_bytes,
                         uint32_t max_delay_steps, bool snapshot_sources, double receive_timeout_s,
                         double transport_timeout_s) {
  transport::ProbeConfig config;
  if (transport_name == "mapped") {
    config.transport = transport::ProbeTransport::kMapped;
  } else if (transport_name == "emulated") {
    config.transport = transport::ProbeTransport::kEmulated;
  } else {
    throw std::invalid_argument("transport must be 'mapped' or 'emulated'");
  }
  config.mutant = transport::mutant_named(mutant);
  config.num_ranks = num_ranks;
  config.warps_per_rank = warps_per_rank;
  config.rows = rows;
  config.row_bytes = row_bytes;
  config.rounds = rounds;
  config.proxy.ordering = transport::ordering_named(ordering);
  config.proxy.seed = seed;
  config.proxy.chunk_bytes = chunk_bytes;
  config.proxy.max_delay_steps = max_delay_steps;
  config.proxy.snapshot_sources = snapshot_sources;
  config.receive_timeout_s = receive_timeout_s;
  config.transport_timeout_s = transport_timeout_s;
  transport::ProbeResult result;
  {
    nb::gil_scoped_release release;
    result = transport::run_transport_probe(config);
  }
  nb::dict out;
  out["bad_rows"] = result.bad_rows;
  out["timeouts"] = result.timeouts;
  out["proxy_errors"] = result.proxy_errors;
  out["cuda_error"] = result.cuda_error;
  out["seconds"] = result.seconds;
  return out;
}

}  // namespace

void add_emulated_queue_functions(nb::module_& m) {
  nb::class_<EmulatedQueueForTests>(
      m, "EmulatedQueueForTests",
      "The emulated transport's host proxy over host memory: push commands as a "
      "kernel would, run the proxy step by step, read its deliveries and errors.")
      .def(nb::init<int, int, uint64_t, uint32_t, const std::string&, uint64_t, uint64_t, uint32_t,
                    bool>(),
           nb::arg("rank") = 0, nb::arg("num_queues") = 1, nb::arg("capacity") = 64,
           nb::arg("num_warps") = 4, nb::arg("ordering") = "unordered", nb::arg("seed") = 0,
           nb::arg("chunk_bytes") = 0, nb::arg("max_delay_steps") = 0,
           nb::arg("snapshot_sources") = false)
      .def(
          "register_region",
          [](EmulatedQueueForTests& self, int rank, uint32_t region, nb::handle array) {
            self.register_region(rank, region, nb::cast<ByteArray>(array), array);
          },
          nb::arg("rank"), nb::arg("region"), nb::arg("array"),
          "A writable 1-D uint8 numpy array as `region` of `rank` (kept alive by the queue).")
      .def("put", &EmulatedQueueForTests::put, nb::arg("warp"), nb::arg("peer"),
           nb::arg("dst_region"), nb::arg("dst_offset"), nb::arg("src_region"),
           nb::arg("src_offset"), nb::arg("bytes"))
      .def("put_signal", &EmulatedQueueForTests::put_signal, nb::arg("warp"), nb::arg("peer"),
           nb::arg("dst_region"), nb::arg("dst_offset"), nb::arg("src_region"),
           nb::arg("src_offset"), nb::arg("bytes"), nb::arg("signal_region"),
           nb::arg("signal_offset"), nb::arg("value"), nb::arg("add") = true)
      .def("signal", &EmulatedQueueForTests::signal, nb::arg("warp"), nb::arg("peer"),
           nb::arg("signal_region"), nb::arg("signal_offset"), nb::arg("value"),
           nb::arg("add") = true)
      .def("fence", &EmulatedQueueForTests::fence, nb::arg("warp"))
      .def("quiet", &EmulatedQueueForTests::quiet, nb::arg("warp"),
           "Pushes the warp's quiet; returns its position (see quiet_done).")
      .def("quiet_done", &EmulatedQueueForTests::quiet_done, nb::arg("warp"), nb::arg("position"))
      .def("poll", &EmulatedQueueForTests::poll)
      .def("step", &EmulatedQueueForTests::step)
      .def("run", &EmulatedQueueForTests::run, nb::arg("max_steps") = uint64_t{1} << 24)
      .def("idle", &EmulatedQueueForTests::idle)
      .def("state", &EmulatedQueueForTests::state,
           "What the proxy holds: commands drained per queue, pending (the oldest named).")
      .def("deliveries", &EmulatedQueueForTests::deliveries)
      .def("errors", &EmulatedQueueForTests::errors)
      .def("traffic", &EmulatedQueueForTests::traffic,
           "What was delivered since the last reset, one dict per destination rank: src, dst, "
           "puts (rows; a put-with-signal counts one), bytes, signals. Rejected commands count "
           "nothing.")
      .def("reset_traffic", &EmulatedQueueForTests::reset_traffic)
      .def("start_thread", &EmulatedQueueForTests::start_thread,
           "Runs the proxy on its own thread (as next to the kernels) until stop_thread().")
      .def("stop_thread", &EmulatedQueueForTests::stop_thread,
           "Delivers what was pushed before the call, then stops the thread.")
      .def("thread_running", &EmulatedQueueForTests::thread_running)
      .def("wait_drained", &EmulatedQueueForTests::wait_drained, nb::arg("timeout_s"),
           "True once everything pushed before the call was delivered; False after timeout_s.")
      .def("take_errors", &EmulatedQueueForTests::take_errors,
           "The errors the thread found since the last call, each once.");
  m.def("transport_ring_stress", &ring_stress, nb::arg("producers"),
        nb::arg("commands_per_producer"), nb::arg("capacity"), nb::arg("seed") = 0,
        "Producer threads against the proxy on one small ring.");
  m.def("transport_probe", &transport_probe, nb::arg("transport") = "emulated",
        nb::arg("mutant") = "none", nb::arg("num_ranks") = 2, nb::arg("warps_per_rank") = 4,
        nb::arg("rows") = 16, nb::arg("row_bytes") = 512, nb::arg("rounds") = 3,
        nb::arg("ordering") = "unordered", nb::arg("seed") = 0, nb::arg("chunk_bytes") = 0,
        nb::arg("max_delay_steps") = 0, nb::arg("snapshot_sources") = false,
        nb::arg("receive_timeout_s") = 2.0, nb::arg("transport_timeout_s") = 10.0,
        "An all-to-all exchange between emulated ranks on the current GPU over the 'mapped' or "
        "the 'emulated' transport, optionally with one protocol rule broken (`mutant`); returns "
        "bad_rows, timeouts, proxy_errors, cuda_error, seconds.");
}

}  // namespace jax_ep
