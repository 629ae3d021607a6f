"""The custom call of every CUDA op: side-effecting for XLA, effect-free for JAX's dispatch.

``jax.ffi.ffi_call(..., has_side_effect=True)`` does two things: the HLO custom call is marked
side-effecting (XLA neither removes nor merges it: what our communicating calls need), and the
jaxpr gets a JAX effect. The effect costs every call of a program that holds one of our ops:
``jax.jit`` takes effectful programs off its C++ dispatch path and runs each call through
Python, with runtime tokens (docs/decisions.md, "How the ops sit in XLA"). This primitive keeps
the first and drops the second.

What the missing JAX effect allows, and why it is safe: JAX may drop a call whose results are
all unused (every rank runs the same program, so every rank drops the same call) and may
recompute one under ``jax.checkpoint`` (every rank again); it never reorders calls, which only
data dependences order anyway (``_ordering.py``). Differentiation and ``vmap`` are refused as
``ffi_call`` refuses them: the ops' own ``custom_vjp`` rules differentiate them.
"""

from __future__ import annotations

import functools

import jax
from jax.extend.core import Primitive
from jax.interpreters import mlir

custom_call_p = Primitive("jax_ep_custom_call")
custom_call_p.multiple_results = True


# Outside any trace: the one call, compiled once per target, types and attributes.
@functools.partial(jax.jit, static_argnames=("target_name", "result_avals", "attributes",
                                             "aliases"))
def _impl(*operands, target_name, result_avals, attributes, aliases):
    return custom_call_p.bind(*operands, target_name=target_name, result_avals=result_avals,
                              attributes=attributes, aliases=aliases)


custom_call_p.def_impl(_impl)


@custom_call_p.def_abstract_eval
def _abstract_eval(*operands, target_name, result_avals, attributes, aliases):
    del operands, target_name, attributes, aliases
    return result_avals


def _lowering(ctx, *operands, target_name, result_avals, attributes, aliases):
    del result_avals  # ctx.avals_out
    rule = jax.ffi.ffi_lowering(target_name, has_side_effect=True,
                                operand_output_aliases=dict(aliases) or None)
    return rule(ctx, *operands, **dict(attributes))


mlir.register_lowering(custom_call_p, _lowering)


def custom_call(target_name, result_avals, *operands, aliases=(), **attributes):
    """Calls FFI target ``target_name`` on ``operands`` with ``attributes`` (scalars: they are
    hashed), returning a tuple of arrays typed ``result_avals``. ``aliases``: (operand index,
    result index) pairs whose buffers XLA shares (a result written in place of its operand)."""
    return tuple(custom_call_p.bind(*operands, target_name=target_name,
                                    result_avals=tuple(result_avals),
                                    attributes=tuple(sorted(attributes.items())),
                                    aliases=tuple(aliases)))
