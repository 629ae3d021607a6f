"""`grouped_matmul`: the tiled grouped matmul of `jax_ep.moe`, `jax.lax.ragged_dot`'s function
with ordinary batched matmuls over row tiles (the portable fallback of the expert matmuls: CPU
and GPUs without a grouped-GEMM library; `jax_ep.moe.grouped_gemm` holds the library kernels)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jax_ep import _vma

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
