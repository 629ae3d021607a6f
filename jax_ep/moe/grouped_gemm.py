"""Library grouped GEMMs for the MoE expert matmuls on Hopper GPUs, and the choice among them.

Sharding model: everything here is local to one device (one expert-parallel rank's rows and
experts); it may run inside or outside `jax.shard_map`, under `jax.jit`.

`jax_ep.moe.swiglu_experts` multiplies `x [N, K]` (rows grouped by expert, `group_sizes [G]`
rows each, rows past `sum(group_sizes)` belong to no group) by one `[K, M]` matrix per expert.
Forward and backward are three products, each a grouped GEMM:

    forward  y[r]  = x[r] @ w[g]          rows of group g              [N, K] x [G, K, M] -> [N, M]
    dx       dx[r] = dy[r] @ w[g]^T       rows of group g              [N, M] x [G, K, M] -> [N, K]
    dw       dw[g] = x_g^T @ dy_g         contracted over g's rows     [N, K] x [N, M] -> [G, K, M]

`matmul` names which kernels compute them (see `MATMULS`):

- `"tiled"`: `jax_ep.moe.grouped_matmul`, batched XLA matmuls over row tiles (any platform; the
  portable fallback). `"ragged_dot"`: `jax.lax.ragged_dot` (XLA:GPU rewrites it into a dense
  matmul over all experts unless an experimental XLA flag selects a grouped GEMM).
- `"tokamax"`: all three products through `tokamax.ragged_dot_general` with its Pallas Mosaic GPU
  (Hopper) kernels: forward and dx are row-ragged kernels (dx gets `w` transposed by XLA first),
  dw is tokamax's ragged-contraction kernel.
- `"mosaic"`: the Pallas Mosaic GPU kernels that ship with jax
  (`jax.experimental.pallas.ops.gpu`): `ragged_dot` (forward; dx with `transpose_rhs`, no weight
  transpose) and `transposed_ragged_dot` (dw, masks only a group's first and last row block).
- `"tokamax+mosaic"`: the forward through tokamax, both backward products through jax's
  kernels (dx without a transposed copy of the weights, dw without tokamax's per-block masking).
- `"auto"`: `JAX_EP_MOE_MATMUL` when set, else `"mosaic"` on Hopper GPUs where jax's kernels
  import and the rows are bfloat16 / float16, else `"tiled"`; `swiglu_experts` also falls back
  to `"tiled"` when the kernels cannot tile the expert widths (`supports`). Chosen by
  measurement on an H200 at the benchmark's shape, where jax's forward kernel ran faster than
  tokamax's (docs/decisions.md, "Kernels"; docs/performance.md has the figures kept). tokamax's
  own dw kernel gave wrong gradients (`WRONG_ON_GPU`), masks every row block in registers
  before its WGMMA, and its dx needs the weights transposed by XLA first.

The library kernels take bfloat16 / float16 operands of one dtype and accumulate in float32; we
ask for results in the operands' dtype (half the output traffic of float32, and the cotangents
then arrive in the dtype the backward kernels take; jax's kernels write no other). Rows past
`sum(group_sizes)` are never computed by tokamax's row kernel and never stored by either: their
output rows are left as the kernel found them; `swiglu_experts` masks them.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib

import jax
import jax.numpy as jnp

from jax_ep import _vma, settings

__all__ = [
    "LIBRARY_MATMULS",
    "MATMULS",
    "library_matmul",
    "library_status",
    "resolve_matmul",
    "selection_report",
    "supports",
]

MATMULS = ("auto", "tiled", "ragged_dot", "tokamax", "tokamax+mosaic", "mosaic")
# Combinations refused on GPUs, and why (measured; docs/decisions.md, "Kernels").
WRONG_ON_GPU = {
    "tokamax": "gave wrong weight gradients on an H200 (tokamax 0.0.17's dw kernel with groups "
               "that share row blocks); use 'tokamax+mosaic', whose dw and dx run jax's Mosaic "
               "GPU kernels"}
# Environment variable naming what "auto" resolves to (one of MATMULS other than "auto").
MATMUL_ENV = "JAX_EP_MOE_MATMUL"
# What "auto" picks on Hopper GPUs where its kernels' libraries import (bfloat16 / float16 rows).
AUTO_LIBRARY_MATMUL = "mosaic"
_FAST_DTYPES = (jnp.bfloat16, jnp.float16)


@dataclasses.dataclass(frozen=True)
class _Kernels:
    """Which library computes each product: "tokamax" or "mosaic" (jax's Pallas kernels)."""

    forward: str
    dx: str
    dw: str


LIBRARY_MATMULS = {
    "tokamax": _Kernels("tokamax", "tokamax", "tokamax"),
    "tokamax+mosaic": _Kernels("tokamax", "mosaic", "mosaic"),
    "mosaic": _Kernels("mosaic", "mosaic", "mosaic"),
}

# Kernel tile configurations (bfloat16, H200). tokamax ships no tuning for H200 and its
# heuristic on Hopper is a 64x64 tile with 2 stages; its own H100 tuning table picks 128x64x128
# tiles, 4 stages, persistent, for row-ragged products of these sizes (~420-460 TFLOP/s there).
# None: let tokamax choose (heuristics / its autotuning cache).
TOKAMAX_CONFIGS: dict[str, dict | None] = {
    "rows": dict(block_m=128, block_n=64, block_k=128, num_stages=4, split_k=1,
                 persistent=True, grid_minor_dim=1, grid_tile_width=4),
    "contract": dict(block_m=128, block_n=64, block_k=128, num_stages=4, split_k=1,
                     persistent=False, grid_minor_dim=0, grid_tile_width=1),
}
# jax's kernels: block sizes from their own tuning sweeps' ranges (block_k 64 = one 128-byte
# swizzle of bfloat16). "rows" is the best of bench_moe_layer's sweep (`--sections products
# --sweep`) on an H200 at the gate shape, forward and dx. grid_block_n is the most output blocks
# a CTA group walks; each call uses the largest power of two up to it that divides the output
# width in blocks (`_grid_block_n`). Chosen in the step, not per product: the sweep's
# per-product winners (contract 5 stages / grid_block_n 8, rows 6 stages) made the six GEMMs of
# a step slower on one H200 (`profile_moe_experts.py --variants gemms`, configs edited in turn).
MOSAIC_CONFIGS: dict[str, dict] = {
    "rows": dict(block_m=128, block_n=128, block_k=64, max_concurrent_steps=5, grid_block_n=8),
    "contract": dict(block_m=128, block_n=128, block_k=64, max_concurrent_steps=4,
                     grid_block_n=4),
}
# The ragged-contraction product dw (rows of x and dy contracted per group, no group dims).
_CONTRACT_ROWS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([0], [0]), ([], [])),
    lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[],
)


# ---------------------------------------------------------------------------- availability


def _hopper_gpus() -> tuple[bool, str]:
    """Whether jax's default backend is CUDA GPUs of compute capability 9.x."""
    try:
        backend = jax.default_backend()
        devices = jax.local_devices()
    except RuntimeError as e:  # pragma: no cover - jax failed to start
        return False, f"jax failed to start: {e}"
    if backend != "gpu":
        return False, f"jax's default backend is {backend}, not a GPU"
    caps = sorted({str(getattr(d, "compute_capability", "?")) for d in devices})
    if not all(c.startswith("9.") for c in caps):
        return False, f"GPUs of compute capability {', '.join(caps)}, not Hopper (9.x)"
    return True, f"Hopper GPU ({devices[0].device_kind})"


@functools.cache
def _import_status(module: str) -> tuple[bool, str]:
    try:
        mod = importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - any import failure means "not available"
        return False, f"import {module} failed: {type(e).__name__}: {e}"
    version = getattr(mod, "__version__", None)
    return True, f"{module} {version}" if version else module


# The module each library's kernels come from.
_MODULES = {"tokamax": "tokamax",
            "mosaic": "jax.experimental.pallas.ops.gpu.transposed_ragged_dot_mgpu"}


def library_status(library: str) -> tuple[bool, str]:
    """`(usable, why)` for "tokamax" or "mosaic" on this machine's default backend."""
    hopper, why_gpu = _hopper_gpus()
    if not hopper:
        return False, why_gpu
    ok, why = _import_status(_MODULES[library])
    return ok, f"{why}; {why_gpu}" if ok else why


def resolve_matmul(matmul: str, dtype=None) -> str:
    """The concrete matmul (`"auto"` resolved) for rows of `dtype` (None: assume bfloat16).

    Raises:
        ValueError: on a name outside `MATMULS`, or a `JAX_EP_MOE_MATMUL` outside it.
    """
    if matmul not in MATMULS:
        raise ValueError(f"matmul must be one of {MATMULS}, got {matmul!r}")
    if matmul != "auto":
        return matmul
    fast_dtype = dtype is None or any(jnp.dtype(dtype) == jnp.dtype(d) for d in _FAST_DTYPES)
    env = settings.value(MATMUL_ENV)  # ValueError naming it when not one of MATMULS[1:]
    if env:
        return env if (env not in LIBRARY_MATMULS or fast_dtype) else "tiled"
    if fast_dtype and _auto_status()[0]:
        return AUTO_LIBRARY_MATMUL
    return "tiled"


def _auto_status() -> tuple[bool, str]:
    """`library_status` of every library `AUTO_LIBRARY_MATMUL`'s kernels come from."""
    kernels = LIBRARY_MATMULS[AUTO_LIBRARY_MATMUL]
    statuses = [library_status(lib) for lib in sorted({kernels.forward, kernels.dx, kernels.dw})]
    failed = [why for ok, why in statuses if not ok]
    return (False, failed[0]) if failed else (True, statuses[0][1])


def selection_report() -> str:
    """One line: what `matmul="auto"` picks for bfloat16 rows on this machine, and why."""
    picked = resolve_matmul("auto", jnp.bfloat16)
    env = settings.value(MATMUL_ENV)
    if env:
        return f"{picked} (from {MATMUL_ENV}={env})"
    ok, why = _auto_status()
    return f"{picked} ({why})" if ok else f"{picked} ({AUTO_LIBRARY_MATMUL} not used: {why})"


# ---------------------------------------------------------------------------- products


def _tokamax_impl(kind: str):
    """tokamax's `implementation` argument: its Mosaic GPU op with our tile config, or "mosaic"
    (tokamax's own choice) when the config is None."""
    params = TOKAMAX_CONFIGS.get(kind)
    if params is None:
        return "mosaic"
    from tokamax._src.ops.ragged_dot import pallas_mosaic_gpu  # tokamax exports no config API

    op = pallas_mosaic_gpu.PallasMosaicGpuRaggedDot(config=pallas_mosaic_gpu.Config(**params))
    return [op]


def _tokamax_product(product: str, a, b, group_sizes):
    import tokamax

    if product == "forward":  # [N, K] x [G, K, M]
        return tokamax.ragged_dot(a, b, group_sizes, preferred_element_type=a.dtype,
                                  implementation=_tokamax_impl("rows"))
    if product == "dx":  # [N, M] x [G, K, M]^T: the row kernel reads [G, M, K]
        return tokamax.ragged_dot(a, jnp.swapaxes(b, 1, 2), group_sizes,
                                  preferred_element_type=a.dtype,
                                  implementation=_tokamax_impl("rows"))
    from tokamax._src.ops.ragged_dot import base  # the dimension numbers its kernels match

    return tokamax.ragged_dot_general(  # dw: [N, K] x [N, M] -> [G, K, M]
        a, b, group_sizes, ragged_dot_dimension_numbers=base.RAGGED_CONTRACTING_DOT_DIM_NUMS,
        preferred_element_type=a.dtype, implementation=_tokamax_impl("contract"))


def _grid_block_n(config: dict, out_width: int) -> dict:
    """`config` with `grid_block_n` cut to the largest power of two up to it that divides
    `out_width // block_n` (`_check_tiles` has made it whole)."""
    blocks, group = out_width // config["block_n"], config["grid_block_n"]
    while blocks % group:
        group //= 2
    return {**config, "grid_block_n": group}


def _mosaic_product(product: str, a, b, group_sizes):
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu

    group_sizes = group_sizes.astype(jnp.int32)
    if product == "forward":  # [N, K] x [G, K, M] -> [N, M]
        return ragged_dot_mgpu.ragged_dot(a, b, group_sizes=group_sizes,
                                          **_grid_block_n(MOSAIC_CONFIGS["rows"], b.shape[2]))
    if product == "dx":  # [N, M] x [G, K, M]^T -> [N, K]
        return ragged_dot_mgpu.ragged_dot(a, b, group_sizes=group_sizes, transpose_rhs=True,
                                          **_grid_block_n(MOSAIC_CONFIGS["rows"], b.shape[1]))
    return transposed_ragged_dot_mgpu.transposed_ragged_dot(
        a, b, group_sizes=group_sizes, **_grid_block_n(MOSAIC_CONFIGS["contract"], b.shape[1]))


def _product(library: str, product: str, a, b, group_sizes):
    fn = _tokamax_product if library == "tokamax" else _mosaic_product
    return fn(product, a, b, group_sizes)


def _varying_like(out, ref):
    """`out` typed to vary over `ref`'s manual axes inside shard_map: a Pallas kernel's result
    carries none, and left so, the cotangent flowing back into it would be summed over the
    axes (the transpose of the implicit cast) and the custom_vjp's types would not match."""
    return _vma.make_varying(out, _vma.varying_axes(ref))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _library_matmul(x, w, group_sizes, matmul):
    out = _product(LIBRARY_MATMULS[matmul].forward, "forward", x, w, group_sizes)
    return _varying_like(out, x)


def _library_matmul_fwd(x, w, group_sizes, matmul):
    return _library_matmul(x, w, group_sizes, matmul), (x, w, group_sizes)


def _library_matmul_bwd(matmul, residuals, dy):
    x, w, group_sizes = residuals
    kernels = LIBRARY_MATMULS[matmul]
    dy = dy.astype(x.dtype)  # the kernels take one operand dtype
    dx = _product(kernels.dx, "dx", dy, w, group_sizes)
    dw = _product(kernels.dw, "dw", x, dy, group_sizes)
    return _varying_like(dx.astype(x.dtype), x), _varying_like(dw.astype(w.dtype), w), None


_library_matmul.defvjp(_library_matmul_fwd, _library_matmul_bwd)


def _check_tiles(matmul: str, k: int, m: int) -> None:
    """jax's kernels need whole blocks along K and M (tokamax's handle any width)."""
    kernels = LIBRARY_MATMULS[matmul]
    if "mosaic" not in (kernels.forward, kernels.dx, kernels.dw):
        return
    rows, contract = MOSAIC_CONFIGS["rows"], MOSAIC_CONFIGS["contract"]
    # K and M are each a contraction width (block_k), an output width (whole blocks of block_n;
    # `_grid_block_n` fits the grouping) and a dw block (block_m / block_n) of some product; all
    # are powers of two.
    unit = max(rows["block_k"], rows["block_n"], contract["block_m"], contract["block_n"])
    bad = [f"{name}={size}" for name, size in (("K", k), ("M", m)) if size % unit]
    if bad:
        raise ValueError(f"library_matmul: matmul={matmul!r} uses jax's Mosaic GPU kernels, "
                         f"whose blocks need multiples of {unit}, got {', '.join(bad)}; use "
                         "'tokamax' or 'tiled'")


def supports(matmul: str, k: int, m: int) -> bool:
    """Whether the kernels of library `matmul` tile a `[K, M]` expert matrix (both products)."""
    try:
        _check_tiles(matmul, k, m)
    except ValueError:
        return False
    return True


def library_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array, matmul: str) -> jax.Array:
    """`jax.lax.ragged_dot(x, w, group_sizes)` through a library's grouped GEMM kernels.

    Row `r` of group `g` gives `x[r] @ w[g]`; rows past `sum(group_sizes)` are left
    unspecified (not zero: mask them). Jittable; reverse-mode differentiable w.r.t. `x` and `w`
    (a `jax.custom_vjp` whose two backward products run through the kernels `matmul` names;
    the cotangent is cast to `x`'s dtype first). No forward-mode rule. Hopper GPUs only.

    Args:
        x: `[N, K]` bfloat16 or float16 rows grouped by group.
        w: `[G, K, M]` in `x`'s dtype.
        group_sizes: `[G]` int32 rows per group, non-negative, `sum <= N`.
        matmul: a key of `LIBRARY_MATMULS` ("tokamax", "tokamax+mosaic", "mosaic").

    Returns:
        `[N, M]` in `x`'s dtype (float32 accumulation inside the kernel).

    Raises:
        ValueError: on an unknown `matmul`, mismatched shapes or dtypes, or widths the kernels
            cannot tile.
        RuntimeError: when a library the kernels come from does not import.
    """
    if matmul not in LIBRARY_MATMULS:
        raise ValueError(f"library_matmul: matmul must be one of {tuple(LIBRARY_MATMULS)}, got "
                         f"{matmul!r}")
    if x.ndim != 2 or w.ndim != 3 or x.shape[1] != w.shape[1]:
        raise ValueError(f"library_matmul: expected x [N, K] and w [G, K, M] with the same K, "
                         f"got x {x.shape} and w {w.shape}")
    if x.dtype != w.dtype or not any(x.dtype == jnp.dtype(d) for d in _FAST_DTYPES):
        raise ValueError(f"library_matmul: matmul={matmul!r} takes bfloat16 or float16 x and w "
                         f"of one dtype, got {x.dtype} and {w.dtype}; use matmul='tiled'")
    _check_tiles(matmul, w.shape[1], w.shape[2])
    if matmul in WRONG_ON_GPU and jax.default_backend() == "gpu":
        raise ValueError(f"library_matmul: matmul={matmul!r} {WRONG_ON_GPU[matmul]}")
    kernels = LIBRARY_MATMULS[matmul]
    for library in sorted({kernels.forward, kernels.dx, kernels.dw}):
        ok, why = _import_status(_MODULES[library])
        if not ok:
            raise RuntimeError(f"library_matmul: matmul={matmul!r} needs {library}: {why}")
    # As grouped_matmul: inside shard_map the custom_vjp cotangents must vary like the primals.
    axes = frozenset().union(*(_vma.varying_axes(a) for a in (x, w, group_sizes)))
    x, w = (_vma.make_varying(a, axes) for a in (x, w))
    return _library_matmul(x, w, group_sizes.astype(jnp.int32), matmul)
