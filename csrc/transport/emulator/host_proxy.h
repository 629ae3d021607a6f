// The host proxy of the emulated transport: drains the command rings that kernels fill
// (command_ring.h) and performs the commands through an executor (transport/emulator/executor.h).
//
// It is deliberately weaker than any real network, so that a protocol that passes over it does
// not lean on an accident of NVLink stores:
//  - every source, destination and signal word must lie inside a registered region, aligned as
//    the mapped transport needs; a command that does not is recorded as an error, with the
//    command, and not performed (nothing is written);
//  - the source is read when a piece is delivered, not when the command was issued; with
//    `snapshot_sources` it is also copied when the command is drained and compared at delivery
//    and at the warp's quiet, which catches a source reused before quiet;
//  - kUnordered (EFA-like): commands of a queue are delivered in any order, except that a
//    fenced command waits for the same warp's earlier commands to the same peer;
//    kInOrderPerQueue (InfiniBand-like): a queue's commands are delivered one after another;
//  - messages above `chunk_bytes` are torn into chunks delivered in random order (both modes);
//    a put-with-signal's signal follows its own chunks, nothing else;
//  - a quiet waits for the calling warp's commands only;
//  - each command waits a random number of steps (0..max_delay_steps) before it may be delivered.
// All choices come from one std::mt19937_64 seeded by `seed`: one seed, one delivery order.
// It counts what it delivers, per destination rank (traffic()): the network traffic of a run.
//
// Not thread-safe: one thread polls and steps (run_until_idle, or the caller's own loop).
#pragma once

#include <cstdint>
#include <map>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "transport/emulator/command_ring.h"
#include "transport/emulator/executor.h"

namespace jax_ep {
namespace transport {

enum class Ordering {
  kUnordered = 0,        // EFA-like: any order within a queue unless fenced
  kInOrderPerQueue = 1,  // InfiniBand-like: a queue's commands in order
};

struct ProxyOptions {
  Ordering ordering = Ordering::kUnordered;
  uint64_t seed = 0;
  uint64_t chunk_bytes = 0;  // tear larger messages into chunks of this size; 0: never
  uint32_t max_delay_steps = 0;
  bool snapshot_sources = false;
  bool log_deliveries = true;  // keep deliveries() (tests); off for long runs
};

enum class ProxyErrorKind {
  kBadCommand = 1,  // unknown op, peer or warp
  kSourceOutOfRegion = 2,
  kDestinationOutOfRegion = 3,
  kSignalOutOfRegion = 4,
  kMisaligned = 5,    // a put offset or size not a multiple of 16, a signal not 8-aligned
  kSourceReused = 6,  // the source differed from its snapshot before the warp's quiet
};

const char* proxy_error_name(ProxyErrorKind kind);

// "unordered" or "in_order" (the tests' names); throws std::invalid_argument otherwise.
Ordering ordering_named(const std::string& name);

struct ProxyError {
  ProxyErrorKind kind;
  int queue;
  uint64_t position;  // the command's position in its ring
  TransportCommand command;
  std::string message;
};

// What the proxy delivered from its rank to one destination rank. A put counts once its last
// chunk lands (a put-with-signal counts a put and a signal; a zero-byte put moves no row and
// counts none); bytes count chunk by chunk; a rejected command counts nothing.
struct TrafficCount {
  uint64_t puts = 0;     // rows: one per put or put-with-signal
  uint64_t bytes = 0;    // bytes put
  uint64_t signals = 0;  // signal words written (signal, put-with-signal)
};

// One thing the proxy did, in the order it did it.
struct Delivery {
  enum Kind { kData = 0, kSignal = 1, kQuietAck = 2 };
  Kind kind;
  int queue;
  uint64_t position;
  uint32_t warp;
  int32_t peer;
  uint64_t offset;  // kData: the chunk's offset in the message
  uint64_t bytes;   // kData: the chunk's size
  uint64_t value;   // kSignal: the word's new value
};

class HostProxy {
 public:
  // `rank` is the rank whose kernels fill the rings: sources are its regions.
  HostProxy(int rank, const ProxyOptions& options, TransportExecutor* executor);

  // Memory of (rank, region) as the executor addresses it: the local rank's own regions and
  // every peer's, as mapped on this host.
  void register_region(int rank, uint32_t region, void* base, uint64_t bytes);
  // Returns the queue's index. The proxy starts at the ring's current `consumed`.
  int add_queue(const RingView& ring);

  // Moves every published command out of the rings (checked, snapshotted); returns how many.
  uint64_t poll();
  // One delivery (a chunk, a signal or a quiet's acknowledgement), or one tick of the delay
  // clock when nothing is deliverable yet. Returns false when nothing is pending.
  bool step();
  // poll + step until the rings are empty and nothing is pending; returns the steps taken.
  // Stops after max_steps (a guard: a correct proxy always drains).
  uint64_t run_until_idle(uint64_t max_steps);
  bool idle() const { return pending_.empty(); }
  // What it holds now, for failure reports: per queue the commands drained, and how many are
  // pending (the oldest named).
  std::string state() const;

  const std::vector<ProxyError>& errors() const { return errors_; }
  const std::vector<Delivery>& deliveries() const { return deliveries_; }
  int rank() const { return rank_; }
  // Per destination rank, what was delivered since construction or reset_traffic().
  const std::map<int32_t, TrafficCount>& traffic() const { return traffic_; }
  void reset_traffic() { traffic_.clear(); }

 private:
  struct Region {
    char* base;
    uint64_t bytes;
  };
  struct Pending {
    int queue;
    uint64_t position;
    TransportCommand command;
    const char* src = nullptr;
    char* dst = nullptr;
    uint64_t* signal = nullptr;
    uint64_t epoch = 0;                 // fences seen from (queue, warp, peer) up to this command
    uint64_t ready_step = 0;            // delay: not deliverable before this step
    std::vector<uint64_t> chunks_left;  // offsets of the chunks not yet delivered
    bool signal_left = false;
    std::vector<char> snapshot;  // the source as drained (snapshot_sources)
  };
  // A delivered command whose source must stay unchanged until its warp's quiet.
  struct Unquieted {
    int queue;
    uint64_t position;
    TransportCommand command;
    const char* src;
    std::vector<char> snapshot;
  };
  using WarpKey = std::tuple<int, uint32_t>;            // (queue, warp)
  using FenceKey = std::tuple<int, uint32_t, int32_t>;  // (queue, warp, peer)

  const Region* find_region(int rank, uint32_t region) const;
  bool check(int queue, uint64_t position, const TransportCommand& command, Pending* pending);
  void record_error(ProxyErrorKind kind, int queue, uint64_t position,
                    const TransportCommand& command, const std::string& message);
  bool source_unchanged(const char* src, uint64_t offset, uint64_t bytes,
                        const std::vector<char>& snapshot);
  void deliver_chunk(Pending& pending, size_t chunk_index);
  void deliver_signal(Pending& pending);
  void acknowledge_quiet(const Pending& pending);
  void finish(uint64_t id);
  uint64_t random_below(uint64_t n) { return n == 0 ? 0 : rng_() % n; }

  int rank_;
  ProxyOptions options_;
  TransportExecutor* executor_;
  std::mt19937_64 rng_;
  std::map<std::tuple<int, uint32_t>, Region> regions_;  // (rank, region)
  std::vector<RingView> rings_;
  std::vector<uint64_t> tails_;          // next position to drain, per queue
  std::map<uint64_t, Pending> pending_;  // by drain order (per queue: ring order)
  uint64_t next_id_ = 0;
  uint64_t step_ = 0;
  std::map<FenceKey, uint64_t> fence_epochs_;
  std::map<uint64_t, uint64_t> signal_values_;  // word address -> the value this proxy wrote
  std::map<WarpKey, std::vector<Unquieted>> unquieted_;
  std::vector<ProxyError> errors_;
  std::vector<Delivery> deliveries_;
  std::map<int32_t, TrafficCount> traffic_;  // by destination rank
};

}  // namespace transport
}  // namespace jax_ep
