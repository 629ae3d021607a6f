"""Timing of the benchmarks: programs that repeat an op (unrolled, one host dispatch), the
difference of a short and a long program's wall times, and the timer noise that decides
whether a time is a figure.

Sharding model: the programs are ``jax.jit(jax.shard_map(...))`` over the mesh axis ``"ep"``
(``bench_mesh``), every argument sharded along axis 0.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import bench_mesh as bm
import jax
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P


def shard_mapped(mesh: Mesh, fn: Callable, num_args: int, donate: tuple[int, ...] = ()):
    """``jax.jit(shard_map(fn))``: every argument (a pytree) sharded along "ep" on axis 0, and
    every output leaf concatenated along axis 0 over the ranks; ``donate``: the arguments the
    caller gives up (XLA may reuse their buffers for outputs)."""
    return jax.jit(
        jax.shard_map(
            fn, mesh=mesh, in_specs=(P(bm.AXIS),) * num_args, out_specs=P(bm.AXIS), check_vma=False
        ),
        donate_argnums=donate,
    )


def _per_rank_leaves(tree):
    """Every array leaf with a leading axis of 1 (a free reshape), so scalars can leave the
    shard_map as ``[R]`` arrays."""
    return [leaf[None] for leaf in jax.tree.leaves(tree)]


def repeated_program(mesh: Mesh, op: Callable, iterations: int, prologue: Callable | None = None,
                     epilogue: Callable | None = None, outputs: str = "all"):
    """One jitted program that runs ``op`` ``iterations`` times, unrolled.

    ``program(fixed, sets)``: ``fixed`` is a tuple of global arrays given to ``prologue`` once
    (its result, e.g. a dispatch handle, is ``ctx``); ``sets`` is a tuple of argument tuples, at
    least ``iterations`` of them: iteration i runs ``op(ctx, *sets[i])``. ``epilogue(ctx, args,
    out)`` runs once after the last iteration (its arguments and outputs), e.g. to complete a
    call that the iterations leave open; like the prologue it cancels in a short/long difference.

    - Distinct inputs per iteration: no two calls are the same expression, so XLA cannot CSE
      them (an ``optimization_barrier`` alone does not stop that: XLA:CPU removes it first).
    - ``outputs="all"``: every output of every call is an output of the program (no reduction
      that XLA could slice through), so no work is dead. ``"last"``: only the last call's (and
      the epilogue's); the barriers below keep every earlier call alive, and the program hands
      back far fewer buffers (a check of how much the per-output host work weighs).
    - Iteration i+1's arguments pass through an ``optimization_barrier`` together with
      iteration i's outputs, asking XLA to run the calls one after the other. With
      ``outputs="all"`` those outputs leave the program through the barrier, which keeps it;
      with ``"last"`` XLA prunes the barrier's unused values and the calls are not ordered by
      it (custom calls with side effects still all run).
    """

    if outputs not in ("all", "last"):
        raise ValueError(f"outputs must be 'all' or 'last', got {outputs!r}")

    def body(fixed, sets):
        if len(sets) < iterations:
            raise ValueError(f"{iterations} iterations need as many input sets, got {len(sets)}")
        ctx = prologue(*fixed) if prologue is not None else None
        carry = None
        kept = []
        for i in range(iterations):
            args = sets[i]
            if carry is not None:
                args, carry = lax.optimization_barrier((args, carry))
                # XLA prunes a barrier's unused values (and with them the tie): the previous
                # call's outputs leave the program through the barrier.
                kept[-1] = carry
            carry = op(ctx, *args)
            kept.append(carry)
        if outputs == "last":
            kept = kept[-1:]
        if epilogue is not None:
            kept.append(epilogue(ctx, args, carry))
        return _per_rank_leaves(kept)

    return shard_mapped(mesh, body, 2)


def wall_us(fn: Callable, *args) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return (time.perf_counter() - start) * 1e6


def time_per_op_us(
    compiled_short, compiled_long, args, n_short: int, n_long: int, repeats: int, warmup: int
) -> tuple[float, dict[str, float]]:
    """GPU time of one op: ``(median t(n_long) - median t(n_short)) / (n_long - n_short)``.

    Each program is one host dispatch, so the fixed host cost (~200 us for a 2-GPU call) and the
    prologue cancel in the difference. Short and long runs are interleaved so drift hits both.
    The extras hold both medians and the per-op timer noise (``noise_us``, see ``noise_us``).
    """
    for _ in range(warmup):
        wall_us(compiled_short, *args)
        wall_us(compiled_long, *args)
    short, long = [], []
    for _ in range(repeats):
        short.append(wall_us(compiled_short, *args))
        long.append(wall_us(compiled_long, *args))
    med_short, med_long = statistics.median(short), statistics.median(long)
    per_op = (med_long - med_short) / (n_long - n_short)
    return per_op, {"t_short_us": med_short, "t_long_us": med_long,
                    "noise_us": noise_us(short, long, n_long - n_short)}


# Standard deviation of normal samples = 1.4826 x their median absolute deviation (robust to the
# odd slow call); the standard error of a median of n samples = 1.2533 sigma / sqrt(n).
_MAD_TO_SIGMA = 1.4826
_MEDIAN_STDERR = 1.2533

# A per-op time within this many standard errors of zero is reported as below the noise.
NOISE_STDERRS = 2.0


def noise_us(short: Sequence[float], long: Sequence[float], calls: int) -> float:
    """Timer noise of a per-op time ``(median(long) - median(short)) / calls``: ``NOISE_STDERRS``
    standard errors of that difference, each median's from its samples' median absolute
    deviation. A time at or below it cannot be told from zero."""

    def stderr(samples):
        center = statistics.median(samples)
        mad = statistics.median(abs(s - center) for s in samples)
        return _MEDIAN_STDERR * _MAD_TO_SIGMA * mad / len(samples) ** 0.5

    return NOISE_STDERRS * (stderr(short) ** 2 + stderr(long) ** 2) ** 0.5 / calls


def below_noise(time_us: float, extra: dict[str, float]) -> bool:
    """Whether a per-op time from ``time_per_op_us`` is too small to tell from its noise."""
    return time_us <= extra.get("noise_us", 0.0)


def noise_text(extra: dict[str, float]) -> str:
    """``"below noise (±x us)"``, the words a table prints for such a time."""
    noise = extra.get("noise_us", 0.0)
    return f"below noise (±{noise / 1e3:.3g} ms)" if noise >= 1e3 else \
        f"below noise (±{noise:.3g} us)"
