"""Two micro-batches whose communication runs under each other's compute (two-batch overlap).

Sharding model: per rank, inside ``jax.shard_map`` manual over the Buffer's axis, under
``jax.jit``, like the ops.

A step is a list of stages that alternate between ``Compute`` (any JAX function of the
parameters and the state) and ``Comm`` (jax_ep ops only). Both micro-batches run every stage
in order, B one stage behind A, so that each communication stage of one micro-batch runs
beside a compute stage of the other::

    A: comm0 | comp1 | comm2 | comp3 |       ...        (stages [comm, comp, comm])
    B:       | comm0 | comp1 | comm2 | ...

e.g. for one MoE layer (``moe_ffn(..., micro_batches=2)``): A's dispatch, then A's experts
beside B's dispatch, B's experts beside A's combine, then B's combine. Over a Buffer with
``overlap=True`` each pair runs through ``deferred.overlap``: the communication starts on the
Buffer's side stream before the compute and is waited for after it. With ``overlap=False`` or
the reference backend the same stages run in the same order, computing the same values.

``two_batch`` is differentiable (w.r.t. the parameters and both states) when every stage is: its
backward runs the reversed stages with the same schedule, so the backward's communication (each
op's own backward: a combine for a dispatch, a cached dispatch for a combine) overlaps the
other micro-batch's backward compute too. Decode stages (low-latency ops) have no backward.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_ep.backends import deferred

__all__ = ["Comm", "Compute", "two_batch"]


@dataclasses.dataclass(frozen=True)
class Compute:
    """A compute stage: ``fn(params, state) -> state``, any JAX function."""

    fn: Callable[[Any, Any], Any]


@dataclasses.dataclass(frozen=True)
class Comm:
    """A communication stage: ``forward(state) -> (state, residuals)`` and, for training,
    ``backward(residuals, state_cotangent) -> input_cotangent``. Both may compute on their
    inputs but must only call jax_ep ops after that and return their results as they come
    (``deferred.overlap``), since those are read only after the wait."""

    forward: Callable[[Any], tuple[Any, Any]]
    backward: Callable[[Any, Any], Any] | None = None


def _check_stages(stages):
    kinds = [type(s) for s in stages]
    if not stages or any(k not in (Compute, Comm) for k in kinds):
        raise ValueError(f"two_batch: stages must be a non-empty list of Compute and Comm, got "
                         f"{stages!r}")
    if any(a is b for a, b in zip(kinds, kinds[1:], strict=False)):
        raise ValueError("two_batch: stages must alternate between Compute and Comm, got "
                         f"{[k.__name__ for k in kinds]}")


def _schedule(is_comm, run, first, second):
    """Runs stage k of ``first`` beside stage k-1 of ``second`` for k = 0..n; ``run(m, k, s)``
    returns (state, extra). Returns the final states and the extras [m][k].

    In an overlapped pair the waits take (``pinned``) the compute's state only, not its extra (a
    stage's residuals, or its parameters' gradient), so XLA need not write those out whole."""
    n = len(is_comm)
    states, extras = [first, second], [[None] * n, [None] * n]
    for k in range(n + 1):
        jobs = [(m, s) for m, s in ((0, k), (1, k - 1)) if 0 <= s < n]
        comm = [(m, s) for m, s in jobs if is_comm[s]]
        compute = [(m, s) for m, s in jobs if not is_comm[s]]
        if comm and compute:
            (cm, cs), (pm, ps) = comm[0], compute[0]
            (states[cm], extras[cm][cs]), (states[pm], extras[pm][ps]) = deferred.overlap(
                lambda cm=cm, cs=cs: run(cm, cs, states[cm]),
                lambda state, pm=pm, ps=ps: run(pm, ps, state), states[pm],
                pinned=lambda out: out[0])
        else:
            for m, s in jobs:
                states[m], extras[m][s] = run(m, s, states[m])
    return states, extras


def _forward(stages, params, state_a, state_b, record):
    is_comm = [isinstance(s, Comm) for s in stages]

    def run(m, k, state):
        stage = stages[k]
        if isinstance(stage, Comm):
            return stage.forward(state)
        if record:
            return jax.vjp(stage.fn, params, state)
        return stage.fn(params, state), None

    return _schedule(is_comm, run, state_a, state_b)


def _zero_cotangent(x):
    """The zero cotangent of one leaf: float0 for integer and boolean arrays."""
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.zeros(x.shape, x.dtype)
    return np.zeros(x.shape, jax.dtypes.float0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _two_batch(stages, params, state_a, state_b):
    (out_a, out_b), _ = _forward(stages, params, state_a, state_b, record=False)
    return out_a, out_b


def _two_batch_fwd(stages, params, state_a, state_b):
    if any(isinstance(s, Comm) and s.backward is None for s in stages):
        raise ValueError("two_batch: a Comm stage without a backward (decode stages) is not "
                         "differentiable")
    (out_a, out_b), extras = _forward(stages, params, state_a, state_b, record=True)
    return (out_a, out_b), (params, extras)


def _two_batch_bwd(stages, residuals, cotangents):
    params, extras = residuals
    n = len(stages)
    is_comm = [isinstance(s, Comm) for s in reversed(stages)]
    ct_params = [None, None]
    # B finished last: it leads the backward (micro-batch 0 of the schedule is B).
    order = (1, 0)

    def run(m, j, ct):
        micro_batch, k = order[m], n - 1 - j
        if isinstance(stages[k], Comm):
            return stages[k].backward(extras[micro_batch][k], ct), None
        ct_p, ct_state = extras[micro_batch][k](ct)
        return ct_state, ct_p

    (ct_b, ct_a), ct_extra = _schedule(is_comm, run, cotangents[1], cotangents[0])
    for m in (0, 1):
        for ct_p in ct_extra[m]:
            if ct_p is not None:
                ct_params[m] = ct_p if ct_params[m] is None else jax.tree.map(
                    jnp.add, ct_params[m], ct_p)
    total = ct_params[0] if ct_params[1] is None else jax.tree.map(jnp.add, *ct_params)
    if total is None:
        total = jax.tree.map(_zero_cotangent, params)
    return total, ct_a, ct_b


_two_batch.defvjp(_two_batch_fwd, _two_batch_bwd)


def two_batch(stages, params, state_a, state_b):
    """Runs ``stages`` on micro-batches A and B with A's communication under B's compute and
    the other way round (see the module docstring).

    Args:
      stages: a list of ``Compute`` and ``Comm`` stages, alternating.
      params: a pytree every ``Compute`` stage receives (differentiable).
      state_a, state_b: the two micro-batches' first states (pytrees of arrays; their
        structure may change from stage to stage).

    Returns:
      ``(state_a, state_b)`` after the last stage.
    """
    _check_stages(stages)
    return _two_batch(tuple(stages), params, state_a, state_b)
