// What an emulated rank's proxy delivered (HostProxy::traffic), as the Python rows the tests and
// benchmarks read: one dict per destination rank {src, dst, puts, bytes, signals}
// (EmulatedQueueForTests.traffic, transport_traffic; jax_ep.testing.fold_traffic folds them).
#pragma once

#include <nanobind/nanobind.h>

#include <cstdint>
#include <map>

#include "transport/emulator/host_proxy.h"

namespace jax_ep {

inline void append_traffic_rows(nanobind::list& out, int src,
                                const std::map<int32_t, transport::TrafficCount>& traffic) {
  for (const auto& [dst, count] : traffic) {
    nanobind::dict row;
    row["src"] = src;
    row["dst"] = dst;
    row["puts"] = count.puts;
    row["bytes"] = count.bytes;
    row["signals"] = count.signals;
    out.append(row);
  }
}

}  // namespace jax_ep
