// The kernels' host arithmetic, for the CPU tests that check it (tests/test_facts.py): the
// low-latency layout's regions and FastDivisor's division.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <string>
#include <vector>

#include "bindings.h"
#include "common/fast_divisor.h"
#include "kernels/low_latency/layout.cuh"

namespace nb = nanobind;

namespace jax_ep {
namespace {

// Each region's start of one channel of the low-latency layout, and the end of its last element
// as the index helpers place it (a region of no elements ends where it starts), in layout order;
// then total_bytes.
nb::dict low_latency_layout(int num_ranks, int num_experts, int hidden, int max_tokens_per_rank,
                            int num_topk) {
  if (num_ranks < 1 || num_experts < num_ranks || num_experts % num_ranks != 0 || hidden < 1 ||
      max_tokens_per_rank < 1 || num_topk < 1) {
    throw nb::value_error(
        "num_ranks >= 1, num_experts a positive multiple of it, hidden, max_tokens_per_rank, "
        "num_topk >= 1");
  }
  // The fields the layout reads, in BufferConfig's order.
  const BufferConfig config{num_ranks, num_experts, hidden, max_tokens_per_rank, num_topk};
  const LowLatencyLayout l = make_low_latency_layout(config);
  const int r = l.num_ranks - 1, e = l.num_local_experts - 1, t = l.max_tokens - 1;
  const size_t row = l.dispatch_row_bytes();
  const size_t rows_end =
      l.num_ranks > 1 ? l.dispatch_row_offset(1, e, r, 0, t) + row : l.dispatch_rows;
  nb::dict out;
  out["names"] = std::vector<std::string>{
      "control",       "dispatch_counts",   "combine_flags", "dispatch_meta", "dispatch_row_flags",
      "dispatch_rows", "dispatch_own_rows", "combine_rows"};
  out["starts"] = std::vector<size_t>{l.control,           l.dispatch_counts,    l.combine_flags,
                                      l.dispatch_meta,     l.dispatch_row_flags, l.dispatch_rows,
                                      l.dispatch_own_rows, l.combine_rows};
  out["ends"] = std::vector<size_t>{
      l.control + sizeof(LowLatencyControl),
      l.dispatch_counts + (l.dispatch_count_index(1, e, r) + 1) * sizeof(uint64_t),
      l.combine_flags + (l.flag_index(1, r) + 1) * sizeof(uint64_t),
      l.dispatch_meta + (l.dispatch_meta_index(1, e, r, t) + 1) * 2 * sizeof(int32_t),
      l.dispatch_row_flags + (l.dispatch_meta_index(1, e, r, t) + 1) * sizeof(uint64_t),
      rows_end,
      l.dispatch_own_row_offset(t) + row,
      l.combine_row_offset(1, t, l.num_topk - 1) + l.combine_row_bytes()};
  out["total_bytes"] = l.total_bytes;
  return out;
}

std::vector<uint32_t> fast_divide(uint32_t divisor, const std::vector<uint32_t>& numerators) {
  if (divisor == 0) throw nb::value_error("divisor must be at least 1");
  const FastDivisor by(divisor);
  std::vector<uint32_t> quotients;
  quotients.reserve(numerators.size());
  for (const uint32_t n : numerators) quotients.push_back(by.divide(n));
  return quotients;
}

}  // namespace

void add_layout_functions(nb::module_& m) {
  m.def("low_latency_layout", &low_latency_layout, nb::arg("num_ranks"), nb::arg("num_experts"),
        nb::arg("hidden"), nb::arg("max_tokens_per_rank"), nb::arg("num_topk"),
        "The low-latency layout of one channel (kernels/low_latency/layout.cuh): every region's "
        "name, start and the end of its last element, and total_bytes.");
  m.def("fast_divide", &fast_divide, nb::arg("divisor"), nb::arg("numerators"),
        "numerators // divisor as the kernels divide (FastDivisor: the same code on host and "
        "device).");
}

}  // namespace jax_ep
