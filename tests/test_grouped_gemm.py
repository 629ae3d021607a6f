"""Tests of jax_ep.moe.grouped_gemm (library grouped GEMMs for the expert matmuls) and of the MoE
layer running on them.

On CPU the library kernels cannot run: the plumbing around them (custom_vjp, dtypes, the
masking of rows past the groups, shard_map) is checked with reference kernels patched in that
behave like the real ones where it matters (operand-dtype results, rows past the groups left as
NaN), and tokamax's API is exercised through its XLA implementation where tokamax imports.
GPU tests (`-m gpu`) run the real kernels of every library that imports, on Hopper GPUs, against
float32 references: values and gradients within bfloat16 tolerance.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import require_gpus
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep import moe
from jax_ep import testing as oracle
from jax_ep.moe import grouped_gemm

NUM_DEVICES = 8
BF16_RTOL = oracle.rounding_rtol(jnp.bfloat16)


def _assert_layer_close(got, want, name, magnitude=None, num_terms=1024):
    """bfloat16 layer results (swiglu experts, the MoE layer) per element and row
    (``oracle.assert_layer_close``; no sum here is longer than 1024 terms)."""
    oracle.assert_layer_close(np.asarray(got, np.float32), np.asarray(want, np.float32),
                              magnitude, dtype=jnp.bfloat16, num_terms=num_terms, what=name)


def _reference_product(library, product, a, b, group_sizes):
    """What the library kernels compute, in float32, cast to the operand dtype; like them it
    leaves the output rows past the groups unspecified (NaN here)."""
    del library
    f32 = jnp.float32
    if product == "dw":
        out = jax.lax.ragged_dot_general(a.astype(f32), b.astype(f32), group_sizes,
                                         grouped_gemm._CONTRACT_ROWS)
        return out.astype(a.dtype)
    rhs = b if product == "forward" else jnp.swapaxes(b, 1, 2)
    out = jax.lax.ragged_dot(a.astype(f32), rhs.astype(f32), group_sizes)
    used = jnp.arange(a.shape[0]) < jnp.sum(group_sizes)
    return jnp.where(used[:, None], out, jnp.nan).astype(a.dtype)


@pytest.fixture
def reference_kernels(monkeypatch):
    """The library kernels replaced by `_reference_product` (any platform)."""
    monkeypatch.setattr(grouped_gemm, "_product", _reference_product)
    monkeypatch.setattr(grouped_gemm, "_import_status", lambda module: (True, module))


def _operands(rng, num_rows, sizes, k, m, dtype=jnp.bfloat16):
    x = jnp.asarray(rng.normal(size=(num_rows, k)), jnp.float32)
    used = int(np.sum(sizes))
    x = x.at[used:].set(0.0).astype(dtype)  # permute's padding rows are zero
    w = jnp.asarray(rng.normal(size=(len(sizes), k, m)) * k**-0.5, jnp.float32).astype(dtype)
    ct = jnp.asarray(rng.normal(size=(num_rows, m)), jnp.float32)
    return x, w, jnp.asarray(sizes, jnp.int32), ct


def _matmul_value_and_grads(fn, x, w, sizes, ct):
    """Value [N, M] and (dx, dw) of sum(fn(x, w) * ct) over the rows of the groups."""
    used = (jnp.arange(x.shape[0]) < jnp.sum(sizes))[:, None]

    def loss(x, w):
        y = jnp.where(used, fn(x, w, sizes).astype(jnp.float32), 0.0)
        return jnp.sum(y * ct), y

    (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(x, w)
    return y, grads


def _reference_value_and_grads(x, w, sizes, ct):
    f32 = functools.partial(jnp.asarray, dtype=jnp.float32)
    return _matmul_value_and_grads(
        lambda x, w, s: jax.lax.ragged_dot(x, w, s, precision="highest"), f32(x), f32(w),
        sizes, ct)


def _check_products(matmul, got, want, magnitude, sizes, k, m):
    """Value, dx and dw of a bfloat16 grouped GEMM against float32 (``want``) per element:
    each sums k, m and a group's rows of terms (``magnitude``: the same products of absolute
    values); the gradients' terms carry the cotangent's rounding to bfloat16."""
    (y, (dx, dw)), used = got, int(np.sum(sizes))
    (want_y, (want_dx, want_dw)), (mag_y, (mag_dx, mag_dw)) = want, magnitude
    oracle.assert_products_close(y, want_y, mag_y, k, dtype=jnp.bfloat16,
                                 what=f"{matmul} value")
    oracle.assert_products_close(dx[:used], want_dx[:used], mag_dx[:used], m,
                                 operand_rtol=BF16_RTOL, what=f"{matmul} dx")
    oracle.assert_products_close(dw, want_dw, mag_dw, max(np.asarray(sizes).max(), 1),
                                 operand_rtol=BF16_RTOL, what=f"{matmul} dw")


def _library_products(matmul, rng, num_rows, sizes, k, m):
    """``(got, want, magnitude, sizes)`` of `matmul`'s value and gradients (see
    _check_products)."""
    x, w, sizes, ct = _operands(rng, num_rows, sizes, k, m)
    got = _matmul_value_and_grads(
        functools.partial(grouped_gemm.library_matmul, matmul=matmul), x, w, sizes, ct)
    assert got[1][0].dtype == x.dtype and got[1][1].dtype == w.dtype
    want = _reference_value_and_grads(x, w, sizes, ct)
    magnitude = _reference_value_and_grads(abs(x), abs(w), sizes, abs(ct))
    return jax.tree.map(np.asarray, (got, want, magnitude)), sizes


def _check_library_matmul(matmul, rng, num_rows, sizes, k, m):
    (got, want, magnitude), sizes = _library_products(matmul, rng, num_rows, sizes, k, m)
    _check_products(matmul, got, want, magnitude, sizes, k, m)


# ---------------------------------------------------------------------------- selection
def test_auto_is_tiled_without_a_hopper_gpu(monkeypatch):
    monkeypatch.delenv(grouped_gemm.MATMUL_ENV, raising=False)
    if grouped_gemm.library_status("mosaic")[0]:
        pytest.skip("jax's Mosaic GPU kernels run here: auto is not tiled")
    assert grouped_gemm.resolve_matmul("auto", jnp.bfloat16) == "tiled"
    assert grouped_gemm.resolve_matmul("auto", jnp.float32) == "tiled"
    assert grouped_gemm.resolve_matmul("ragged_dot") == "ragged_dot"
    assert grouped_gemm.selection_report().startswith("tiled (mosaic not used: ")
    assert moe.DEFAULT_MATMUL == "auto"


def test_auto_follows_the_environment(monkeypatch):
    monkeypatch.setenv(grouped_gemm.MATMUL_ENV, "mosaic")
    assert grouped_gemm.resolve_matmul("auto", jnp.bfloat16) == "mosaic"
    assert grouped_gemm.resolve_matmul("auto", jnp.float32) == "tiled"  # kernels: bf16/f16 only
    assert grouped_gemm.resolve_matmul("tokamax") == "tokamax"  # explicit names win
    assert "JAX_EP_MOE_MATMUL=mosaic" in grouped_gemm.selection_report()
    monkeypatch.setenv(grouped_gemm.MATMUL_ENV, "fastest")
    with pytest.raises(ValueError, match="JAX_EP_MOE_MATMUL"):
        grouped_gemm.resolve_matmul("auto")
    with pytest.raises(ValueError, match="matmul must be one of"):
        grouped_gemm.resolve_matmul("dense")


def test_auto_falls_back_to_tiled_where_the_kernels_do_not_tile(monkeypatch, reference_kernels):
    monkeypatch.setenv(grouped_gemm.MATMUL_ENV, "mosaic")
    assert grouped_gemm.supports("mosaic", 1024, 512) and grouped_gemm.supports("tokamax", 96, 40)
    assert not grouped_gemm.supports("mosaic", 128, 64)
    calls = []
    monkeypatch.setattr(grouped_gemm, "_product", lambda *a: calls.append(a[:2]) or
                        _reference_product(*a))
    sizes = jnp.asarray([3, 5], jnp.int32)
    rng = np.random.default_rng(0)
    for hidden, ffn, want_calls in ((128, 64, 0), (512, 512, 3)):
        weights = [jnp.asarray(rng.normal(size=s), jnp.bfloat16)
                   for s in ((2, hidden, ffn), (2, hidden, ffn), (2, ffn, hidden))]
        x = jnp.ones((8, hidden), jnp.bfloat16)
        y = moe.swiglu_experts(x, sizes, *weights)  # auto -> mosaic (environment) or tiled
        assert y.shape == (8, hidden) and len(calls) == want_calls, (hidden, calls)
        # expert_matmul names what swiglu_experts ran (the Flax example prints it)
        want = "mosaic" if want_calls else "tiled"
        assert moe.expert_matmul("auto", jnp.bfloat16, (hidden, ffn), (ffn, hidden)) == want
        calls.clear()
    assert moe.expert_matmul("auto", jnp.float32, (512, 512), (512, 512)) == "tiled"
    assert moe.expert_matmul("mosaic", jnp.bfloat16, (128, 64), (64, 128)) == "mosaic"
    with pytest.raises(ValueError, match="multiples of 128"):  # asked for explicitly: an error
        moe.swiglu_experts(jnp.ones((8, 128), jnp.bfloat16), sizes, *(
            jnp.zeros(s, jnp.bfloat16) for s in ((2, 128, 64), (2, 128, 64), (2, 64, 128))),
            matmul="mosaic")


def test_grid_grouping_divides_the_output_width():
    """jax's row kernel needs the output width in whole groups of `grid_block_n` blocks."""
    config = dict(grouped_gemm.MOSAIC_CONFIGS["rows"], block_n=128, grid_block_n=8)
    got = {w: grouped_gemm._grid_block_n(config, w)["grid_block_n"]
           for w in (2048, 1024, 1536, 640, 384, 128)}
    assert got == {2048: 8, 1024: 8, 1536: 4, 640: 1, 384: 1, 128: 1}


def test_library_matmul_rejects_bad_arguments(monkeypatch):
    x, w = jnp.zeros((8, 512), jnp.bfloat16), jnp.zeros((2, 512, 512), jnp.bfloat16)
    sizes = jnp.array([4, 4], jnp.int32)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        grouped_gemm.library_matmul(x.astype(jnp.float32), w.astype(jnp.float32), sizes,
                                    "tokamax")
    with pytest.raises(ValueError, match="same K"):
        grouped_gemm.library_matmul(x, w[:, :256], sizes, "tokamax")
    with pytest.raises(ValueError, match="matmul must be one of"):
        grouped_gemm.library_matmul(x, w, sizes, "tiled")
    with pytest.raises(ValueError, match="multiples of 128, got M=96"):
        grouped_gemm.library_matmul(x, w[..., :96], sizes, "mosaic")
    monkeypatch.setattr(grouped_gemm, "_import_status",
                        lambda module: (False, f"import {module} failed: nope"))
    with pytest.raises(RuntimeError, match="needs tokamax: import tokamax failed"):
        grouped_gemm.library_matmul(x, w, sizes, "tokamax")


# ---------------------------------------------------------------------------- plumbing on CPU
def test_product_check_catches_kernel_like_mutations(reference_kernels):
    """The per-element check of the grouped GEMMs (``oracle.assert_products_close``) passes
    the bfloat16 products and fails kernel-like mutations: in the value (a) half a row zeroed,
    (b) one term of a row's sums left out (a k index skipped), (c) output columns 128-255
    negated; in dw (d) one row of a group left out (a group boundary off by one). Columns
    128-255 of the weights are 100x smaller: the former check (2% of the tensor's maximum)
    lets (c) through."""
    rng = np.random.default_rng(7)
    num_rows, sizes, k, m = 96, [20, 0, 41, 9, 13], 256, 256
    x, w, sizes, ct = _operands(rng, num_rows, sizes, k, m)
    w = w.at[..., 128:].multiply(0.01)
    matmul = functools.partial(grouped_gemm.library_matmul, matmul="mosaic")
    got = jax.tree.map(np.asarray, _matmul_value_and_grads(matmul, x, w, sizes, ct))
    want = _reference_value_and_grads(x, w, sizes, ct)
    magnitude = _reference_value_and_grads(abs(x), abs(w), sizes, abs(ct))

    def check(y=got[0], dw=got[1][1]):
        _check_products("mosaic", (y, (got[1][0], dw)), want, magnitude, sizes, k, m)

    check()
    y, dw = got[0], got[1][1]
    x32, w32, ct32 = (np.asarray(a, np.float32) for a in (x, w, ct))
    half_row = y.copy()
    half_row[25, m // 2:] = 0  # a row of group 2 (rows 20-60)
    dropped_term = y.copy()
    j = np.argmax(np.abs(x32[25]) * np.abs(w32[2]).max(1))  # the largest term of row 25
    dropped_term[25] -= x32[25, j] * w32[2, j]
    negated = y.copy()
    negated[:, 128:256] = -negated[:, 128:256]
    dropped_row = dw.copy()
    dropped_row[2] -= np.outer(x32[60], ct32[60].astype(jnp.bfloat16).astype(np.float32))
    for mutated in (dict(y=half_row), dict(y=dropped_term), dict(y=negated),
                    dict(dw=dropped_row)):
        with pytest.raises(AssertionError, match="outside their tolerance"):
            check(**mutated)
    np.testing.assert_allclose(negated, want[0], rtol=2e-2,  # the former check
                               atol=2e-2 * np.abs(want[0]).max())


@pytest.mark.parametrize("matmul", sorted(grouped_gemm.LIBRARY_MATMULS))
def test_library_matmul_plumbing(matmul, reference_kernels):
    rng = np.random.default_rng(1)
    # An empty group, uneven groups and 13 rows past the groups (NaN from the kernels).
    _check_library_matmul(matmul, rng, 96, [20, 0, 41, 9, 13], 512, 512)


def test_swiglu_library_masks_rows_past_the_groups(reference_kernels):
    rng = np.random.default_rng(2)
    num_rows, hidden, ffn = 90, 64, 32
    sizes = jnp.asarray([20, 0, 41, 9, 12], jnp.int32)  # 8 rows past the groups
    x = jnp.asarray(rng.normal(size=(num_rows, hidden)), jnp.float32).at[82:].set(0.0)
    weights = [jnp.asarray(rng.normal(size=s) * s[1]**-0.5, jnp.float32) for s in
               ((5, hidden, ffn), (5, hidden, ffn), (5, ffn, hidden))]
    # bfloat16-representable: both runs compute the same function of the same inputs
    x, *weights = (a.astype(jnp.bfloat16).astype(jnp.float32) for a in (x, *weights))
    ct = jnp.asarray(rng.normal(size=(num_rows, hidden)), jnp.float32)

    def run(matmul, dtype):
        def loss(x, *weights):
            y = moe.swiglu_experts(x.astype(dtype), sizes, *(w.astype(dtype) for w in weights),
                                   matmul=matmul, precision="highest")
            return jnp.sum(y.astype(jnp.float32) * ct), y

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(x, *weights)

    (_, y), grads = run("tokamax", jnp.bfloat16)
    (_, want_y), want_grads = run("ragged_dot", jnp.float32)
    assert y.dtype == jnp.bfloat16
    assert not np.asarray(y[82:], np.float32).any()  # rows past the groups: exactly zero
    _assert_layer_close(y, want_y, "value")
    for name, g, want in zip(("dx", "dw_gate", "dw_up", "dw_down"), grads, want_grads,
                             strict=True):
        if name == "dx":  # rows past the groups: unspecified (no consumer reads them)
            g, want = g[:82], want[:82]
        _assert_layer_close(g, want, name)


def _dense_moe(x, topk_idx, topk_weights, w_gate, w_up, w_down, magnitude=False):
    """Every token through every expert, gated by its top-k (the oracle; float32 in, highest
    precision). ``magnitude``: the sum of the absolute values of each token's terms instead,
    ``sum_k |weight_k * expert_k(x)|``."""
    dot = functools.partial(jnp.einsum, precision="highest")
    gates = jnp.einsum("tk,tke->te", topk_weights, jax.nn.one_hot(topk_idx, w_gate.shape[0]))
    h = jax.nn.silu(dot("th,ehf->tef", x, w_gate)) * dot("th,ehf->tef", x, w_up)
    y = dot("tef,efh->teh", h, w_down)
    if magnitude:
        return dot("te,teh->th", jnp.abs(gates), jnp.abs(y))
    return dot("te,teh->th", gates, y)


def _check_moe_layer(mesh, backend, matmul, experts, topk, tokens_per_rank, hidden, ffn, seed):
    """moe_ffn with `matmul` in bfloat16 against the dense layer in float32 on the same
    bfloat16-rounded parameters and the same routing (computed once, so that no near tie of
    router scores can route differently): output and gradients w.r.t. the tokens and weights."""
    num_tokens = tokens_per_rank * mesh.devices.size
    buf = jax_ep.Buffer(mesh, "ep", num_experts=experts, hidden=hidden,
                        max_tokens_per_rank=tokens_per_rank, num_topk=topk,
                        dtype=jnp.bfloat16, backend=backend)
    rng = np.random.default_rng(seed)

    def normal(shape, scale):  # bfloat16-representable float32
        return jnp.asarray(rng.normal(size=shape) * scale, jnp.bfloat16).astype(jnp.float32)

    params = dict(x=normal((num_tokens, hidden), 1.0), w_gate=normal((experts, hidden, ffn),
                  hidden**-0.5), w_up=normal((experts, hidden, ffn), hidden**-0.5),
                  w_down=normal((experts, ffn, hidden), ffn**-0.5))
    scores = rng.random((num_tokens, experts))
    topk_idx = np.argsort(-scores, axis=1)[:, :topk].astype(np.int32)
    topk_weights = np.take_along_axis(scores, topk_idx, 1)
    topk_weights = jnp.asarray(topk_weights / topk_weights.sum(1, keepdims=True), jnp.float32)
    topk_idx = jnp.asarray(topk_idx)
    ct = normal((num_tokens, hidden), 1.0)

    def ep_layer(x, idx, weights, w_gate, w_up, w_down):
        return moe.moe_ffn(buf, x, idx, weights, w_gate, w_up, w_down, matmul=matmul)

    tokens = P(tuple(mesh.axis_names)) if len(mesh.axis_names) > 1 else P("ep")
    ep = jax.shard_map(ep_layer, mesh=mesh, out_specs=tokens,
                       in_specs=(tokens, tokens, tokens, P("ep"), P("ep"), P("ep")))

    def grads(layer, dtype):
        def loss(p):
            p = {k: v.astype(dtype) for k, v in p.items()}
            y = layer(p["x"], topk_idx, topk_weights, p["w_gate"], p["w_up"], p["w_down"])
            return jnp.sum(y.astype(jnp.float32) * ct), y.astype(jnp.float32)

        return jax.jit(jax.grad(loss, has_aux=True))(params)

    got_grads, got_y = grads(ep, jnp.bfloat16)
    want_grads, want_y = grads(_dense_moe, jnp.float32)
    magnitude = _dense_moe(params["x"], topk_idx, topk_weights, params["w_gate"],
                           params["w_up"], params["w_down"], magnitude=True)
    buf.close()
    assert float(jnp.abs(want_y).max()) > 0.1
    # the longest sums: a product's hidden size, an expert's tokens (weight gradients)
    num_terms = max(hidden, ffn, num_tokens)
    _assert_layer_close(got_y, want_y, f"{matmul} EP={mesh.shape['ep']} output",
                        magnitude=np.asarray(magnitude), num_terms=num_terms)
    for name in params:
        _assert_layer_close(got_grads[name], want_grads[name], f"{matmul} gradient {name}",
                            num_terms=num_terms)


@pytest.mark.parametrize("matmul", ["tiled", "mosaic"])
def test_gate_and_up_in_one_weight_is_the_same_function(matmul, reference_kernels, monkeypatch):
    """`w_up=None` with gate and up side by side in one `[E, H, 2F]` weight: the values and
    gradients of two weights, in 6 library products instead of 9 (forward, dx and dw of gate and
    up are one product each)."""
    rng = np.random.default_rng(5)
    num_rows, hidden, ffn = 90, 128, 128
    sizes = jnp.asarray([20, 0, 41, 9, 12], jnp.int32)  # 8 rows past the groups
    x = jnp.asarray(rng.normal(size=(num_rows, hidden)), jnp.float32).at[82:].set(0.0)
    x = x.astype(jnp.bfloat16)
    w_gate, w_up, w_down = (jnp.asarray(rng.normal(size=s) * s[1]**-0.5, jnp.bfloat16) for s in
                            ((5, hidden, ffn), (5, hidden, ffn), (5, ffn, hidden)))
    ct = jnp.asarray(rng.normal(size=(num_rows, hidden)), jnp.float32)
    products = []
    monkeypatch.setattr(grouped_gemm, "_product",
                        lambda *a: products.append(a[1]) or _reference_product(*a))

    def value_and_grads(*weights):
        def loss(x, *weights):
            y = moe.swiglu_experts(x, sizes, *weights, matmul=matmul, precision="highest")
            return jnp.sum(y.astype(jnp.float32) * ct), y

        argnums = tuple(i for i, w in enumerate((x, *weights)) if w is not None)
        return jax.jit(jax.value_and_grad(loss, argnums=argnums, has_aux=True))(x, *weights)

    (_, y), (dx, dw_gate, dw_up, dw_down) = value_and_grads(w_gate, w_up, w_down)
    split_products = len(products)
    products.clear()
    (_, y1), (dx1, dw_gate_up, dw_down1) = value_and_grads(
        jnp.concatenate([w_gate, w_up], axis=2), None, w_down)
    if matmul != "tiled":
        assert (split_products, len(products)) == (9, 6), (split_products, products)
    _assert_layer_close(y1, y, f"{matmul} value")
    _assert_layer_close(dx1[:82], dx[:82], f"{matmul} dx")  # rows past the groups unspecified
    _assert_layer_close(dw_gate_up, jnp.concatenate([dw_gate, dw_up], axis=2), f"{matmul} dw")
    _assert_layer_close(dw_down1, dw_down, f"{matmul} dw_down")
    with pytest.raises(ValueError, match="side by side"):
        moe.swiglu_experts(x, sizes, w_gate, None, w_down, matmul=matmul)


@pytest.mark.parametrize("matmul", ["tokamax", "mosaic"])
def test_moe_layer_on_library_kernels_matches_dense(matmul, reference_kernels):
    if len(jax.devices()) < NUM_DEVICES:
        pytest.skip(f"needs {NUM_DEVICES} host devices")
    mesh = Mesh(np.array(jax.devices()[:NUM_DEVICES]).reshape(2, 4), ("data", "ep"))
    _check_moe_layer(mesh, "reference", matmul, experts=8, topk=2, tokens_per_rank=12, hidden=512,
                     ffn=512, seed=3)


def test_tokamax_api_through_its_xla_implementation(monkeypatch):
    """Our three tokamax calls (dimension numbers, dtypes, group sizes) against tokamax itself,
    with its XLA implementation in place of the Mosaic GPU kernels."""
    pytest.importorskip("tokamax", reason="tokamax is not installed (pip install jax_ep[gpu])")
    monkeypatch.setattr(grouped_gemm, "_tokamax_impl", lambda kind: "xla")
    _check_library_matmul("tokamax", np.random.default_rng(4), 80, [30, 0, 25, 9], 96, 40)


class _H200:
    """What the kernels ask of the default device while they trace (no GPU here)."""

    core_count = 132
    compute_capability = "9.0"
    device_kind = "NVIDIA H200"
    platform = "gpu"


@pytest.mark.parametrize("matmul", sorted(grouped_gemm.LIBRARY_MATMULS))
def test_layer_on_the_real_kernels_lowers_for_cuda(matmul, monkeypatch):
    """No GPU needed: moe_ffn forward + backward on the real kernels, inside shard_map with
    vma checking, lowered for CUDA (jax's Pallas Mosaic GPU lowering runs on any host): the
    kernels' arguments trace, the custom_vjp's types match (the kernels' results carry no
    manual axes), and all 9 products are Mosaic GPU kernels."""
    if "tokamax" in (grouped_gemm.LIBRARY_MATMULS[matmul].forward,
                     grouped_gemm.LIBRARY_MATMULS[matmul].dx):
        pytest.importorskip("tokamax", reason="tokamax is not installed (pip install jax_ep[gpu])")
        from jax.extend import backend

        monkeypatch.setattr(backend, "get_default_device", lambda: _H200())
    mesh = Mesh(np.array(jax.devices()[:1]), ("ep",))
    devices = jax.devices
    monkeypatch.setattr(jax, "devices", lambda *a: devices(*a) if a else [_H200()])
    tokens, hidden, ffn, experts, topk = 256, 1024, 512, 8, 2
    buf = jax_ep.Buffer(mesh, "ep", num_experts=experts, hidden=hidden,
                        max_tokens_per_rank=tokens, num_topk=topk, dtype=jnp.bfloat16,
                        backend="reference", report_errors=False)

    def layer(x, idx, weights, w_gate, w_up, w_down):
        return moe.moe_ffn(buf, x, idx, weights, w_gate, w_up, w_down, matmul=matmul)

    ep = jax.shard_map(layer, mesh=mesh, in_specs=(P("ep"),) * 6, out_specs=P("ep"))

    def step(x, idx, weights, *w):
        return jax.value_and_grad(lambda x, *w: jnp.sum(ep(x, idx, weights, *w)),
                                  argnums=(0, 1, 2, 3))(x, *w)

    s = jax.ShapeDtypeStruct
    args = (s((tokens, hidden), jnp.bfloat16), s((tokens, topk), jnp.int32),
            s((tokens, topk), jnp.float32), s((experts, hidden, ffn), jnp.bfloat16),
            s((experts, hidden, ffn), jnp.bfloat16), s((experts, ffn, hidden), jnp.bfloat16))
    text = jax.jit(step).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    buf.close()
    assert text.count("mosaic_gpu") >= 9 and text.count("@mosaic_gpu_v2") + text.count(
        '"mosaic_gpu_v2"') == 9, "expected 9 Mosaic GPU kernels (3 products forward, 6 backward)"


# ---------------------------------------------------------------------------- GPU
def _require_library_matmul(matmul):
    require_gpus(1)
    kernels = grouped_gemm.LIBRARY_MATMULS[matmul]
    for library in sorted({kernels.forward, kernels.dx, kernels.dw}):
        ok, why = grouped_gemm.library_status(library)
        if not ok:
            pytest.skip(f"{matmul} needs {library}: {why}")


@pytest.mark.gpu
@pytest.mark.parametrize("matmul", sorted(grouped_gemm.LIBRARY_MATMULS))
def test_library_matmul_on_gpu(matmul):
    _require_library_matmul(matmul)
    if matmul in grouped_gemm.WRONG_ON_GPU:  # measured wrong on an H200: refused, with why
        with pytest.raises(ValueError, match="wrong weight gradients"):
            grouped_gemm.library_matmul(jnp.zeros((8, 1024), jnp.bfloat16),
                                        jnp.zeros((2, 1024, 512), jnp.bfloat16),
                                        jnp.array([4, 4], jnp.int32), matmul)
        return
    rng = np.random.default_rng(5)
    # 16 groups (two empty, one of a single row) over 4000 of 4224 rows: groups share row
    # blocks, and 224 rows past the groups are never computed.
    sizes = rng.multinomial(3900, np.ones(13) / 13).tolist() + [0, 1, 0]
    sizes[5] += 99
    with jax.default_device(jax.devices("gpu")[0]):
        _check_library_matmul(matmul, rng, 4224, sizes, 1024, 512)


@pytest.mark.gpu
@pytest.mark.parametrize("matmul", sorted(set(grouped_gemm.LIBRARY_MATMULS)
                                          - set(grouped_gemm.WRONG_ON_GPU)))
def test_moe_layer_on_gpu_matches_dense(matmul):
    _require_library_matmul(matmul)
    gpus = require_gpus(1)
    mesh = Mesh(np.array(gpus), ("ep",))
    _check_moe_layer(mesh, "cuda", matmul, experts=8 * len(gpus), topk=4, tokens_per_rank=256,
                     hidden=1024, ffn=512, seed=6)
