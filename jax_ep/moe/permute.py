"""`permute` and `unpermute`: a rank's received rows grouped by local expert, and back.

Sharding model: purely local (no communication): one rank's arrays, inside or outside
`jax.shard_map`. `jax_ep.moe.layer` (one MoE layer) and `jax_ep.moe.stages` (its stages for the
two-micro-batch schedule) both build on these; this module imports neither.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

__all__ = ["PermuteState", "Permuted", "permute", "unpermute"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PermuteState:
    """How `permute` reordered the (row, k) pairs of a received block; consumed by `unpermute`.

    With `C` received rows and `K` top-k slots there are `C*K` pairs; pair `(r, k)` has flat
    index `r*K + k`. Valid pairs (local expert id in `[0, num_local_experts)`) occupy sorted rows
    `[0, sum(group_sizes))` of the `N` sorted rows in (expert, row, k) order; the remaining rows
    hold invalid pairs (zero).

    Attributes:
        sorted_pair: `[N]` int32, the flat pair index held by each sorted row.
        sorted_valid: `[N]` bool, whether each sorted row holds a valid pair.
        pair_slot: `[C, K]` int32, the sorted row of each kept pair (0 where not kept).
        pair_valid: `[C, K]` bool, whether each pair is valid and kept (its slot is `< N`).
    """

    sorted_pair: jax.Array
    sorted_valid: jax.Array
    pair_slot: jax.Array
    pair_valid: jax.Array

    @property
    def num_topk(self) -> int:
        return self.pair_slot.shape[1]


class Permuted(NamedTuple):
    """Result of `permute` (unpacks as `x_sorted, group_sizes, state`).

    Attributes:
        x_sorted: `[N, H]` (`N = num_rows`, default `C*K`), rows grouped by local expert; rows
            after `sum(group_sizes)` are 0.
        group_sizes: `[num_local_experts]` int32, rows per expert, for `grouped_matmul` or
            `jax.lax.ragged_dot`.
        state: the `PermuteState` that `unpermute` needs.
    """

    x_sorted: jax.Array
    group_sizes: jax.Array
    state: PermuteState


# Row movement. `_expand` (pairs <- rows) and `_collect` (rows x K <- pairs) are linear and each
# other's transpose, so each one's backward is the other one: gathers both ways.


@jax.custom_vjp
def _expand(x: jax.Array, state: PermuteState) -> jax.Array:
    """`[C, H]` -> `[N, H]`: sorted row j = x[row of pair sorted_pair[j]], 0 if invalid."""
    rows = state.sorted_pair // state.num_topk
    return jnp.where(state.sorted_valid[:, None], x[rows], jnp.zeros((), x.dtype))


def _expand_fwd(x, state):
    return _expand(x, state), state


def _expand_bwd(state, g):
    # d x[r] = sum over valid k of g[pair_slot[r, k]].
    return _collect(g, state).sum(axis=1), None


_expand.defvjp(_expand_fwd, _expand_bwd)


@jax.custom_vjp
def _collect(y: jax.Array, state: PermuteState) -> jax.Array:
    """`[N, H]` -> `[C, K, H]`: pair (r, k) = y[pair_slot[r, k]], 0 if not kept."""
    return jnp.where(state.pair_valid[..., None], y[state.pair_slot], jnp.zeros((), y.dtype))


def _collect_fwd(y, state):
    return _collect(y, state), state


def _collect_bwd(state, g):
    # pair_slot maps the kept pairs one-to-one onto the valid sorted rows:
    # d y[j] = g[pair sorted_pair[j]] if row j is valid.
    c, k, h = g.shape
    flat = g.reshape(c * k, h)
    dy = jnp.where(state.sorted_valid[:, None], flat[state.sorted_pair], jnp.zeros((), g.dtype))
    return dy, None


_collect.defvjp(_collect_fwd, _collect_bwd)


def permute(
    recv_x: jax.Array,
    recv_topk_idx: jax.Array,
    num_local_experts: int,
    *,
    num_rows: int | None = None,
) -> Permuted:
    """Groups the received (row, k) pairs by local expert, for `grouped_matmul`.

    Jittable and differentiable w.r.t. `recv_x` (the gradient is a gather, deterministic).

    Args:
        recv_x: `[C, H]` received rows (`Dispatched.recv_x`), any float dtype.
        recv_topk_idx: `[C, K]` int32 local expert ids (`Dispatched.recv_topk_idx`); ids outside
            `[0, num_local_experts)` (`-1` = expert not on this rank, padding rows) are skipped.
        num_local_experts: static number of experts on this rank (`Buffer.num_local_experts`).
        num_rows: static number of sorted rows `N` (default `C*K`). Since the ids of one row are
            distinct (top-k), a row has at most `min(K, num_local_experts)` valid pairs, so
            `N = C * min(K, num_local_experts)` is lossless and saves expert compute when
            `num_local_experts < K`. A smaller `N` drops the valid pairs past row `N` (the
            highest experts' last rows), like a capacity limit: they contribute 0.

    Returns:
        `Permuted(x_sorted, group_sizes, state)`: `x_sorted` `[N, H]` (dtype of `recv_x`) holds
        one copy of row r per valid pair (r, k), stably ordered by expert, then r, then k; the
        rows after `sum(group_sizes)` (padding) are zero and belong to no group.
        `group_sizes` `[num_local_experts]` int32; `sum(group_sizes) <= N`.

    Raises:
        ValueError: on mismatched shapes, a non-positive `num_local_experts` or `num_rows`
            outside `[1, C*K]`.
    """
    if recv_x.ndim != 2 or recv_topk_idx.ndim != 2 or recv_x.shape[0] != recv_topk_idx.shape[0]:
        raise ValueError(
            "permute: expected recv_x [C, H] and recv_topk_idx [C, K] with the same C, got "
            f"recv_x {recv_x.shape} and recv_topk_idx {recv_topk_idx.shape}"
        )
    if not jnp.issubdtype(recv_topk_idx.dtype, jnp.integer):
        raise ValueError(f"permute: recv_topk_idx must be int32, got {recv_topk_idx.dtype}")
    if int(num_local_experts) <= 0:
        raise ValueError(f"permute: num_local_experts must be positive, got {num_local_experts}")
    num_local_experts = int(num_local_experts)
    c, k = recv_topk_idx.shape
    num_rows = c * k if num_rows is None else num_rows
    if isinstance(num_rows, int) and isinstance(c, int) and not 0 < num_rows <= c * k:
        raise ValueError(f"permute: num_rows must be in [1, C*K = {c * k}], got {num_rows}")

    pair_expert = recv_topk_idx.astype(jnp.int32).reshape(c * k)
    pair_valid = (pair_expert >= 0) & (pair_expert < num_local_experts)
    # Invalid pairs get key E_loc, so they sort after every group. The stable sort keeps the flat
    # (r*K + k) order within a key: expert, then row, then k.
    key = jnp.where(pair_valid, pair_expert, num_local_experts)
    order = jnp.argsort(key, stable=True).astype(jnp.int32)
    positions = jnp.arange(c * k, dtype=jnp.int32)
    pair_slot = jnp.zeros((c * k,), jnp.int32).at[order].set(positions)
    kept = pair_valid & (pair_slot < num_rows)  # valid pairs that fit in num_rows
    counts = jnp.zeros((num_local_experts + 1,), jnp.int32).at[key].add(1)
    group_ends = jnp.minimum(jnp.cumsum(counts[:num_local_experts]), num_rows)
    group_sizes = jnp.diff(group_ends, prepend=0).astype(jnp.int32)

    sorted_pair = order[:num_rows]
    state = PermuteState(
        sorted_pair=sorted_pair,
        sorted_valid=pair_valid[sorted_pair],
        pair_slot=jnp.where(kept, pair_slot, 0).reshape(c, k),
        pair_valid=kept.reshape(c, k),
    )
    return Permuted(_expand(recv_x, state), group_sizes, state)


def unpermute(y_sorted: jax.Array, state: PermuteState, recv_topk_weights: jax.Array) -> jax.Array:
    """Weights and sums the expert outputs of each received row: the inverse of `permute`.

    `out[r] = sum over valid k of recv_topk_weights[r, k] * y_sorted[row of pair (r, k)]`,
    accumulated in float32 and cast to the dtype of `y_sorted`. Rows with no valid pair are 0.
    Jittable and differentiable w.r.t. `y_sorted` and `recv_topk_weights` (gathers only).

    Args:
        y_sorted: `[N, H_out]` expert outputs in `permute`'s order (rows after
            `sum(group_sizes)` are ignored).
        state: the `PermuteState` returned by `permute`.
        recv_topk_weights: `[C, K]` float gate weights (`Dispatched.recv_topk_weights`).

    Returns:
        `[C, H_out]` in the dtype of `y_sorted`: the value to pass to `jax_ep.combine`.

    Raises:
        ValueError: on shapes that do not match `state`.
    """
    c, k = state.pair_slot.shape
    num_rows = state.sorted_pair.shape[0]
    if y_sorted.ndim != 2 or y_sorted.shape[0] != num_rows:
        raise ValueError(f"unpermute: expected y_sorted [{num_rows}, H_out], got {y_sorted.shape}")
    if recv_topk_weights.shape != (c, k):
        raise ValueError(
            f"unpermute: expected recv_topk_weights [{c}, {k}], got {recv_topk_weights.shape}"
        )
    pairs = _collect(y_sorted, state)  # [C, K, H_out], invalid pairs zero
    weights = jnp.where(state.pair_valid, recv_topk_weights.astype(jnp.float32), 0.0)
    # An elementwise product and a reduction over k (not a dot): exact float32 on every platform
    # (no TF32), and XLA can fuse the gather into the reduction instead of materialising pairs.
    out = jnp.sum(weights[:, :, None] * pairs.astype(jnp.float32), axis=1)
    return out.astype(y_sorted.dtype)
