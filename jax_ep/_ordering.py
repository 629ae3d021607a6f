"""Program order of the low-latency calls of one trace (for the split send/receive halves).

XLA orders custom calls only through data dependences: ``has_side_effect`` keeps a call from
being removed or merged, not from being moved. A split low-latency call is two custom calls
(send, then receive, tied by the ticket), and per Buffer and op the split calls must run
send, receive, send, receive, ... (the split channel's regions are double-buffered by call
parity; docs/internals.md). Fused calls use their own channel of the workspace and may run
anywhere, also between a send and its receive (where XLA may place the fused calls of autodiff's
backward pass). For the split calls of one trace this module

- raises ``ValueError`` when a send of an op is traced while a send of the same op and Buffer
  waits for its receive, or when a pending object is received twice;
- hands each send a result of the previous receive of the same op (``after``), which the send's
  custom call takes as an operand it never reads, so XLA cannot run the send first. (An
  optimization barrier is not enough: XLA prunes a barrier's unused values, and scheduled all
  sends of a chain before their receives when only a barrier tied them.) Programs without
  split calls are left exactly as they were.

Limits: split calls in different traces (an inner ``jax.jit``, a ``lax.cond`` branch) are not
tied. The state holds the last receive's result strongly: a program that keeps only some of a
receive's outputs (``recv(...).recv_x``) must still tie its next send (a weak reference died
with the dropped result and the sends ran ahead of their receives). It is released when the
Buffer goes or when ``_TRACES_KEPT`` newer traces replace its entry.
"""

from __future__ import annotations

import threading
import weakref

import jax

try:  # public for library authors since jax 0.4.36 (jax.extend.core)
    from jax.extend.core import get_opaque_trace_state as _current_trace
except ImportError:  # pragma: no cover - older jax spells it jax.core.get_opaque_trace_state
    _current_trace = getattr(jax.core, "get_opaque_trace_state", None)

# Per Buffer and op, the states of this many most recent traces are kept (nested traces, e.g. a
# jit inside the shard_map body, must not wipe the outer trace's state).
_TRACES_KEPT = 8


class _OpTrace:
    """The split calls of one op of one Buffer in one trace."""

    def __init__(self, trace):
        self.trace = trace
        self.pending = False  # a send whose receive is not traced yet
        self.last = None  # a result of the last receive (a tracer of this trace)
        self.received = []  # weakrefs to the tickets received so far


_STATE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Buffer -> {op: [_OpTrace]}
_STATE_LOCK = threading.Lock()  # traces may run in several threads; an entry is one trace's


def _state(buf, op):
    if _current_trace is None:
        return None
    trace = _current_trace()
    with _STATE_LOCK:
        traces = _STATE.setdefault(buf, {}).setdefault(op, [])
        for entry in traces:
            if entry.trace == trace:
                return entry
        entry = _OpTrace(trace)
        traces.append(entry)
        del traces[:-_TRACES_KEPT]
        return entry


def before_send(buf, op):
    """Checks the rule for a send of ``op`` ("low_latency_dispatch" or "low_latency_combine");
    returns the value the send must take as its ``after`` operand: a result of the last receive
    of ``op`` in this trace (gradient stopped), or None when there is none."""
    entry = _state(buf, op)
    if entry is None:
        return None
    if entry.pending:
        raise ValueError(
            f"{op}_send: an earlier {op}_send on this Buffer has not been received yet "
            f"({op}_recv). At most one send per Buffer and op may wait for its receive: the "
            f"split calls' regions are double-buffered by call parity. Receive the first "
            f"pending object before the next send, or use a second Buffer for a second stream "
            f"of calls.")
    return None if entry.last is None else jax.lax.stop_gradient(entry.last)


def after_send(buf, op):
    entry = _state(buf, op)
    if entry is not None:
        entry.pending = True


def before_recv(buf, op, ticket):
    """Raises if the pending object holding ``ticket`` was received before in this trace."""
    entry = _state(buf, op)
    if entry is not None and any(ref() is ticket for ref in entry.received):
        raise ValueError(f"{op}_recv: this pending object was already received; every send has "
                         f"exactly one receive")


def after_recv(buf, op, ticket, result):
    """Records a receive of ``op``; ``result`` (an array of its outputs) ties the next send."""
    entry = _state(buf, op)
    if entry is None:
        return
    entry.pending = False
    entry.received.append(weakref.ref(ticket))
    entry.last = result
