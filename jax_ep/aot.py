"""Ahead-of-time compilation of a user's step, so its first call compiles nothing.

Together with ``Buffer.warmup()`` (which runs every op once: memory touched, ranks lined up,
kernels already preloaded at Buffer creation) this leaves no one-time cost for the first real
step. See benchmarks/first_call.py for the measured effect.
"""

from __future__ import annotations

import jax


def aot_compile(step, *example_args, **example_kwargs):
    """Compiles ``step`` for the shapes/shardings of the example arguments, now.

    Args:
      step: a function (jitted or not) that calls jax_ep ops inside ``jax.shard_map``.
      *example_args: arrays or ``jax.ShapeDtypeStruct``s (with shardings) like the real inputs.

    Returns:
      The compiled executable: call it with arrays of exactly those shapes, dtypes and
      shardings; it never retraces or recompiles.
    """
    jitted = step if hasattr(step, "lower") else jax.jit(step)
    return jitted.lower(*example_args, **example_kwargs).compile()
