"""Mixture-of-Experts building blocks around `jax_ep.dispatch` / `jax_ep.combine`.

Sharding model: the functions here work on one expert-parallel rank's *local* arrays. `router`,
`permute` and `unpermute` are purely local (no communication) and may be used anywhere, inside or
outside `jax.shard_map`; `moe_ffn` calls `jax_ep.dispatch` and `jax_ep.combine`, so it must run
inside `jax.shard_map` that is manual over the Buffer's expert-parallel axis, under `jax.jit`.
Each rank holds its `num_local_experts = num_experts // R` experts' weights; global expert `e`
lives on rank `e // num_local_experts` (docs/api.md, "Buffer").

One expert-parallel MoE feed-forward layer, per rank::

    topk_idx, topk_weights, aux_loss = router(x @ w_router, num_topk)
    d = jax_ep.dispatch(buf, x, topk_idx, topk_weights)               # [C, H] received rows
    x_sorted, group_sizes, state = permute(d.recv_x, d.recv_topk_idx, E_loc)
    y_sorted = swiglu_experts(x_sorted, group_sizes, w_gate, w_up, w_down)  # grouped matmuls
    y_recv = unpermute(y_sorted, state, d.recv_topk_weights)          # [C, H] weighted
    y, _ = jax_ep.combine(buf, y_recv, d.handle)                      # [T, H]

which `moe_ffn` packages for SwiGLU experts. The expert matmuls are selectable (`matmul`):
a library's grouped GEMM kernels on Hopper GPUs (`jax_ep.grouped_gemm`: tokamax's or jax's
Pallas Mosaic GPU kernels; `"auto"` picks tokamax's forward with jax's backward kernels where
tokamax imports), `grouped_matmul` (tiled batched matmuls, work and memory linear in the rows:
the portable fallback, and `"auto"`'s choice elsewhere) or `jax.lax.ragged_dot` (which XLA:GPU
turns into a dense matmul over all local experts).
Everything is jittable, has static shapes and is differentiable; `permute` / `unpermute` move
rows with gathers only (their gradients are gathers too, no scatter-add), so they are
deterministic forward and backward. The one scatter-add of the layer is `grouped_matmul`'s
weight gradient (a sum of per-tile float32 products per expert; see its docstring).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp

from jax_ep import _vma, grouped_gemm
from jax_ep.ops import combine, dispatch

if TYPE_CHECKING:  # pragma: no cover
    from jax_ep.buffer import Buffer

__all__ = [
    "PermuteState",
    "Permuted",
    "Routing",
    "grouped_matmul",
    "moe_ffn",
    "permute",
    "router",
    "swiglu_experts",
    "unpermute",
]


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


class Routing(NamedTuple):
    """Result of `router` (unpacks as `topk_idx, topk_weights, aux_loss`).

    Attributes:
        topk_idx: `[T, K]` int32 global expert ids, `-1` for masked-out tokens.
        topk_weights: `[T, K]` float32 gate weights, 0 where `topk_idx` is -1.
        aux_loss: float32 scalar load-balancing loss (1.0 for perfectly uniform routing).
    """

    topk_idx: jax.Array
    topk_weights: jax.Array
    aux_loss: jax.Array


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


def router(
    logits: jax.Array,
    num_topk: int,
    *,
    normalize_weights: bool = True,
    token_mask: jax.Array | None = None,
) -> Routing:
    """Top-k softmax router with the Switch/GShard load-balancing auxiliary loss.

    Scores are `p = softmax(logits)` in float32; each token picks its `num_topk` highest-scoring
    experts (distinct ids, as `jax_ep.dispatch` requires), whose scores are its gate weights,
    renormalised to sum to 1 when `normalize_weights` (with `num_topk=1` that makes every
    weight 1 and leaves the router no gradient from the task loss: use `normalize_weights=False`
    there, as Switch Transformer does).

    The auxiliary loss is `aux = E * sum_e f_e * P_e` where `f_e` is the fraction of (token, k)
    assignments that went to expert e (not differentiable) and `P_e` is the mean router
    probability of expert e over the tokens. It is 1.0 when routing is perfectly uniform and
    grows with imbalance; its gradient pushes probability away from overloaded experts
    (Switch Transformer eq. 4, generalised to top-k by counting every assignment). Inside
    `shard_map` it is computed over the rank's own tokens; take `jax.lax.pmean` over the data
    axes for the global-batch value, or call `router` outside `shard_map` on the global logits.

    Args:
        logits: `[T, E]` router logits (any float dtype; computed in float32).
        num_topk: static K, `1 <= K <= E`.
        normalize_weights: renormalise each token's top-k weights to sum to 1.
        token_mask: optional `[T]` bool, False for padding tokens: they are routed nowhere
            (`topk_idx` -1, weights 0) and do not count in the auxiliary loss.

    Returns:
        `Routing(topk_idx [T, K] int32, topk_weights [T, K] float32, aux_loss float32 scalar)`.

    Raises:
        ValueError: on a bad `logits` rank or `num_topk`.
    """
    if logits.ndim != 2:
        raise ValueError(f"router: expected logits [T, E], got shape {logits.shape}")
    num_tokens, num_experts = logits.shape
    if not 1 <= int(num_topk) <= num_experts:
        raise ValueError(f"router: num_topk must be in [1, {num_experts}], got {num_topk}")
    num_topk = int(num_topk)

    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    topk_weights, topk_idx = jax.lax.top_k(probs, num_topk)
    topk_idx = topk_idx.astype(jnp.int32)
    if normalize_weights:
        topk_weights = topk_weights / jnp.sum(topk_weights, axis=-1, keepdims=True)

    if token_mask is None:
        mask = jnp.ones((num_tokens,), jnp.float32)
    else:
        if token_mask.shape != (num_tokens,):
            raise ValueError(f"router: token_mask must be [{num_tokens}], got {token_mask.shape}")
        mask = token_mask.astype(jnp.float32)
        keep = token_mask.astype(bool)[:, None]
        topk_idx = jnp.where(keep, topk_idx, -1)
        topk_weights = jnp.where(keep, topk_weights, 0.0)

    num_valid = jnp.maximum(jnp.sum(mask), 1.0)
    assignments = jax.nn.one_hot(topk_idx, num_experts, dtype=jnp.float32).sum(axis=1)  # [T, E]
    frac_assigned = jax.lax.stop_gradient(assignments.sum(axis=0) / (num_valid * num_topk))
    mean_prob = jnp.sum(probs * mask[:, None], axis=0) / num_valid
    aux_loss = num_experts * jnp.sum(frac_assigned * mean_prob)
    return Routing(topk_idx, topk_weights, aux_loss)


# ---------------------------------------------------------------------------- grouped matmul
# XLA:GPU (jax 0.10-0.11) has no grouped GEMM for `jax.lax.ragged_dot` outside cuDNN, which does
# not take our float32-output matmuls: xla/hlo/transforms/expanders/ragged_dot_rewriter.cc turns
# every ragged_dot into one dense matmul over all G groups with a masked copy of the rows per
# group ([G, N, K] temporaries and G times the useful FLOPs; at N=65536, K=2048, G=32 the MoE
# layer's forward + backward needs 61-76 GiB of temporaries and runs at ~5 TFLOP/s on an H200).
# `grouped_matmul` computes the same function with ordinary batched matmuls over row tiles.

# Rows per tile. A tile shared by two groups is computed once per group (up to (G - 1) * tile
# extra rows) and each (tile, group) work item copies its group's [K, M] weights: smaller tiles
# waste fewer rows, larger ones copy fewer weights. At the benchmark shape (32768-65536 used
# rows, G=32, K*M = 2048*1024) a FLOP/s + bandwidth model of an H200 puts 512 and 1024 within
# ~10% of each other and 256 10-25% slower; 512 wastes fewer rows when groups are small.
DEFAULT_TILE = 512
# Tiles are padded to a multiple of this many rows (GEMM-friendly shapes for small N).
_ROW_ALIGN = 8
# Work items run in chunks (a lax.scan) whose [items, K, M] float32 temporaries (weight copies,
# weight-gradient partial products) stay under this size: 32 items at K*M = 2048*1024, i.e.
# 16384 rows of 512-row tiles per batched matmul, still large enough for a GPU. Chunks holding
# no used item (rows past sum(group_sizes), e.g. a lossless-capacity permute) are skipped.
_CHUNK_BYTES = 256 * 2**20
# The expert matmuls of swiglu_experts / moe_ffn: "tiled" (grouped_matmul), "ragged_dot"
# (jax.lax.ragged_dot) or a library's grouped GEMM kernels (jax_ep.grouped_gemm); "auto" picks
# tokamax+mosaic on Hopper GPUs where tokamax imports, else tiled (JAX_EP_MOE_MATMUL overrides).
MATMULS = grouped_gemm.MATMULS
DEFAULT_MATMUL = "auto"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _TilePlan:
    """Where `grouped_matmul` computes each row.

    The `N` rows are cut into `T = ceil(N / B)` tiles of `B` rows. Work item `p` multiplies the
    rows of tile `item_tile[p]` by group `item_group[p]`'s matrix; items list every overlapping
    (tile, group) pair in (group, tile) order, hence also in tile order. Consecutive groups
    share at most one tile, so `T + G - 1` items always suffice; `P` is that bound rounded up
    to whole chunks (`_chunking`). The used items come first; unused ones have tile 0, group
    `G - 1` and an all-False `item_mask` (a product computed for them is never read).

    Attributes:
        item_used: `[P]` bool, whether the item overlaps its group (a prefix of the items).
        item_tile: `[P]` int32 tile of each item.
        item_group: `[P]` int32 group of each item, nondecreasing.
        item_mask: `[P, B]` bool, whether row `b` of the item's tile belongs to its group.
        row_slot: `[N]` int32 flat index into `[P * B]` of the item row that holds each row.
        row_valid: `[N]` bool, False for rows past `sum(group_sizes)` (they belong to no group).
    """

    item_used: jax.Array
    item_tile: jax.Array
    item_group: jax.Array
    item_mask: jax.Array
    row_slot: jax.Array
    row_valid: jax.Array


def _chunking(num_rows: int, w_shape: tuple[int, int, int], tile: int) -> tuple[int, int]:
    """Static `(num_chunks, items_per_chunk)` covering the `T + G - 1` work items."""
    num_groups, k, m = w_shape
    max_items = -(-num_rows // tile) + num_groups - 1
    num_chunks = -(-max_items // max(1, _CHUNK_BYTES // (4 * k * m)))
    return num_chunks, -(-max_items // num_chunks)


def _tile_plan(group_sizes: jax.Array, num_rows: int, num_items: int, tile: int) -> _TilePlan:
    num_groups = group_sizes.shape[0]
    # Group g holds rows [starts[g], ends[g]); groups past row N are truncated, as in ragged_dot.
    ends = jnp.minimum(jnp.cumsum(group_sizes.astype(jnp.int32)), num_rows)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    first_tile = starts // tile
    num_group_items = jnp.where(ends > starts, (ends - 1) // tile - first_tile + 1, 0)
    items_end = jnp.cumsum(num_group_items)
    items_start = items_end - num_group_items

    item = jnp.arange(num_items, dtype=jnp.int32)
    item_used = item < items_end[-1]
    item_group = jnp.searchsorted(items_end, item, side="right", method="compare_all")
    item_group = jnp.minimum(item_group, num_groups - 1).astype(jnp.int32)
    item_tile = first_tile[item_group] + item - items_start[item_group]
    item_tile = jnp.where(item_used, item_tile, 0)
    rows = item_tile[:, None] * tile + jnp.arange(tile, dtype=jnp.int32)
    item_mask = (item_used[:, None] & (rows >= starts[item_group][:, None])
                 & (rows < ends[item_group][:, None]))

    row = jnp.arange(num_rows, dtype=jnp.int32)
    row_group = jnp.searchsorted(ends, row, side="right", method="compare_all").astype(jnp.int32)
    row_valid = row_group < num_groups
    g = jnp.minimum(row_group, num_groups - 1)
    row_item = items_start[g] + row // tile - first_tile[g]
    row_slot = jnp.where(row_valid, row_item * tile + row % tile, 0)
    return _TilePlan(item_used, item_tile, item_group, item_mask, row_slot, row_valid)


def _tiles(a: jax.Array, tile: int) -> jax.Array:
    """`[N, D]` -> `[T, B, D]`, zero-padded to whole tiles."""
    num_tiles = -(-a.shape[0] // tile)
    a = jnp.pad(a, ((0, num_tiles * tile - a.shape[0]), (0, 0)))
    return a.reshape(num_tiles, tile, a.shape[1])


def _item_rows(y: jax.Array, plan: _TilePlan) -> jax.Array:
    """`[P, B, D]` -> `[N, D]`: row r from the item of its group; 0 past `sum(group_sizes)`."""
    flat = y.reshape(-1, y.shape[-1])
    return jnp.where(plan.row_valid[:, None], flat[plan.row_slot], jnp.zeros((), y.dtype))


def _scan_chunks(body, carry, items, plan: _TilePlan, num_chunks: int, axes: frozenset):
    """`body(carry, items) -> (carry, [p, ...])` over `num_chunks` equal chunks of the items.

    A chunk with no used item is skipped: carry unchanged, output zeros (never read). `axes`:
    the manual axes the body's results vary over inside shard_map (scan and cond need the
    skipped branch and the initial carry typed alike)."""
    if num_chunks == 1:
        return body(carry, items)

    def chunk_step(carry, chunk):
        used, items = chunk
        out = jax.eval_shape(body, carry, items)[1]

        def skip(carry, _):
            return carry, _vma.make_varying(jnp.zeros(out.shape, out.dtype), axes)

        return jax.lax.cond(used, body, skip, carry, items)

    carry = jax.tree.map(lambda a: _vma.make_varying(a, axes), carry)
    chunks = jax.tree.map(lambda a: a.reshape(num_chunks, -1, *a.shape[1:]), items)
    chunk_used = plan.item_used.reshape(num_chunks, -1)[:, 0]  # used items are a prefix
    carry, out = jax.lax.scan(chunk_step, carry, (chunk_used, chunks))
    return carry, out.reshape(-1, *out.shape[2:])


def _batched_dot(a, b, contract, precision, preferred_element_type):
    """Batch dim 0 of both operands; contracts `a`'s axis `contract[0]` with `b`'s `contract[1]`."""
    return jax.lax.dot_general(a, b, (((contract[0],), (contract[1],)), ((0,), (0,))),
                               precision=precision,
                               preferred_element_type=preferred_element_type)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _tiled_matmul(x, w, group_sizes, tile, precision, preferred_element_type):
    return _tiled_matmul_fwd(x, w, group_sizes, tile, precision, preferred_element_type)[0]


def _tiled_matmul_fwd(x, w, group_sizes, tile, precision, preferred_element_type):
    num_chunks, items_per_chunk = _chunking(x.shape[0], w.shape, tile)
    plan = _tile_plan(group_sizes, x.shape[0], num_chunks * items_per_chunk, tile)
    x_tiles = _tiles(x, tile)

    def products(carry, items):
        # [p, B, K] x [p, K, M] -> [p, B, M]. Each row is read back from its own group's item
        # only, so the rows of other groups in a shared tile need no mask here.
        tile_idx, group_idx = items
        return carry, _batched_dot(x_tiles[tile_idx], w[group_idx], (2, 1), precision,
                                   preferred_element_type)

    _, y = _scan_chunks(products, None, (plan.item_tile, plan.item_group), plan, num_chunks,
                        _vma.varying_axes(x))
    return _item_rows(y, plan), (x, w, plan)


def _tiled_matmul_bwd(tile, precision, preferred_element_type, residuals, dy):
    x, w, plan = residuals
    num_chunks, _ = _chunking(x.shape[0], w.shape, tile)
    x_tiles, dy_tiles = _tiles(x, tile), _tiles(dy, tile)
    # dw's per-item partial sums are kept in at least float32 whatever preferred_element_type.
    acc_dtype = jnp.promote_types(dy.dtype, jnp.float32)

    def grads(dw, items):
        tile_idx, group_idx, mask = items
        dy_items = dy_tiles[tile_idx]  # [p, B, M]
        # dx = dy w_g^T in preferred_element_type, then x's dtype (as ragged_dot's transpose).
        dx_items = _batched_dot(dy_items, w[group_idx], (2, 2), precision,
                                preferred_element_type).astype(x.dtype)
        # dw_g += x_g^T dy_g over the item's rows of its group (mask), [p, K, M].
        x_items = jnp.where(mask[..., None], x_tiles[tile_idx], jnp.zeros((), x.dtype))
        partial = _batched_dot(x_items, dy_items, (1, 1), precision, acc_dtype)
        return dw.at[group_idx].add(partial, indices_are_sorted=True), dx_items

    dw, dx_items = _scan_chunks(grads, jnp.zeros(w.shape, acc_dtype),
                                (plan.item_tile, plan.item_group, plan.item_mask), plan,
                                num_chunks, _vma.varying_axes(x))
    return _item_rows(dx_items, plan), dw.astype(w.dtype), None


_tiled_matmul.defvjp(_tiled_matmul_fwd, _tiled_matmul_bwd)


def grouped_matmul(
    x: jax.Array,
    w: jax.Array,
    group_sizes: jax.Array,
    *,
    tile: int = DEFAULT_TILE,
    precision: jax.lax.PrecisionLike = None,
    preferred_element_type: jax.typing.DTypeLike | None = None,
) -> jax.Array:
    """`jax.lax.ragged_dot(x, w, group_sizes)` computed as batched matmuls over row tiles.

    The same function as ragged_dot: row `r` of group `g` (groups are consecutive row ranges,
    in order, of `group_sizes[g]` rows) gives `out[r] = x[r] @ w[g]`; rows past
    `sum(group_sizes)` give 0 and groups reaching past row `N` are truncated. Unlike ragged_dot
    on XLA:GPU (one dense matmul over all `G` groups, see the comment above `DEFAULT_TILE`),
    work and memory are linear in the rows:

    - The rows are cut into tiles of `tile` rows; each (tile, group) pair that overlaps is one
      work item, a `[tile, K] x [K, M]` matmul of a batched `dot_general`. There are at most
      `ceil(N / tile) + G - 1` items: at most `(G - 1) * tile` rows are computed on top of the
      `sum(group_sizes)` useful ones.
    - Items run in chunks (a `lax.scan`, one batched matmul per chunk) whose `[items, K, M]`
      weight copies and weight-gradient partial products stay near 256 MiB; the chunks past
      the used items are skipped (`lax.cond`: on GPUs one predicate read by the host per
      chunk), so the padding rows past `sum(group_sizes)` cost next to nothing.
    - Temporaries: one chunk's tiles, weight copies and products, the `[P, tile, M]` products
      of all `P ~ N / tile + G` items, and in the backward a `[G, K, M]` float32 accumulator.

    Jittable (static shapes) and reverse-mode differentiable w.r.t. `x` and `w` through a
    `jax.custom_vjp` whose backward is tiled the same way and saves only `x`, `w` and the int32
    plan: `dx` is the tiled product of the cotangent with `w^T` (ragged_dot's dtypes), and
    `dw[g] = x_g^T dy_g` sums the item products of group g in at least float32. Every output
    row is read from its own item (gathers); the one scatter-add is that sum, whose float32
    order may vary between runs on GPUs unless XLA is asked for deterministic ops
    (`--xla_gpu_exclude_nondeterministic_ops`). No forward-mode (jvp) rule.

    Args:
        x: `[N, K]` rows grouped by group (e.g. `permute`'s `x_sorted`).
        w: `[G, K, M]` one matrix per group.
        group_sizes: `[G]` integer (int32) rows per group, non-negative.
        tile: static rows per tile (default `DEFAULT_TILE` = 512); capped at `N` rounded up to
            a multiple of 8, so a small `N` is one tile.
        precision: as for `jax.lax.ragged_dot` (e.g. `"highest"` to avoid TF32 for float32).
        preferred_element_type: result dtype as for `jax.lax.ragged_dot` (e.g. float32 to
            accumulate bfloat16 inputs in float32 and return float32).

    Returns:
        `[N, M]` in `preferred_element_type`, else the dtype `jax.lax.dot_general` gives.

    Raises:
        ValueError: on mismatched shapes, a non-integer `group_sizes` or a non-positive `tile`.
    """
    if x.ndim != 2 or w.ndim != 3 or x.shape[1] != w.shape[1] or w.shape[0] < 1:
        raise ValueError(
            f"grouped_matmul: expected x [N, K] and w [G >= 1, K, M] with the same K, got x "
            f"{x.shape} and w {w.shape}"
        )
    if group_sizes.shape != w.shape[:1] or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(
            f"grouped_matmul: group_sizes must be int32 [{w.shape[0]}] (one per group of w), got "
            f"{group_sizes.dtype} {group_sizes.shape}"
        )
    if int(tile) <= 0:
        raise ValueError(f"grouped_matmul: tile must be a positive int, got {tile}")
    num_rows = x.shape[0]
    tile = min(int(tile), -(-num_rows // _ROW_ALIGN) * _ROW_ALIGN)
    if num_rows == 0:
        return jax.lax.dot_general(x, w[0], (((1,), (0,)), ((), ())), precision=precision,
                                   preferred_element_type=preferred_element_type)
    # Inside shard_map a custom_vjp cotangent must vary over its primal's manual axes: x and w
    # are cast to vary over the same axes first (those of every intermediate), and the cast's
    # transpose sums dw over the axes w is replicated on (e.g. a data axis).
    axes = frozenset().union(*(_vma.varying_axes(a) for a in (x, w, group_sizes)))
    x, w = (_vma.make_varying(a, axes) for a in (x, w))
    return _tiled_matmul(x, w, group_sizes, tile, precision, preferred_element_type)


def swiglu_experts(
    x_sorted: jax.Array,
    group_sizes: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    *,
    activation: Callable[[jax.Array], jax.Array] = jax.nn.silu,
    precision: jax.lax.PrecisionLike = None,
    matmul: str = DEFAULT_MATMUL,
) -> jax.Array:
    """Applies expert e's gated MLP to its group of rows: `(act(x Wg_e) * (x Wu_e)) Wd_e`.

    Jittable; differentiable w.r.t. `x_sorted` and the three weights.

    Args:
        x_sorted: `[N, H]` rows grouped by expert (`permute`'s output).
        group_sizes: `[E_loc]` int32 rows per expert; rows after the groups give 0.
        w_gate: `[E_loc, H, F]`; w_up: `[E_loc, H, F]`; w_down: `[E_loc, F, H_out]`.
        activation: elementwise activation of the gate (SiLU for SwiGLU).
        precision: matmul precision of `"tiled"` / `"ragged_dot"` (e.g. `"highest"` to avoid
            TF32 on GPUs for float32); the library kernels take bfloat16 / float16 only.
        matmul: how the three grouped matmuls run (forward and both backward products), same
            function either way (`jax_ep.grouped_gemm.MATMULS`):
            `"auto"` (default): `JAX_EP_MOE_MATMUL` if set, else `"tokamax+mosaic"` for
            bfloat16 / float16 rows on Hopper GPUs where tokamax imports, else `"tiled"` (also
            when the library kernels cannot tile `H` / `F`, e.g. widths not multiples of 512).
            `"tokamax"`, `"tokamax+mosaic"`, `"mosaic"`: `grouped_gemm.library_matmul`, grouped
            GEMM kernels of tokamax and / or jax (`jax.experimental.pallas.ops.gpu`), Hopper
            only, bfloat16 / float16; rows past the groups are never stored (masked to 0 here).
            `"tiled"`: `grouped_matmul`, batched matmuls over row tiles with a tiled
            backward; work and temporaries linear in the rows (padding rows past the groups
            are skipped), values and gradients equal to ragged_dot's up to float32 summation
            order. At the benchmark shape (`N=65536`, `H=2048`, `F=1024`, `E_loc=32`) the
            forward + backward of the MoE layer compiles for an H200 with 3.4-4.1 GiB of
            temporaries instead of 61-76 GiB.
            `"ragged_dot"`: `jax.lax.ragged_dot`. XLA:GPU (jax 0.10-0.11) rewrites it into a
            dense matmul over all `E_loc` experts with a masked copy of the rows per expert
            (ragged_dot_rewriter.cc; cuDNN's grouped GEMM does not take float32 outputs):
            `E_loc` times the FLOPs and `[E_loc, N, H]` temporaries, ~5 TFLOP/s on an H200.
            Kept for comparison and for platforms whose ragged_dot is a real grouped GEMM.

    Returns:
        `[N, H_out]`: float32 with `"tiled"` / `"ragged_dot"` (matmuls take `x_sorted`'s dtype,
        accumulate in float32); `x_sorted`'s dtype with the library kernels (they accumulate in
        float32 and write the operand dtype; the gate and up products are bfloat16 too).

    Raises:
        ValueError: on an unknown `matmul`, or a library matmul with unsupported dtypes or
            widths.
    """
    if matmul not in MATMULS:
        raise ValueError(f"swiglu_experts: matmul must be one of {MATMULS}, got {matmul!r}")
    dtype = x_sorted.dtype
    requested, matmul = matmul, grouped_gemm.resolve_matmul(matmul, dtype)
    widths = (w_gate.shape[1:], w_down.shape[1:])
    if requested == "auto" and matmul in grouped_gemm.LIBRARY_MATMULS and not all(
            grouped_gemm.supports(matmul, k, m) for k, m in widths):
        matmul = "tiled"  # auto never picks kernels that cannot tile these widths
    if matmul in grouped_gemm.LIBRARY_MATMULS:
        return _swiglu_library(x_sorted, group_sizes, w_gate, w_up, w_down, activation, matmul)
    gmm = grouped_matmul if matmul == "tiled" else jax.lax.ragged_dot

    def expert_matmul(lhs, rhs):
        return gmm(lhs, rhs.astype(dtype), group_sizes, precision=precision,
                   preferred_element_type=jnp.float32)

    hidden = activation(expert_matmul(x_sorted, w_gate)) * expert_matmul(x_sorted, w_up)
    return expert_matmul(hidden.astype(dtype), w_down)


def _swiglu_library(x_sorted, group_sizes, w_gate, w_up, w_down, activation, matmul):
    """`swiglu_experts` through `grouped_gemm.library_matmul` (bf16 / f16 in and out).

    The kernels leave the rows past the groups unspecified (possibly NaN), so the matmul
    outputs are masked with selects before anything else reads them: the activation then sees
    zeros there, and every cotangent row past the groups is an exact zero (a select's
    transpose), which keeps the weight-gradient kernels' edge blocks finite."""
    dtype = x_sorted.dtype
    num_rows = x_sorted.shape[0]
    used = jnp.minimum(jnp.sum(group_sizes.astype(jnp.int32)), num_rows)
    valid = (jnp.arange(num_rows, dtype=jnp.int32) < used)[:, None]
    zero = jnp.zeros((), dtype)

    def expert_matmul(lhs, rhs):
        out = grouped_gemm.library_matmul(lhs, rhs.astype(dtype), group_sizes, matmul)
        return jnp.where(valid, out, zero)

    gate = expert_matmul(x_sorted, w_gate).astype(jnp.float32)
    up = expert_matmul(x_sorted, w_up).astype(jnp.float32)
    return expert_matmul((activation(gate) * up).astype(dtype), w_down)


def moe_ffn(
    buf: Buffer,
    x: jax.Array,
    topk_idx: jax.Array,
    topk_weights: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    *,
    activation: Callable[[jax.Array], jax.Array] = jax.nn.silu,
    precision: jax.lax.PrecisionLike = None,
    matmul: str = DEFAULT_MATMUL,
) -> jax.Array:
    """Expert-parallel MoE feed-forward with SwiGLU experts, for one rank inside `shard_map`.

    `y[t] = sum_k topk_weights[t, k] * expert_{topk_idx[t, k]}(x[t])` with
    `expert_e(v) = (act(v Wg_e) * (v Wu_e)) Wd_e`, where each rank holds the weights of its own
    `E_loc` experts: dispatch -> `permute` -> `swiglu_experts` -> `unpermute` -> combine.

    Must be called inside `jax.shard_map` manual over `buf`'s expert-parallel axis, under
    `jax.jit`. Differentiable w.r.t. `x`, `topk_weights` and the three weights (through the
    custom VJPs of `jax_ep.dispatch` / `jax_ep.combine`).

    Args:
        buf: the `jax_ep.Buffer` (its `dtype`, `hidden`, `num_topk`, `num_local_experts`).
        x: `[T, H]` this rank's tokens, dtype `buf.dtype`.
        topk_idx: `[T, K]` int32 global expert ids, `-1` = no expert.
        topk_weights: `[T, K]` float32 gate weights.
        w_gate: `[E_loc, H, F]` this rank's gate projections.
        w_up: `[E_loc, H, F]` this rank's up projections.
        w_down: `[E_loc, F, H]` this rank's down projections.
        activation: gate activation (default SiLU).
        precision: precision of the expert matmuls (see `swiglu_experts`).
        matmul: how the expert matmuls run: `"auto"` (default), `"tokamax"`,
            `"tokamax+mosaic"`, `"mosaic"`, `"tiled"` or `"ragged_dot"` (see `swiglu_experts`).

    Returns:
        `[T, H]` in `x`'s dtype; tokens routed nowhere give 0.

    Raises:
        ValueError: when the weights do not have `E_loc = buf.num_local_experts` experts or do
            not match `H`, or on an unknown `matmul`.
    """
    num_local = buf.num_local_experts
    hidden = x.shape[-1]
    if w_gate.ndim != 3 or w_gate.shape[:2] != (num_local, hidden):
        raise ValueError(
            f"moe_ffn: w_gate must be [num_local_experts={num_local}, hidden={hidden}, F], "
            f"got {w_gate.shape}"
        )
    ffn = w_gate.shape[2]
    if w_up.shape != w_gate.shape:
        raise ValueError(f"moe_ffn: w_up must be {w_gate.shape} like w_gate, got {w_up.shape}")
    if w_down.shape != (num_local, ffn, hidden):
        raise ValueError(
            f"moe_ffn: w_down must be [{num_local}, {ffn}, {hidden}], got {w_down.shape}"
        )
    d = dispatch(buf, x, topk_idx, topk_weights)
    # A received row has at most min(K, E_loc) local experts: no more sorted rows are needed.
    num_rows = d.recv_x.shape[0] * min(buf.num_topk, num_local)
    x_sorted, group_sizes, state = permute(
        d.recv_x, d.recv_topk_idx, num_local, num_rows=num_rows
    )
    y_sorted = swiglu_experts(
        x_sorted, group_sizes, w_gate, w_up, w_down, activation=activation, precision=precision,
        matmul=matmul,
    )
    y_recv = unpermute(y_sorted, state, d.recv_topk_weights).astype(x.dtype)
    y, _ = combine(buf, y_recv, d.handle)
    return y
