"""Result and handle types of the jax_ep ops: frozen dataclasses registered as pytrees.

Every array field holds the *per-rank* value seen inside ``jax.shard_map`` (manual over the EP
axis). Shapes use: ``T`` tokens of this rank, ``R`` ranks, ``K`` top-k, ``H`` hidden,
``C`` receive capacity, ``E_loc`` experts per rank, ``T_max`` = ``max_tokens_per_rank``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

Array = Any


def _pytree(cls):
    """Registers a frozen dataclass as a pytree: fields marked ``_static()`` are static (part of
    the tree structure), every other field is a child (None allowed)."""
    fields = dataclasses.fields(cls)
    meta = [f.name for f in fields if f.metadata.get("static", False)]
    data = [f.name for f in fields if f.name not in meta]
    return jax.tree_util.register_dataclass(cls, data_fields=data, meta_fields=meta)


def _static():
    """A static pytree field (a Python value known at trace time, e.g. a flag)."""
    return dataclasses.field(metadata={"static": True})


@_pytree
@dataclasses.dataclass(frozen=True)
class DispatchHandle:
    """Routing of one normal-mode dispatch; reused by combine and the cached dispatch.

    Attributes:
      send_pos: ``[T, R]`` int32, row of token t in rank r's receive buffer; ``-1`` = not sent
        there. May be ``>= C`` when r's capacity overflowed (that row was dropped).
      recv_src: ``[C]`` int32, ``src_rank * T + src_token`` of each received row, ``-1`` for rows
        ``>= num_recv_tokens``.
      num_recv_tokens: ``[]`` int32, rows this rank received (the true count, may exceed C).
    """

    send_pos: Array
    recv_src: Array
    num_recv_tokens: Array


@_pytree
@dataclasses.dataclass(frozen=True)
class Dispatched:
    """What ``jax_ep.dispatch`` returns on each rank.

    Attributes:
      recv_x: ``[C, H]`` received rows (grouped by source rank ascending, then source token
        ascending; bit-exact copies of the senders' rows). Rows ``>= num_recv_tokens`` are zero.
        With an fp8 input, the fp8 part of the pair.
      recv_scales: ``[C, H // 128]`` float32 scales when the input was an fp8 pair, else None.
      recv_topk_idx: ``[C, K]`` int32 *local* expert ids, ``-1`` where that expert is not on this
        rank (and on padding rows). None for the cached form.
      recv_topk_weights: ``[C, K]`` float32, 0 where ``recv_topk_idx`` is -1. None for the cached
        form.
      num_recv_tokens: ``[]`` int32 number of valid rows (may exceed C on overflow: see
        ``Buffer.check``).
      num_recv_tokens_per_expert: ``[E_loc]`` int32 rows whose ``recv_topk_idx`` contains each
        local expert. None for the cached form.
      handle: the ``DispatchHandle`` for ``combine`` and the cached ``dispatch``.
    """

    recv_x: Array
    recv_scales: Array | None
    recv_topk_idx: Array | None
    recv_topk_weights: Array | None
    num_recv_tokens: Array
    num_recv_tokens_per_expert: Array | None
    handle: DispatchHandle


@_pytree
@dataclasses.dataclass(frozen=True)
class Layout:
    """What ``jax_ep.get_dispatch_layout`` returns on each rank.

    Attributes:
      num_tokens_per_rank: ``[R]`` int32 tokens with at least one expert on each rank.
      num_tokens_per_expert: ``[E]`` int32 (token, expert) pairs per global expert.
      is_token_in_rank: ``[T, R]`` bool.
    """

    num_tokens_per_rank: Array
    num_tokens_per_expert: Array
    is_token_in_rank: Array


@_pytree
@dataclasses.dataclass(frozen=True)
class LowLatencyHandle:
    """Routing of one low-latency dispatch; reused by ``low_latency_combine``.

    Attributes:
      recv_src: ``[E_loc, R * T_max]`` int32 ``src_rank * T_max + src_token``, -1 on invalid rows.
      recv_k: ``[E_loc, R * T_max]`` int32 the top-k slot of that selection, -1 on invalid rows.
      recv_count: ``[E_loc]`` int32 valid rows per local expert.
    """

    recv_src: Array
    recv_k: Array
    recv_count: Array


@_pytree
@dataclasses.dataclass(frozen=True)
class LowLatencyDispatched:
    """What ``jax_ep.low_latency_dispatch`` returns on each rank.

    Attributes:
      recv_x: ``[E_loc, R * T_max, H]`` bfloat16, or float8_e4m3fn with ``use_fp8``. Within each
        local expert's block rows are ordered by source rank, source token, then k; the first
        ``recv_count[e]`` rows are valid, the rest unspecified.
      recv_scales: ``[E_loc, R * T_max, H // 128]`` float32 with ``use_fp8``, else None.
      recv_count: ``[E_loc]`` int32.
      recv_src: ``[E_loc, R * T_max]`` int32 ``src_rank * T_max + src_token``, -1 on invalid rows.
      handle: the ``LowLatencyHandle`` for ``low_latency_combine``.
    """

    recv_x: Array
    recv_scales: Array | None
    recv_count: Array
    recv_src: Array
    handle: LowLatencyHandle


@_pytree
@dataclasses.dataclass(frozen=True)
class LowLatencyPendingDispatch:
    """What ``jax_ep.low_latency_dispatch_send`` returns: a dispatch whose receive half is still
    to run (``jax_ep.low_latency_dispatch_recv``). Pass it on unchanged.

    Attributes:
      ticket: ``[1]`` int32, the send custom call's result. The receive takes it as an operand,
        so XLA runs the receive after the send and never drops the send. Its value is
        informational (CUDA: the low 32 bits of the call's sequence tag; reference backend: 0).
      x: ``[T, H]`` bfloat16, the tokens sent (the receive reads this rank's own rows from it,
        and gradients flow through it).
      topk_idx: ``[T, K]`` int32 global expert ids, -1 = none.
      use_fp8, round_scale: the send's options (static).
    """

    ticket: Array
    x: Array
    topk_idx: Array
    use_fp8: bool = _static()
    round_scale: bool = _static()


@_pytree
@dataclasses.dataclass(frozen=True)
class LowLatencyPendingCombine:
    """What ``jax_ep.low_latency_combine_send`` returns: a combine whose receive half is still to
    run (``jax_ep.low_latency_combine_recv``). Pass it on unchanged.

    Attributes:
      ticket: ``[1]`` int32, the send custom call's result (see ``LowLatencyPendingDispatch``).
      y: ``[E_loc, R * T_max, H]`` bfloat16 expert outputs (the receive reads the rows of this
        rank's own tokens from it; gradients flow through it).
      topk_idx: ``[T, K]`` int32, the ids passed to the dispatch.
      topk_weights: ``[T, K]`` float32.
      handle: the ``LowLatencyHandle`` of the dispatch.
    """

    ticket: Array
    y: Array
    topk_idx: Array
    topk_weights: Array
    handle: LowLatencyHandle
