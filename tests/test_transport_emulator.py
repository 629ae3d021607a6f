"""The emulated transport's host proxy on CPU (csrc/transport/emulator/host_proxy.cc,
docs/transport.md).

Python stands in for the kernels: it pushes commands into the same rings the device side of
EmulatedTransport fills, numpy arrays stand in for every rank's registered regions, and the
proxy runs over host memcpy, step by step or on its own thread. Rank 0 issues; its region 0 is
the send region. Ranks 1 and 2 are peers with a data region 0 and a signal region 1.
"""

import time

import numpy as np
import pytest

from jax_ep import testing
from jax_ep.backends import cuda

# None where the extension is missing: the `extension` fixture (conftest's rule) then fails each
# test where nvcc or a GPU is found, and skips it elsewhere, before the test touches _C. The
# test module is built and installed with _C.
_C, _ = cuda.load_extension()
try:
    from jax_ep import _C_testing
except ImportError:
    _C_testing = None
pytestmark = pytest.mark.usefixtures("extension")

SEEDS = range(16)
SEND, DATA, SIGNALS = 0, 0, 1


class World:
    """One issuing rank (0) and two peers, with a guard after every region: a write past a
    region's end lands in the guard, which the tests check stays zero."""

    def __init__(self, data_bytes=4096, guard=256, **options):
        self.queue = _C_testing.EmulatedQueueForTests(**options)
        rng = np.random.default_rng(1234)
        self.send = rng.integers(1, 256, data_bytes, dtype=np.uint8)
        self.backing = {}
        self.data = {}
        self.signals = {}
        self.queue.register_region(0, SEND, self.send)
        for peer in (1, 2):
            data = np.zeros(data_bytes + guard, np.uint8)
            signals = np.zeros(8 * 8 + guard, np.uint8)
            self.backing[peer] = (data, signals)
            self.data[peer] = data[:data_bytes]
            self.signals[peer] = signals[: 8 * 8]
            self.queue.register_region(peer, DATA, self.data[peer])
            self.queue.register_region(peer, SIGNALS, self.signals[peer])

    def guards_untouched(self):
        return all(
            not b[len(r) :].any()
            for peer, (data, signals) in self.backing.items()
            for b, r in ((data, self.data[peer]), (signals, self.signals[peer]))
        )

    def signal_word(self, peer, index):
        return int(self.signals[peer].view(np.uint64)[index])

    def data_positions(self):
        """Command positions in the order their (first) data chunk was delivered."""
        order = []
        for kind, _, position, *_ in self.queue.deliveries():
            if kind == "data" and position not in order:
                order.append(position)
        return order


def pushed_puts(world, count, rows=64, warp=0, peer=1, fence=False):
    """`count` puts of `rows` bytes each from the send region to the same offsets on `peer`."""
    positions = []
    for i in range(count):
        if fence:
            world.queue.fence(warp)
        positions.append(world.queue.put(warp, peer, DATA, i * rows, SEND, i * rows, rows))
    return positions


def test_in_order_mode_delivers_each_queue_in_order():
    for seed in SEEDS:
        world = World(ordering="in_order", seed=seed, chunk_bytes=32, max_delay_steps=5)
        positions = pushed_puts(world, 12)
        world.queue.run()
        assert world.data_positions() == positions, seed
        # Chunks of one message may interleave among themselves, never with the next message.
        by_message = [d[2] for d in world.queue.deliveries() if d[0] == "data"]
        assert by_message == sorted(by_message), seed
        assert np.array_equal(world.data[1][: 12 * 64], world.send[: 12 * 64])


def test_unordered_mode_reorders_some_seed_and_delivers_everything():
    reordered = 0
    for seed in SEEDS:
        world = World(seed=seed)
        positions = pushed_puts(world, 8)
        world.queue.run()
        order = world.data_positions()
        assert sorted(order) == positions, seed
        reordered += order != positions
        assert np.array_equal(world.data[1][: 8 * 64], world.send[: 8 * 64])
        assert not world.queue.errors()
    assert reordered > len(SEEDS) // 2, f"only {reordered} of {len(SEEDS)} seeds reordered"


def test_fence_restores_order_per_warp_and_peer():
    for seed in SEEDS:
        world = World(seed=seed, chunk_bytes=16, max_delay_steps=4)
        to_1 = pushed_puts(world, 8, fence=True)
        world.queue.run()
        assert world.data_positions() == to_1, seed
        # Every chunk of a message lands before any chunk of the next fenced one.
        by_message = [d[2] for d in world.queue.deliveries() if d[0] == "data"]
        assert by_message == sorted(by_message), seed


def test_fence_orders_one_warp_only():
    """A fenced command of warp 1 does not wait for warp 0's commands."""
    overtook = 0
    for seed in SEEDS:
        world = World(seed=seed, num_warps=2)
        first = world.queue.put(0, 1, DATA, 0, SEND, 0, 64)
        world.queue.fence(1)
        second = world.queue.put(1, 1, DATA, 64, SEND, 64, 64)
        world.queue.run()
        overtook += world.data_positions() == [second, first]
    assert overtook > 0


def test_signal_after_a_fence_is_never_visible_before_its_data():
    unfenced_early = 0
    for seed in SEEDS:
        for fence in (True, False):
            world = World(seed=seed, chunk_bytes=32, max_delay_steps=3)
            world.queue.put(0, 1, DATA, 0, SEND, 0, 256)
            if fence:
                world.queue.fence(0)
            world.queue.signal(0, 1, SIGNALS, 0, 1)
            # Step by step: whenever the signal is visible, all of its data must be there.
            early = False
            while world.queue.step() or world.queue.poll():
                if world.signal_word(1, 0) == 1 and not np.array_equal(
                    world.data[1][:256], world.send[:256]
                ):
                    early = True
            assert world.signal_word(1, 0) == 1
            if fence:
                assert not early, seed
            unfenced_early += early
    # Without the fence the emulator does show the signal first (the dropped-fence bug).
    assert unfenced_early > 0


def test_put_signal_orders_its_own_data_only():
    overtook = 0
    for seed in SEEDS:
        world = World(seed=seed, chunk_bytes=32)
        world.queue.put(0, 1, DATA, 0, SEND, 0, 128)
        world.queue.put_signal(0, 1, DATA, 128, SEND, 128, 128, SIGNALS, 8, 1)
        seen_own = seen_other = False
        while world.queue.step() or world.queue.poll():
            if world.signal_word(1, 1) == 1:
                assert np.array_equal(world.data[1][128:256], world.send[128:256]), seed
                seen_own = True
                if not np.array_equal(world.data[1][:128], world.send[:128]):
                    seen_other = True
        assert seen_own
        overtook += seen_other
    assert overtook > 0


def test_signal_add_accumulates_and_set_overwrites():
    world = World(seed=3, num_warps=2)
    for i in range(5):
        world.queue.put_signal(i % 2, 1, DATA, 64 * i, SEND, 64 * i, 64, SIGNALS, 16, 2)
    world.queue.run()
    assert world.signal_word(1, 2) == 10
    world.queue.signal(0, 1, SIGNALS, 16, 7, add=False)
    world.queue.run()
    assert world.signal_word(1, 2) == 7


def test_tearing_delivers_every_byte_exactly_once():
    shuffled = 0
    for seed in SEEDS:
        world = World(seed=seed, chunk_bytes=48)
        world.queue.put(0, 1, DATA, 64, SEND, 0, 1008)  # 21 chunks of 48 bytes
        world.queue.run()
        chunks = [(d[5], d[6]) for d in world.queue.deliveries() if d[0] == "data"]
        assert sorted(chunks) == [(o, 48) for o in range(0, 1008, 48)], seed
        shuffled += [o for o, _ in chunks] != sorted(o for o, _ in chunks)
        assert np.array_equal(world.data[1][64:1072], world.send[:1008])
        assert not world.data[1][:64].any() and not world.data[1][1072:].any()
        assert world.guards_untouched()
    assert shuffled > 0


def test_tearing_keeps_a_short_last_chunk():
    world = World(seed=0, chunk_bytes=96)
    world.queue.put(0, 1, DATA, 0, SEND, 0, 208)  # 96 + 96 + 16
    world.queue.run()
    chunks = sorted((d[5], d[6]) for d in world.queue.deliveries() if d[0] == "data")
    assert chunks == [(0, 96), (96, 96), (192, 16)]
    assert np.array_equal(world.data[1][:208], world.send[:208])
    assert not world.data[1][208:].any()


@pytest.mark.parametrize(
    "command, kind",
    [
        (("put", 0, 1, DATA, 4096 - 16, SEND, 0, 32), "destination_out_of_region"),
        (("put", 0, 1, DATA, 0, SEND, 4096 - 16, 32), "source_out_of_region"),
        (("put", 0, 1, 5, 0, SEND, 0, 32), "destination_out_of_region"),  # not registered
        (("put", 0, 3, DATA, 0, SEND, 0, 32), "destination_out_of_region"),  # unknown rank
        (("put", 0, 1, DATA, 0, SEND, 0, 2**63), "source_out_of_region"),  # offset overflow
        (("put", 0, 1, DATA, 8, SEND, 0, 32), "misaligned"),
        (("put_signal", 0, 1, DATA, 0, SEND, 0, 32, SIGNALS, 64, 1), "signal_out_of_region"),
        (("signal", 0, 1, SIGNALS, 4, 1), "misaligned"),
        (("signal", 0, 1, SIGNALS, 2**64 - 8, 1), "signal_out_of_region"),
    ],
)
def test_out_of_region_command_is_reported_and_writes_nothing(command, kind):
    world = World(seed=0)
    op, *args = command
    position = getattr(world.queue, op)(*args)
    world.queue.run()
    errors = world.queue.errors()
    assert [(e[0], e[2]) for e in errors] == [(kind, position)], errors
    assert f"position {position}" in errors[0][3]
    assert not any(d[0] in ("data", "signal") for d in world.queue.deliveries())
    assert not any(world.data[p].any() or world.signals[p].any() for p in (1, 2))
    assert world.guards_untouched()
    assert world.queue.traffic() == []  # a rejected command counts nothing
    # A quiet after a rejected command still returns (the kernel then fails on the error).
    quiet = world.queue.quiet(0)
    world.queue.run()
    assert world.queue.quiet_done(0, quiet)


def test_traffic_counts_rows_bytes_and_signals_per_destination():
    """Counted as delivered, whatever the tearing and order: a put-with-signal is a put and a
    signal, bytes are summed over chunks, a rejected command and a quiet count nothing."""
    for seed in range(4):
        world = World(seed=seed, num_warps=2, chunk_bytes=48, max_delay_steps=3)
        world.queue.put(0, 1, DATA, 0, SEND, 0, 1008)                             # 21 chunks
        world.queue.put(1, 1, DATA, 1024, SEND, 0, 64)
        world.queue.put_signal(0, 1, DATA, 2048, SEND, 0, 96, SIGNALS, 0, 1)
        world.queue.put_signal(1, 2, DATA, 0, SEND, 0, 32, SIGNALS, 8, 1)
        world.queue.signal(0, 2, SIGNALS, 16, 5, add=False)
        world.queue.signal(1, 2, SIGNALS, 24, 1)
        world.queue.put(0, 2, DATA, 4096, SEND, 0, 64)                            # rejected
        world.queue.signal(1, 1, SIGNALS, 64, 1)                                  # rejected
        world.queue.quiet(0)
        world.queue.run()
        assert len(world.queue.errors()) == 2, seed
        assert world.queue.traffic() == [
            {"src": 0, "dst": 1, "puts": 3, "bytes": 1008 + 64 + 96, "signals": 1},
            {"src": 0, "dst": 2, "puts": 1, "bytes": 32, "signals": 3},
        ], seed
        world.queue.reset_traffic()
        assert world.queue.traffic() == []
        world.queue.put(0, 2, DATA, 128, SEND, 0, 16)
        world.queue.run()
        assert world.queue.traffic() == [{"src": 0, "dst": 2, "puts": 1, "bytes": 16,
                                          "signals": 0}]


def test_traffic_is_counted_only_once_delivered():
    world = World(seed=0, chunk_bytes=16)
    world.queue.put_signal(0, 1, DATA, 0, SEND, 0, 64, SIGNALS, 0, 1)
    world.queue.poll()
    assert world.queue.traffic() == []
    world.queue.step()  # one chunk of four
    assert world.queue.traffic() == [{"src": 0, "dst": 1, "puts": 0, "bytes": 16, "signals": 0}]
    world.queue.run()
    assert world.queue.traffic() == [{"src": 0, "dst": 1, "puts": 1, "bytes": 64, "signals": 1}]


def test_fold_traffic_splits_by_host():
    rows = [{"src": 0, "dst": 1, "bytes": 10}, {"src": 0, "dst": 2, "bytes": 100},
            {"src": 0, "dst": 0, "bytes": 7}, {"src": 3, "dst": 2, "bytes": 1},
            {"src": 3, "dst": 0, "bytes": 1000}, {"src": 0, "dst": 1, "bytes": 5}]
    same, cross = testing.fold_traffic(rows, num_ranks=4, ranks_per_host=2)
    assert same.tolist() == [15, 0, 0, 1] and cross.tolist() == [100, 0, 0, 1000]
    matrix = np.arange(16.0).reshape(4, 4)
    same, cross = testing.fold_traffic(matrix, num_ranks=4, ranks_per_host=2)
    assert same.tolist() == [1, 4, 11, 14] and cross.tolist() == [5, 13, 17, 25]
    with pytest.raises(ValueError, match="multiple of ranks_per_host"):
        testing.fold_traffic(rows, num_ranks=4, ranks_per_host=3)


def test_a_rejected_command_does_not_stop_the_valid_ones():
    world = World(seed=5)
    world.queue.put(0, 1, DATA, 0, SEND, 0, 64)
    bad = world.queue.put(0, 1, DATA, 4096, SEND, 0, 64)
    world.queue.put(0, 2, DATA, 0, SEND, 64, 64)
    world.queue.run()
    assert [(e[0], e[2]) for e in world.queue.errors()] == [("destination_out_of_region", bad)]
    assert np.array_equal(world.data[1][:64], world.send[:64])
    assert np.array_equal(world.data[2][:64], world.send[64:128])
    assert world.guards_untouched()


def test_quiet_waits_for_the_calling_warp_only():
    overtook = 0
    for seed in SEEDS:
        world = World(seed=seed, num_warps=2, chunk_bytes=32, max_delay_steps=4)
        other = pushed_puts(world, 6, warp=1)
        mine = world.queue.put(0, 2, DATA, 0, SEND, 1024, 128)
        quiet = world.queue.quiet(0)
        while not world.queue.quiet_done(0, quiet):
            assert world.queue.step() or world.queue.poll(), seed
        # Acknowledged: every byte of warp 0's put has landed...
        assert np.array_equal(world.data[2][:128], world.send[1024:1152]), seed
        delivered = {d[2] for d in world.queue.deliveries() if d[0] == "data"}
        assert mine in delivered
        # ...while some of warp 1's may still be in flight.
        overtook += not set(other) <= delivered or not world.queue.idle()
        world.queue.run()
    assert overtook > 0


def test_quiet_covers_every_earlier_command_of_the_warp():
    for seed in SEEDS:
        world = World(seed=seed, chunk_bytes=16, max_delay_steps=8)
        pushed_puts(world, 4, peer=1)
        world.queue.put_signal(0, 2, DATA, 0, SEND, 0, 64, SIGNALS, 0, 1)
        quiet = world.queue.quiet(0)
        while not world.queue.quiet_done(0, quiet):
            assert world.queue.step() or world.queue.poll(), seed
        assert np.array_equal(world.data[1][:256], world.send[:256]), seed
        assert world.signal_word(2, 0) == 1, seed


def test_source_is_read_at_delivery_not_at_enqueue():
    world = World(seed=0)
    world.queue.put(0, 1, DATA, 0, SEND, 0, 64)
    world.queue.poll()
    world.send[:64] = 7
    world.queue.run()
    assert (world.data[1][:64] == 7).all()
    assert not world.queue.errors()  # no snapshot: nothing to compare with


def test_source_reused_before_quiet_is_caught_in_snapshot_mode():
    # Changed between the put and its delivery.
    world = World(seed=0, snapshot_sources=True)
    early = world.queue.put(0, 1, DATA, 0, SEND, 0, 64)
    world.queue.poll()
    world.send[10] ^= 0xFF
    world.queue.run()
    assert [(e[0], e[2]) for e in world.queue.errors()] == [("source_reused", early)]

    # Torn: reported once, however many chunks read the changed source.
    world = World(seed=0, snapshot_sources=True, chunk_bytes=16)
    torn = world.queue.put(0, 1, DATA, 0, SEND, 0, 256)
    world.queue.poll()
    world.send[:256] ^= 0xFF
    world.queue.quiet(0)
    world.queue.run()
    assert [(e[0], e[2]) for e in world.queue.errors()] == [("source_reused", torn)]

    # Changed after delivery but before the warp's quiet.
    world = World(seed=0, snapshot_sources=True)
    late = world.queue.put(0, 1, DATA, 0, SEND, 0, 64)
    world.queue.run()
    assert not world.queue.errors()
    world.send[63] ^= 0xFF
    world.queue.quiet(0)
    world.queue.run()
    assert [(e[0], e[2]) for e in world.queue.errors()] == [("source_reused", late)]

    # Changed after the quiet: allowed.
    world = World(seed=0, snapshot_sources=True)
    world.queue.put(0, 1, DATA, 0, SEND, 0, 64)
    world.queue.quiet(0)
    world.queue.run()
    world.send[:64] ^= 0xFF
    world.queue.put(0, 1, DATA, 64, SEND, 64, 64)
    world.queue.quiet(0)
    world.queue.run()
    assert not world.queue.errors()


def delivery_order(seed):
    world = World(seed=seed, num_warps=3, chunk_bytes=32, max_delay_steps=3)
    for warp in range(3):
        pushed_puts(world, 4, warp=warp, peer=1 + warp % 2)
        world.queue.signal(warp, 1, SIGNALS, 8 * warp, 1)
        world.queue.quiet(warp)
    world.queue.run()
    return world.queue.deliveries()


def test_same_seed_same_delivery_order_different_seeds_differ():
    for seed in (0, 1, 12345):
        assert delivery_order(seed) == delivery_order(seed)
    orders = {tuple(delivery_order(seed)) for seed in SEEDS}
    assert len(orders) == len(SEEDS)


def test_ring_wraps_around_when_smaller_than_the_commands():
    world = World(seed=2, capacity=4, chunk_bytes=16)
    positions = pushed_puts(world, 40, rows=32)
    assert positions == list(range(40))
    world.queue.run()
    assert np.array_equal(world.data[1][: 40 * 32], world.send[: 40 * 32])
    assert not world.queue.errors()


def test_ring_under_concurrent_producers():
    producers, per_producer = 4, 3000
    dst, errors = _C_testing.transport_ring_stress(producers, per_producer, capacity=8, seed=1)
    i = np.arange(producers * per_producer * 16, dtype=np.uint64)
    expected = ((i * 131 + 7) >> 4).astype(np.uint8)
    assert errors == 0
    assert np.array_equal(np.frombuffer(dst, np.uint8), expected)


# ------------------------------------------------------------ the proxy on its own thread


def test_proxy_thread_delivers_while_commands_arrive():
    """The proxy on its own thread (ProxyThread, as it runs next to the kernels): puts pushed
    into a ring smaller than them all, torn and delayed, land while the thread runs; a warp's
    quiet is acknowledged without anyone stepping the proxy."""
    world = World(seed=3, capacity=4, num_warps=2, chunk_bytes=16, max_delay_steps=3)
    world.queue.start_thread()
    assert world.queue.thread_running()
    pushed_puts(world, 60, rows=32, warp=0)
    pushed_puts(world, 60, rows=32, warp=1, peer=2)
    quiet = world.queue.quiet(1)
    deadline = time.monotonic() + 10
    while not world.queue.quiet_done(1, quiet):  # what the device's quiet() spins on
        assert time.monotonic() < deadline, "the thread never acknowledged the quiet"
        time.sleep(1e-4)
    assert np.array_equal(world.data[2][: 60 * 32], world.send[: 60 * 32])  # warp 1's puts
    assert world.queue.wait_drained(10)
    assert np.array_equal(world.data[1][: 60 * 32], world.send[: 60 * 32])
    assert world.queue.take_errors() == []
    world.queue.stop_thread()
    assert not world.queue.thread_running() and world.guards_untouched()


def test_proxy_thread_reports_each_error_once_and_keeps_going():
    world = World(seed=4)
    world.queue.start_thread()
    world.queue.put(0, 1, DATA, 0, SEND, 0, 64)
    bad = [world.queue.put(0, 1, DATA, 4096, SEND, 0, 64),
           world.queue.put(0, 2, DATA, 8, SEND, 0, 32)]
    world.queue.put(0, 2, DATA, 0, SEND, 64, 64)
    assert world.queue.wait_drained(10)
    errors = world.queue.take_errors()
    assert [(e[0], e[2]) for e in errors] == [("destination_out_of_region", bad[0]),
                                              ("misaligned", bad[1])], errors
    assert world.queue.take_errors() == []  # taken once
    assert np.array_equal(world.data[1][:64], world.send[:64])
    assert np.array_equal(world.data[2][:64], world.send[64:128])
    world.queue.stop_thread()
    assert world.guards_untouched()


def test_stopping_the_proxy_thread_delivers_what_was_pushed():
    """stop_thread() right after the pushes, while most of them are still pending (torn into
    16-byte chunks and delayed: far more steps than the pushes take), delivers them all."""
    world = World(data_bytes=2048 * 64, seed=6, capacity=2048, chunk_bytes=16,
                  max_delay_steps=20)
    world.queue.start_thread()
    pushed_puts(world, 2048, rows=64)
    world.queue.stop_thread()  # no wait: stop itself drains
    assert np.array_equal(world.data[1], world.send)
    assert world.queue.errors() == []  # the proxy is Python's again


def test_the_proxy_belongs_to_its_thread_while_it_runs():
    world = World(seed=0)
    world.queue.start_thread()
    for call in (world.queue.poll, world.queue.step, world.queue.run, world.queue.idle,
                 world.queue.deliveries, world.queue.errors):
        with pytest.raises(RuntimeError, match="stop_thread"):
            call()
    world.queue.stop_thread()
    assert world.queue.idle()
    assert not world.queue.wait_drained(0.1)  # no thread: nothing can drain


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"num_ranks": 9}, "num_ranks"),
    ({"row_bytes": 24}, "row_bytes"),
    ({"rounds": 0}, "rounds"),
    ({"transport": "nvlink"}, "transport"),
    ({"mutant": "drop_quiet"}, "mutant"),
    ({"ordering": "random"}, "ordering"),
])
def test_transport_probe_refuses_bad_arguments_before_touching_a_gpu(kwargs, message):
    # The GPU test of both transports is tests/test_transport_gpu.py.
    with pytest.raises(ValueError, match=message):
        _C_testing.transport_probe(**kwargs)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"num_ranks": 9}, "num_ranks"),
    ({"num_experts": 30}, "num_experts"),
    ({"hidden": 100}, "hidden"),
    ({"warps_per_rank": 0}, "warps_per_rank"),
    ({"transport": "nvlink"}, "transport"),
    ({"ordering": "random"}, "ordering"),
    ({"launches": "two"}, "launches"),
    ({"mutant": "drop_quiet"}, "mutant"),
    ({"combine_slots": 0}, "combine_slots"),
])
def test_low_latency_transport_refuses_bad_arguments_before_touching_a_gpu(kwargs, message):
    args = dict(num_ranks=8, num_experts=32, num_topk=4, max_tokens=8, hidden=256)
    with pytest.raises(ValueError, match=message):
        _C_testing.LowLatencyTransportForTests(**{**args, **kwargs})


@pytest.mark.parametrize("shape", [(1, 1, 1, 1, 128, 1, 1), (8, 32, 4, 8, 256, 4, 8),
                                   (8, 256, 8, 128, 7168, 16, 8), (2, 6, 3, 5, 384, 3, 2)])
def test_low_latency_transport_regions_neither_overlap_nor_overrun(shape):
    # Each region starts after the last element of the one before, 256-aligned, and the last
    # one ends inside the region's size: an accessor or a carve size off by one element fails.
    layout = _C_testing.low_latency_transport_layout(*shape)
    for starts, ends in ((layout["workspace"], layout["workspace_ends"]),
                         (layout["staging"], layout["staging_ends"])):
        assert starts[0] == 0 and all(s % 256 == 0 for s in starts), starts
        for i, end in enumerate(ends):
            assert starts[i] < end <= starts[i + 1], (i, starts, ends)
            # Carved with no more than alignment slack past the last element.
            assert starts[i + 1] - end < 256, (i, starts, ends)
    hidden = shape[4]
    assert layout["row_bytes"] == 2 * hidden
    assert layout["fp8_message_bytes"] % 16 == 0
    assert hidden + hidden // 32 <= layout["fp8_message_bytes"] <= layout["row_bytes"]


def test_state_names_what_was_drained_and_the_oldest_pending_command():
    """What a failed kernel's message shows of each proxy (RankProxy::Report::state)."""
    world = World(seed=0, num_queues=2)
    assert world.queue.state() == "queue 0: 0 drained; queue 1: 0 drained; 0 pending"
    pushed_puts(world, 3, warp=1, peer=2)
    world.queue.poll()
    # warp 1's commands go to queue 1 (warp % num_queues)
    assert world.queue.state() == ("queue 0: 0 drained; queue 1: 3 drained; 3 pending "
                                   "(oldest: queue 1 position 0 op 1 warp 1 peer 2)")
    world.queue.run()
    assert world.queue.state() == "queue 0: 0 drained; queue 1: 3 drained; 0 pending"
