"""The peers jax_ep is compared with, as per-rank functions inside ``jax.shard_map``:
``jax.lax.all_to_all`` with capacity padding and ``jax.lax.ragged_all_to_all``.

Sharding model: per rank, over the mesh axis ``"ep"`` (``bench_mesh``). Both have the routing
semantics of ``jax_ep.dispatch`` / ``jax_ep.combine`` (docs/api.md, "Normal mode"): a token goes
once to every rank that holds at least one of its top-k experts, and combine sums what comes
back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import bench_mesh as bm
import jax.numpy as jnp
from jax import lax


def token_in_rank(topk_idx, num_ranks: int, experts_per_rank: int):
    """``[T, R]`` bool: token t has at least one expert on rank r."""
    dst = jnp.where(topk_idx >= 0, topk_idx // experts_per_rank, -1)
    return (dst[:, :, None] == jnp.arange(num_ranks, dtype=dst.dtype)).any(axis=1)


def to_local_ids(recv_idx, experts_per_rank: int):
    """Global expert ids -> this rank's local ids, -1 for experts elsewhere."""
    first = lax.axis_index(bm.AXIS) * experts_per_rank
    local = recv_idx - first
    return jnp.where((recv_idx >= 0) & (local >= 0) & (local < experts_per_rank), local, -1)


def _as_bytes(a):
    """fp8 -> uint8 bit pattern (collectives move bytes; NCCL has no fp8 type)."""
    return lax.bitcast_convert_type(a, jnp.uint8) if a.dtype == jnp.float8_e4m3fn else a


def _from_bytes(a, dtype):
    return lax.bitcast_convert_type(a, dtype) if dtype == jnp.float8_e4m3fn else a


def pack_meta(topk_idx, topk_weights):
    """``[T, 2K]`` int32: ids then the weights' bits (one collective for the routing metadata)."""
    if topk_weights is None:
        return topk_idx
    return jnp.concatenate([topk_idx, lax.bitcast_convert_type(topk_weights, jnp.int32)], -1)


def unpack_meta(meta, topk: int, experts_per_rank: int):
    idx = to_local_ids(meta[:, :topk], experts_per_rank)
    if meta.shape[1] == topk:
        return idx, None
    w = lax.bitcast_convert_type(meta[:, topk:], jnp.float32)
    return idx, jnp.where(idx >= 0, w, 0.0)


class AllToAllPeer:
    """``jax.lax.all_to_all`` with capacity padding.

    Dispatch: each rank builds ``[R, T, ...]`` (row ``[r, t]`` = token t if it goes to rank r,
    else zeros) for the data and for the packed (ids, weights) metadata, and exchanges them with
    tiled all_to_alls; rank r receives ``[R*T, ...]`` grouped by source rank (rows of tokens not
    sent to r: zeros, ids -1). Combine: the expert
    output ``y [R*T, H]`` (rows in the received order) goes back with the reverse all_to_all and
    the owner sums, in float32, the rows of the ranks its token went to.
    """

    name = "all_to_all"

    def __init__(self, num_ranks: int, experts: int, topk: int):
        self.num_ranks, self.topk = num_ranks, topk
        self.experts_per_rank = experts // num_ranks

    def _exchange(self, a, mask, fill=0):
        num_tokens = a.shape[0]
        keep = mask.T.reshape(self.num_ranks, num_tokens, *([1] * (a.ndim - 1)))
        a = _as_bytes(a)
        send = jnp.where(keep, a[None], jnp.full((), fill, a.dtype))
        recv = lax.all_to_all(send, bm.AXIS, 0, 0, tiled=True)
        return recv.reshape(self.num_ranks * num_tokens, *a.shape[1:])

    def dispatch(self, payload: Sequence[Any], topk_idx, topk_weights=None):
        """``payload``: arrays ``[T, ...]`` (x, or x_fp8 and scales). Returns received arrays
        ``[R*T, ...]``, local ids ``[R*T, K]`` (-1 = not here) and weights (or None)."""
        mask = token_in_rank(topk_idx, self.num_ranks, self.experts_per_rank)
        recv = [_from_bytes(self._exchange(a, mask), a.dtype) for a in payload]
        # Rows not sent to a rank carry ids -1 (no expert), so they never look local there.
        meta = self._exchange(pack_meta(topk_idx, topk_weights), mask, fill=-1)
        return (*recv, *unpack_meta(meta, self.topk, self.experts_per_rank))

    def plan(self, topk_idx):
        """The combine 'handle': which ranks each local token went to."""
        return token_in_rank(topk_idx, self.num_ranks, self.experts_per_rank)

    def combine(self, y, plan):
        num_tokens = plan.shape[0]
        back = lax.all_to_all(
            y.reshape(self.num_ranks, num_tokens, -1), bm.AXIS, 0, 0, tiled=True
        )  # [R (expert rank), T, H]
        keep = plan.T[:, :, None]
        return jnp.sum(jnp.where(keep, back.astype(jnp.float32), 0.0), axis=0).astype(y.dtype)


class RaggedAllToAllPeer:
    """``jax.lax.ragged_all_to_all``, MaxText pattern.

    Dispatch: each rank sorts the (token, destination rank) pairs by destination (a gather into
    ``[R*T, ...]``), exchanges the per-destination sizes with one small ``all_gather`` (every rank
    then knows the whole ``[R_src, R_dst]`` size matrix, hence input/output offsets), and moves the
    rows with ``ragged_all_to_all`` into an ``[R*T, ...]`` output (grouped by source rank, rows
    past the received count zero, their ids -1); the packed (ids, weights) metadata goes the same
    way. Combine: the reverse ``ragged_all_to_all`` of the expert output, then each owner
    gathers, for each token, the rows of the ranks it went to and sums them in float32.
    """

    name = "ragged_all_to_all"

    def __init__(self, num_ranks: int, experts: int, topk: int):
        self.num_ranks, self.topk = num_ranks, topk
        self.experts_per_rank = experts // num_ranks

    def plan(self, topk_idx):
        num_ranks, num_tokens = self.num_ranks, topk_idx.shape[0]
        mask = token_in_rank(topk_idx, num_ranks, self.experts_per_rank)  # [T, R]
        flat = mask.T.reshape(-1)  # [R*T], destination-major
        pos = (jnp.cumsum(flat.astype(jnp.int32)) - 1).reshape(num_ranks, num_tokens).T  # [T, R]
        # Sorted order: row p of the send buffer holds token send_token[p].
        send_token = jnp.zeros(num_ranks * num_tokens, jnp.int32).at[
            jnp.where(mask, pos, num_ranks * num_tokens)
        ].set(jnp.broadcast_to(jnp.arange(num_tokens, dtype=jnp.int32)[:, None], mask.shape),
              mode="drop")
        send_sizes = mask.sum(0).astype(jnp.int32)  # [R]
        sizes = lax.all_gather(send_sizes, bm.AXIS)  # [R_src, R_dst]
        me = lax.axis_index(bm.AXIS)
        before_src = jnp.cumsum(sizes, 0) - sizes  # rows from earlier sources, per destination
        before_dst = jnp.cumsum(sizes, 1) - sizes  # rows to earlier destinations, per source
        return {
            "mask": mask, "pos": pos, "send_token": send_token,
            "send_sizes": send_sizes,
            "input_offsets": before_dst[me],
            "output_offsets": before_src[me],  # where my rows start in each receiver's output
            "recv_sizes": sizes[:, me],
            "recv_offsets": before_src[:, me],
            "back_output_offsets": before_dst[:, me],  # where my rows sat in each source's send
        }

    def _exchange(self, a, plan, fill=0):
        a = _as_bytes(a)
        send = jnp.take(a, plan["send_token"], axis=0, mode="clip")
        out = jnp.full((self.num_ranks * a.shape[0], *a.shape[1:]), fill, a.dtype)
        return lax.ragged_all_to_all(
            send, out, plan["input_offsets"], plan["send_sizes"], plan["output_offsets"],
            plan["recv_sizes"], axis_name=bm.AXIS,
        )

    def dispatch(self, payload: Sequence[Any], topk_idx, topk_weights=None):
        plan = self.plan(topk_idx)
        recv = [_from_bytes(self._exchange(a, plan), a.dtype) for a in payload]
        meta = self._exchange(pack_meta(topk_idx, topk_weights), plan, fill=-1)
        return (*recv, *unpack_meta(meta, self.topk, self.experts_per_rank))

    def combine(self, y, plan):
        back = lax.ragged_all_to_all(
            y, jnp.zeros_like(y), plan["recv_offsets"], plan["recv_sizes"],
            plan["back_output_offsets"], plan["send_sizes"], axis_name=bm.AXIS,
        )  # [R*T, H] in this rank's destination-sorted send order
        rows = jnp.take(back, plan["pos"], axis=0, mode="clip")  # [T, R, H]
        keep = plan["mask"][:, :, None]
        return jnp.sum(jnp.where(keep, rows.astype(jnp.float32), 0.0), axis=1).astype(y.dtype)


PEER_CLASSES = {"all_to_all": AllToAllPeer, "ragged_all_to_all": RaggedAllToAllPeer}
