"""Asynchronous ops held open across compute: the starts of a ``Buffer(overlap=True)``'s ops
traced inside ``overlap``'s communication function are waited for only after its compute.

Sharding model: per rank, inside ``jax.shard_map`` under ``jax.jit``, like the ops.

A ``Buffer(overlap=True)`` runs each op as two custom calls (``cuda.py``): ``<op>_async``,
which launches the op's kernels on the Buffer's side stream and returns at once, and ``wait``,
whose results are the op's (aliased: no copy) once XLA's stream has waited for those kernels.
Called plainly, an op's wait follows its start. ``overlap(comm, compute, *args)`` pins the
schedule by data dependences, which XLA keeps: the compute's arguments pass an optimization
barrier with a result of the first start (so every compute op comes after the starts), and
each wait takes the compute's results (``pinned`` of them) as operands it never reads (so it
comes after all of them); the waits also take the starts' operands, which XLA then keeps alive
until the kernels have read them.

``comm`` may only call jax_ep ops (of overlap Buffers, chained or not) and return their results
rearranged: anything else it computes from an op's result would read it before the wait. The
reference backend and ``Buffer(overlap=False)`` have nothing to hold open: there ``overlap``
runs ``comm`` then ``compute``, and XLA orders them by their data alone.

``pins(...)`` drops either pin while it is open, to measure what the pins buy
(``benchmarks/bench_overlap.py --unpinned``) and to check that a lowered program missing one is
caught (``tests/test_two_batch.py``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

import jax
from jax.extend.core import get_opaque_trace_state

_local = threading.local()


class _Started:
    """The async ops started inside one ``collect()``: (backend, raw results, operands), and
    the trace they must belong to."""

    def __init__(self):
        self.ops = []
        self.trace = get_opaque_trace_state()


@contextlib.contextmanager
def pins(*, compute_after_starts: bool = True, waits_after_compute: bool = True):
    """Which of ``overlap``'s pins hold for the ops traced while this is open (both by default).

    Args:
      compute_after_starts: False: no optimization barrier ties the compute's arguments to the
        first start, so XLA may run the compute before the starts.
      waits_after_compute: False: no op is left to ``overlap``; each op of an overlap Buffer
        waits right after its start (the async calls and the side stream without the
        two-micro-batch schedule), and ``overlap`` runs ``comm`` then ``compute``.

    Trace-time only (it changes the program traced, not a compiled one); not for models: a
    step traced with a pin dropped computes the same values, without the overlap.
    """
    previous = getattr(_local, "pins", (True, True))
    _local.pins = (bool(compute_after_starts), bool(waits_after_compute))
    try:
        yield
    finally:
        _local.pins = previous


def _pins() -> tuple[bool, bool]:
    return getattr(_local, "pins", (True, True))


@contextlib.contextmanager
def collect():
    """While open, an overlap Buffer's op leaves its wait to the collector."""
    stack = _local.__dict__.setdefault("stack", [])
    started = _Started()
    stack.append(started)
    try:
        yield started
    finally:
        stack.pop()


def collector():
    """The innermost open ``collect()`` when the caller traces at its level, else None: an op
    traced deeper (inside a ``custom_vjp``, an inner ``jit``) waits for itself, since its
    results cannot leave that trace unwaited."""
    stack = getattr(_local, "stack", None)
    if not stack or not _pins()[1] or stack[-1].trace != get_opaque_trace_state():
        return None
    return stack[-1]


def overlap(comm: Callable, compute: Callable, *compute_args, pinned: Callable = lambda out: out):
    """``(comm(), compute(*compute_args))``, the ops of ``comm`` running beside ``compute``.

    Returns both results; ``comm``'s are the waited ones. ``pinned(compute_out)``: the part of
    the compute's results the waits take, so XLA computes it before them (default: all); the
    rest XLA may compute after the waits, and need not store: a wait's operand is a buffer XLA
    must write out whole, where an unpinned result may fuse into its consumers. Not
    differentiable by itself (the two-micro-batch schedule of ``jax_ep.moe`` has its own
    backward, which overlaps too).
    """
    with collect() as started:
        comm_out = comm()
    if not started.ops:
        return comm_out, compute(*compute_args)
    # The tie: the first start's smallest result. Its wait does not alias it (XLA would copy
    # a buffer that is both an aliased operand and, through the barrier, another operand of
    # the same call, and copy it on its stream before the wait: a read before the kernels
    # wrote it); the wait copies it after joining instead, a few bytes.
    first = started.ops[0][1]
    tie = min(range(len(first)), key=lambda i: first[i].size * first[i].dtype.itemsize)
    tied = _pins()[0]
    if tied:
        compute_args, token = jax.lax.optimization_barrier((compute_args, first[tie]))
    compute_out = compute(*compute_args)
    after = [leaf for leaf in jax.tree.leaves(pinned(compute_out)) if isinstance(leaf, jax.Array)]
    if tied:
        after.append(token)
    waited = {}
    for n, (backend, raw, operands) in enumerate(started.ops):
        results = jax.lax.optimization_barrier(backend.wait(
            raw, operands, tuple(after), unaliased=(tie,) if n == 0 and tied else ()))
        waited.update({id(r): w for r, w in zip(raw, results, strict=True)})
    leaves, treedef = jax.tree.flatten(comm_out)
    return jax.tree.unflatten(treedef, [waited.get(id(leaf), leaf) for leaf in leaves]), compute_out
