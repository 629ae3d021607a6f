"""The stages of an expert-parallel MoE layer, for ``two_batch``'s two-micro-batch schedule.

Sharding model: per rank, inside ``jax.shard_map`` manual over the Buffer's axis, under
``jax.jit``.

A state is a pair ``(flow, carry)``: ``flow`` is what the layer's stages transform, ``carry``
whatever the caller threads through them untouched (a residual, say). A communication stage
calls the Buffer's backend directly (not the public ops, whose ``custom_vjp`` would keep their
results from being waited for outside them) and computes nothing from its results.

Normal mode (training, prefill), flows::

    (x [T, H], topk_idx [T, K], topk_weights [T, K])                  -- dispatch_stage ->
    (recv_x [C, H], recv_topk_idx [C, K], recv_topk_weights [C, K], handle)
                                                                      -- expert_stage ->
    (y [C, H], handle)                                                -- combine_stage ->
    (combined [T, H],)

Low-latency mode (decode, no backward), flows::

    (x [T, H] bf16, topk_idx, topk_weights)            -- low_latency_dispatch_stage ->
    (recv_x [E_loc, R*T_max, H], recv_count, handle, topk_idx, topk_weights)
                                                       -- low_latency_expert_stage ->
    (y [E_loc, R*T_max, H] bf16, handle, topk_idx, topk_weights)
                                                       -- low_latency_combine_stage ->
    (combined [T, H] bf16,)

(``recv_x`` is the pair of fp8 rows and scales with ``use_fp8``.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_ep import fp8
from jax_ep._types import LowLatencyHandle
from jax_ep.moe.permute import permute, unpermute
from jax_ep.moe.two_batch import Comm, Compute, two_batch


def _no_scales(rows):
    return jnp.zeros((rows.shape[0], 0), jnp.float32)


def _int_zeros(tree):
    """float0 cotangents of an integer pytree (routing ids, handles)."""
    return jax.tree.map(lambda a: np.zeros(a.shape, jax.dtypes.float0), tree)


def dispatch_stage(buf) -> Comm:
    """``jax_ep.dispatch`` as a stage; its backward is a combine (as the op's)."""

    def forward(state):
        (x, topk_idx, topk_weights), carry = state
        out = buf._impl.dispatch(x, _no_scales(x), topk_idx, topk_weights)
        flow = (out["recv_x"], out["recv_topk_idx"], out["recv_topk_weights"], out["handle"])
        return (flow, carry), (out["handle"], out["recv_topk_idx"], topk_idx)

    def backward(residuals, cotangent):
        handle, recv_topk_idx, topk_idx = residuals
        (ct_recv_x, _, ct_recv_w, _), ct_carry = cotangent
        # Only weights that were kept (their expert is on the receiving rank) carry gradient.
        ct_w = jnp.where(recv_topk_idx >= 0, ct_recv_w, 0.0).astype(jnp.float32)
        dx, dw = buf._impl.combine(ct_recv_x.astype(buf.dtype), ct_w, handle)
        return (dx, _int_zeros(topk_idx), dw), ct_carry

    return Comm(forward, backward)


def combine_stage(buf) -> Comm:
    """``jax_ep.combine`` (unweighted, as the op) as a stage; its backward is a cached
    dispatch."""

    def forward(state):
        (y, handle), carry = state
        combined, _ = buf._impl.combine(y, _no_scales(y), handle)
        return ((combined,), carry), handle

    def backward(handle, cotangent):
        (ct_combined,), ct_carry = cotangent
        ct = ct_combined.astype(buf.dtype)
        dy, _, _ = buf._impl.cached_dispatch(ct, _no_scales(ct), _no_scales(ct), handle)
        return (dy, _int_zeros(handle)), ct_carry

    return Comm(forward, backward)


def expert_stage(buf, experts) -> Compute:
    """The local experts on the received rows: ``experts(params, x_sorted, group_sizes) ->
    y_sorted`` (e.g. ``swiglu_experts`` with the weights in ``params``), between ``permute``
    and ``unpermute`` (weighted by the received gate weights)."""

    def fn(params, state):
        (recv_x, recv_topk_idx, recv_topk_weights, handle), carry = state
        num_local = buf.num_local_experts
        num_rows = recv_x.shape[0] * min(buf.num_topk, num_local)
        x_sorted, group_sizes, permuted = permute(recv_x, recv_topk_idx, num_local,
                                                  num_rows=num_rows)
        y_sorted = experts(params, x_sorted, group_sizes)
        y = unpermute(y_sorted, permuted, recv_topk_weights).astype(recv_x.dtype)
        return (y, handle), carry

    return Compute(fn)


def low_latency_dispatch_stage(buf, use_fp8=False) -> Comm:
    """``jax_ep.low_latency_dispatch`` as a (forward-only) stage; fp8 rows are dequantized by
    the expert stage."""

    def forward(state):
        (x, topk_idx, topk_weights), carry = state
        out = buf._impl.low_latency_dispatch(x, topk_idx, bool(use_fp8), False)
        handle = LowLatencyHandle(recv_src=out["recv_src"], recv_k=out["recv_k"],
                                  recv_count=out["recv_count"])
        recv = (out["recv_x"], out["recv_scales"]) if use_fp8 else out["recv_x"]
        return ((recv, out["recv_count"], handle, topk_idx, topk_weights), carry), None

    return Comm(forward)


def low_latency_expert_stage(buf, experts) -> Compute:
    """The local experts on the received expert blocks: the valid rows of every block (the
    first ``recv_count[e]``) gathered into expert-grouped rows for ``experts(params, x_sorted,
    group_sizes)``, and its outputs scattered back into the blocks (zeros elsewhere)."""

    def fn(params, state):
        (recv, recv_count, handle, topk_idx, topk_weights), carry = state
        if isinstance(recv, tuple):  # fp8 rows and their per-128-channel scales
            rows, scales = recv
            per_channel = jnp.repeat(scales, fp8.CHANNELS_PER_SCALE, axis=-1)
            blocks = (rows.astype(jnp.float32) * per_channel).astype(jnp.bfloat16)
        else:
            blocks = recv
        num_local, block_rows, hidden = blocks.shape
        # Every (token, k) pair of every source lands in one block row: at most R*T*K rows.
        num_rows = min(num_local * block_rows, buf.num_ranks * topk_idx.shape[0] * buf.num_topk)
        counts = jnp.minimum(recv_count, block_rows).astype(jnp.int32)
        ends = jnp.cumsum(counts)
        slot = jnp.arange(num_rows, dtype=jnp.int32)
        expert = jnp.minimum(jnp.searchsorted(ends, slot, side="right"), num_local - 1)
        row = slot - (ends[expert] - counts[expert])
        valid = slot < ends[-1]
        x_sorted = jnp.where(valid[:, None], blocks[expert, jnp.where(valid, row, 0)], 0)
        y_sorted = experts(params, x_sorted, counts).astype(jnp.bfloat16)
        target = jnp.where(valid, expert * block_rows + row, num_local * block_rows)
        y = jnp.zeros((num_local * block_rows, hidden), jnp.bfloat16)
        y = y.at[target].set(y_sorted, mode="drop").reshape(num_local, block_rows, hidden)
        return (y, handle, topk_idx, topk_weights), carry

    return Compute(fn)


def low_latency_combine_stage(buf) -> Comm:
    """``jax_ep.low_latency_combine`` as a (forward-only) stage."""

    def forward(state):
        (y, handle, topk_idx, topk_weights), carry = state
        combined = buf._impl.low_latency_combine(y, topk_idx, topk_weights, handle)
        return ((combined,), carry), None

    return Comm(forward)


def _halves(name, *arrays):
    """Each array split into two micro-batches along its first axis (which must be even)."""
    num_tokens = arrays[0].shape[0]
    if num_tokens % 2:
        raise ValueError(f"{name}: micro_batches=2 needs an even number of tokens, got "
                         f"{num_tokens}")
    half = num_tokens // 2
    return tuple(a[:half] for a in arrays), tuple(a[half:] for a in arrays)


def two_batch_moe_ffn(buf, x, topk_idx, topk_weights, experts, params):
    """``moe_ffn``'s ``micro_batches=2``: the first and the second half of the tokens as
    micro-batches A and B (``two_batch``); ``experts(params, x_sorted, group_sizes)``."""
    first, second = _halves("moe_ffn", x, topk_idx, topk_weights)
    stages = [dispatch_stage(buf), expert_stage(buf, experts), combine_stage(buf)]
    ((out_a,), _), ((out_b,), _) = two_batch(stages, params, (first, None), (second, None))
    return jnp.concatenate([out_a, out_b], axis=0)


def low_latency_moe_ffn(buf, x, topk_idx, topk_weights, experts, params, *, use_fp8=False,
                        micro_batches=1):
    """A decode MoE layer over the low-latency ops (forward only), for one rank inside
    ``jax.shard_map``: ``low_latency_dispatch`` -> the local experts on the valid rows of every
    expert block -> ``low_latency_combine``; with ``micro_batches=2`` the two halves of the
    tokens overlap each other's experts (``two_batch``).

    Args:
      buf: a ``Buffer`` with ``low_latency=True`` (bf16 data).
      x: ``[T, H]`` bfloat16; ``topk_idx``/``topk_weights``: ``[T, K]`` int32 / float32.
      experts: ``experts(params, x_sorted [N, H], group_sizes [E_loc]) -> [N, H]``, e.g.
        ``lambda p, x, g: swiglu_experts(x, g, *p)``.
      params: the experts' parameters.
      use_fp8: dispatch fp8 rows (dequantized before the experts).
      micro_batches: 1 or 2.

    Returns:
      ``[T, H]`` bfloat16.
    """
    if micro_batches not in (1, 2):
        raise ValueError(f"low_latency_moe_ffn: micro_batches must be 1 or 2, got "
                         f"{micro_batches}")
    stages = [low_latency_dispatch_stage(buf, use_fp8), low_latency_expert_stage(buf, experts),
              low_latency_combine_stage(buf)]
    if micro_batches == 1:
        state = ((x, topk_idx, topk_weights), None)
        for stage in stages:
            state = stage.fn(params, state) if isinstance(stage, Compute) else stage.forward(
                state)[0]
        return state[0][0]
    first, second = _halves("low_latency_moe_ffn", x, topk_idx, topk_weights)
    ((out_a,), _), ((out_b,), _) = two_batch(stages, params, (first, None), (second, None))
    return jnp.concatenate([out_a, out_b], axis=0)
