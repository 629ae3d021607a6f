"""The reference backend (``backend="reference"``): docs/api.md's semantics in plain ``jax.lax``.

Runs inside ``jax.shard_map`` (manual over the EP axis) on any platform, XLA:CPU included. Each
rank packs, per destination rank, a capacity-padded block of ``T`` rows (every token that has an
expert there, in token order), exchanges the blocks with one ``all_to_all`` and compacts what it
received into the contract's order (source rank, then source token). Moved rows are gathered and
selected, never computed on, so they are bit-exact. ``ragged_all_to_all`` would avoid the padding
but does not run on XLA:CPU. A normal combine sums in float32, rounded once; when the Buffer's EP
groups span hosts (``Buffer._rank_hosts``), it sums per host first, each host's partial sum
rounded to the rows' dtype, as the hierarchical mode does (``sum_over_sources``;
``jax_ep.hierarchical``).

Every method has the same signature and handle layout as the CUDA backend
(``jax_ep/backends/cuda.py``; both implement ``jax_ep.backends.Backend``), so the public ops in
``jax_ep/ops.py`` treat both alike.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_ep import fp8
from jax_ep._types import DispatchHandle, Layout


def _compact_order(mask):
    """For each row of ``mask [N, T]``: the indices of its True entries first, ascending."""
    return jnp.argsort(~mask, axis=-1, stable=True).astype(jnp.int32)


def _split_rows(counts, num_rows):
    """Maps rows ``0..num_rows-1`` of a buffer grouped by source onto (source, position).

    Args:
      counts: ``[..., R]`` rows per source, sources stored back to back in ascending order.
      num_rows: rows of the output buffer.

    Returns:
      ``(source [..., num_rows], position [..., num_rows], valid [..., num_rows])``.
    """
    ends = jnp.cumsum(counts, axis=-1)
    starts = ends - counts
    rows = jnp.arange(num_rows, dtype=jnp.int32)
    source = jax.vmap(lambda e: jnp.searchsorted(e, rows, side="right"))(
        ends.reshape(-1, counts.shape[-1])).reshape(*counts.shape[:-1], num_rows)
    source = jnp.minimum(source, counts.shape[-1] - 1).astype(jnp.int32)
    position = rows - jnp.take_along_axis(starts, source, axis=-1)
    valid = rows < ends[..., -1:]
    return source, position.astype(jnp.int32), valid


def sum_over_sources(got, rank_hosts, dtype):
    """A normal combine's sum over the ranks that hold each row (docs/api.md, "combine").

    Args:
      got: ``[R(source), T, ...]`` float32, zero where a rank sent nothing.
      rank_hosts: host of each rank of the EP group (ints; hosts are taken in ascending order),
        or None when the group lies inside one host.
      dtype: the result's dtype (the rows' own).

    Returns:
      ``[T, ...]`` of ``dtype``. One host: the flat sum, float32 over the ranks in XLA's
      reduction order (which depends on the shape), rounded once. Several hosts (the
      hierarchical combine's order, explicit, bit for bit): per host, the
      float32 sum over its ranks in ascending rank order, rounded to ``dtype`` (the partial sum
      that host's forwarder sends over the network), then the float32 sum of the partial sums
      in ascending host order, rounded to ``dtype``. ``jax_ep.testing.sum_by_host`` is its
      NumPy oracle.
    """
    if rank_hosts is None:
        return jnp.sum(got, axis=0).astype(dtype)
    total = jnp.zeros(got.shape[1:], jnp.float32)
    for host in sorted(set(rank_hosts)):
        partial = jnp.zeros(got.shape[1:], jnp.float32)
        for rank in (r for r, h in enumerate(rank_hosts) if h == host):
            partial = partial + got[rank]
        total = total + partial.astype(dtype).astype(jnp.float32)
    return total.astype(dtype)


def _select_rows(valid, rows, fill):
    """``rows`` where ``valid`` (broadcast over trailing dims), else ``fill``; bit-exact."""
    mask = valid.reshape(valid.shape + (1,) * (rows.ndim - valid.ndim))
    return jnp.where(mask, rows, jnp.asarray(fill, rows.dtype))


class ReferenceBackend:
    """Pure-JAX implementation of every op, for one Buffer's configuration."""

    name = "reference"

    def __init__(self, buf):
        self.buf = buf
        self.axis = buf.axis_name
        self.num_ranks = buf.num_ranks
        self.num_experts = buf.num_experts
        self.num_local_experts = buf.num_local_experts

    # ----------------------------------------------------------------------------- routing
    def _expert_rank(self, topk_idx):
        """Rank of each selected expert, -1 for -1 or invalid ids; and the invalid-id count."""
        valid = (topk_idx >= 0) & (topk_idx < self.num_experts)
        invalid = jnp.sum((topk_idx != -1) & ~valid).astype(jnp.int32)
        return jnp.where(valid, topk_idx // self.num_local_experts, -1), valid, invalid

    def _is_token_in_rank(self, expert_rank):
        ranks = jnp.arange(self.num_ranks, dtype=expert_rank.dtype)
        return jnp.any(expert_rank[:, :, None] == ranks, axis=1)

    def layout(self, topk_idx):
        expert_rank, valid, invalid = self._expert_rank(topk_idx)
        self.buf._report_errors(invalid, jnp.int32(0))
        is_in = self._is_token_in_rank(expert_rank)
        per_expert = jnp.zeros((self.num_experts,), jnp.int32).at[
            jnp.where(valid, topk_idx, self.num_experts)].add(1, mode="drop")
        return Layout(num_tokens_per_rank=jnp.sum(is_in, axis=0, dtype=jnp.int32),
                      num_tokens_per_expert=per_expert,
                      is_token_in_rank=is_in)

    # -------------------------------------------------------------------------- normal mode
    def _exchange(self, blocks):
        """``[R(dest), ...]`` per-destination blocks -> ``[R(source), ...]``."""
        return jax.lax.all_to_all(blocks, self.axis, split_axis=0, concat_axis=0)

    def _send_plan(self, is_in):
        """Tokens in each destination's block, in token order: ``[R, T]`` and counts ``[R]``."""
        return _compact_order(is_in.T), jnp.sum(is_in, axis=0, dtype=jnp.int32)

    def _pack(self, token_of, count, rows):
        """Per-destination blocks ``[R, T, ...]`` of ``rows [T, ...]`` (zero past ``count``)."""
        valid = jnp.arange(rows.shape[0])[None, :] < count[:, None]
        return _select_rows(valid, rows[token_of], 0)

    def dispatch(self, x, x_scales, topk_idx, topk_weights):
        R, T = self.num_ranks, x.shape[0]
        capacity = self.buf.capacity_for(T)
        me = jax.lax.axis_index(self.axis)
        expert_rank, _, invalid = self._expert_rank(topk_idx)
        is_in = self._is_token_in_rank(expert_rank)
        token_of, count = self._send_plan(is_in)

        # send_pos: every rank needs all counts to know where its rows land at each receiver.
        count_matrix = jax.lax.all_gather(count, self.axis)  # [R(source), R(dest)]
        offset = jnp.sum(jnp.where(jnp.arange(R)[:, None] < me, count_matrix, 0), axis=0)
        position = jnp.cumsum(is_in, axis=0, dtype=jnp.int32) - 1
        send_pos = jnp.where(is_in, offset[None, :] + position, -1).astype(jnp.int32)
        num_recv = jnp.sum(count_matrix[:, me]).astype(jnp.int32)

        # Local expert ids as each destination sees them (-1 for experts elsewhere).
        dest = jnp.arange(R, dtype=jnp.int32)[:, None, None]
        local_idx = jnp.where(expert_rank[None] == dest,
                              topk_idx[None] - dest * self.num_local_experts, -1)
        tokens = jnp.arange(T, dtype=jnp.int32)
        picked_idx = jnp.take_along_axis(local_idx, token_of[:, :, None], axis=1)
        valid_slot = tokens[None, :] < count[:, None]
        blocks = dict(
            x=self._pack(token_of, count, x),
            scales=self._pack(token_of, count, x_scales),
            idx=jnp.where(valid_slot[:, :, None], picked_idx, -1),
            weights=self._pack(token_of, count, topk_weights),
            token=jnp.where(valid_slot, token_of, -1),
        )
        recv = {k: self._exchange(v) for k, v in blocks.items()}

        source, slot, valid = _split_rows(count_matrix[:, me], capacity)
        take = lambda a: a[source, slot]  # noqa: E731
        recv_idx = _select_rows(valid, take(recv["idx"]), -1)
        recv_w = jnp.where(recv_idx >= 0, take(recv["weights"]), 0.0).astype(jnp.float32)
        recv_src = jnp.where(valid, source * T + take(recv["token"]), -1).astype(jnp.int32)
        per_expert = jnp.sum(
            jnp.any(recv_idx[:, :, None] == jnp.arange(self.num_local_experts), axis=1),
            axis=0, dtype=jnp.int32)
        self.buf._report_errors(invalid, jnp.maximum(num_recv - capacity, 0))
        return dict(
            recv_x=_select_rows(valid, take(recv["x"]), 0),
            recv_scales=_select_rows(valid, take(recv["scales"]), 0),
            recv_topk_idx=recv_idx,
            recv_topk_weights=recv_w,
            num_recv_tokens=num_recv,
            num_recv_tokens_per_expert=per_expert,
            handle=DispatchHandle(send_pos=send_pos, recv_src=recv_src, num_recv_tokens=num_recv),
        )

    def cached_dispatch(self, x, x_scales, w, handle):
        R, T = self.num_ranks, x.shape[0]
        capacity = handle.recv_src.shape[0]
        is_in = handle.send_pos >= 0
        token_of, count = self._send_plan(is_in)
        recv = [self._exchange(self._pack(token_of, count, a)) for a in (x, x_scales, w)]

        # Received rows are grouped by source: a row's slot in its source's block is its index
        # minus the first row of that source.
        valid = handle.recv_src >= 0
        source = jnp.where(valid, handle.recv_src // T, 0)
        per_source = jnp.sum(valid[:, None] & (source[:, None] == jnp.arange(R)), axis=0)
        first_row = jnp.cumsum(per_source) - per_source
        slot = jnp.arange(capacity) - first_row[source]
        slot = jnp.where(valid, slot, 0)
        return tuple(_select_rows(valid, a[source, slot], 0) for a in recv)

    def combine(self, y, y_w, handle):
        R = self.num_ranks
        T = handle.send_pos.shape[0]
        capacity = y.shape[0]
        valid = handle.recv_src >= 0
        owner = jnp.where(valid, handle.recv_src // T, R)  # R = out of range: dropped
        token = jnp.where(valid, handle.recv_src % T, 0)

        def reduce(rows):
            back = jnp.zeros((R, T) + rows.shape[1:], rows.dtype)
            back = back.at[owner, token].set(rows, mode="drop")
            got = self._exchange(back)  # [R(source), T, ...]
            received = (handle.send_pos >= 0) & (handle.send_pos < capacity)  # [T, R]
            got = jnp.where(received.T.reshape(R, T, *([1] * (rows.ndim - 1))),
                            got.astype(jnp.float32), 0.0)
            return sum_over_sources(got, self.buf._rank_hosts, rows.dtype)

        return reduce(y), reduce(y_w)

    # --------------------------------------------------------------------- low-latency mode
    def low_latency_dispatch(self, x, topk_idx, use_fp8, round_scale):
        R, T = self.num_ranks, x.shape[0]
        E, E_loc, T_max = self.num_experts, self.num_local_experts, self.buf.max_tokens_per_rank
        K = topk_idx.shape[1]
        _, valid, invalid = self._expert_rank(topk_idx)

        # One row per selection (t, k) with a valid id, in (t, k) order per expert; a source
        # has T_max rows at each expert, selections past them (possible only when a token
        # repeats an expert) are dropped and counted.
        width = min(T * K, T_max)                                          # rows per block
        flat = jnp.where(valid, topk_idx, -1).reshape(T * K)
        hits = flat[None, :] == jnp.arange(E, dtype=jnp.int32)[:, None]   # [E, T*K]
        selection_of = _compact_order(hits)[:, :width]                     # [E, width]
        total = jnp.sum(hits, axis=1, dtype=jnp.int32)                     # [E]
        count = jnp.minimum(total, T_max)
        self.buf._report_errors(invalid, jnp.int32(0), jnp.sum(total - count))
        token_of, k_of = selection_of // K, selection_of % K
        slot_valid = jnp.arange(width)[None, :] < count[:, None]

        if use_fp8:
            payload, scales = fp8.per_token_cast_to_fp8(x, round_scale)
        else:
            payload, scales = x, jnp.zeros((T, 0), jnp.float32)
        by_rank = lambda a: a.reshape((R, E_loc) + a.shape[1:])  # noqa: E731
        blocks = dict(
            x=by_rank(payload[token_of]),
            scales=by_rank(scales[token_of]),
            token=by_rank(jnp.where(slot_valid, token_of, -1)),
            k=by_rank(jnp.where(slot_valid, k_of, -1)),
            count=by_rank(count),
        )
        recv = {k: self._exchange(v) for k, v in blocks.items()}  # [R(source), E_loc, ...]

        rows = R * T_max
        source, slot, row_valid = _split_rows(recv["count"].T, rows)      # [E_loc, rows]
        slot = jnp.where(row_valid, slot, 0)
        expert = jnp.arange(E_loc)[:, None]
        take = lambda a: a[source, expert, slot]  # noqa: E731
        recv_src = jnp.where(row_valid, source * T_max + take(recv["token"]), -1)
        return dict(
            recv_x=_select_rows(row_valid, take(recv["x"]), 0),
            recv_scales=_select_rows(row_valid, take(recv["scales"]), 0),
            recv_count=jnp.sum(recv["count"], axis=0, dtype=jnp.int32),
            recv_src=recv_src.astype(jnp.int32),
            recv_k=jnp.where(row_valid, take(recv["k"]), -1).astype(jnp.int32),
        )

    def low_latency_combine(self, y, topk_idx, topk_weights, handle):
        R, T, K = self.num_ranks, topk_idx.shape[0], topk_idx.shape[1]
        T_max = self.buf.max_tokens_per_rank
        valid = handle.recv_src >= 0
        owner = jnp.where(valid, handle.recv_src // T_max, R)  # R = out of range: dropped
        token = jnp.where(valid, handle.recv_src % T_max, 0)
        k = jnp.where(valid, handle.recv_k, 0)
        back = jnp.zeros((R, T_max, K, y.shape[-1]), y.dtype)
        back = back.at[owner, token, k].set(y, mode="drop")
        got = jnp.sum(self._exchange(back).astype(jnp.float32), axis=0)[:T]  # one source each
        _, selected, _ = self._expert_rank(topk_idx)
        weights = jnp.where(selected, topk_weights, 0.0).astype(jnp.float32)
        out = jnp.sum(jnp.where(selected[:, :, None], weights[:, :, None] * got, 0.0), axis=1)
        return out.astype(jnp.bfloat16)

    # Send/receive halves (same signatures as the CUDA backend's): nothing moves at the send;
    # the receive computes the fused op from the inputs the pending object carried, so results
    # are those of the fused op by construction.
    def low_latency_dispatch_send(self, x, topk_idx, after, use_fp8, round_scale):
        del x, topk_idx, after, use_fp8, round_scale  # pure XLA: data dependences order it
        return jnp.zeros((1,), jnp.int32)

    def low_latency_dispatch_recv(self, x, topk_idx, ticket, use_fp8, round_scale):
        del ticket
        return self.low_latency_dispatch(x, topk_idx, use_fp8, round_scale)

    def low_latency_combine_send(self, y, topk_idx, topk_weights, handle, after):
        del y, topk_idx, topk_weights, handle, after
        return jnp.zeros((1,), jnp.int32)

    def low_latency_combine_recv(self, y, topk_idx, topk_weights, handle, ticket):
        del ticket
        return self.low_latency_combine(y, topk_idx, topk_weights, handle)
