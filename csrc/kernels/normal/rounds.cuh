// The rounds of a normal-mode transfer kernel on the device (kernels/normal/windows.h): the
// credit a sender waits for before it reuses a receiver's slots, and the receiver's publication
// of the rounds it finished, in order.
//
// A receiver counts the rows (dispatch) or tokens (combine) it finished in each round. The
// block that finishes a round's last one publishes every finished round from the first not yet
// published on, in order: a compare-and-swap on the published count picks one publisher per
// round, which sets the credit word [receiver][round] at every peer to the call's tag. So a
// credit for round k means that rounds 0..k are finished. A block also tries to publish when it
// starts (rounds without rows finish at once). tests/rounds_model.py transcribes this protocol
// and the kernels' enumeration of rounds, and checks them under random interleavings: a change
// here is made there too.
#pragma once

#include <cstdint>

#include "common/limits.h"
#include "common/peer_field.cuh"
#include "common/sync.cuh"
#include "kernels/normal/put_path.cuh"
#include "kernels/normal/windows.h"
#include "kernels/normal/workspace.h"

namespace jax_ep {

// What a transfer kernel needs of its call's rounds.
struct RoundArgs {
  int64_t slots = 0;                  // NormalWindow::slots
  int64_t round_rows = 1;             // NormalWindow::round_rows
  int num_rounds = 1;                 // NormalWindow::num_rounds (of the call's extent)
  uint32_t* published = nullptr;      // this rank's rounds published (counters word 2)
  uint32_t* finished = nullptr;       // [M] this rank's rows or tokens finished per round
  const uint64_t* credits = nullptr;  // this rank's credit words [receiver][M]
  PeerField<uint64_t> peer_credits;   // every rank's credit words
  uint32_t publisher_warp = 0;        // transport warp of block 0's publisher (then + block)
};

// A sender reuses slots only when the call has more than two rounds.
__device__ __forceinline__ bool reuses_slots(const RoundArgs& rounds) {
  return rounds.num_rounds > 2;
}

// Before a sender writes a row of round `round` into `receiver`'s slots (the whole warp):
// waits until the receiver finished round - 2, whose slots the row reuses (bounded, in
// `phase`). Over a transport the warp's own earlier puts may not have left yet (a put need not
// progress before a quiet), and the credit may wait for them: the warp flushes them first
// (`sender.flush`) unless the credit is already there.
template <typename Sender>
__device__ __forceinline__ void wait_for_credit(Sender& sender, const RoundArgs& rounds,
                                                const WaitContext& wait, WaitPhase phase,
                                                int receiver, int round, uint64_t tag, int lane) {
  if (round < 2) return;
  const uint64_t* credit =
      rounds.credits + static_cast<int64_t>(receiver) * kNormalMaxRounds + (round - 2);
  // One decision for the warp: flush is a warp-wide call.
  const int ready = __shfl_sync(0xffffffffu, lane == 0 && ld_acquire_sys(credit) >= tag, 0);
  if (ready) return;
  sender.flush(lane);
  WaitContext credit_wait = wait;
  credit_wait.phase = static_cast<int32_t>(phase);
  wait_flag(credit_wait, credit, tag, receiver);
}

// Entry `q` of a list ordered round by round, then by level, then by peer (the ranks after
// `rank`, in turn), round k's entries starting at prefix[k]: its round (found from `*round` up,
// as a caller's q only grows), its level and its peer.
struct RoundEntry {
  int round;
  int level;
  int peer;
};
template <typename Index>
__device__ __forceinline__ RoundEntry round_entry(const Index* prefix, Index q, int* round,
                                                  int rank, int num_ranks) {
  while (q >= prefix[*round + 1]) ++*round;
  const Index entry = q - prefix[*round];
  const int num_peers = num_ranks - 1;
  return {*round, static_cast<int>(entry / num_peers),
          (rank + 1 + static_cast<int>(entry % num_peers)) % num_ranks};
}

// After a block finished `count` rows or tokens of `round` (all its threads call it): adds them
// to the round's count (thread 0, after a fence that orders the block's reads of those slots).
__device__ __forceinline__ void count_finished(const RoundArgs& rounds, int round, int count) {
  __syncthreads();
  if (threadIdx.x == 0 && count > 0) {
    __threadfence();
    atomicAdd(rounds.finished + round, static_cast<uint32_t>(count));
    __threadfence();  // the add, before this block reads the published count
  }
}

// Warp 0 of a block (all its lanes): publishes every finished round from the first unpublished
// one on, while rounds below `last` (rounds no sender waits for are not published) are
// finished; `total(k)` is the number of rows or tokens round k has at this rank.
template <typename Path, typename Total>
__device__ __forceinline__ void publish_finished_rounds(const Path& path, const RoundArgs& rounds,
                                                        int rank, int num_ranks, int last,
                                                        Total total, uint64_t tag,
                                                        const WaitContext& wait, int lane) {
  constexpr int kStop = 0;
  constexpr int kRetry = 1;
  constexpr int kPublish = 2;
  for (;;) {
    int state = kStop;
    uint32_t round = 0;
    if (lane == 0) {
      round = *reinterpret_cast<volatile uint32_t*>(rounds.published);
      if (static_cast<int>(round) < last &&
          *reinterpret_cast<volatile uint32_t*>(rounds.finished + round) >=
              static_cast<uint32_t>(total(static_cast<int>(round)))) {
        __threadfence();  // the count read, before the CAS that claims the round
        state = atomicCAS(rounds.published, round, round + 1) == round ? kPublish : kRetry;
        __threadfence();  // the CAS, before the next round's count is read
      }
    }
    state = __shfl_sync(0xffffffffu, state, 0);
    round = __shfl_sync(0xffffffffu, round, 0);
    __syncwarp();  // lane 0's reads, before the other lanes' credits
    if (state == kStop) return;
    if (state == kRetry) continue;
    const int64_t word = static_cast<int64_t>(rank) * kNormalMaxRounds + round;
    // One writer per word and call (the round's publisher), and calls follow each other on
    // this rank's stream: a plain release store never lowers a word. (No atomic on a peer's
    // memory: not every peer link has them.) A transport's credits are delivered before this
    // kernel ends (its quiet), so the next call's tag is never undone either.
    __threadfence_system();  // every lane: the slots' reads, before the credit (a release)
    if constexpr (is_stores_path<Path>) {
      for (int peer = lane; peer < num_ranks; peer += kWarpSize) {
        if (peer != rank) st_release_sys(rounds.peer_credits[peer] + word, tag);
      }
    } else {
      auto t = make_normal_transport(path, rank, rounds.publisher_warp + blockIdx.x, wait);
      const size_t offset = path.args.layout.credits + sizeof(uint64_t) * word;
      for (int peer = 0; peer < num_ranks; ++peer) {
        if (peer != rank) {
          t.signal(peer, in_normal_area(offset), tag, transport::SignalOp::kSet, lane);
        }
      }
      t.quiet(lane);
    }
  }
}

}  // namespace jax_ep
