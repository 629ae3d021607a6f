#include "transport/emulator/host_proxy.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>

namespace jax_ep {
namespace transport {
namespace {

constexpr uint64_t kPutAlignment = 16;  // the mapped transport moves 16-byte vectors

bool in_range(uint64_t offset, uint64_t bytes, uint64_t size) {
  return offset <= size && bytes <= size - offset;
}

bool carries_data(uint32_t op) {
  return op == static_cast<uint32_t>(CommandOp::kPut) ||
         op == static_cast<uint32_t>(CommandOp::kPutSignal);
}

bool carries_signal(uint32_t op) {
  return op == static_cast<uint32_t>(CommandOp::kPutSignal) ||
         op == static_cast<uint32_t>(CommandOp::kSignal);
}

bool is_quiet(uint32_t op) { return op == static_cast<uint32_t>(CommandOp::kQuiet); }

// Messages are built with std::to_string, not iostreams: the proxy formats them on its own
// thread, and on the H200 machine's build (libstdc++ linked statically) the first ostringstream
// number formatting on a proxy thread crashed (SIGSEGV in ostream::_M_insert<unsigned long>).
std::string byte_range(uint64_t offset, uint64_t bytes) {
  return "[" + std::to_string(offset) + ", +" + std::to_string(bytes) + ")";
}

}  // namespace

const char* proxy_error_name(ProxyErrorKind kind) {
  // By value, from kBadCommand = 1 to kSourceReused.
  static constexpr const char* kNames[] = {
      "bad_command",          "source_out_of_region", "destination_out_of_region",
      "signal_out_of_region", "misaligned",           "source_reused"};
  static_assert(
      sizeof(kNames) / sizeof(kNames[0]) == static_cast<size_t>(ProxyErrorKind::kSourceReused),
      "one name per kind");
  const int index = static_cast<int>(kind) - static_cast<int>(ProxyErrorKind::kBadCommand);
  return index >= 0 && index < static_cast<int>(sizeof(kNames) / sizeof(kNames[0])) ? kNames[index]
                                                                                    : "unknown";
}

Ordering ordering_named(const std::string& name) {
  if (name == "unordered") return Ordering::kUnordered;
  if (name == "in_order") return Ordering::kInOrderPerQueue;
  throw std::invalid_argument("ordering must be 'unordered' (EFA-like) or 'in_order' (IB-like)");
}

HostProxy::HostProxy(int rank, const ProxyOptions& options, TransportExecutor* executor)
    : rank_(rank), options_(options), executor_(executor), rng_(options.seed) {}

void HostProxy::register_region(int rank, uint32_t region, void* base, uint64_t bytes) {
  regions_[{rank, region}] = Region{static_cast<char*>(base), bytes};
}

int HostProxy::add_queue(const RingView& ring) {
  rings_.push_back(ring);
  tails_.push_back(__atomic_load_n(ring.consumed, __ATOMIC_ACQUIRE));
  return static_cast<int>(rings_.size()) - 1;
}

const HostProxy::Region* HostProxy::find_region(int rank, uint32_t region) const {
  auto it = regions_.find({rank, region});
  return it == regions_.end() ? nullptr : &it->second;
}

void HostProxy::record_error(ProxyErrorKind kind, int queue, uint64_t position,
                             const TransportCommand& command, const std::string& message) {
  std::string text = std::string(proxy_error_name(kind)) + ": " + message + " (queue " +
                     std::to_string(queue) + ", position " + std::to_string(position) + ", warp " +
                     std::to_string(command.warp) + ", op " + std::to_string(command.op) +
                     ", peer " + std::to_string(command.peer) + ")";
  errors_.push_back(ProxyError{kind, queue, position, command, std::move(text)});
}

// Resolves the command's addresses into `pending`; records an error and returns false when any
// of them falls outside what was registered (the command is then dropped, nothing written).
bool HostProxy::check(int queue, uint64_t position, const TransportCommand& c, Pending* pending) {
  auto fail = [&](ProxyErrorKind kind, const std::string& message) {
    record_error(kind, queue, position, c, message);
    return false;
  };
  const uint32_t op = c.op;
  if (!carries_data(op) && !carries_signal(op) && !is_quiet(op)) {
    return fail(ProxyErrorKind::kBadCommand, "unknown op");
  }
  if (c.warp >= rings_[queue].num_warps) {
    return fail(ProxyErrorKind::kBadCommand, "warp beyond the ring's acknowledgement words");
  }
  if (is_quiet(op)) return true;
  if (c.peer < 0) return fail(ProxyErrorKind::kBadCommand, "negative peer");
  if (carries_data(op)) {
    if (c.src_offset % kPutAlignment || c.dst_offset % kPutAlignment || c.bytes % kPutAlignment) {
      return fail(ProxyErrorKind::kMisaligned, "put offsets and size must be multiples of 16");
    }
    const Region* src = find_region(rank_, c.src_region);
    if (src == nullptr || !in_range(c.src_offset, c.bytes, src->bytes)) {
      return fail(ProxyErrorKind::kSourceOutOfRegion,
                  "source " + byte_range(c.src_offset, c.bytes) + " not inside region " +
                      std::to_string(c.src_region) + " of rank " + std::to_string(rank_) +
                      (src ? "" : " (not registered)"));
    }
    const Region* dst = find_region(c.peer, c.dst_region);
    if (dst == nullptr || !in_range(c.dst_offset, c.bytes, dst->bytes)) {
      return fail(ProxyErrorKind::kDestinationOutOfRegion,
                  "destination " + byte_range(c.dst_offset, c.bytes) + " not inside region " +
                      std::to_string(c.dst_region) + " of rank " + std::to_string(c.peer) +
                      (dst ? "" : " (not registered)"));
    }
    pending->src = src->base + c.src_offset;
    pending->dst = dst->base + c.dst_offset;
  }
  if (carries_signal(op)) {
    if (c.signal_offset % sizeof(uint64_t)) {
      return fail(ProxyErrorKind::kMisaligned, "signal word not 8-byte aligned");
    }
    if (c.signal_op != static_cast<uint32_t>(SignalOp::kSet) &&
        c.signal_op != static_cast<uint32_t>(SignalOp::kAdd)) {
      return fail(ProxyErrorKind::kBadCommand, "unknown signal op");
    }
    const Region* sig = find_region(c.peer, c.signal_region);
    if (sig == nullptr || !in_range(c.signal_offset, sizeof(uint64_t), sig->bytes)) {
      return fail(ProxyErrorKind::kSignalOutOfRegion,
                  "signal word at " + std::to_string(c.signal_offset) + " not inside region " +
                      std::to_string(c.signal_region) + " of rank " + std::to_string(c.peer) +
                      (sig ? "" : " (not registered)"));
    }
    pending->signal = reinterpret_cast<uint64_t*>(sig->base + c.signal_offset);
  }
  return true;
}

uint64_t HostProxy::poll() {
  uint64_t drained = 0;
  for (int q = 0; q < static_cast<int>(rings_.size()); ++q) {
    const RingView& ring = rings_[q];
    uint64_t& tail = tails_[q];
    while (true) {
      TransportCommand* slot = &ring.slots[tail & (ring.capacity - 1)];
      if (__atomic_load_n(&slot->ready, __ATOMIC_ACQUIRE) != tail + 1) break;
      Pending p;
      p.queue = q;
      p.position = tail;
      std::memcpy(&p.command, slot, sizeof(TransportCommand));
      // The slot is copied out: hand it back to the producers.
      ++tail;
      __atomic_store_n(ring.consumed, tail, __ATOMIC_RELEASE);
      ++drained;
      const TransportCommand& c = p.command;
      // The fence counts even when its command is rejected: later commands stay ordered.
      if (!is_quiet(c.op)) {
        uint64_t& epoch = fence_epochs_[FenceKey{q, c.warp, c.peer}];
        if (c.flags & kFenceBefore) ++epoch;
        p.epoch = epoch;
      }
      if (!check(q, p.position, c, &p)) continue;
      if (carries_data(c.op)) {
        const uint64_t chunk = options_.chunk_bytes ? options_.chunk_bytes : c.bytes;
        for (uint64_t offset = 0; offset < c.bytes; offset += chunk) {
          p.chunks_left.push_back(offset);
        }
        if (options_.snapshot_sources) {
          p.snapshot.resize(c.bytes);
          executor_->read(p.snapshot.data(), p.src, c.bytes);
        }
      }
      p.signal_left = carries_signal(c.op);
      if (!is_quiet(c.op) && p.chunks_left.empty() && !p.signal_left) continue;  // empty put
      if (options_.max_delay_steps) {
        p.ready_step = step_ + random_below(uint64_t{options_.max_delay_steps} + 1);
      }
      pending_.emplace(next_id_++, std::move(p));
    }
  }
  return drained;
}

bool HostProxy::source_unchanged(const char* src, uint64_t offset, uint64_t bytes,
                                 const std::vector<char>& snapshot) {
  std::vector<char> now(bytes);
  executor_->read(now.data(), src + offset, bytes);
  return std::memcmp(now.data(), snapshot.data() + offset, bytes) == 0;
}

void HostProxy::deliver_chunk(Pending& p, size_t chunk_index) {
  const uint64_t offset = p.chunks_left[chunk_index];
  const uint64_t chunk = options_.chunk_bytes ? options_.chunk_bytes : p.command.bytes;
  const uint64_t bytes = std::min(chunk, p.command.bytes - offset);
  if (!p.snapshot.empty() && !source_unchanged(p.src, offset, bytes, p.snapshot)) {
    record_error(ProxyErrorKind::kSourceReused, p.queue, p.position, p.command,
                 "source bytes " + byte_range(offset, bytes) +
                     " changed between the put and its delivery (reused before quiet)");
    p.snapshot.clear();  // reported once; the quiet does not check this command again
  }
  // Read late: whatever the source holds now is what lands.
  executor_->copy(p.dst + offset, p.src + offset, bytes);
  p.chunks_left.erase(p.chunks_left.begin() + static_cast<std::ptrdiff_t>(chunk_index));
  TrafficCount& count = traffic_[p.command.peer];
  count.bytes += bytes;
  if (p.chunks_left.empty()) ++count.puts;
  if (options_.log_deliveries) {
    deliveries_.push_back(Delivery{Delivery::kData, p.queue, p.position, p.command.warp,
                                   p.command.peer, offset, bytes, 0});
  }
}

void HostProxy::deliver_signal(Pending& p) {
  // One writer per signal word (one word per source rank): this proxy keeps the running value
  // and writes it whole, so an add needs no atomic at the destination (copy engines have none).
  const uint64_t key = reinterpret_cast<uint64_t>(p.signal);
  auto it = signal_values_.find(key);
  if (it == signal_values_.end()) {
    uint64_t current = 0;
    executor_->read(&current, p.signal, sizeof(current));
    it = signal_values_.emplace(key, current).first;
  }
  const bool add = p.command.signal_op == static_cast<uint32_t>(SignalOp::kAdd);
  it->second = add ? it->second + p.command.signal_value : p.command.signal_value;
  executor_->write_signal(p.signal, it->second);
  p.signal_left = false;
  ++traffic_[p.command.peer].signals;
  if (options_.log_deliveries) {
    deliveries_.push_back(Delivery{Delivery::kSignal, p.queue, p.position, p.command.warp,
                                   p.command.peer, 0, 0, it->second});
  }
}

void HostProxy::acknowledge_quiet(const Pending& p) {
  // Everything this warp issued before the quiet has been delivered (checked by the caller);
  // make sure it landed, and that no source was reused in the meantime.
  executor_->complete();
  auto it = unquieted_.find(WarpKey{p.queue, p.command.warp});
  if (it != unquieted_.end()) {
    for (const Unquieted& u : it->second) {
      if (!source_unchanged(u.src, 0, u.command.bytes, u.snapshot)) {
        record_error(ProxyErrorKind::kSourceReused, u.queue, u.position, u.command,
                     "source changed after delivery but before the warp's quiet");
      }
    }
    unquieted_.erase(it);
  }
  __atomic_store_n(&rings_[p.queue].acks[p.command.warp], p.position + 1, __ATOMIC_RELEASE);
  if (options_.log_deliveries) {
    deliveries_.push_back(Delivery{Delivery::kQuietAck, p.queue, p.position, p.command.warp,
                                   p.command.peer, 0, 0, p.position + 1});
  }
}

void HostProxy::finish(uint64_t id) {
  auto it = pending_.find(id);
  Pending& p = it->second;
  if (options_.snapshot_sources && carries_data(p.command.op) && !p.snapshot.empty()) {
    unquieted_[WarpKey{p.queue, p.command.warp}].push_back(
        Unquieted{p.queue, p.position, p.command, p.src, std::move(p.snapshot)});
  }
  pending_.erase(it);
}

bool HostProxy::step() {
  if (pending_.empty()) return false;
  // What blocks what, from the commands still pending (quiets block nothing).
  std::map<int, uint64_t> queue_head;      // in-order mode: the one deliverable command
  std::map<FenceKey, uint64_t> min_epoch;  // unordered mode: fenced commands wait for these
  std::map<WarpKey, uint64_t> warp_first;  // quiet: the warp's oldest undelivered command
  for (const auto& [id, p] : pending_) {
    if (is_quiet(p.command.op)) continue;
    queue_head.emplace(p.queue, id);
    warp_first.emplace(WarpKey{p.queue, p.command.warp}, id);
    auto [epoch, inserted] =
        min_epoch.emplace(FenceKey{p.queue, p.command.warp, p.command.peer}, p.epoch);
    if (!inserted) epoch->second = std::min(epoch->second, p.epoch);
  }
  enum What { kChunk, kSignal, kAck };
  struct Action {
    uint64_t id;
    What what;
    size_t chunk;
  };
  std::vector<Action> actions;
  for (const auto& [id, p] : pending_) {
    if (step_ < p.ready_step) continue;
    if (is_quiet(p.command.op)) {
      auto first = warp_first.find(WarpKey{p.queue, p.command.warp});
      if (first == warp_first.end() || first->second > id) actions.push_back({id, kAck, 0});
      continue;
    }
    if (options_.ordering == Ordering::kInOrderPerQueue) {
      if (queue_head.at(p.queue) != id) continue;
    } else if (min_epoch.at(FenceKey{p.queue, p.command.warp, p.command.peer}) < p.epoch) {
      continue;
    }
    for (size_t i = 0; i < p.chunks_left.size(); ++i) actions.push_back({id, kChunk, i});
    if (p.chunks_left.empty() && p.signal_left) actions.push_back({id, kSignal, 0});
  }
  ++step_;
  if (actions.empty()) return true;  // only delayed commands: the clock moved on
  const Action action = actions[random_below(actions.size())];
  Pending& p = pending_.at(action.id);
  switch (action.what) {
    case kChunk:
      deliver_chunk(p, action.chunk);
      break;
    case kSignal:
      deliver_signal(p);
      break;
    case kAck:
      acknowledge_quiet(p);
      break;
  }
  if (p.chunks_left.empty() && !p.signal_left) finish(action.id);
  return true;
}

std::string HostProxy::state() const {
  std::string text;
  for (size_t q = 0; q < rings_.size(); ++q) {
    text += (q ? "; " : "") + std::string("queue ") + std::to_string(q) + ": " +
            std::to_string(tails_[q]) + " drained";
  }
  text += "; " + std::to_string(pending_.size()) + " pending";
  if (!pending_.empty()) {
    const Pending& p = pending_.begin()->second;
    text += " (oldest: queue " + std::to_string(p.queue) + " position " +
            std::to_string(p.position) + " op " + std::to_string(p.command.op) + " warp " +
            std::to_string(p.command.warp) + " peer " + std::to_string(p.command.peer) + ")";
  }
  return text;
}

uint64_t HostProxy::run_until_idle(uint64_t max_steps) {
  uint64_t steps = 0;
  while (steps < max_steps) {
    poll();
    if (!step()) {
      if (poll() == 0) break;
      continue;
    }
    ++steps;
  }
  return steps;
}

}  // namespace transport
}  // namespace jax_ep
