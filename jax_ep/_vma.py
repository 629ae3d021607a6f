"""Varying-manual-axes (vma) helpers for shard_map's type check, across jax versions.

Inside ``jax.shard_map`` every value is typed with the manual axes it varies over. Our ops'
results vary over the EP axis; custom_vjp demands that a cotangent has its primal's type, and
our custom call types its results like its operands (which must agree). So the public ops first
align every input to one set of axes (pcast to varying, whose transpose sums the gradient of an
invariant input).
"""

from __future__ import annotations

import jax


def varying_axes(x) -> frozenset:
    """Manual mesh axes ``x`` varies over (empty outside shard_map or with check_vma=False)."""
    aval = jax.typeof(x)
    vma = getattr(aval, "vma", None)
    if vma is None:  # jax 0.10 spells it aval.mat.varying
        vma = getattr(getattr(aval, "mat", None), "varying", frozenset())
    return frozenset(vma)


def make_varying(x, axes: frozenset):
    """``x`` cast to vary over ``axes`` (a no-op when it already does)."""
    missing = tuple(sorted(axes - varying_axes(x)))
    if not missing:
        return x
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(x, missing, to="varying")
    return jax.lax.pvary(x, missing)


def align(axis_name, tree):
    """Every array leaf of ``tree`` cast to vary over the union of their axes and ``axis_name``.

    With check_vma=False nothing carries axes and nothing is cast."""
    leaves, treedef = jax.tree.flatten(tree)
    axes = frozenset().union(*(varying_axes(a) for a in leaves))
    if not axes:
        return tree  # vma checking is off (or nothing is varying yet: outside shard_map)
    axes |= {axis_name}
    return jax.tree.unflatten(treedef, [make_varying(a, axes) for a in leaves])


def check_manual_axis(axis_name, num_ranks, op):
    """Raises ValueError unless ``op`` is traced inside ``jax.shard_map`` manual over
    ``axis_name`` of ``num_ranks`` ranks (outside it the arrays are global, not per rank)."""
    try:
        size = jax.lax.axis_size(axis_name)
    except NameError:  # "unbound axis name": not inside a shard_map manual over the axis
        raise ValueError(
            f"{op} runs per rank: call it inside jax.shard_map manual over the Buffer's axis "
            f"{axis_name!r}, each rank passing its own arrays (the README's API example "
            f"shows one)") from None
    if size != num_ranks:
        raise ValueError(f"{op}: the shard_map's axis {axis_name!r} has {size} ranks, the "
                         f"Buffer's mesh {num_ranks}: use the Buffer's mesh")
