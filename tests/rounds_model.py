"""A model of the normal mode's rounds, to check the protocol where no GPU runs it.

The kernels (csrc/kernels/normal/windows.h, rounds.cuh, dispatch_transfer.cuh, combine_plan.cuh,
combine_transfer.cuh) move a call's rows through a window of slots in rounds: a sender writes a
row of round k only after its receiver's credit for round k - 2, and receivers publish finished
rounds in order. This module transcribes what decides correctness, with item and round sizes
scaled down: the windows, the enumeration of push entries and receive items (round spans,
levels, prefixes), the combine's rows by (owner, round), the counting and in-order publication
of finished rounds, and the credit waits. It runs the ranks' blocks and push warps as generators
interleaved at random, and checks that every row lands once where it belongs, that no slot is
written before its previous row was read, and that every call ends (no deadlock).

It is a transcription: a change of the kernels' protocol must be made here too
(tests/test_rounds_model.py runs it).
"""

from __future__ import annotations

import random

ROWS_PER_ITEM = 4  # kRowsPerItem (dispatch receive item) and kTokensPerItem (combine), scaled
ROUND_UNIT = 4  # kNormalRoundUnit, scaled: a multiple of ROWS_PER_ITEM
MAX_ROUNDS = 64  # kNormalMaxRounds
BOUNDS_STRIDE = MAX_ROUNDS + 1  # kRoundBoundsStride
WAIT = "wait"  # what a generator yields while its condition does not hold


class Deadlock(RuntimeError):
    pass


def normal_window(extent, rows):
    """normal_window() of windows.h: (slots, round_rows, num_rounds, fits)."""
    if extent <= rows:
        return extent, max(extent, 1), 1, True
    slots = rows // (2 * ROUND_UNIT) * (2 * ROUND_UNIT)
    round_rows = slots // 2
    num_rounds = -(-extent // max(round_rows, 1))
    return slots, round_rows, num_rounds, slots >= 2 * ROUND_UNIT and num_rounds <= MAX_ROUNDS


def round_span(round_rows, k, begin, count):
    """round_span() of dispatch_transfer.cuh: the offsets [lo, hi) of the segment [begin, begin +
    count) that lie in round k."""
    first = k * round_rows - begin
    return max(first, 0), min(first + round_rows, count)


def round_entries(prefix, first, stride, me, num_ranks):
    """round_entry() of rounds.cuh over entries first, first + stride, ... of a list ordered
    round by round (round k's entries start at prefix[k]), then by level, then by peer (the
    ranks after ``me``, in turn): ``(round, level, peer)`` of each."""
    k = 0
    peers = num_ranks - 1
    for q in range(first, prefix[-1], stride):
        while q >= prefix[k + 1]:
            k += 1
        entry = q - prefix[k]
        yield k, entry // peers, (me + 1 + entry % peers) % num_ranks


# Ways to break the protocol, for the tests to show that the model catches each: no credit
# waits, a credit for round k - 3 instead of k - 2, a round published one receive item before it
# is finished, finished rounds published out of order, and the last credited round never
# published.
MUTANTS = ("no_credits", "credit_lags_three", "published_early", "unordered", "stops_early")


class Rounds:
    """The round state of every rank: credit words (at the sender: [receiver, round]), counts
    of what each rank finished per round, and its published rounds; `mutant`: one of MUTANTS."""

    def __init__(self, num_ranks, mutant=None):
        assert mutant in (None, *MUTANTS), mutant
        self.num_ranks = num_ranks
        self.mutant = mutant
        self.credits = [set() for _ in range(num_ranks)]
        self.finished = [[0] * MAX_ROUNDS for _ in range(num_ranks)]
        self.published = [set() for _ in range(num_ranks)]

    def wait_for_credit(self, sender, receiver, k):
        """wait_for_credit(): round k reuses the slots of round k - 2."""
        if self.mutant == "no_credits":
            return
        lag = 3 if self.mutant == "credit_lags_three" else 2
        while k >= lag and (receiver, k - lag) not in self.credits[sender]:
            yield WAIT

    def publish(self, me, last, total):
        """publish_finished_rounds(): every finished round from the first unpublished one on,
        below `last`, in order."""
        if self.mutant == "stops_early":
            last -= 1
        slack = ROWS_PER_ITEM if self.mutant == "published_early" else 0  # one item short
        while True:
            candidates = [p for p in range(last) if p not in self.published[me]]
            if self.mutant != "unordered":  # in order: the first unpublished round only
                candidates = candidates[:1]
            done = [p for p in candidates if self.finished[me][p] >= total(p) - slack]
            if not done:
                return
            p = done[0]
            self.published[me].add(p)
            for peer in range(self.num_ranks):
                if peer != me:
                    self.credits[peer].add((me, p))
            yield


def interleave(blocks, rng, patience=200_000):
    """Runs the generators `blocks` to their end in a random interleaving; Deadlock when all
    that are left keep waiting."""
    live = list(blocks)
    idle = 0
    while live:
        i = rng.randrange(len(live))
        try:
            idle = idle + 1 if next(live[i]) == WAIT else 0
        except StopIteration:
            live.pop(i)
            idle = 0
        if idle > patience:
            raise Deadlock(f"{len(live)} blocks wait for each other")


def run_warps(warps, rng):
    """A push role: its block's warps, interleaved, as one generator."""
    warps = list(warps)
    while warps:
        w = rng.choice(warps)
        try:
            yield next(w)
        except StopIteration:
            warps.remove(w)


def dispatch(routing, window_rows, *, blocks, push_blocks, warps, seed, mutant=None):
    """One dispatch of every rank's tokens (routing[src][token]: the set of destination ranks)
    at the default capacity R * T. Returns the number of rounds; raises AssertionError on a row
    in the wrong place or a slot overwritten, Deadlock on a hang. `mutant` (one of MUTANTS)
    breaks the protocol, for a test that the model catches it."""
    rng = random.Random(seed)
    num_ranks, num_tokens = len(routing), len(routing[0])
    capacity = num_ranks * num_tokens
    slots, round_rows, num_rounds, fits = normal_window(capacity, window_rows)
    assert fits
    reuses = num_rounds > 2
    streams = [[[t for t in range(num_tokens) if d in routing[s][t]] for d in range(num_ranks)]
               for s in range(num_ranks)]
    count = [[len(streams[s][d]) for d in range(num_ranks)] for s in range(num_ranks)]
    region = [[None] * slots for _ in range(num_ranks)]
    flags = [set() for _ in range(num_ranks)]
    out = [{} for _ in range(num_ranks)]
    rounds = Rounds(num_ranks, mutant)
    peers = num_ranks - 1

    def plan(me):
        p = {"dest_base": [sum(count[s][d] for s in range(me)) for d in range(num_ranks)],
             "recv_prefix": [sum(count[x][me] for x in range(s)) for s in range(num_ranks)]}
        p["send_valid"] = [max(0, min(capacity - p["dest_base"][d], count[me][d]))
                           for d in range(num_ranks)]
        p["recv_valid"] = [max(0, min(capacity - p["recv_prefix"][s], count[s][me]))
                           for s in range(num_ranks)]
        p["num_valid"] = min(sum(count[s][me] for s in range(num_ranks)), capacity)
        levels, items = [0] * num_rounds, [0] * num_rounds
        for r in range(num_ranks):
            if r == me:
                continue
            for k in range(num_rounds):
                lo, hi = round_span(round_rows, k, p["dest_base"][r], p["send_valid"][r])
                levels[k] = max(levels[k], hi - lo)
                lo, hi = round_span(round_rows, k, p["recv_prefix"][r], p["recv_valid"][r])
                items[k] = max(items[k], -(-(hi - lo) // ROWS_PER_ITEM))
        p["push_prefix"] = [sum(levels[:k]) * peers for k in range(num_rounds + 1)]
        p["item_prefix"] = [sum(items[:k]) * peers for k in range(num_rounds + 1)]
        own = p["recv_valid"][me]

        def peer_rows(k):
            a = round_span(round_rows, k, 0, p["num_valid"])
            o = round_span(round_rows, k, p["recv_prefix"][me], own)
            return max(0, a[1] - a[0]) - max(0, o[1] - o[0])

        p["peer_rows"] = peer_rows
        p["credited"] = max(0, -(-p["num_valid"] // round_rows) - 2)
        p["items"] = [push_blocks if peers else 0, -(-own // ROWS_PER_ITEM),
                      -(-(capacity - p["num_valid"]) // ROWS_PER_ITEM),
                      p["item_prefix"][num_rounds]]
        return p

    plans = [plan(me) for me in range(num_ranks)]

    def push_warp(me, warp):
        p = plans[me]
        for k, level, dst in round_entries(p["push_prefix"], warp, push_blocks * warps, me,
                                           num_ranks):
            lo, hi = round_span(round_rows, k, p["dest_base"][dst], p["send_valid"][dst])
            pos = lo + level
            if pos < hi:
                if reuses:
                    yield from rounds.wait_for_credit(me, dst, k)
                row = p["dest_base"][dst] + pos
                assert region[dst][row % slots] is None, f"slot of row {row} at {dst} overwritten"
                region[dst][row % slots] = (me, pos)
                yield
                flags[dst].add((me, pos))
            yield

    def block(me):
        p = plans[me]
        num_push, num_own, num_pad, num_recv = p["items"]
        if reuses:
            yield from rounds.publish(me, p["credited"], p["peer_rows"])
        while True:
            item = work[me]
            work[me] += 1
            if item < num_push:
                yield from run_warps((push_warp(me, item * warps + w) for w in range(warps)), rng)
                continue
            item -= num_push
            if item < num_own:
                for pos in range(item * ROWS_PER_ITEM,
                                 min(p["recv_valid"][me], (item + 1) * ROWS_PER_ITEM)):
                    out[me][p["recv_prefix"][me] + pos] = (me, pos)
                continue
            item -= num_own + num_pad
            if item < 0:
                continue
            if item >= num_recv:
                return
            k, level, src = next(round_entries(p["item_prefix"], item, 1, me, num_ranks))
            lo, hi = round_span(round_rows, k, p["recv_prefix"][src], p["recv_valid"][src])
            begin = lo + level * ROWS_PER_ITEM
            end = min(hi, begin + ROWS_PER_ITEM)
            for pos in range(begin, end):
                while (src, pos) not in flags[me]:
                    yield WAIT
                row = p["recv_prefix"][src] + pos
                assert region[me][row % slots] == (src, pos), f"row {row} at {me}: wrong slot"
                out[me][row] = (src, pos)
                region[me][row % slots] = None
                yield
            if reuses:
                rounds.finished[me][k] += max(0, end - begin)
                yield from rounds.publish(me, p["credited"], p["peer_rows"])

    work = [0] * num_ranks
    interleave([block(me) for me in range(num_ranks) for _ in range(blocks)], rng)
    for me in range(num_ranks):
        p = plans[me]
        want = {p["recv_prefix"][s] + pos: (s, pos)
                for s in range(num_ranks) for pos in range(p["recv_valid"][s])}
        assert out[me] == want, f"rank {me} received other rows"
    return num_rounds


def combine(routing, window_rows, *, blocks, push_blocks, warps, seed, mutant=None):
    """One combine of the rows a dispatch of `routing` left (every rank holds, for each owner,
    the rows of that owner's tokens routed to it, in token order), through `window_rows` rows
    of region (window_rows / R slots per source). Returns the number of rounds; raises as
    dispatch() does."""
    rng = random.Random(seed)
    num_ranks, num_tokens = len(routing), len(routing[0])
    slots, round_rows, num_rounds, fits = normal_window(num_tokens, window_rows // num_ranks)
    assert fits
    reuses = num_rounds > 2
    recv_src = [[o * num_tokens + t for o in range(num_ranks) for t in range(num_tokens)
                 if r in routing[o][t]] for r in range(num_ranks)]
    region = [[[None] * slots for _ in range(num_ranks)] for _ in range(num_ranks)]
    flags = [set() for _ in range(num_ranks)]
    reduced = [{} for _ in range(num_ranks)]
    rounds = Rounds(num_ranks, mutant)
    peers = num_ranks - 1

    def plan(me):
        src = recv_src[me]
        num_valid = len(src)
        begins = [next((i for i, s in enumerate(src) if s >= o * num_tokens), num_valid)
                  for o in range(num_ranks + 1)]
        p = {"src": src, "begins": begins}
        levels = [max([begins[o + 1] - begins[o] for o in range(num_ranks) if o != me] or [0])]
        if reuses:  # fill_round_bounds()
            num_keys = num_ranks * BOUNDS_STRIDE
            bounds = [None] * num_keys

            def key_of(i):
                owner = src[i] // num_tokens
                key = owner * BOUNDS_STRIDE + (src[i] - owner * num_tokens) // round_rows
                return max(0, min(num_keys, key))

            for i in range(num_valid + 1):
                previous = -1 if i == 0 else key_of(i - 1)
                key = num_keys if i == num_valid else key_of(i)
                for f in range(previous + 1, min(key, num_keys - 1) + 1):
                    bounds[f] = i
            p["bounds"] = bounds
            levels = [max([bounds[o * BOUNDS_STRIDE + k + 1] - bounds[o * BOUNDS_STRIDE + k]
                           for o in range(num_ranks) if o != me] or [0])
                      for k in range(num_rounds)]
        p["prefix"] = [sum(levels[:k]) * peers for k in range(num_rounds + 1)]
        return p

    plans = [plan(me) for me in range(num_ranks)]

    def push_warp(me, warp):
        p = plans[me]
        for k, level, owner in round_entries(p["prefix"], warp, push_blocks * warps, me,
                                             num_ranks):
            begin, end = p["begins"][owner], p["begins"][owner + 1]
            if reuses:
                bounds = p["bounds"][owner * BOUNDS_STRIDE:]
                begin, end = min(max(bounds[k], begin), end), min(max(bounds[k + 1], begin), end)
            row = begin + level
            if row < end:
                token = p["src"][row] - owner * num_tokens
                if reuses:
                    yield from rounds.wait_for_credit(me, owner, token // round_rows)
                assert region[owner][me][token % slots] is None, f"slot of {token} overwritten"
                region[owner][me][token % slots] = token
                yield
                flags[owner].add((me, token))
            yield

    def block(me):
        while True:
            item = work[me]
            work[me] += 1
            num_push = push_blocks if peers else 0
            if item < num_push:
                yield from run_warps((push_warp(me, item * warps + w) for w in range(warps)), rng)
                continue
            begin = (item - num_push) * ROWS_PER_ITEM
            if begin >= num_tokens:
                return
            end = min(num_tokens, begin + ROWS_PER_ITEM)
            for t in range(begin, end):
                sources = sorted(routing[me][t])
                for r in sources:
                    while r != me and (r, t) not in flags[me]:
                        yield WAIT
                    assert r == me or region[me][r][t % slots] == t, f"token {t}: wrong slot"
                for r in sources:
                    if r != me:
                        region[me][r][t % slots] = None
                reduced[me][t] = sources
                yield
            if reuses:
                rounds.finished[me][begin // round_rows] += end - begin
                yield from rounds.publish(
                    me, num_rounds - 2, lambda k: min(round_rows, num_tokens - k * round_rows))

    work = [0] * num_ranks
    interleave([block(me) for me in range(num_ranks) for _ in range(blocks)], rng)
    for me in range(num_ranks):
        assert reduced[me] == {t: sorted(routing[me][t]) for t in range(num_tokens)}
    return num_rounds


ROUTINGS = ("uniform", "one_rank", "half_empty", "skewed")


def make_routing(kind, num_ranks, num_tokens, rng):
    """routing[src][token]: the destination ranks of each token, as the op tests' routings."""
    def ranks(t):
        if kind == "uniform":
            return set(rng.sample(range(num_ranks), min(3, num_ranks)))
        if kind == "one_rank":
            return {0}
        if kind == "half_empty":
            return set() if rng.random() < 0.5 else {rng.randrange(num_ranks)}
        return {d for d in range(num_ranks) if rng.random() < (0.9 if d < 2 else 0.1)}
    return [[ranks(t) for t in range(num_tokens)] for _ in range(num_ranks)]
