"""The normal mode's rounds, on their model (tests/rounds_model.py): under random interleavings
of blocks and warps, every routing of the op tests lands each row where it belongs through a
window a fraction of the call's size, without an overwritten slot or a hang; and the model
catches each way of breaking the protocol that matters."""

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


# Each broken protocol (rounds_model.MUTANTS) in each op, but finished rounds published out of
# order in the combine: its round k + 2 reuses the slots of round k alone (a token's slot is its
# index modulo two rounds), so a credit for round k needs no earlier round (the kernels publish in
# order anyway). The dispatch needs the order: a round of nothing but the rank's own rows counts
# as finished at once, while rows of an earlier round may still wait in their slots.
@pytest.mark.parametrize(("op", "mutant"), [
    (op, mutant) for op in (model.dispatch, model.combine) for mutant in model.MUTANTS
    if (op, mutant) != (model.combine, "unordered")])
def test_each_broken_protocol_is_caught(op, mutant):
    """Among the random cases, one at least ends in a misplaced or overwritten row or a hang."""
    for _, routing, window, grid in cases(120):
        rows = window * len(routing) if op is model.combine else window
        try:
            op(routing, rows, mutant=mutant, **grid)
        except AssertionError as e:
            assert "overwritten" in str(e) or "wrong slot" in str(e) or "other rows" in str(e), e
            return
        except model.Deadlock:
            return
    pytest.fail(f"{op.__name__} survives {mutant}")


def test_the_combine_takes_finished_rounds_in_any_order():
    for _, routing, window, grid in cases(60):
        model.combine(routing, window * len(routing), mutant="unordered", **grid)
