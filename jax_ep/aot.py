"""Ahead-of-time compilation of a user's step, so its first real call pays nothing extra.

Together with ``Buffer.warmup()`` (which runs every jax_ep op once: communication memory touched,
ranks lined up; kernels are already preloaded at Buffer creation) this leaves no one-time cost
for the first real step. One-time costs and where they go: tracing and XLA compilation ->
``lower().compile()`` here; loading the compiled program's own GPU kernels and first use of its
buffers -> the warm-up execution here; jax_ep's kernels -> preloaded by the Buffer.
See benchmarks/first_call.py for the measured effect.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_ep.backends import cuda


def _zeros_like(example):
    sharding = getattr(example, "sharding", None)
    return jnp.zeros(example.shape, example.dtype, device=sharding)


# Executions of the compiled step by aot_compile's warm-up. On 2x H200 the second and third
# calls of a low-latency step still cost 1.3-2x the steady state (host-side caches of the
# executable's launch path warming up), the fourth no longer does.
WARMUP_EXECUTIONS = 3


def aot_compile(step, *example_args, warmup=True, warmup_args=None):
    """Compiles ``step`` for the shapes/shardings of ``example_args`` now, and runs it a few times.

    Args:
      step: a function (jitted or not) that calls jax_ep ops inside ``jax.shard_map``.
      *example_args: arrays or ``jax.ShapeDtypeStruct``s (with shardings) like the real inputs.
      warmup: execute the compiled step ``WARMUP_EXECUTIONS`` times (an int: that many times;
        False: never; outputs discarded) so that XLA loads its kernels, allocates its buffers
        and warms its launch path before the first real call. The step must be free of side
        effects other than jax_ep's communication (true of a pure jitted function). Call
        ``buf.warmup()`` before this, not after: the step's own executions come last.
      warmup_args: inputs for that execution; default ``example_args`` themselves when they are
        all arrays (the first real call with them then finds XLA's command buffers recorded for
        their addresses), else zeros shaped like them (zero expert ids route everything to
        expert 0: valid, if skewed).

    Returns:
      The compiled executable: call it with arrays of exactly those shapes, dtypes and
      shardings; it never retraces or recompiles.
    """
    jitted = step if hasattr(step, "lower") else jax.jit(step)
    compiled = jitted.lower(*example_args).compile()
    if warmup:
        args = warmup_args
        if args is None:
            concrete = all(isinstance(a, jax.Array) for a in jax.tree.leaves(example_args))
            args = example_args if concrete else jax.tree.map(_zeros_like, example_args)
        for _ in range(WARMUP_EXECUTIONS if warmup is True else int(warmup)):
            jax.block_until_ready(compiled(*args))
    return compiled


def export_step(step, *args, platforms=("cuda",), **export_kwargs):
    """``jax.export.export(step)(*args)`` for a step that calls jax_ep ops, ready to serialise.

    Adds ``disabled_checks=export_safety_checks()`` (our custom calls carry a version in their
    name instead of a compatibility guarantee) and lowers with the GSPMD partitioner, so that a
    symbolic token count (``jax.export.symbolic_shape``) refines to static shapes when the
    deserialised program is compiled: under Shardy, jax 0.10-0.11 leave the shard_map body's
    shapes dynamic and the GPU compile fails (``cuda.gspmd_partitioner``). The exported program
    is called as usual, under either partitioner.

    Args:
      step: a jitted function (e.g. ``jax.jit(jax.shard_map(...))``).
      *args: ``jax.ShapeDtypeStruct``s, possibly with symbolic dimensions.
      platforms: lowering platforms (default cuda: exporting from a CPU machine works with a
        ``Buffer(..., backend="cuda", lowering_only=True)``).
      **export_kwargs: passed to ``jax.export.export``.
    """
    checks = list(export_kwargs.pop("disabled_checks", ())) + cuda.export_safety_checks()
    with cuda.gspmd_partitioner():
        return jax.export.export(step, platforms=platforms, disabled_checks=checks,
                                 **export_kwargs)(*args)
