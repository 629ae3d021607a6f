"""DeepEP's hierarchical normal mode for an EP group across hosts, composed of two groups of the
flat ops.

The EP group is a mesh's two axes, hosts x GPUs of a host (rank = host * G + gpu, the order of a
flat EP axis laid out host by host). A dispatch sends each token once per destination host, to
the GPU of the same local index there: the flat dispatch of the group of that local index over
the host axis (``across``), whose experts are a host's. That GPU forwards the token to the ranks
of its host holding its experts: the flat dispatch of the host's group over the GPU axis
(``within``). A combine runs the other way: each forwarding GPU sums its host's rows (float32,
rounded to the Buffer's dtype: the partial sum that crosses the network), then the token's
owner sums the hosts' partial sums in host order, which is the order and rounding of a combine
across hosts (docs/api.md, "combine"). The dispatch's results are the flat dispatch's, bit for
bit: rows arrive forwarder by forwarder, and are put back in the flat order (by source rank,
then token) with the handle's ``order``.

The forwarder lays the rows it received at slots ``host * T + token`` before it forwards them,
so the within leg's ``recv_src`` names each row's source host and token at the expert rank. No
routing metadata moves but what the legs move themselves: the mode's own code runs no
collective, so it runs wherever the flat ops run, processes sharing one GPU included (where NCCL,
and so XLA's collectives, refuses two ranks on one GPU). For that reason the handle has no
``send_pos`` (where each token lands at each rank of the flat group): it would take every rank's
counts, a gather over the group that nothing of the hierarchical ops needs.

Each leg is a Buffer of the flat ops, so every backend and transport serves it: over the CUDA
kernels, the ``across`` leg is the one that crosses hosts (NVSHMEM's device API:
docs/process_models.md, "What spans hosts") and the ``within`` leg stays on NVLink.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jax_ep import ops
from jax_ep._types import Dispatched, DispatchHandle
from jax_ep.buffer import Buffer
from jax_ep.system import config


@dataclasses.dataclass(frozen=True)
class HierarchicalHandle:
    """Routing of one hierarchical dispatch, for ``combine`` and the cached ``dispatch``.

    Attributes:
      recv_src: ``[C]`` int32, the flat dispatch's: ``src_rank * T + src_token``, ``-1`` past
        the received rows.
      num_recv_tokens: ``[]`` int32 rows this rank received.
      across: the ``DispatchHandle`` of the leg across hosts (at the forwarding GPU).
      within: the ``DispatchHandle`` of the leg within the host (its rows: the forwarder's
        slots, ``host * T + token``).
      order: ``[C]`` int32, the ``within`` row that is each row of the results.
    """

    recv_src: jax.Array
    num_recv_tokens: jax.Array
    across: DispatchHandle
    within: DispatchHandle
    order: jax.Array


jax.tree_util.register_dataclass(
    HierarchicalHandle, data_fields=[f.name for f in dataclasses.fields(HierarchicalHandle)],
    meta_fields=[])


class HierarchicalBuffer:
    """The two Buffers of a hierarchical EP group: ``across`` (over ``host_axis``: the ranks of
    one local index on every host) and ``within`` (over ``gpu_axis``: one host's GPUs).

    Args:
      mesh: a mesh with ``host_axis`` (one entry per host) and ``gpu_axis`` (the GPUs of a
        host), besides any other axes.
      num_experts, hidden, max_tokens_per_rank, num_topk, dtype: as ``Buffer``'s, for the group
        of ``hosts * gpus`` ranks.
      capacity: rows a rank receives, at most (default ``R * max_tokens_per_rank``); rows past
        it are dropped in the flat order, as a flat dispatch drops them.
      **kwargs: the other ``Buffer`` arguments (``backend``, ``timeout_s``, ...), for both legs.
    """

    def __init__(self, mesh, host_axis, gpu_axis, *, num_experts, hidden, max_tokens_per_rank,
                 num_topk, capacity=None, dtype=jnp.bfloat16, **kwargs):
        for name, axis in (("host_axis", host_axis), ("gpu_axis", gpu_axis)):
            if axis not in mesh.axis_names:
                raise ValueError(f"{name} {axis!r} is not an axis of the mesh "
                                 f"{tuple(mesh.axis_names)}")
        if host_axis == gpu_axis:
            raise ValueError(f"host_axis and gpu_axis must differ, both are {host_axis!r}")
        self.mesh, self.host_axis, self.gpu_axis = mesh, host_axis, gpu_axis
        self.num_hosts, self.gpus_per_host = mesh.shape[host_axis], mesh.shape[gpu_axis]
        self.num_ranks = self.num_hosts * self.gpus_per_host
        checked = config.check_config(
            num_ranks=self.num_ranks, num_experts=num_experts, hidden=hidden,
            max_tokens_per_rank=max_tokens_per_rank, num_topk=num_topk, capacity=capacity)
        self.num_experts, self.hidden, self.num_topk = num_experts, hidden, num_topk
        self.max_tokens_per_rank = max_tokens_per_rank
        self.capacity = checked["capacity"] or self.num_ranks * max_tokens_per_rank
        self.across = Buffer(mesh, host_axis, num_experts=num_experts, hidden=hidden,
                             max_tokens_per_rank=max_tokens_per_rank, num_topk=num_topk,
                             dtype=dtype, **kwargs)
        # The forwarding GPU's rows, all of them: the within leg never drops one.
        forwarded = self.num_hosts * max_tokens_per_rank
        self.within = Buffer(mesh, gpu_axis, num_experts=num_experts // self.num_hosts,
                             hidden=hidden, max_tokens_per_rank=forwarded, num_topk=num_topk,
                             dtype=dtype, **kwargs)
        self.dtype = self.across.dtype

    def close(self):
        self.across.close()
        self.within.close()


def _to_slots(rows, sources, num_slots, fill):
    """The forwarder's received rows at their slots: row ``i`` at ``sources[i]`` (the across
    leg's ``recv_src``, ``host * T + token``), ``fill`` where no row came; ``[num_slots, ...]``."""
    where = jnp.where(sources >= 0, sources, num_slots)  # past the end: dropped
    slots = jnp.full((num_slots,) + rows.shape[1:], fill, rows.dtype)
    return slots.at[where].set(rows, mode="drop")


def _from_slots(slots, sources):
    """``_to_slots`` undone: the rows at ``sources`` in the across leg's order, zero past its
    received rows."""
    valid = sources >= 0
    rows = slots[jnp.where(valid, sources, 0)]
    return jnp.where(valid.reshape(valid.shape + (1,) * (rows.ndim - 1)), rows, 0)


def _forward(hbuf, at_forwarder, across, num_tokens, handle=None):
    """The within leg: the forwarder's rows from their slots (so a row's slot, which the
    within leg's ``recv_src`` carries to the expert rank, names its source host and token),
    to the ranks of its host holding its experts."""
    num_slots = hbuf.num_hosts * num_tokens
    x = _to_slots(at_forwarder.recv_x, across.recv_src, num_slots, 0)
    if handle is not None:
        return ops.dispatch(hbuf.within, x, handle=handle)
    return ops.dispatch(
        hbuf.within, x, _to_slots(at_forwarder.recv_topk_idx, across.recv_src, num_slots, -1),
        _to_slots(at_forwarder.recv_topk_weights, across.recv_src, num_slots, 0))


def _flat_order(hbuf, within, num_tokens):
    """(order, recv_src): the within rows in the flat dispatch's order (source rank, then
    token; padding last), the first ``capacity`` of them, and their flat sources. A within row
    comes from GPU ``g`` of the host (the forwarder, the source's local index) and slot
    ``host * T + token`` there; its flat source rank is ``host * G + g``."""
    num_slots = hbuf.num_hosts * num_tokens
    valid = within.recv_src >= 0
    gpu, slot = within.recv_src // num_slots, within.recv_src % num_slots
    host, token = slot // num_tokens, slot % num_tokens
    flat = (host * hbuf.gpus_per_host + gpu) * num_tokens + token
    last = jnp.iinfo(jnp.int32).max
    order = jnp.argsort(jnp.where(valid, flat, last), stable=True)[: hbuf.capacity]
    recv_src = jnp.where(valid[order], flat[order], -1).astype(jnp.int32)
    return order.astype(jnp.int32), recv_src


def dispatch(hbuf, x, topk_idx=None, topk_weights=None, *, handle=None) -> Dispatched:
    """``jax_ep.dispatch`` over the hierarchical group: the same results, bit for bit, with a
    ``HierarchicalHandle``. Differentiable w.r.t. ``x`` and ``topk_weights``.

    Args:
      hbuf: the ``HierarchicalBuffer``.
      x: ``[T, H]`` of the Buffer's dtype.
      topk_idx, topk_weights: ``[T, K]`` int32 global expert ids (``-1`` = none), float32.
      handle: instead of the routing, the handle of an earlier hierarchical dispatch (the
        cached form: ``recv_x``, ``num_recv_tokens`` and the handle only).
    """
    num_tokens = x.shape[0]
    if handle is not None:
        if topk_idx is not None or topk_weights is not None:
            raise ValueError("pass either handle (cached dispatch) or topk_idx/topk_weights")
        if not isinstance(handle, HierarchicalHandle):
            raise ValueError(f"handle must be a hierarchical dispatch's HierarchicalHandle, got "
                             f"{type(handle).__name__}")
        at_forwarder = ops.dispatch(hbuf.across, x, handle=handle.across)
        at_rank = _forward(hbuf, at_forwarder, handle.across, num_tokens, handle.within)
        return Dispatched(recv_x=at_rank.recv_x[handle.order], recv_scales=None,
                          recv_topk_idx=None, recv_topk_weights=None,
                          num_recv_tokens=handle.num_recv_tokens,
                          num_recv_tokens_per_expert=None, handle=handle)
    if topk_idx is None or topk_weights is None:
        raise ValueError("dispatch needs topk_idx and topk_weights (or handle=)")
    # Across hosts: once per destination host, ids made local to that host.
    at_forwarder = ops.dispatch(hbuf.across, x, topk_idx, topk_weights)
    # Within the host: to the ranks of the experts, ids made local to each rank.
    at_rank = _forward(hbuf, at_forwarder, at_forwarder.handle, num_tokens)
    order, recv_src = _flat_order(hbuf, at_rank.handle, num_tokens)
    recv_topk_idx = at_rank.recv_topk_idx[order]
    local_experts = hbuf.num_experts // hbuf.num_ranks
    holds = recv_topk_idx[:, :, None] == jnp.arange(local_experts)[None, None, :]
    handle = HierarchicalHandle(
        recv_src=recv_src, num_recv_tokens=at_rank.num_recv_tokens,
        across=at_forwarder.handle, within=at_rank.handle, order=order)
    return Dispatched(
        recv_x=at_rank.recv_x[order], recv_scales=None, recv_topk_idx=recv_topk_idx,
        recv_topk_weights=at_rank.recv_topk_weights[order],
        num_recv_tokens=at_rank.num_recv_tokens,
        num_recv_tokens_per_expert=holds.any(axis=1).sum(axis=0, dtype=jnp.int32),
        handle=handle)


def combine(hbuf, y, handle, topk_weights=None):
    """``jax_ep.combine`` over the hierarchical group: each host's rows summed at its forwarding
    GPU (float32, rounded to the Buffer's dtype), then the hosts' sums at the token's owner
    (float32 in host order, rounded once more). Returns ``(combined [T, H], combined weights
    [T, K] or None)``; differentiable w.r.t. ``y`` and ``topk_weights``."""
    if not isinstance(handle, HierarchicalHandle):
        raise ValueError(f"handle must be a hierarchical dispatch's HierarchicalHandle, got "
                         f"{type(handle).__name__}")
    rows = handle.within.recv_src.shape[0]
    at_rank = jnp.zeros((rows,) + y.shape[1:], y.dtype).at[handle.order].set(y)
    weights = None
    if topk_weights is not None:
        weights = jnp.zeros((rows,) + topk_weights.shape[1:], topk_weights.dtype)
        weights = weights.at[handle.order].set(topk_weights)
    # The forwarder's partial sums, at their slots, back in the across leg's row order.
    partial, partial_weights = ops.combine(hbuf.within, at_rank, handle.within, weights)
    sources = handle.across.recv_src
    if partial_weights is not None:
        partial_weights = _from_slots(partial_weights, sources)
    return ops.combine(hbuf.across, _from_slots(partial, sources), handle.across,
                       partial_weights)
