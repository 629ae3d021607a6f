"""The public ops: validation, gradients (custom_vjp), and the call into the Buffer's backend.

All ops run inside ``jax.shard_map`` manual over ``buf.axis_name``, under ``jax.jit``, with
per-rank shapes. They are jit- and (CUDA backend, low-latency ops) CUDA-graph safe. Gradients:
dispatch's backward is a combine, combine's backward is a cached dispatch; the low-latency ops'
backwards are the other low-latency op with the same handle.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jax_ep import _vma, fp8
from jax_ep._types import Dispatched, DispatchHandle, Layout, LowLatencyDispatched, LowLatencyHandle


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
        _check_array("x[1] (scales)", scales, (x_fp8.shape[0], buf.hidden // 128),
                     (jnp.float32,))
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
    buf._check_open()
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
    buf._check_open()
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
    buf._check_open()
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
    buf._check_open()
    _check_low_latency(buf)
    _check_array("x", x, (None, buf.hidden), (jnp.bfloat16,))
    _check_tokens(buf, "x", x.shape[0])
    _check_routing(buf, x.shape[0], topk_idx)
    x, topk_idx = _vma.align(buf.axis_name, (x, topk_idx))
    if use_fp8:
        out = buf._impl.low_latency_dispatch(x, topk_idx, True, bool(round_scale))
        return _low_latency_result(out, with_scales=True)
    return _ll_dispatch(buf, x, topk_idx)


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
    buf._check_open()
    _check_low_latency(buf)
    rows = buf.num_ranks * buf.max_tokens_per_rank
    _check_array("y", y, (buf.num_local_experts, rows, buf.hidden), (jnp.bfloat16,))
    _check_array("topk_idx", topk_idx, (None, buf.num_topk), (jnp.int32,))
    _check_tokens(buf, "topk_idx", topk_idx.shape[0])
    _check_routing(buf, topk_idx.shape[0], topk_idx, topk_weights)
    if not isinstance(handle, LowLatencyHandle):
        raise ValueError(f"handle must be the LowLatencyHandle of a low_latency_dispatch, got "
                         f"{type(handle).__name__}")
    y, topk_idx, topk_weights, handle = _vma.align(buf.axis_name,
                                                   (y, topk_idx, topk_weights, handle))
    return _ll_combine(buf, y, topk_idx, topk_weights, handle)


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
