"""The public ops: validation, gradients (custom_vjp), and the call into the Buffer's backend.

All ops run inside ``jax.shard_map`` manual over ``buf.axis_name``, under ``jax.jit``, with
per-rank shapes. They are jit- and (CUDA backend, low-latency ops) CUDA-graph safe. Gradients:
dispatch's backward is a combine, combine's backward is a cached dispatch; the low-latency ops'
backwards are the other low-latency op with the same handle. The low-latency ops also come as a
send half and a receive half (``low_latency_*_send`` / ``low_latency_*_recv``) so that compute can
run in between; their results and gradients are the fused op's.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jax_ep import _ordering, _vma, fp8
from jax_ep._types import (
    Dispatched,
    DispatchHandle,
    Layout,
    LowLatencyDispatched,
    LowLatencyHandle,
    LowLatencyPendingCombine,
    LowLatencyPendingDispatch,
)


# ---------------------------------------------------------------------------------- validation
def _check_array(name, x, shape, dtypes):
    """Raises ValueError naming ``name`` unless ``x`` has ``shape`` (None = any) and a dtype in
    ``dtypes``."""
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise ValueError(f"{name} must be an array, got {type(x).__name__}")
    dims_ok = len(x.shape) == len(shape) and all(
        want is None or got == want for got, want in zip(x.shape, shape, strict=True))
    if not dims_ok:
        want = "[" + ", ".join("*" if w is None else str(w) for w in shape) + "]"
        raise ValueError(f"{name} must have shape {want}, got {list(x.shape)}")
    if jnp.dtype(x.dtype) not in [jnp.dtype(d) for d in dtypes]:
        names = " or ".join(jnp.dtype(d).name for d in dtypes)
        raise ValueError(f"{name} must have dtype {names}, got {jnp.dtype(x.dtype).name}")


def _check_tokens(buf, name, num_tokens):
    if not isinstance(num_tokens, int):
        return  # symbolic (jax.export): checked when the program is instantiated
    if num_tokens > buf.max_tokens_per_rank:
        raise ValueError(f"{name} has {num_tokens} tokens per rank, more than the Buffer's "
                         f"max_tokens_per_rank={buf.max_tokens_per_rank}")


def _check_routing(buf, num_tokens, topk_idx, topk_weights=None):
    _check_array("topk_idx", topk_idx, (num_tokens, buf.num_topk), (jnp.int32,))
    if topk_weights is not None:
        _check_array("topk_weights", topk_weights, (num_tokens, buf.num_topk), (jnp.float32,))


def _split_input(buf, x):
    """``x`` or the fp8 pair -> (payload [T,H], scales [T,S] or [T,0], is_fp8)."""
    if isinstance(x, (tuple, list)):
        if len(x) != 2:
            raise ValueError(f"x must be an array or a pair (x_fp8, scales), got {len(x)} items")
        x_fp8, scales = x
        _check_array("x[0] (fp8 data)", x_fp8, (None, buf.hidden), (fp8.FP8_DTYPE,))
        _check_array("x[1] (scales)", scales,
                     (x_fp8.shape[0], buf.hidden // fp8.CHANNELS_PER_SCALE), (jnp.float32,))
        return x_fp8, scales, True
    _check_array("x", x, (None, buf.hidden), (buf.dtype,))
    return x, jnp.zeros((x.shape[0], 0), jnp.float32), False


def _check_handle(buf, handle, num_rows=None):
    if not isinstance(handle, DispatchHandle):
        raise ValueError(f"handle must be the DispatchHandle of a dispatch (d.handle), got "
                         f"{type(handle).__name__}")
    _check_array("handle.send_pos", handle.send_pos, (None, buf.num_ranks), (jnp.int32,))
    _check_array("handle.recv_src", handle.recv_src, (num_rows,), (jnp.int32,))


def _like_primals(buf, handle, *cotangents):
    """Cotangents typed like the primal inputs: the public ops aligned every input to the
    handle's varying axes, and custom_vjp insists a cotangent has its primal's type."""
    return _vma.align(buf.axis_name, (handle, *cotangents))[1:]


# ------------------------------------------------------------------------------------- layout
def get_dispatch_layout(buf, topk_idx) -> Layout:
    """Per-rank routing statistics of ``topk_idx [T, K]`` int32 (global ids, -1 = none).

    Returns:
      ``Layout(num_tokens_per_rank [R], num_tokens_per_expert [E], is_token_in_rank [T, R])``.
    """
    buf._check_call("get_dispatch_layout")
    _check_array("topk_idx", topk_idx, (None, buf.num_topk), (jnp.int32,))
    _check_tokens(buf, "topk_idx", topk_idx.shape[0])
    return buf._impl.layout(topk_idx)


# ----------------------------------------------------------------------------------- dispatch
def dispatch(buf, x, topk_idx=None, topk_weights=None, *, handle=None) -> Dispatched:
    """Sends each token once to every rank that holds one of its top-k experts.

    Args:
      buf: the ``Buffer``.
      x: ``[T, H]`` of ``buf.dtype``, or the pair ``(x_fp8 [T, H] float8_e4m3fn,
        scales [T, H // 128] float32)`` (see ``per_token_cast_to_fp8``).
      topk_idx: ``[T, K]`` int32 global expert ids, ``-1`` = no expert.
      topk_weights: ``[T, K]`` float32.
      handle: instead of ``topk_idx``/``topk_weights``, the handle of an earlier dispatch: the
        cached form, same routing (combine's backward). It returns only ``recv_x``
        (``recv_scales``), ``num_recv_tokens`` and the handle; the other fields are None.

    Returns:
      ``Dispatched`` (see its docstring). Differentiable w.r.t. ``x`` (not fp8) and
      ``topk_weights``.
    """
    buf._check_call("dispatch")
    payload, scales, is_fp8 = _split_input(buf, x)
    num_tokens = payload.shape[0]
    _check_tokens(buf, "x", num_tokens)
    if handle is not None:
        if topk_idx is not None or topk_weights is not None:
            raise ValueError("pass either handle (cached dispatch) or topk_idx/topk_weights")
        _check_handle(buf, handle)
        if handle.send_pos.shape[0] != num_tokens:
            raise ValueError(f"x has {num_tokens} tokens but handle.send_pos was made for "
                             f"{handle.send_pos.shape[0]}")
        payload, scales, handle = _vma.align(buf.axis_name, (payload, scales, handle))
        no_weights = jnp.zeros((num_tokens, 0), jnp.float32)
        if is_fp8:
            recv_x, recv_scales, _ = buf._impl.cached_dispatch(payload, scales, no_weights, handle)
        else:
            recv_x = _cached_dispatch(buf, payload, handle)
            recv_scales = None
        return Dispatched(recv_x=recv_x, recv_scales=recv_scales, recv_topk_idx=None,
                          recv_topk_weights=None, num_recv_tokens=handle.num_recv_tokens,
                          num_recv_tokens_per_expert=None, handle=handle)
    if topk_idx is None or topk_weights is None:
        raise ValueError("dispatch needs topk_idx and topk_weights (or handle=)")
    _check_routing(buf, num_tokens, topk_idx, topk_weights)
    if is_fp8:
        out = buf._impl.dispatch(payload, scales, topk_idx, topk_weights)
        return Dispatched(**out)
    payload, topk_idx, topk_weights = _vma.align(buf.axis_name, (payload, topk_idx, topk_weights))
    out = _dispatch(buf, payload, topk_idx, topk_weights)
    return dataclasses.replace(out, recv_scales=None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _dispatch(buf, x, topk_idx, topk_weights):
    scales = jnp.zeros((x.shape[0], 0), jnp.float32)
    return Dispatched(**buf._impl.dispatch(x, scales, topk_idx, topk_weights))


def _dispatch_fwd(buf, x, topk_idx, topk_weights):
    out = _dispatch(buf, x, topk_idx, topk_weights)
    return out, (out.handle, out.recv_topk_idx)


def _dispatch_bwd(buf, residuals, cotangent):
    handle, recv_topk_idx = residuals
    # Only weights that were kept (their expert is on the receiving rank) carry gradient.
    ct_weights = jnp.where(recv_topk_idx >= 0, cotangent.recv_topk_weights, 0.0)
    dx, dw = buf._impl.combine(cotangent.recv_x, ct_weights.astype(jnp.float32), handle)
    dx, dw = _like_primals(buf, handle, dx, dw)
    return dx, None, dw


_dispatch.defvjp(_dispatch_fwd, _dispatch_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _cached_dispatch(buf, x, handle):
    no_scales = jnp.zeros((x.shape[0], 0), jnp.float32)
    recv_x, _, _ = buf._impl.cached_dispatch(x, no_scales, no_scales, handle)
    return recv_x


def _cached_dispatch_fwd(buf, x, handle):
    return _cached_dispatch(buf, x, handle), handle


def _cached_dispatch_bwd(buf, handle, ct_recv_x):
    no_weights = jnp.zeros((ct_recv_x.shape[0], 0), jnp.float32)
    dx, _ = buf._impl.combine(ct_recv_x, no_weights, handle)
    (dx,) = _like_primals(buf, handle, dx)
    return dx, None


_cached_dispatch.defvjp(_cached_dispatch_fwd, _cached_dispatch_bwd)


# ------------------------------------------------------------------------------------ combine
def combine(buf, y, handle, topk_weights=None):
    """Returns each token's rows to its source rank and sums them (float32, rounded once).

    Args:
      buf: the ``Buffer``.
      y: ``[C, H]`` of ``buf.dtype``, one row per received row of the dispatch that made
        ``handle`` (the caller has already weighted and summed its local experts per row).
      handle: ``Dispatched.handle``.
      topk_weights: optional ``[C, K]`` float32, summed the same way.

    Returns:
      ``(combined [T, H], combined_topk_weights [T, K] or None)``; tokens sent nowhere give 0.
      Differentiable w.r.t. ``y`` and ``topk_weights``.
    """
    buf._check_call("combine")
    _check_handle(buf, handle)
    num_rows = handle.recv_src.shape[0]
    _check_array("y", y, (num_rows, buf.hidden), (buf.dtype,))
    if topk_weights is not None:
        _check_array("topk_weights", topk_weights, (num_rows, buf.num_topk), (jnp.float32,))
    weights = jnp.zeros((num_rows, 0), jnp.float32) if topk_weights is None else topk_weights
    y, weights, handle = _vma.align(buf.axis_name, (y, weights, handle))
    combined, combined_weights = _combine(buf, y, weights, handle)
    return combined, (None if topk_weights is None else combined_weights)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _combine(buf, y, y_w, handle):
    return buf._impl.combine(y, y_w, handle)


def _combine_fwd(buf, y, y_w, handle):
    return _combine(buf, y, y_w, handle), handle


def _combine_bwd(buf, handle, cotangents):
    ct_combined, ct_w = cotangents
    no_scales = jnp.zeros((ct_combined.shape[0], 0), jnp.float32)
    dy, _, dy_w = buf._impl.cached_dispatch(ct_combined, no_scales, ct_w, handle)
    dy, dy_w = _like_primals(buf, handle, dy, dy_w)
    return dy, dy_w, None


_combine.defvjp(_combine_fwd, _combine_bwd)


# ------------------------------------------------------------------------------ low latency
def _check_low_latency(buf):
    if not buf.low_latency:
        raise ValueError("low-latency ops need a Buffer created with low_latency=True")


def low_latency_dispatch(buf, x, topk_idx, use_fp8=True, round_scale=False):
    """Sends one copy of each token per selected expert into expert-major blocks (decode).

    Args:
      buf: a ``Buffer`` with ``low_latency=True``.
      x: ``[T, H]`` bfloat16, ``T <= max_tokens_per_rank``.
      topk_idx: ``[T, K]`` int32 global expert ids, -1 = none.
      use_fp8: cast to float8_e4m3fn (one scale per token per 128 channels) before sending.
      round_scale: round the scales up to powers of two.

    Returns:
      ``LowLatencyDispatched``: ``recv_x [E_loc, R*T_max, H]``, ``recv_scales`` (fp8 only),
      ``recv_count [E_loc]``, ``recv_src [E_loc, R*T_max]``, ``handle``. Differentiable w.r.t.
      ``x`` when ``use_fp8`` is False (the backward is a low-latency combine).
    """
    x, topk_idx = _check_ll_dispatch_args(buf, x, topk_idx)
    if use_fp8:
        out = buf._impl.low_latency_dispatch(x, topk_idx, True, bool(round_scale))
        result = _low_latency_result(out, with_scales=True)
    else:
        result = _ll_dispatch(buf, x, topk_idx)
    return result


def _check_ll_dispatch_args(buf, x, topk_idx):
    """Validation shared by the fused dispatch and its send half; returns the aligned inputs."""
    buf._check_call("low_latency_dispatch")
    _check_low_latency(buf)
    _check_array("x", x, (None, buf.hidden), (jnp.bfloat16,))
    _check_tokens(buf, "x", x.shape[0])
    _check_routing(buf, x.shape[0], topk_idx)
    return _vma.align(buf.axis_name, (x, topk_idx))


def _low_latency_result(out, with_scales):
    handle = LowLatencyHandle(recv_src=out["recv_src"], recv_k=out["recv_k"],
                              recv_count=out["recv_count"])
    return LowLatencyDispatched(recv_x=out["recv_x"],
                                recv_scales=out["recv_scales"] if with_scales else None,
                                recv_count=out["recv_count"], recv_src=out["recv_src"],
                                handle=handle)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ll_dispatch(buf, x, topk_idx):
    return _low_latency_result(buf._impl.low_latency_dispatch(x, topk_idx, False, False), False)


def _ll_dispatch_fwd(buf, x, topk_idx):
    out = _ll_dispatch(buf, x, topk_idx)
    return out, (out.handle, topk_idx)


def _ll_dispatch_bwd(buf, residuals, cotangent):
    handle, topk_idx = residuals
    ones = jnp.ones(topk_idx.shape, jnp.float32)
    dx = buf._impl.low_latency_combine(cotangent.recv_x.astype(jnp.bfloat16), topk_idx, ones,
                                       handle)
    (dx,) = _like_primals(buf, handle, dx)
    return dx, None


_ll_dispatch.defvjp(_ll_dispatch_fwd, _ll_dispatch_bwd)


def low_latency_combine(buf, y, topk_idx, topk_weights, handle):
    """Weighted sum of each token's expert outputs, returned to its source rank (decode).

    Args:
      buf: a ``Buffer`` with ``low_latency=True``.
      y: ``[E_loc, R*T_max, H]`` bfloat16 expert outputs in the layout of ``recv_x``.
      topk_idx: ``[T, K]`` int32, the ids passed to the dispatch.
      topk_weights: ``[T, K]`` float32.
      handle: ``LowLatencyDispatched.handle``.

    Returns:
      ``[T, H]`` bfloat16: ``sum_k w[t,k] * y[e_k][row of (t,k)]`` in float32. Differentiable
      w.r.t. ``y`` and ``topk_weights``.
    """
    args = _check_ll_combine_args(buf, y, topk_idx, topk_weights, handle)
    return _ll_combine(buf, *args)


def _check_ll_combine_args(buf, y, topk_idx, topk_weights, handle):
    """Validation shared by the fused combine and its send half; returns the aligned
    ``(y, topk_idx, topk_weights, handle)``."""
    buf._check_call("low_latency_combine")
    _check_low_latency(buf)
    rows = buf.num_ranks * buf.max_tokens_per_rank
    _check_array("y", y, (buf.num_local_experts, rows, buf.hidden), (jnp.bfloat16,))
    _check_array("topk_idx", topk_idx, (None, buf.num_topk), (jnp.int32,))
    _check_tokens(buf, "topk_idx", topk_idx.shape[0])
    _check_routing(buf, topk_idx.shape[0], topk_idx, topk_weights)
    if not isinstance(handle, LowLatencyHandle):
        raise ValueError(f"handle must be the LowLatencyHandle of a low_latency_dispatch, got "
                         f"{type(handle).__name__}")
    return _vma.align(buf.axis_name, (y, topk_idx, topk_weights, handle))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ll_combine(buf, y, topk_idx, topk_weights, handle):
    return buf._impl.low_latency_combine(y, topk_idx, topk_weights, handle)


def _ll_combine_fwd(buf, y, topk_idx, topk_weights, handle):
    return _ll_combine(buf, y, topk_idx, topk_weights, handle), (y, topk_idx, topk_weights,
                                                                handle)


def _ll_combine_bwd(buf, residuals, ct_out):
    y, topk_idx, topk_weights, handle = residuals
    # Each expert row's cotangent is its token's output cotangent: a dispatch of ct_out over the
    # same routing (deterministic row order => same rows), scaled by the row's weight.
    sent = buf._impl.low_latency_dispatch(ct_out.astype(jnp.bfloat16), topk_idx, False, False)
    row_ct = sent["recv_x"].astype(jnp.float32)
    valid = (handle.recv_src >= 0)[..., None]
    row_weights = _ll_values_to_experts(buf, topk_weights, topk_idx, handle)
    dy = jnp.where(valid, row_ct * row_weights[..., None], 0.0).astype(y.dtype)
    # d w[t,k] = <ct_out[t], y row of (t,k)>, computed where the row lives and sent back.
    row_dots = jnp.where(valid[..., 0], jnp.sum(row_ct * y.astype(jnp.float32), axis=-1), 0.0)
    dw = _ll_values_to_owners(buf, row_dots, handle, topk_idx.shape[0])
    dy, dw = _like_primals(buf, handle, dy, dw)
    return dy, None, dw, None


_ll_combine.defvjp(_ll_combine_fwd, _ll_combine_bwd)


def _ll_row_origins(buf, handle, invalid_rank):
    """Per received row ``[E_loc, R*T_max]``: (valid, source rank, source token, k); invalid
    rows get rank ``invalid_rank`` and token/k 0."""
    T_max = buf.max_tokens_per_rank
    valid = handle.recv_src >= 0
    return (valid, jnp.where(valid, handle.recv_src // T_max, invalid_rank),
            jnp.where(valid, handle.recv_src % T_max, 0), jnp.where(valid, handle.recv_k, 0))


def _ll_values_to_experts(buf, values, topk_idx, handle):
    """Per-selection scalars ``values [T, K]`` -> per received row ``[E_loc, R*T_max]``.

    A small dense all_to_all of ``[R, T_max, K]`` float32 (gradients only)."""
    R, T_max = buf.num_ranks, buf.max_tokens_per_rank
    T, K = topk_idx.shape
    valid = (topk_idx >= 0) & (topk_idx < buf.num_experts)
    dest = jnp.where(valid, topk_idx // buf.num_local_experts, R)  # R: dropped
    dense = jnp.zeros((R, T_max, K), jnp.float32)
    dense = dense.at[dest, jnp.arange(T)[:, None], jnp.arange(K)[None, :]].set(
        values.astype(jnp.float32), mode="drop")
    got = jax.lax.all_to_all(dense, buf.axis_name, split_axis=0, concat_axis=0)
    valid_row, source, token, k = _ll_row_origins(buf, handle, invalid_rank=0)
    return jnp.where(valid_row, got[source, token, k], 0.0)


def _ll_values_to_owners(buf, row_values, handle, num_tokens):
    """Per received row scalars ``[E_loc, R*T_max]`` -> ``[T, K]`` at the tokens' owners."""
    R, T_max, K = buf.num_ranks, buf.max_tokens_per_rank, buf.num_topk
    _, owner, token, k = _ll_row_origins(buf, handle, invalid_rank=R)  # R: dropped below
    dense = jnp.zeros((R, T_max, K), jnp.float32).at[owner, token, k].set(row_values,
                                                                         mode="drop")
    got = jax.lax.all_to_all(dense, buf.axis_name, split_axis=0, concat_axis=0)
    return jnp.sum(got, axis=0)[:num_tokens]


# ------------------------------------------------------- low latency: send and receive halves
def low_latency_dispatch_send(buf, x, topk_idx, use_fp8=True,
                              round_scale=False) -> LowLatencyPendingDispatch:
    """The send half of ``low_latency_dispatch``: casts and pushes this rank's rows to the
    experts' ranks and returns at once (it never waits for a peer).

    Args: as ``low_latency_dispatch``.

    Returns:
      ``LowLatencyPendingDispatch`` for ``low_latency_dispatch_recv``. Jit- and CUDA-graph safe.

    Rule: per Buffer and op, at most one send may wait for its receive. Call the send, then its
    receive, before the next send of the same op on the same Buffer: the split calls' regions
    are double-buffered by call parity and the call's sequence word advances at the end of the
    receive. Fused calls (also those of autodiff's backward pass) use a channel of their own and
    may run anywhere, also between a send and its receive. Dispatch and combine are independent
    (a dispatch may be pending while a combine runs, and the reverse). Within one trace this is
    checked (``ValueError``) and XLA is kept to the program order (each send's custom call takes
    a result of the previous receive as an operand); split calls in different traces (an
    inner ``jax.jit``, a ``lax.cond`` branch) are ordered only by their data.

    XLA places independent work where it likes; to make it run between the halves, tie it to
    the pending object::

        pending = jax_ep.low_latency_dispatch_send(buf, x_b, idx_b)
        h, pending = jax.lax.optimization_barrier((h, pending))  # compute after the send
        h = layer(h)
        h, pending = jax.lax.optimization_barrier((h, pending))  # receive after the compute
        d_b = jax_ep.low_latency_dispatch_recv(buf, pending)
    """
    x, topk_idx = _check_ll_dispatch_args(buf, x, topk_idx)
    round_scale = bool(round_scale) and bool(use_fp8)  # bf16 rows are not cast (as the fused op)
    after = _ordering.before_send(buf, "low_latency_dispatch")
    x, topk_idx, after = _vma.align(buf.axis_name, (x, topk_idx, after))
    ticket = _ll_dispatch_send(buf, x, topk_idx, after, bool(use_fp8), round_scale)
    _ordering.after_send(buf, "low_latency_dispatch")
    return LowLatencyPendingDispatch(ticket=ticket, x=x, topk_idx=topk_idx,
                                     use_fp8=bool(use_fp8), round_scale=round_scale)


def _check_pending(buf, pending, kind, op):
    """The checks of a receive half: open low-latency Buffer, a pending object of ``op``'s send,
    not received before in this trace."""
    buf._check_call(f"{op}_recv")
    _check_low_latency(buf)
    if not isinstance(pending, kind):
        raise ValueError(f"pending must be the {kind.__name__} of {op}_send, got "
                         f"{type(pending).__name__}")
    _ordering.before_recv(buf, op, pending.ticket)


def low_latency_dispatch_recv(buf, pending) -> LowLatencyDispatched:
    """The receive half of ``low_latency_dispatch``: waits for the rows of ``pending``'s call
    (bounded waits, as the fused op) and writes the outputs.

    Args:
      buf: the ``Buffer`` of the send.
      pending: the ``LowLatencyPendingDispatch`` of ``low_latency_dispatch_send``, received once.

    Returns:
      ``LowLatencyDispatched``, bit-identical to ``low_latency_dispatch`` with the same inputs.
      Differentiable w.r.t. the send's ``x`` when ``use_fp8`` is False (the backward is a
      low-latency combine, as for the fused op).
    """
    _check_pending(buf, pending, LowLatencyPendingDispatch, "low_latency_dispatch")
    x, topk_idx, ticket = _vma.align(buf.axis_name, (pending.x, pending.topk_idx,
                                                     pending.ticket))
    if pending.use_fp8:
        out = buf._impl.low_latency_dispatch_recv(x, topk_idx, ticket, True,
                                                  pending.round_scale)
        result = _low_latency_result(out, with_scales=True)
    else:
        result = _ll_dispatch_recv(buf, x, topk_idx, ticket)
    _ordering.after_recv(buf, "low_latency_dispatch", pending.ticket, result.recv_count)
    return result


# The send halves carry no derivative: their only result is the integer ticket, and gradients
# reach x (y, topk_weights) through the receive, which takes them again. A custom_vjp with zero
# cotangents keeps autodiff away from the custom call (integer operands such as a handle from a
# custom_vjp carry instantiated float0 tangents, and the custom call has no JVP).
@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 4, 5))
def _ll_dispatch_send(buf, x, topk_idx, after, use_fp8, round_scale):
    return buf._impl.low_latency_dispatch_send(x, topk_idx, after, use_fp8, round_scale)


def _ll_dispatch_send_fwd(buf, x, topk_idx, after, use_fp8, round_scale):
    return _ll_dispatch_send(buf, x, topk_idx, after, use_fp8, round_scale), None


def _ll_dispatch_send_bwd(buf, use_fp8, round_scale, residuals, ct_ticket):
    return None, None, None


_ll_dispatch_send.defvjp(_ll_dispatch_send_fwd, _ll_dispatch_send_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ll_dispatch_recv(buf, x, topk_idx, ticket):
    out = buf._impl.low_latency_dispatch_recv(x, topk_idx, ticket, False, False)
    return _low_latency_result(out, False)


def _ll_dispatch_recv_fwd(buf, x, topk_idx, ticket):
    out = _ll_dispatch_recv(buf, x, topk_idx, ticket)
    return out, (out.handle, topk_idx)  # the fused op's residuals


def _ll_dispatch_recv_bwd(buf, residuals, cotangent):
    return (*_ll_dispatch_bwd(buf, residuals, cotangent), None)  # no cotangent for the ticket


_ll_dispatch_recv.defvjp(_ll_dispatch_recv_fwd, _ll_dispatch_recv_bwd)


def low_latency_combine_send(buf, y, topk_idx, topk_weights,
                             handle) -> LowLatencyPendingCombine:
    """The send half of ``low_latency_combine``: pushes the expert outputs of rows that came
    from other ranks to their owners and returns at once (it never waits for a peer).

    Args: as ``low_latency_combine``.

    Returns:
      ``LowLatencyPendingCombine`` for ``low_latency_combine_recv``. Jit- and CUDA-graph safe.
      The rule (one pending send per Buffer and op) and the way to place compute between the
      halves are those of ``low_latency_dispatch_send``.
    """
    args = _check_ll_combine_args(buf, y, topk_idx, topk_weights, handle)
    y, topk_idx, topk_weights, handle = args
    after = _ordering.before_send(buf, "low_latency_combine")
    y, after = _vma.align(buf.axis_name, (y, after))
    ticket = _ll_combine_send(buf, y, topk_idx, topk_weights, handle, after)
    _ordering.after_send(buf, "low_latency_combine")
    return LowLatencyPendingCombine(ticket=ticket, y=y, topk_idx=topk_idx,
                                    topk_weights=topk_weights, handle=handle)


def low_latency_combine_recv(buf, pending):
    """The receive half of ``low_latency_combine``: sums this rank's own rows, waits for the
    rows pushed by the peers (bounded waits, as the fused op) and returns the weighted sums.

    Args:
      buf: the ``Buffer`` of the send.
      pending: the ``LowLatencyPendingCombine`` of ``low_latency_combine_send``, received once.

    Returns:
      ``[T, H]`` bfloat16, bit-identical to ``low_latency_combine`` with the same inputs.
      Differentiable w.r.t. the send's ``y`` and ``topk_weights`` (as the fused op).
    """
    _check_pending(buf, pending, LowLatencyPendingCombine, "low_latency_combine")
    args = _vma.align(buf.axis_name, (pending.y, pending.topk_idx, pending.topk_weights,
                                      pending.handle, pending.ticket))
    out = _ll_combine_recv(buf, *args)
    _ordering.after_recv(buf, "low_latency_combine", pending.ticket, out)
    return out


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ll_combine_send(buf, y, topk_idx, topk_weights, handle, after):  # no derivative: see above
    return buf._impl.low_latency_combine_send(y, topk_idx, topk_weights, handle, after)


def _ll_combine_send_fwd(buf, y, topk_idx, topk_weights, handle, after):
    return _ll_combine_send(buf, y, topk_idx, topk_weights, handle, after), None


def _ll_combine_send_bwd(buf, residuals, ct_ticket):
    return None, None, None, None, None


_ll_combine_send.defvjp(_ll_combine_send_fwd, _ll_combine_send_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ll_combine_recv(buf, y, topk_idx, topk_weights, handle, ticket):
    return buf._impl.low_latency_combine_recv(y, topk_idx, topk_weights, handle, ticket)


def _ll_combine_recv_fwd(buf, y, topk_idx, topk_weights, handle, ticket):
    out = _ll_combine_recv(buf, y, topk_idx, topk_weights, handle, ticket)
    return out, (y, topk_idx, topk_weights, handle)  # the fused op's residuals


def _ll_combine_recv_bwd(buf, residuals, ct_out):
    return (*_ll_combine_bwd(buf, residuals, ct_out), None)  # no cotangent for the ticket


_ll_combine_recv.defvjp(_ll_combine_recv_fwd, _ll_combine_recv_bwd)
