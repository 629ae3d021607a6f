// jax_ep._C_testing.LowLatencyTransportForTests: the low-latency dispatch and combine over a device
// transport (kernels/low_latency_put/put_protocol.h) with every rank of an EP group on the
// current GPU in one launch, for tests/test_transport_gpu.py. Over the emulated transport each
// rank has its own ring, host proxy, copy executor and proxy thread
// (transport/emulator/emulated_ranks.h). Inputs and outputs are host bytes: the test compares them
// with jax_ep.testing's oracle.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <memory>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "bindings.h"
#include "emulated.h"
#include "kernels/low_latency_put/put_protocol.h"
#include "kernels/put_plugin.h"
#include "transport/emulator/emulated_ranks.h"

namespace nb = nanobind;

namespace jax_ep {
namespace {

using transport::check_cuda;
using transport::DeviceArena;
using transport::RankProxy;

constexpr uint64_t kRingCapacity = 4096;

// The shape of the test objects, each bound checked (std::invalid_argument naming it).
LowLatencyTransportShape checked_shape(int num_ranks, int num_experts, int num_topk, int max_tokens,
                                       int hidden, int warps_per_rank, int combine_slots) {
  if (num_ranks < 1 || num_ranks > kTransportMaxRanksPerLaunch) {
    throw std::invalid_argument("num_ranks: 1 to 8");
  }
  if (num_experts < num_ranks || num_experts % num_ranks != 0) {
    throw std::invalid_argument("num_experts: a positive multiple of num_ranks");
  }
  if (hidden <= 0 || hidden % kChannelsPerScale != 0) {
    throw std::invalid_argument("hidden: a positive multiple of 128");
  }
  if (num_topk < 1 || max_tokens < 1 || warps_per_rank < 1 || warps_per_rank > 32) {
    throw std::invalid_argument("num_topk, max_tokens >= 1; warps_per_rank 1 to 32");
  }
  if (combine_slots < 1) throw std::invalid_argument("combine_slots: at least 1");
  LowLatencyTransportShape shape;
  shape.num_ranks = num_ranks;
  shape.num_experts = num_experts;
  shape.num_topk = num_topk;
  shape.max_tokens = max_tokens;
  shape.hidden = hidden;
  shape.warps_per_rank = warps_per_rank;
  shape.combine_slots = combine_slots;
  return shape;
}

class LowLatencyTransportForTests {
 public:
  LowLatencyTransportForTests(int num_ranks, int num_experts, int num_topk, int max_tokens,
                              int hidden, int warps_per_rank, const std::string& transport_name,
                              const std::string& ordering, uint64_t seed, uint64_t chunk_bytes,
                              uint32_t max_delay_steps, bool snapshot_sources, double timeout_s,
                              int combine_slots, const std::string& mutant,
                              const std::string& launches) {
    const LowLatencyTransportShape shape = checked_shape(
        num_ranks, num_experts, num_topk, max_tokens, hidden, warps_per_rank, combine_slots);
    const transport::Ordering order = transport::ordering_named(ordering);
    const transport::Mutant broken = transport::mutant_named(mutant);
    if (launches != "one" && launches != "per_rank") {
      throw std::invalid_argument(
          "launches must be 'one' (every rank in one launch) or "
          "'per_rank' (a launch per rank, each on its own stream)");
    }
    per_rank_ = launches == "per_rank";
    if (transport_name == "mapped") {
      plugin_ = *mapped_put_plugin();
      if (broken != transport::Mutant::kNone) {
        throw std::invalid_argument("mutant: only the emulated transport carries one");
      }
    } else if (transport_name == "emulated") {
      plugin_ = emulated_put_kernels();
      emulated_ = true;
    } else {
      throw std::invalid_argument("transport must be 'mapped' or 'emulated'");
    }
    launch_.layout = make_low_latency_transport_layout(shape);
    for (int r = 0; r < (per_rank_ ? num_ranks : 1); ++r) {
      streams_.push_back(std::make_unique<transport::OwnedStream>());
    }
    launch_.rank_base = 0;
    launch_.rank_count = num_ranks;
    launch_.timeout_ns = static_cast<uint64_t>(timeout_s * 1e9);

    const LowLatencyTransportLayout& layout = launch_.layout;
    std::vector<char*> bases;
    std::vector<std::vector<std::pair<void*, uint64_t>>> regions(num_ranks);
    for (int r = 0; r < num_ranks; ++r) {
      for (uint64_t bytes : {static_cast<uint64_t>(layout.workspace_bytes),
                             static_cast<uint64_t>(layout.staging_bytes)}) {
        char* base = static_cast<char*>(arena_.device_zeroed(bytes));
        bases.push_back(base);
        regions[r].emplace_back(base, bytes);
      }
    }
    char** device_bases = static_cast<char**>(arena_.device_zeroed(bases.size() * sizeof(char*)));
    check_cuda(cudaMemcpy(device_bases, bases.data(), bases.size() * sizeof(char*),
                          cudaMemcpyHostToDevice),
               "cudaMemcpy (region table)");
    launch_.region_bases = device_bases;

    const size_t tokens = static_cast<size_t>(max_tokens);
    const size_t received = static_cast<size_t>(shape.num_local()) * num_ranks * max_tokens;
    for (int r = 0; r < num_ranks; ++r) {
      launch_.barrier[r] = static_cast<uint32_t*>(arena_.device_zeroed(sizeof(uint32_t)));
      for (OpWords* words : {&dispatch_words_, &combine_words_}) {
        words->sequence[r] = static_cast<uint64_t*>(arena_.device_zeroed(sizeof(uint64_t)));
        words->finished[r] = static_cast<uint32_t*>(arena_.device_zeroed(sizeof(uint32_t)));
      }
      x_[r] = arena_.device_zeroed(tokens * hidden * 2);
      idx_[r] = static_cast<int32_t*>(arena_.device_zeroed(tokens * num_topk * 4));
      weights_[r] = static_cast<float*>(arena_.device_zeroed(tokens * num_topk * 4));
      recv_x_[r] = arena_.device_zeroed(received * hidden * 2);
      recv_scales_[r] =
          static_cast<float*>(arena_.device_zeroed(received * (hidden / kChannelsPerScale) * 4));
      recv_count_[r] = static_cast<int32_t*>(arena_.device_zeroed(shape.num_local() * 4));
      recv_src_[r] = static_cast<int32_t*>(arena_.device_zeroed(received * 4));
      recv_k_[r] = static_cast<int32_t*>(arena_.device_zeroed(received * 4));
      y_[r] = arena_.device_zeroed(received * hidden * 2);
      out_[r] = arena_.device_zeroed(tokens * hidden * 2);
    }
    if (emulated_) {
      for (int r = 0; r < num_ranks; ++r) {
        const transport::RingView ring =
            transport::make_ring(arena_, kRingCapacity, static_cast<uint32_t>(warps_per_rank));
        launch_.queues[r] = transport::make_queue(arena_, ring, broken);
        transport::ProxyOptions options;
        options.ordering = order;
        options.seed = seed + static_cast<uint64_t>(r);
        options.chunk_bytes = chunk_bytes;
        options.max_delay_steps = max_delay_steps;
        options.snapshot_sources = snapshot_sources;
        options.log_deliveries = false;
        proxies_.push_back(std::make_unique<RankProxy>(r, options, ring, regions));
      }
    }
  }

  // x: bf16 bits [R, T, H]; topk_idx: int32 [R, T, K]. Returns recv_x (bytes [R, E_loc, R*T_max,
  // H] of e4m3, or of bf16 bits), recv_scales, recv_count, recv_src, recv_k as bytes.
  nb::dict dispatch(nb::bytes x, nb::bytes topk_idx, int num_tokens, bool use_fp8,
                    bool round_scale) {
    const LowLatencyTransportShape& s = launch_.layout.shape;
    set_tokens(num_tokens);
    upload(x, x_, static_cast<size_t>(num_tokens) * s.hidden * 2, "x");
    upload(topk_idx, idx_, static_cast<size_t>(num_tokens) * s.num_topk * 4, "topk_idx");
    LowLatencyTransportDispatch op;
    op.use_fp8 = use_fp8;
    op.round_scale = round_scale;
    for (int r = 0; r < s.num_ranks; ++r) {
      op.x[r] = x_[r];
      op.recv_x[r] = recv_x_[r];
      op.recv_scales[r] = recv_scales_[r];
      op.recv_count[r] = recv_count_[r];
      op.recv_src[r] = recv_src_[r];
      op.recv_k[r] = recv_k_[r];
      launch_.topk_idx[r] = idx_[r];
    }
    run(dispatch_words_, op, &PutPlugin::low_latency_dispatch, "dispatch");
    const size_t received = static_cast<size_t>(s.num_local()) * s.num_ranks * s.max_tokens;
    nb::dict out;
    out["recv_x"] = download(recv_x_, received * s.hidden * (use_fp8 ? 1 : 2));
    out["recv_scales"] = download(recv_scales_, received * (s.hidden / kChannelsPerScale) * 4);
    out["recv_count"] = download(recv_count_, static_cast<size_t>(s.num_local()) * 4);
    out["recv_src"] = download(recv_src_, received * 4);
    out["recv_k"] = download(recv_k_, received * 4);
    return out;
  }

  // y: bf16 bits [R, E_loc, R*T_max, H]; topk_idx, topk_weights [R, T, K] (int32, float32),
  // with the handle of the last dispatch. Returns the combined rows, bf16 bits [R, T, H].
  nb::bytes combine(nb::bytes y, nb::bytes topk_idx, nb::bytes topk_weights, int num_tokens) {
    const LowLatencyTransportShape& s = launch_.layout.shape;
    set_tokens(num_tokens);
    const size_t received = static_cast<size_t>(s.num_local()) * s.num_ranks * s.max_tokens;
    upload(y, y_, received * s.hidden * 2, "y");
    upload(topk_idx, idx_, static_cast<size_t>(num_tokens) * s.num_topk * 4, "topk_idx");
    upload(topk_weights, weights_, static_cast<size_t>(num_tokens) * s.num_topk * 4,
           "topk_weights");
    LowLatencyTransportCombine op;
    for (int r = 0; r < s.num_ranks; ++r) {
      op.y[r] = y_[r];
      op.recv_src[r] = recv_src_[r];
      op.recv_k[r] = recv_k_[r];
      op.recv_count[r] = recv_count_[r];
      op.topk_weights[r] = weights_[r];
      op.out[r] = out_[r];
      launch_.topk_idx[r] = idx_[r];
    }
    run(combine_words_, op, &PutPlugin::low_latency_combine, "combine");
    return download(out_, static_cast<size_t>(num_tokens) * s.hidden * 2);
  }

  // Stops the proxies (emulated); returns every error they found, as "kind: message".
  std::vector<std::string> close() {
    std::vector<std::string> errors;
    for (std::unique_ptr<RankProxy>& p : proxies_) {
      RankProxy::Report report = p->stop();
      if (!report.cuda_error.empty()) errors.push_back("cuda: " + report.cuda_error);
      errors.insert(errors.end(), report.errors.begin(), report.errors.end());
    }
    proxies_.clear();
    return errors;
  }

 private:
  void set_tokens(int num_tokens) {
    if (num_tokens < 0 || num_tokens > launch_.layout.shape.max_tokens) {
      throw std::invalid_argument("num_tokens: 0 to max_tokens");
    }
    launch_.num_tokens = num_tokens;
  }

  // bytes holds R equal parts, one per rank.
  template <typename T>
  void upload(const nb::bytes& bytes, T* const* per_rank, size_t bytes_per_rank, const char* name) {
    const int ranks = launch_.layout.shape.num_ranks;
    if (bytes.size() != bytes_per_rank * ranks) {
      throw std::invalid_argument(std::string(name) + ": wrong size");
    }
    for (int r = 0; r < ranks; ++r) {
      check_cuda(cudaMemcpy(per_rank[r], bytes.c_str() + r * bytes_per_rank, bytes_per_rank,
                            cudaMemcpyHostToDevice),
                 "cudaMemcpy (input)");
    }
  }

  template <typename T>
  nb::bytes download(T* const* per_rank, size_t bytes_per_rank) {
    const int ranks = launch_.layout.shape.num_ranks;
    std::vector<char> host(bytes_per_rank * ranks);
    for (int r = 0; r < ranks; ++r) {
      check_cuda(cudaMemcpy(host.data() + r * bytes_per_rank, per_rank[r], bytes_per_rank,
                            cudaMemcpyDeviceToHost),
                 "cudaMemcpy (output)");
    }
    return nb::bytes(host.data(), host.size());
  }

  // The op's sequence words, per rank.
  struct OpWords {
    uint64_t* sequence[kTransportMaxRanksPerLaunch] = {};
    uint32_t* finished[kTransportMaxRanksPerLaunch] = {};
  };

  // The launch and op arguments of rank r alone (its arrays at index 0), for a launch per rank.
  template <typename Op>
  static Op rank_only(const Op& op, int r) {
    Op one = op;
    auto first = [r](auto& array) { array[0] = array[r]; };
    if constexpr (std::is_same_v<Op, LowLatencyTransportDispatch>) {
      first(one.x);
      first(one.recv_x);
      first(one.recv_scales);
      first(one.recv_count);
      first(one.recv_src);
      first(one.recv_k);
    } else if constexpr (std::is_same_v<Op, LowLatencyTransportCombine>) {
      first(one.y);
      first(one.recv_src);
      first(one.recv_k);
      first(one.recv_count);
      first(one.topk_weights);
      first(one.out);
    } else {  // LowLatencyTransportLaunch
      first(one.queues);
      first(one.barrier);
      first(one.sequence);
      first(one.finished);
      first(one.topk_idx);
      one.rank_base = r;
      one.rank_count = 1;
    }
    return one;
  }

  // Launches the op (every rank at once, or a launch per rank on its own stream) through the
  // transport's table, and waits.
  template <typename Op>
  void run(const OpWords& words, const Op& op,
           int (*PutPlugin::*launcher)(const LowLatencyTransportLaunch*, const Op*, cudaStream_t),
           const char* what) {
    auto launch_on = [&](const LowLatencyTransportLaunch& l, const Op& o, cudaStream_t stream) {
      return static_cast<cudaError_t>((plugin_.*launcher)(&l, &o, stream));
    };
    LowLatencyTransportLaunch launch = launch_;
    std::copy(std::begin(words.sequence), std::end(words.sequence), std::begin(launch.sequence));
    std::copy(std::begin(words.finished), std::end(words.finished), std::begin(launch.finished));
    if (per_rank_) {
      for (int r = 0; r < launch.rank_count; ++r) {
        check_cuda(launch_on(rank_only(launch, r), rank_only(op, r), streams_[r]->stream), what);
      }
    } else {
      check_cuda(launch_on(launch, op, streams_[0]->stream), what);
    }
    nb::gil_scoped_release release;
    try {
      for (const auto& stream : streams_) check_cuda(cudaStreamSynchronize(stream->stream), what);
    } catch (const std::runtime_error& e) {  // a kernel that trapped: what did the proxies see?
      throw std::runtime_error(std::string(e.what()) +
                               "; the proxies:" + transport::stop_and_describe(proxies_));
    }
  }

  // Declaration order is teardown order reversed: the proxies stop before the memory goes.
  DeviceArena arena_;
  std::vector<std::unique_ptr<transport::OwnedStream>> streams_;  // one, or one per rank
  bool per_rank_ = false;
  OpWords dispatch_words_;
  OpWords combine_words_;
  PutPlugin plugin_;  // the transport's kernels: the mapped ones (as jax_ep._C builds them) or the
                      // emulated ones
  bool emulated_ = false;
  LowLatencyTransportLaunch launch_;
  void* x_[kTransportMaxRanksPerLaunch] = {};
  int32_t* idx_[kTransportMaxRanksPerLaunch] = {};
  float* weights_[kTransportMaxRanksPerLaunch] = {};
  void* recv_x_[kTransportMaxRanksPerLaunch] = {};
  float* recv_scales_[kTransportMaxRanksPerLaunch] = {};
  int32_t* recv_count_[kTransportMaxRanksPerLaunch] = {};
  int32_t* recv_src_[kTransportMaxRanksPerLaunch] = {};
  int32_t* recv_k_[kTransportMaxRanksPerLaunch] = {};
  void* y_[kTransportMaxRanksPerLaunch] = {};
  void* out_[kTransportMaxRanksPerLaunch] = {};
  std::vector<std::unique_ptr<RankProxy>> proxies_;
};

// The layout's region starts and, for each indexed region, the end of its last element (the
// accessors at their largest indices), for the CPU test that regions neither overlap nor run
// past their region.
nb::dict transport_layout(int num_ranks, int num_experts, int num_topk, int max_tokens, int hidden,
                          int warps_per_rank, int combine_slots) {
  const LowLatencyTransportShape shape = checked_shape(num_ranks, num_experts, num_topk, max_tokens,
                                                       hidden, warps_per_rank, combine_slots);
  const LowLatencyTransportLayout l = make_low_latency_transport_layout(shape);
  const int r = num_ranks - 1;
  const int e = shape.num_local() - 1;
  const int t = max_tokens - 1;
  const int k = num_topk - 1;
  const size_t row = shape.row_bytes();
  nb::dict out;
  out["workspace"] = std::vector<size_t>{l.counts, l.combine_words, l.meta,
                                         l.rows,   l.combine_rows,  l.workspace_bytes};
  out["workspace_ends"] = std::vector<size_t>{
      l.count_word(1, e, r) + 8, l.combine_word(1, r, e) + 8, l.meta_at(1, e, r, t) + 16,
      l.row_at(1, e, r, t) + row, l.combine_row_at(1, t, k) + row};
  out["staging"] =
      std::vector<size_t>{l.staged_rows, l.staged_meta, l.combine_slots, l.staging_bytes};
  out["staging_ends"] =
      std::vector<size_t>{l.staged_row_at(t) + row, l.staged_meta_at(t, k) + 16,
                          l.combine_slot_at(warps_per_rank - 1, combine_slots - 1) + row};
  out["fp8_message_bytes"] = shape.fp8_message_bytes();
  out["row_bytes"] = row;
  return out;
}

}  // namespace

void add_low_latency_transport_functions(nb::module_& m) {
  m.def("low_latency_transport_layout", &transport_layout, nb::arg("num_ranks"),
        nb::arg("num_experts"), nb::arg("num_topk"), nb::arg("max_tokens"), nb::arg("hidden"),
        nb::arg("warps_per_rank"), nb::arg("combine_slots"),
        "The regions of the low-latency ops over a transport.");
  nb::class_<LowLatencyTransportForTests>(
      m, "LowLatencyTransportForTests",
      "The low-latency dispatch and combine over the 'mapped' or 'emulated' transport, every "
      "rank of the group on the current GPU.")
      .def(
          nb::init<int, int, int, int, int, int, const std::string&, const std::string&, uint64_t,
                   uint64_t, uint32_t, bool, double, int, const std::string&, const std::string&>(),
          nb::arg("num_ranks"), nb::arg("num_experts"), nb::arg("num_topk"), nb::arg("max_tokens"),
          nb::arg("hidden"), nb::arg("warps_per_rank") = 4, nb::arg("transport") = "emulated",
          nb::arg("ordering") = "unordered", nb::arg("seed") = 0, nb::arg("chunk_bytes") = 0,
          nb::arg("max_delay_steps") = 0, nb::arg("snapshot_sources") = false,
          nb::arg("timeout_s") = 10.0, nb::arg("combine_slots") = 8, nb::arg("mutant") = "none",
          nb::arg("launches") = "one")
      .def("dispatch", &LowLatencyTransportForTests::dispatch, nb::arg("x"), nb::arg("topk_idx"),
           nb::arg("num_tokens"), nb::arg("use_fp8") = false, nb::arg("round_scale") = false)
      .def("combine", &LowLatencyTransportForTests::combine, nb::arg("y"), nb::arg("topk_idx"),
           nb::arg("topk_weights"), nb::arg("num_tokens"))
      .def("close", &LowLatencyTransportForTests::close,
           "Stops the proxies; returns the errors they found.");
}

}  // namespace jax_ep
