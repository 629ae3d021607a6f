"""The normal mode's rounds, on their model (tests/rounds_model.py): under random interleavings
of blocks and warps, every routing of the op tests lands each row where it belongs through a
window a fraction of the call's size, without an overwritten slot or a hang; and the model
catches a protocol without its credit waits."""

import random

import pytest
import rounds_model as model


def cases(count):
    """Random groups (2-5 ranks, 8-40 tokens), routings, windows and grids, by seed."""
    for seed in range(count):
        rng = random.Random(seed)
        num_ranks = rng.choice([2, 3, 4, 5])
        num_tokens = rng.choice([8, 16, 24, 40])
        routing = model.make_routing(rng.choice(model.ROUTINGS), num_ranks, num_tokens, rng)
        blocks = rng.choice([2, 3, 4])
        grid = {"blocks": blocks, "push_blocks": rng.randrange(1, blocks), "warps": 2,
                "seed": seed}
        yield seed, routing, rng.choice([8, 12, 16, 24, 1000]), grid


@pytest.mark.parametrize("op", [model.dispatch, model.combine])
def test_every_routing_streams_through_a_small_window(op):
    rounds = []
    for _, routing, window, grid in cases(60):
        rows = window * len(routing) if op is model.combine else window
        rounds.append(op(routing, rows, **grid))
    assert max(rounds) >= 10 and 1 in rounds  # many rounds, and calls that fit in one


@pytest.mark.parametrize("op", [model.dispatch, model.combine])
def test_without_credit_waits_a_slot_is_overwritten(op):
    caught = 0
    for _, routing, window, grid in cases(30):
        rows = window * len(routing) if op is model.combine else window
        try:
            op(routing, rows, credits=False, **grid)
        except AssertionError as e:
            assert "overwritten" in str(e) or "wrong slot" in str(e), e
            caught += 1
    assert caught >= 5
