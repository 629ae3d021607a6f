"""Mixture-of-Experts building blocks around `jax_ep.dispatch` / `jax_ep.combine`.

Sharding model: the functions here work on one expert-parallel rank's *local* arrays. `router`
and `permute` / `unpermute` (`jax_ep.moe.permute`) are purely local (no communication) and may
be used anywhere, inside or outside `jax.shard_map`; `moe_ffn` calls `jax_ep.dispatch` and
`jax_ep.combine`, so it must run inside `jax.shard_map` that is manual over the Buffer's
expert-parallel axis, under `jax.jit`.
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
a library's grouped GEMM kernels on Hopper GPUs (`jax_ep.moe.grouped_gemm`: tokamax's or jax's
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

from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp

from jax_ep.moe import grouped_gemm, stages
from jax_ep.moe.permute import permute, unpermute
from jax_ep.moe.tiled_matmul import grouped_matmul
from jax_ep.ops import combine, dispatch

if TYPE_CHECKING:  # pragma: no cover
    from jax_ep.buffer import Buffer

__all__ = [
    "Routing",
    "expert_matmul",
    "grouped_matmul",
    "moe_ffn",
    "router",
    "swiglu_experts",
]


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


# ---------------------------------------------------------------------------- expert matmuls
# The expert matmuls of swiglu_experts / moe_ffn: "tiled" (grouped_matmul), "ragged_dot"
# (jax.lax.ragged_dot) or a library's grouped GEMM kernels (jax_ep.moe.grouped_gemm); "auto" picks
# mosaic (jax's kernels) on Hopper GPUs, else tiled (JAX_EP_MOE_MATMUL overrides).
MATMULS = grouped_gemm.MATMULS
DEFAULT_MATMUL = "auto"


def swiglu_experts(
    x_sorted: jax.Array,
    group_sizes: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array | None,
    w_down: jax.Array,
    *,
    activation: Callable[[jax.Array], jax.Array] = jax.nn.silu,
    precision: jax.lax.PrecisionLike = None,
    matmul: str = DEFAULT_MATMUL,
) -> jax.Array:
    """Applies expert e's gated MLP to its group of rows: `(act(x Wg_e) * (x Wu_e)) Wd_e`.

    Jittable; differentiable w.r.t. `x_sorted` and the weights.

    Args:
        x_sorted: `[N, H]` rows grouped by expert (`permute`'s output).
        group_sizes: `[E_loc]` int32 rows per expert; rows after the groups give 0.
        w_gate: `[E_loc, H, F]`; w_up: `[E_loc, H, F]`; w_down: `[E_loc, F, H_out]`.
            Or gate and up side by side in one weight: `w_gate` `[E_loc, H, 2F]` (gate columns
            first) and `w_up=None`. The same function in two grouped matmuls instead of three
            (forward, dx and dw of gate and up are one product each, six products in all
            instead of nine, and dx needs no sum; less kernel time per step on an H200 at
            bench_moe_layer's shape). Store the weight that way (the Flax example does);
            concatenating per step costs more.
        activation: elementwise activation of the gate (SiLU for SwiGLU).
        precision: matmul precision of `"tiled"` / `"ragged_dot"` (e.g. `"highest"` to avoid
            TF32 on GPUs for float32); the library kernels take bfloat16 / float16 only.
        matmul: how the three grouped matmuls run (forward and both backward products), same
            function either way (`jax_ep.moe.grouped_gemm.MATMULS`):
            `"auto"` (default): `JAX_EP_MOE_MATMUL` if set, else `"mosaic"` for bfloat16 /
            float16 rows on Hopper GPUs where jax's Mosaic GPU kernels import, else `"tiled"`
            (also when the library kernels cannot tile `H` / `F`: widths not multiples of 128).
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
    _check_gate_up("swiglu_experts", w_gate, w_up, w_down)
    dtype = x_sorted.dtype
    matmul = expert_matmul(matmul, dtype, w_gate.shape[1:], w_down.shape[1:])
    if matmul in grouped_gemm.LIBRARY_MATMULS:
        return _swiglu_library(x_sorted, group_sizes, w_gate, w_up, w_down, activation, matmul)
    gmm = grouped_matmul if matmul == "tiled" else jax.lax.ragged_dot

    def run_matmul(lhs, rhs):
        return gmm(lhs, rhs.astype(dtype), group_sizes, precision=precision,
                   preferred_element_type=jnp.float32)

    gate, up = _gate_and_up(run_matmul, x_sorted, w_gate, w_up)
    return run_matmul((activation(gate) * up).astype(dtype), w_down)


def expert_matmul(matmul: str, dtype, gate_up_width: tuple[int, int],
                  down_width: tuple[int, int]) -> str:
    """The matmul `swiglu_experts(..., matmul=matmul)` runs for rows of `dtype` and expert
    weights `[E_loc, H, F']` (gate and up; `gate_up_width = (H, F')`) and `[E_loc, F, H_out]`
    (`down_width = (F, H_out)`): `"auto"` resolved, and never library kernels that cannot tile
    these widths."""
    requested, matmul = matmul, grouped_gemm.resolve_matmul(matmul, dtype)
    if requested == "auto" and matmul in grouped_gemm.LIBRARY_MATMULS and not all(
            grouped_gemm.supports(matmul, k, m) for k, m in (gate_up_width, down_width)):
        return "tiled"
    return matmul


def _check_gate_up(caller, w_gate, w_up, w_down):
    """The gate / up weights: two `[E, H, F]` or one `[E, H, 2F]` (w_up None), `w_down`'s F."""
    if w_gate.ndim != 3:
        raise ValueError(f"{caller}: w_gate must be [E_loc, H, F], got {w_gate.shape}")
    if w_up is None:
        if w_gate.shape[2] % 2 or w_down.shape[1:2] != (w_gate.shape[2] // 2,):
            raise ValueError(
                f"{caller}: with w_up=None, w_gate holds gate and up side by side: [E_loc, H, 2F] "
                f"with F = w_down.shape[1]; got w_gate {w_gate.shape}, w_down {w_down.shape}")
    elif w_up.shape != w_gate.shape:
        raise ValueError(f"{caller}: w_up must be {w_gate.shape} like w_gate, got {w_up.shape}")


def _gate_and_up(expert_matmul, x, w_gate, w_up):
    """The gate and up products in float32: two products, or one of `[E, H, 2F]` split."""
    if w_up is None:
        gate_up = expert_matmul(x, w_gate).astype(jnp.float32)
        ffn = w_gate.shape[2] // 2
        return gate_up[:, :ffn], gate_up[:, ffn:]
    return (expert_matmul(x, w_gate).astype(jnp.float32),
            expert_matmul(x, w_up).astype(jnp.float32))


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

    gate, up = _gate_and_up(expert_matmul, x_sorted, w_gate, w_up)
    return expert_matmul((activation(gate) * up).astype(dtype), w_down)


def moe_ffn(
    buf: Buffer,
    x: jax.Array,
    topk_idx: jax.Array,
    topk_weights: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array | None,
    w_down: jax.Array,
    *,
    activation: Callable[[jax.Array], jax.Array] = jax.nn.silu,
    precision: jax.lax.PrecisionLike = None,
    matmul: str = DEFAULT_MATMUL,
    micro_batches: int = 1,
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
        w_gate: `[E_loc, H, F]` this rank's gate projections, or `[E_loc, H, 2F]` gate and up
            side by side when `w_up` is None (fewer, larger grouped matmuls: see
            `swiglu_experts`).
        w_up: `[E_loc, H, F]` this rank's up projections, or None.
        w_down: `[E_loc, F, H]` this rank's down projections.
        activation: gate activation (default SiLU).
        precision: precision of the expert matmuls (see `swiglu_experts`).
        matmul: how the expert matmuls run: `"auto"` (default), `"tokamax"`,
            `"tokamax+mosaic"`, `"mosaic"`, `"tiled"` or `"ragged_dot"` (see `swiglu_experts`).
        micro_batches: 1, or 2: the first and second half of the tokens (T even) are two
            micro-batches whose dispatches and combines run under each other's experts, in the
            forward and the backward pass (`jax_ep.moe.two_batch`; concurrent with a Buffer
            made with `overlap=True`). Each token's result is the one micro_batches=1 gives
            for the same half on its own.

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
    ffn = w_gate.shape[2] if w_up is not None else w_gate.shape[2] // 2
    _check_gate_up("moe_ffn", w_gate, w_up, w_down)
    if w_down.shape != (num_local, ffn, hidden):
        raise ValueError(
            f"moe_ffn: w_down must be [{num_local}, {ffn}, {hidden}], got {w_down.shape}"
        )
    if micro_batches not in (1, 2):
        raise ValueError(f"moe_ffn: micro_batches must be 1 or 2, got {micro_batches!r}")
    if micro_batches == 2:
        def experts(params, x_sorted, group_sizes):
            return swiglu_experts(x_sorted, group_sizes, *params, activation=activation,
                                  precision=precision, matmul=matmul)
        return stages.two_batch_moe_ffn(buf, x, topk_idx, topk_weights, experts,
                                        (w_gate, w_up, w_down))
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
