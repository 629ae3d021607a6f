"""Inputs of the benchmarks and what an op moves: the MoE shape options, seeded routing and rows
(sharded along ``"ep"``, axis 0), the fp8 cast, and the bytes a rank moves per call (DeepEP's
counting)."""

from __future__ import annotations

import functools
from typing import Any

import bench_mesh as bm
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh

FP8_BLOCK = 128  # channels per fp8 scale (docs/api.md, "FP8 scales")
FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_MIN_AMAX = 1e-4  # floor of the per-block amax before dividing (docs/api.md, "FP8 scales")

# The each-way NVLink rate that nvlink_share assumes (2x H200, both directions busy); bench_ep's
# records carry it as method.nvlink_bytes_per_s.
NVLINK_BYTES_PER_S = 283e9


def add_shape_arguments(p, defaults: dict[str, Any]) -> None:
    """The MoE shape options (``--tokens --hidden --ffn --experts --topk --ranks``; default
    None: ``fill_defaults`` sets them), their help naming ``defaults``."""
    helps = {"tokens": "tokens per rank", "hidden": "model width H", "ffn": "expert FFN width F",
             "experts": "experts over all ranks", "topk": "experts per token"}
    for name, text in helps.items():
        p.add_argument(f"--{name}", type=int, help=f"{text} (default {defaults[name]})")
    p.add_argument("--ranks", type=int, help="number of devices to use (default all)")


def fill_defaults(args, defaults: dict[str, Any], quick: dict[str, Any]) -> None:
    """Every option of ``defaults`` left None set from ``quick`` (with ``--quick``) or it."""
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick[name] if args.quick else value)


def random_routing(mesh: Mesh, seed: int, tokens: int, experts: int, topk: int):
    """Top-k of uniform random scores, per token, seeded.

    Returns global ``topk_idx [R*T, K] int32`` and ``topk_weights [R*T, K] float32`` (softmax of
    the selected scores), both sharded along "ep".
    """
    return jax.block_until_ready(_routing_maker(mesh, tokens, experts, topk)(jax.random.key(seed)))


def random_rows(mesh: Mesh, seed: int, shape: tuple[int, ...], dtype=jnp.bfloat16):
    """Standard-normal array of global ``shape`` (axis 0 = R * per-rank rows), sharded."""
    return jax.block_until_ready(_rows_maker(mesh, tuple(shape), dtype)(jax.random.key(seed)))


# One jitted maker per shape: a new closure per call compiled again every time (21 compiles in
# bench_ep --quick alone).
@functools.cache
def _routing_maker(mesh: Mesh, tokens: int, experts: int, topk: int):
    num_ranks = mesh.shape[bm.AXIS]

    def make(key):
        scores = jax.random.uniform(key, (num_ranks * tokens, experts), jnp.float32)
        vals, idx = lax.top_k(scores, topk)
        return idx.astype(jnp.int32), jax.nn.softmax(vals, axis=-1)

    return jax.jit(make, out_shardings=(bm.sharded(mesh), bm.sharded(mesh)))


@functools.cache
def _rows_maker(mesh: Mesh, shape: tuple[int, ...], dtype):
    def make(key):
        return jax.random.normal(key, shape, jnp.float32).astype(dtype)

    return jax.jit(make, out_shardings=bm.sharded(mesh))


def cast_fp8(x):
    """Per-token, per-128-channel e4m3fn cast (docs/api.md, "FP8 scales").

    Args:
      x: ``[T, H]`` bfloat16/float32, ``H % 128 == 0``.
    Returns:
      ``(x_fp8 [T, H] float8_e4m3fn, scales [T, H // 128] float32)``.
    """
    num_tokens, hidden = x.shape
    blocks = x.astype(jnp.float32).reshape(num_tokens, hidden // FP8_BLOCK, FP8_BLOCK)
    amax = jnp.max(jnp.abs(blocks), axis=-1)
    scales = jnp.maximum(amax, FP8_MIN_AMAX) / FP8_MAX
    x_fp8 = (blocks * (1.0 / scales)[..., None]).astype(jnp.float8_e4m3fn)
    return x_fp8.reshape(num_tokens, hidden), scales


def routing_stats(topk_idx: np.ndarray, num_ranks: int, experts: int) -> dict[str, float]:
    """Counts used for bytes, DeepEP style, as means over ranks (each rank's own view).

    Args:
      topk_idx: ``[R*T, K]`` int32 host array (global expert ids, -1 = none).
    Returns:
      ``recv_rows`` (rows a rank receives in normal dispatch, itself included),
      ``remote_recv_rows`` (of those, rows from other ranks), ``selections`` (a rank's
      (token, k) pairs with an expert, as sent by low-latency dispatch) and
      ``remote_selections`` (of those, pairs whose expert is on another rank).
    """
    idx = topk_idx.reshape(num_ranks, -1, topk_idx.shape[-1])
    experts_per_rank = experts // num_ranks
    dst = np.where(idx >= 0, idx // experts_per_rank, -1)  # [R_src, T, K]
    in_rank = np.stack([(dst == r).any(-1) for r in range(num_ranks)], -1)  # [R_src, T, R_dst]
    recv = in_rank.sum(axis=(0, 1))  # [R_dst]
    self_recv = np.array([in_rank[r, :, r].sum() for r in range(num_ranks)])
    selections = (dst >= 0).sum(axis=(1, 2))  # [R_src]
    own = np.stack([(dst[r] == r).sum() for r in range(num_ranks)])
    return {
        "recv_rows": float(recv.mean()),
        "remote_recv_rows": float((recv - self_recv).mean()),
        "selections": float(selections.mean()),
        "remote_selections": float((selections - own).mean()),
    }


def bytes_per_rank(op: str, dtype: str, hidden: int, stats: dict[str, float],
                   peer: bool = False):
    """``(bytes, remote_bytes)`` one rank moves for one call (docs/api.md, "Measuring"), counted
    by what it moves: jax_ep's low-latency ops (either backend) move one row per (token, expert)
    selection, a ``peer`` moves each token once per destination rank in both modes. None for
    layout."""
    per_row = hidden * (1 + 4 / FP8_BLOCK) if dtype == "fp8" else 2 * hidden
    if op in ("dispatch", "combine") or (op.startswith("low_latency") and peer):
        return per_row * stats["recv_rows"], per_row * stats["remote_recv_rows"]
    if op == "low_latency_dispatch":
        per_sel = hidden + hidden / 32 + 16 if dtype == "fp8" else 2 * hidden
        return per_sel * stats["selections"], per_sel * stats["remote_selections"]
    if op == "low_latency_combine":
        per_sel = 2 * hidden
        return per_sel * stats["selections"], per_sel * stats["remote_selections"]
    return None, None
