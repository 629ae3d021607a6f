// How a normal-mode call moves any number of rows through a data region of bounded size: a
// window of slots, filled in rounds.
//
// Dispatch: output row o of a rank lands in its data region at slot o % slots, in round
// o / round_rows. Combine: the row that rank r holds of token t lands in its owner's region at
// slot [r][t % slots], in round t / round_rows. When the call's rows fit (extent <= rows) there
// is one round and slot == row, the protocol of a region sized for everything. Otherwise a round
// is half the slots, and a sender writes a row of round k only once its receiver has finished
// round k - 2 (a credit), whose slots it reuses: receivers drain one half while senders fill the
// other. Rounds complete in order at each receiver, so "round k - 2 finished" covers every
// earlier round.
#pragma once

#include <cstdint>

#include "common/limits.h"

namespace jax_ep {

// Rows of the data region when BufferConfig::normal_window_rows is 0: 65536 rows of bf16
// H = 7168 are 0.96 GB, whatever the number of ranks. Groups of up to 16 ranks at T_max = 4096
// fit every call in one round.
constexpr int64_t kDefaultNormalWindowRows = 65536;
// Rounds of one call at most (the credit words and round counters have one entry per round).
constexpr int kNormalMaxRounds = 64;
// Rows of a dispatch receive item and tokens of a combine reduce item: a round is a multiple, so
// no item spans two rounds.
constexpr int64_t kNormalRoundUnit = 32;
// The fewest slots of a window of several rounds (two rounds of one unit).
constexpr int64_t kMinNormalWindowRows = 2 * kNormalRoundUnit;

struct NormalWindow {
  int64_t slots = 0;       // region rows used (dispatch: all of them; combine: per source rank)
  int64_t round_rows = 1;  // rows (dispatch: output rows; combine: tokens) of one round
  int num_rounds = 1;
  bool fits = true;  // false: the region holds too few rows for kNormalMaxRounds rounds
};

constexpr int64_t ceil_div64(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The window of a call that moves `extent` rows (dispatch: its capacity C; combine: its tokens
// T) through `rows` region rows.
constexpr NormalWindow normal_window(int64_t extent, int64_t rows) {
  NormalWindow window;
  if (extent <= rows) {
    window.slots = extent;
    window.round_rows = extent > 0 ? extent : 1;
    return window;
  }
  window.slots = rows / kMinNormalWindowRows * kMinNormalWindowRows;
  window.round_rows = window.slots / 2;
  window.num_rounds =
      static_cast<int>(ceil_div64(extent, window.round_rows > 0 ? window.round_rows : 1));
  window.fits = window.slots >= kMinNormalWindowRows && window.num_rounds <= kNormalMaxRounds;
  return window;
}

// Region rows sized at creation for calls of up to `extent` rows within `budget` rows: all of
// them when they fit, else the budget, raised where needed so that no call takes more than
// kNormalMaxRounds rounds.
constexpr int64_t normal_window_rows(int64_t extent, int64_t budget) {
  if (extent <= budget) return extent;
  const int64_t budget_slots = budget / kMinNormalWindowRows * kMinNormalWindowRows;
  const int64_t fewest =
      ceil_div64(ceil_div64(2 * extent, kNormalMaxRounds), kMinNormalWindowRows) *
      kMinNormalWindowRows;
  const int64_t slots = budget_slots > fewest ? budget_slots : fewest;
  return slots > kMinNormalWindowRows ? slots : kMinNormalWindowRows;
}

static_assert(normal_window(100, 100).num_rounds == 1 && normal_window(100, 100).slots == 100);
static_assert(normal_window(4096, 2048).round_rows == 1024 &&
              normal_window(4096, 2048).num_rounds == 4);
static_assert(normal_window(1 << 20, normal_window_rows(1 << 20, 64)).fits);
static_assert(normal_window(1 << 20, normal_window_rows(1 << 20, 64)).num_rounds <=
              kNormalMaxRounds);

}  // namespace jax_ep
