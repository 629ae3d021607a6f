"""Tests of jax_ep.moe (permute / unpermute / router / grouped_matmul / moe_ffn) and of the Flax
MoE example.

CPU, reference backend, 8 host devices (tests/conftest.py sets XLA_FLAGS before jax is
imported). `grouped_matmul` is checked against `jax.lax.ragged_dot` (its specification) and a
NumPy oracle, values and gradients. The expert-parallel layer is checked against the same layer
evaluated densely on one device: forward output and gradients w.r.t. the tokens, the router and
the expert weights, with either expert matmul.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from jax.test_util import check_grads

import jax_ep
from jax_ep import moe
from jax_ep import testing as oracle
from jax_ep.moe import tiled_matmul

NUM_DEVICES = 8
EXAMPLE_DIR = Path(__file__).resolve().parents[1] / "examples" / "flax_moe"


def _require_devices(n=NUM_DEVICES):
    if len(jax.devices()) < n:
        pytest.skip(f"needs {n} devices (XLA_FLAGS=--xla_force_host_platform_device_count={n}), "
                    f"have {len(jax.devices())}")


def _random_topk(rng, num_rows, num_topk, num_experts, p_missing=0.3):
    """Distinct expert ids per row, each slot -1 with probability p_missing."""
    idx = np.stack([rng.permutation(num_experts)[:num_topk] for _ in range(num_rows)])
    idx = np.where(rng.random(idx.shape) < p_missing, -1, idx)
    return idx.astype(np.int32)


# ---------------------------------------------------------------------------- NumPy oracles
def _np_permute(x, idx, num_local_experts, num_rows=None):
    c, k = idx.shape
    num_rows = c * k if num_rows is None else num_rows
    pairs = [(e, r, j) for r in range(c) for j in range(k)
             if 0 <= (e := idx[r, j]) < num_local_experts]
    pairs = sorted(pairs)[:num_rows]  # pairs past num_rows are dropped
    x_sorted = np.zeros((num_rows, x.shape[1]), x.dtype)
    for slot, (_, r, _) in enumerate(pairs):
        x_sorted[slot] = x[r]
    sizes = np.array([sum(1 for p in pairs if p[0] == e) for e in range(num_local_experts)])
    return x_sorted, sizes, pairs


def _np_unpermute(y_sorted, pairs, weights):
    out = np.zeros((weights.shape[0], y_sorted.shape[1]), np.float64)
    for slot, (_, r, j) in enumerate(pairs):
        out[r] += weights[r, j] * y_sorted[slot].astype(np.float64)
    return out


# ---------------------------------------------------------------------------- permute / unpermute
@pytest.mark.parametrize(
    "rows,topk,local_experts,num_rows",
    [(13, 3, 4, None), (8, 1, 1, None), (20, 4, 7, None), (5, 2, 3, None),
     (16, 4, 2, 32),  # C * min(K, E_loc): lossless
     (16, 3, 4, 9)],  # smaller: the last pairs are dropped
)
def test_permute_matches_numpy(rows, topk, local_experts, num_rows):
    rng = np.random.default_rng(rows * 100 + topk * 10 + local_experts)
    x = rng.normal(size=(rows, 16)).astype(np.float32)
    idx = _random_topk(rng, rows, topk, local_experts + 2)  # ids >= E_loc are skipped
    idx[-1] = -1  # a padding row
    permute = jax.jit(functools.partial(moe.permute, num_rows=num_rows), static_argnums=2)
    out = permute(x, idx, local_experts)
    want_x, want_sizes, pairs = _np_permute(x, idx, local_experts, num_rows)
    np.testing.assert_array_equal(np.asarray(out.x_sorted), want_x)
    np.testing.assert_array_equal(np.asarray(out.group_sizes), want_sizes)
    assert out.group_sizes.dtype == jnp.int32
    assert out.x_sorted.shape == (num_rows or rows * topk, 16)

    y_sorted = rng.normal(size=(num_rows or rows * topk, 24)).astype(np.float32)
    weights = rng.random((rows, topk)).astype(np.float32)
    got = jax.jit(moe.unpermute)(y_sorted, out.state, weights)
    np.testing.assert_allclose(np.asarray(got), _np_unpermute(y_sorted, pairs, weights),
                               rtol=1e-6, atol=1e-6)


def test_permute_all_invalid_and_bfloat16():
    x = jnp.arange(6 * 128, dtype=jnp.float32).reshape(6, 128).astype(jnp.bfloat16)
    idx = -jnp.ones((6, 2), jnp.int32)
    x_sorted, sizes, state = moe.permute(x, idx, 3)
    assert x_sorted.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(sizes), [0, 0, 0])
    assert not np.asarray(x_sorted, np.float32).any()
    y = moe.unpermute(x_sorted, state, jnp.ones((6, 2), jnp.float32))
    assert y.dtype == jnp.bfloat16 and not np.asarray(y, np.float32).any()


def test_permute_unpermute_gradients():
    rng = np.random.default_rng(7)
    rows, topk, local_experts = 9, 3, 4
    x = jnp.asarray(rng.normal(size=(rows, 8)), jnp.float32)
    idx = jnp.asarray(_random_topk(rng, rows, topk, local_experts + 1))
    weights = jnp.asarray(rng.random((rows, topk)), jnp.float32)
    scale = jnp.asarray(rng.normal(size=(rows * topk, 8)), jnp.float32)

    def via_permute(x, weights):
        x_sorted, _, state = moe.permute(x, idx, local_experts)
        return moe.unpermute(jnp.tanh(x_sorted * scale), state, weights)

    # Same function written with a one-hot pair matrix (autodiff through plain matmuls).
    _, _, pairs = _np_permute(np.asarray(x), np.asarray(idx), local_experts)
    onehot = np.zeros((rows * topk, rows, topk), np.float32)
    for slot, (_, r, j) in enumerate(pairs):
        onehot[slot, r, j] = 1.0

    def via_onehot(x, weights):
        x_sorted = jnp.einsum("srk,rh->sh", onehot, x)
        y = jnp.tanh(x_sorted * scale)
        return jnp.einsum("srk,rk,sh->rh", onehot, weights, y)

    ct = jnp.asarray(rng.normal(size=(rows, 8)), jnp.float32)
    loss = lambda f: lambda *a: jnp.sum(f(*a) * ct)
    got = jax.grad(loss(via_permute), argnums=(0, 1))(x, weights)
    want = jax.grad(loss(via_onehot), argnums=(0, 1))(x, weights)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)
    check_grads(via_permute, (x, weights), order=2, modes=["rev"])


def test_permute_rejects_bad_shapes():
    with pytest.raises(ValueError, match="recv_topk_idx"):
        moe.permute(jnp.zeros((4, 8)), jnp.zeros((5, 2), jnp.int32), 2)
    with pytest.raises(ValueError, match="num_local_experts"):
        moe.permute(jnp.zeros((4, 8)), jnp.zeros((4, 2), jnp.int32), 0)
    with pytest.raises(ValueError, match="num_rows"):
        moe.permute(jnp.zeros((4, 8)), jnp.zeros((4, 2), jnp.int32), 2, num_rows=9)
    _, _, state = moe.permute(jnp.zeros((4, 8)), jnp.zeros((4, 2), jnp.int32), 2)
    with pytest.raises(ValueError, match="y_sorted"):
        moe.unpermute(jnp.zeros((7, 8)), state, jnp.zeros((4, 2)))


# ---------------------------------------------------------------------------- router
def test_router_matches_numpy():
    rng = np.random.default_rng(3)
    tokens, experts, topk = 32, 6, 2
    logits = rng.normal(size=(tokens, experts)).astype(np.float32)
    mask = rng.random(tokens) < 0.8
    idx, weights, aux = moe.router(jnp.asarray(logits), topk, token_mask=jnp.asarray(mask))

    probs = np.exp(logits - logits.max(1, keepdims=True))
    probs /= probs.sum(1, keepdims=True)
    want_idx = np.argsort(-probs, axis=1, kind="stable")[:, :topk]
    want_w = np.take_along_axis(probs, want_idx, 1)
    want_w /= want_w.sum(1, keepdims=True)
    np.testing.assert_array_equal(np.asarray(idx), np.where(mask[:, None], want_idx, -1))
    np.testing.assert_allclose(np.asarray(weights), np.where(mask[:, None], want_w, 0),
                               rtol=1e-5, atol=1e-6)
    counts = np.zeros(experts)
    for t in np.flatnonzero(mask):
        counts[want_idx[t]] += 1
    frac = counts / (mask.sum() * topk)
    mean_prob = probs[mask].mean(0)
    np.testing.assert_allclose(float(aux), experts * np.sum(frac * mean_prob), rtol=1e-5)

    _, raw_w, _ = moe.router(jnp.asarray(logits), topk, normalize_weights=False)
    np.testing.assert_allclose(np.asarray(raw_w), np.take_along_axis(probs, want_idx, 1),
                               rtol=1e-5)


def test_router_aux_loss_is_one_when_balanced():
    # Every expert gets the same number of assignments and the mean probabilities are equal.
    experts = 4
    logits = jnp.asarray(np.roll(np.diag(np.full(experts, 3.0)), 0, 1), jnp.float32)
    _, _, aux = moe.router(logits, 1)
    np.testing.assert_allclose(float(aux), 1.0, rtol=1e-6)
    # Gradient exists w.r.t. the logits (through the mean probabilities).
    g = jax.grad(lambda z: moe.router(z, 2).aux_loss)(logits)
    assert np.isfinite(np.asarray(g)).all()


# ---------------------------------------------------------------------------- grouped_matmul
# (group_sizes, num_rows, tile): the group layouts grouped_matmul must get right.
GROUPED_CASES = {
    "mixed_with_empty_groups": ([10, 0, 30, 0, 25, 5], 80, 16),  # 10 rows past the groups
    "one_group_has_all_rows": ([0, 77, 0], 77, 16),  # N not a multiple of the tile
    "single_group": ([37], 37, 8),
    "all_groups_empty": ([0, 0, 0], 40, 16),  # every row is past the groups: all zero
    "groups_past_n_truncated": ([20, 30, 9], 37, 8),  # sum(group_sizes) > N
    "tiny_groups_share_tiles": ([7, 93, 1, 1, 150, 48, 0, 3], 310, 64),
    "tile_larger_than_n": ([3, 9, 4], 21, 512),  # capped: one tile
}


def _np_grouped_matmul(x, w, group_sizes):
    """NumPy oracle (float64): row r of group g -> x[r] @ w[g]; rows past the groups -> 0."""
    out = np.zeros((x.shape[0], w.shape[2]))
    start = 0
    for g, size in enumerate(group_sizes):
        end = min(start + size, x.shape[0])
        out[start:end] = x[start:end].astype(np.float64) @ w[g].astype(np.float64)
        start = end
    return out


def _grouped_operands(case, dtype, k=24, m=40):
    sizes, num_rows, tile = GROUPED_CASES[case]
    rng = np.random.default_rng(len(sizes) * 1000 + num_rows)
    x = jnp.asarray(rng.normal(size=(num_rows, k)), jnp.float32).astype(dtype)
    w = jnp.asarray(rng.normal(size=(len(sizes), k, m)) * k**-0.5, jnp.float32).astype(dtype)
    ct = jnp.asarray(rng.normal(size=(num_rows, m)), jnp.float32)
    return x, w, jnp.asarray(sizes, jnp.int32), ct, tile


def _assert_products_close(got, want, magnitude, num_terms, name):
    """Two grouped matmuls of the same inputs per element (``oracle.assert_products_close``):
    ``magnitude`` the product of the absolute values; each sums at most ``num_terms`` in float32
    in its own order and rounds to its dtype (``want``'s rounding counts per term)."""
    assert got.dtype == want.dtype and got.shape == want.shape, (name, got.dtype, want.dtype)
    as_rows = functools.partial(np.atleast_1d)  # a scalar (the loss) is a row of one
    oracle.assert_products_close(as_rows(np.asarray(got)), as_rows(np.asarray(want, np.float64)),
                                 as_rows(np.asarray(magnitude, np.float64)), num_terms,
                                 operand_rtol=oracle.rounding_rtol(got.dtype), what=name)


# Every group layout with both chunkings (the scan over chunks is where layouts and chunks
# meet); the dtype, which only changes the rounding, alternates.
def _grouped_matmul_cases():
    dtypes = [(jnp.float32, "f32"), (jnp.bfloat16, "bf16")]
    chunkings = [(None, "one_chunk"), (2, "chunks_of_2_items")]
    cases = []
    for i, case in enumerate(sorted(GROUPED_CASES)):
        for j, (chunk_items, chunk_id) in enumerate(chunkings):
            dtype, dtype_id = dtypes[(i + j) % 2]
            cases.append(pytest.param(case, dtype, chunk_items,
                                      id=f"{case}-{dtype_id}-{chunk_id}"))
    return cases


@pytest.mark.parametrize(("case", "dtype", "chunk_items"), _grouped_matmul_cases())
def test_grouped_matmul_matches_ragged_dot(case, dtype, chunk_items, monkeypatch):
    x, w, sizes, ct, tile = _grouped_operands(case, dtype)
    if chunk_items is not None:  # many chunks (a lax.scan), the unused ones skipped
        monkeypatch.setattr(tiled_matmul, "_CHUNK_BYTES", chunk_items * 4 * w.shape[1] * w.shape[2])
    # Same products in float32 either way: only the summation order of dw's partial sums differs
    # (float32 rounding); bfloat16 gradients may then round one ulp apart.

    def value_and_grads(matmul, x=x, w=w, ct=ct):
        def loss(x, w):
            y = matmul(x, w, sizes, precision="highest", preferred_element_type=jnp.float32)
            return jnp.sum(y * ct), y

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(x, w)

    (loss, y), (dx, dw) = value_and_grads(functools.partial(moe.grouped_matmul, tile=tile))
    (want_loss, want_y), (want_dx, want_dw) = value_and_grads(jax.lax.ragged_dot)
    (mag_loss, mag_y), (mag_dx, mag_dw) = value_and_grads(jax.lax.ragged_dot, abs(x), abs(w),
                                                           abs(ct))
    assert y.dtype == jnp.float32
    (n, k), m = x.shape, w.shape[2]  # each sums: k terms, the loss n * m of them, dx m, dw n
    _assert_products_close(y, want_y, mag_y, k, "value")
    _assert_products_close(loss, want_loss, mag_loss, n * m + k, "loss")
    _assert_products_close(dx, want_dx, mag_dx, m, "dx")
    _assert_products_close(dw, want_dw, mag_dw, n, "dw")
    np.testing.assert_allclose(np.asarray(y), _np_grouped_matmul(np.asarray(x, np.float32),
                                                                 np.asarray(w, np.float32),
                                                                 GROUPED_CASES[case][0]),
                               rtol=1e-5, atol=1e-5)
    # Rows past the groups: zero output and zero gradient, exactly.
    num_grouped = min(int(np.sum(GROUPED_CASES[case][0])), x.shape[0])
    assert not np.asarray(y[num_grouped:]).any()
    assert not np.asarray(dx[num_grouped:], np.float32).any()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_grouped_matmul_default_result_dtype(dtype):
    # No preferred_element_type: the result dtype (and rounding) of ragged_dot.
    x, w, sizes, _, tile = _grouped_operands("tiny_groups_share_tiles", dtype)
    got = moe.grouped_matmul(x, w, sizes, tile=tile)
    want = jax.lax.ragged_dot(x, w, sizes)
    magnitude = jax.lax.ragged_dot(abs(x).astype(jnp.float32), abs(w).astype(jnp.float32), sizes)
    _assert_products_close(got, want, magnitude, x.shape[1], "value")
    grads = jax.grad(lambda x, w: jnp.sum(moe.grouped_matmul(x, w, sizes, tile=tile)
                                          .astype(jnp.float32)), argnums=(0, 1))(x, w)
    assert [g.dtype for g in grads] == [dtype, dtype]


def test_grouped_matmul_numeric_gradients():
    x, w, sizes, _, tile = _grouped_operands("mixed_with_empty_groups", jnp.float32, k=6, m=5)
    f = functools.partial(moe.grouped_matmul, group_sizes=sizes, tile=tile, precision="highest")
    check_grads(lambda x, w: jnp.tanh(f(x, w)), (x, w), order=1, modes=["rev"])


def test_grouped_matmul_temporaries_are_linear_in_rows():
    # No [G, N, K]-sized intermediate (ragged_dot's dense rewrite): the largest array of the
    # forward + backward is one of the P = N/tile + G - 1 work items' tiles or weight copies.
    num_rows, k, m, groups, tile = 4096, 64, 48, 16, 128
    x, w = jnp.zeros((num_rows, k), jnp.bfloat16), jnp.zeros((groups, k, m), jnp.bfloat16)
    sizes = jnp.full((groups,), num_rows // groups, jnp.int32)

    def loss(x, w):
        y = moe.grouped_matmul(x, w, sizes, tile=tile, preferred_element_type=jnp.float32)
        return jnp.sum(y)

    jaxpr = jax.make_jaxpr(jax.value_and_grad(loss, argnums=(0, 1)))(x, w).jaxpr

    def sub_jaxprs(params):  # the bodies of scan / cond / pjit / custom_vjp equations
        for value in params.values():
            for v in value if isinstance(value, tuple | list) else (value,):
                jaxpr = getattr(v, "jaxpr", v)
                if hasattr(jaxpr, "eqns"):
                    yield jaxpr

    def largest(jaxpr):
        sizes = [int(np.prod(v.aval.shape)) for e in jaxpr.eqns for v in e.outvars]
        return max(sizes + [largest(j) for e in jaxpr.eqns for j in sub_jaxprs(e.params)])

    num_items = num_rows // tile + groups - 1
    assert largest(jaxpr) <= num_items * max(tile * max(k, m), k * m)
    assert largest(jaxpr) < groups * num_rows * k // 4


def test_grouped_matmul_rejects_bad_arguments():
    x, w, sizes = jnp.zeros((8, 4)), jnp.zeros((2, 4, 3)), jnp.array([4, 4], jnp.int32)
    with pytest.raises(ValueError, match="same K"):
        moe.grouped_matmul(x, jnp.zeros((2, 5, 3)), sizes)
    with pytest.raises(ValueError, match="group_sizes"):
        moe.grouped_matmul(x, w, jnp.array([4, 4, 0], jnp.int32))
    with pytest.raises(ValueError, match="group_sizes"):
        moe.grouped_matmul(x, w, jnp.array([4.0, 4.0]))
    with pytest.raises(ValueError, match="tile"):
        moe.grouped_matmul(x, w, sizes, tile=0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_swiglu_experts_tiled_equals_ragged_dot(dtype):
    rng = np.random.default_rng(2)
    num_rows, hidden, ffn, experts = 90, 32, 16, 5
    x = jnp.asarray(rng.normal(size=(num_rows, hidden)), jnp.float32).astype(dtype)
    weights = [jnp.asarray(rng.normal(size=s) * s[1]**-0.5, jnp.float32) for s in
               ((experts, hidden, ffn), (experts, hidden, ffn), (experts, ffn, hidden))]
    sizes = jnp.asarray([20, 0, 41, 9, 12], jnp.int32)  # 8 rows past the groups

    def run(matmul):
        def loss(x, *weights):
            y = moe.swiglu_experts(x, sizes, *weights, matmul=matmul, precision="highest")
            return jnp.sum(jnp.sin(y)), y

        return jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(x, *weights)

    (_, y), grads = run("tiled")
    (_, want_y), want_grads = run("ragged_dot")
    for name, g, want in zip(("value", "dx", "dw_gate", "dw_up", "dw_down"), (y, *grads),
                             (want_y, *want_grads), strict=True):
        assert g.dtype == want.dtype, (name, g.dtype, want.dtype)
        oracle.assert_layer_close(np.asarray(g, np.float32), np.asarray(want, np.float32),
                                  dtype=dtype, num_terms=num_rows, what=name)
    with pytest.raises(ValueError, match="matmul"):
        moe.swiglu_experts(x, sizes, *weights, matmul="dense")


# ---------------------------------------------------------------------------- MoE layer vs dense
def _dense_moe_layer(x, w_router, w_gate, w_up, w_down, topk, terms=False):
    """All experts on one device, every token through every expert, gated by its top-k.
    ``terms``: ``gates [T, E] * expert outputs [T, E, H]``, the terms each token sums."""
    probs = jax.nn.softmax(x @ w_router, axis=-1)
    vals, idx = jax.lax.top_k(probs, topk)
    vals = vals / vals.sum(-1, keepdims=True)
    gates = jnp.einsum("tk,tke->te", vals, jax.nn.one_hot(idx, w_router.shape[1]))
    h = jax.nn.silu(jnp.einsum("th,ehf->tef", x, w_gate)) * jnp.einsum("th,ehf->tef", x, w_up)
    y_all = jnp.einsum("tef,efh->teh", h, w_down)
    if terms:
        return gates[..., None] * y_all
    return jnp.einsum("te,teh->th", gates, y_all)


def _ep_moe_layer(buf, matmul, x, w_router, w_gate, w_up, w_down):
    """One rank's tokens and experts: route, then moe_ffn (dispatch ... combine)."""
    topk_idx, topk_weights, _ = moe.router(x @ w_router, buf.num_topk)
    return moe.moe_ffn(buf, x, topk_idx, topk_weights, w_gate, w_up, w_down, matmul=matmul)


def _layer_params(rng, tokens, hidden, experts, ffn):
    def normal(shape, scale):
        return jnp.asarray(rng.normal(size=shape) * scale, jnp.float32)

    return dict(
        x=normal((tokens, hidden), 1.0),
        w_router=normal((hidden, experts), 0.3),
        w_gate=normal((experts, hidden, ffn), hidden ** -0.5),
        w_up=normal((experts, hidden, ffn), hidden ** -0.5),
        w_down=normal((experts, ffn, hidden), ffn ** -0.5),
    )


@pytest.mark.parametrize(
    "mesh_shape,experts,topk,matmul,chunked",
    [((1, 8), 16, 3, "tiled", False), ((2, 4), 8, 2, "tiled", False),
     ((2, 4), 8, 2, "tiled", True),  # grouped_matmul's chunk scan and skip under shard_map
     ((1, 8), 16, 3, "ragged_dot", False)],
)
def test_moe_layer_matches_dense(mesh_shape, experts, topk, matmul, chunked, monkeypatch):
    _require_devices()
    if chunked:
        monkeypatch.setattr(tiled_matmul, "_CHUNK_BYTES", 1)  # one work item per chunk
    mesh = Mesh(np.array(jax.devices()[:NUM_DEVICES]).reshape(mesh_shape), ("data", "ep"))
    tokens_per_rank, hidden, ffn = 12, 128, 32
    num_tokens = tokens_per_rank * NUM_DEVICES
    buf = jax_ep.Buffer(mesh, "ep", num_experts=experts, hidden=hidden,
                        max_tokens_per_rank=tokens_per_rank, num_topk=topk,
                        dtype=jnp.float32, backend="reference")
    rng = np.random.default_rng(11)
    params = _layer_params(rng, num_tokens, hidden, experts, ffn)
    ct = jnp.asarray(rng.normal(size=(num_tokens, hidden)), jnp.float32)

    tokens, experts_spec = P(("data", "ep")), P("ep")
    ep_layer = jax.shard_map(
        functools.partial(_ep_moe_layer, buf, matmul), mesh=mesh,
        in_specs=(tokens, P(), experts_spec, experts_spec, experts_spec), out_specs=tokens)
    dense_layer = functools.partial(_dense_moe_layer, topk=topk)

    def value_and_grads(layer):
        def loss(p):
            y = layer(p["x"], p["w_router"], p["w_gate"], p["w_up"], p["w_down"])
            return jnp.sum(y * ct), y
        return jax.jit(jax.grad(loss, has_aux=True))(params)

    grads_ep, y_ep = value_and_grads(ep_layer)
    grads_dense, y_dense = value_and_grads(dense_layer)
    assert float(jnp.abs(y_dense).max()) > 0.1  # the layer does something
    np.testing.assert_allclose(np.asarray(y_ep), np.asarray(y_dense), rtol=1e-4, atol=1e-5)
    for name in params:
        want = np.asarray(grads_dense[name])
        # float32 sums over all tokens in another order: the error scales with the largest
        # terms, so small entries of a large gradient (w_router: up to ~20) get an absolute
        # tolerance relative to the array's scale (1 of 1024 entries missed 1e-5 on some CPUs).
        np.testing.assert_allclose(np.asarray(grads_ep[name]), want, rtol=1e-4,
                                   atol=1e-6 * max(10.0, float(np.abs(want).max())),
                                   err_msg=f"gradient w.r.t. {name}")


def _bfloat16_layer(small_tokens=0):
    """``(y, terms)``: moe_ffn in bfloat16 on the reference backend, and the float32 dense
    layer's terms ``[T, E, H]`` on the same tokens (y's oracle: their sum over E); the first
    ``small_tokens`` tokens 16x smaller (their outputs ~100x)."""
    _require_devices()
    mesh = Mesh(np.array(jax.devices()[:NUM_DEVICES]), ("ep",))
    tokens_per_rank, hidden, ffn, experts, topk = 8, 128, 32, 8, 2
    buf = jax_ep.Buffer(mesh, "ep", num_experts=experts, hidden=hidden,
                        max_tokens_per_rank=tokens_per_rank, num_topk=topk,
                        dtype=jnp.bfloat16, backend="reference")
    p = _layer_params(np.random.default_rng(5), tokens_per_rank * NUM_DEVICES, hidden,
                      experts, ffn)

    def layer(x, w_router, w_gate, w_up, w_down):
        topk_idx, topk_weights, _ = moe.router(x.astype(jnp.float32) @ w_router, topk)
        return moe.moe_ffn(buf, x, topk_idx, topk_weights, w_gate, w_up, w_down)

    ep = jax.jit(jax.shard_map(layer, mesh=mesh, in_specs=(P("ep"), P(), P("ep"), P("ep"),
                                                           P("ep")), out_specs=P("ep")))
    x = p["x"].at[:small_tokens].multiply(1 / 16).astype(jnp.bfloat16)
    y = ep(x, p["w_router"], p["w_gate"], p["w_up"], p["w_down"])
    assert y.dtype == jnp.bfloat16
    terms = _dense_moe_layer(x.astype(jnp.float32), p["w_router"], p["w_gate"], p["w_up"],
                             p["w_down"], topk, terms=True)
    return np.asarray(y), np.asarray(terms, np.float64)


def _assert_layer_matches_terms(y, terms, what="moe_ffn bfloat16"):
    """Per element (``oracle.assert_layer_close``): the sum of a token's terms, each element's
    tolerance from the sum of their absolute values and its row's largest."""
    oracle.assert_layer_close(y.astype(np.float32), terms.sum(1), np.abs(terms).sum(1),
                              dtype=jnp.bfloat16, num_terms=y.shape[-1], what=what)


def test_moe_ffn_bfloat16_forward():
    y, terms = _bfloat16_layer()
    _assert_layer_matches_terms(y, terms)


def test_layer_check_catches_kernel_like_mutations():
    """The per-element check of the MoE layer fails kernel-like mutations of moe_ffn's output:
    (a) half a row zeroed, (b) one expert's term left out of a token, (c) channels 64-127
    negated in every row. Half the tokens are 16x smaller (outputs ~100x): the former check
    (rtol = atol = 0.05) lets (a) and (b) through in their rows, and so would a tolerance from
    the tensor's maximum."""
    y, terms = _bfloat16_layer(small_tokens=32)  # of 64
    _assert_layer_matches_terms(y, terms)
    half_row = y.copy()
    half_row[3, y.shape[1] // 2:] = 0
    # (b) the larger term of a small token of two terms
    summed = np.abs(terms).sum(-1)  # [T, E]
    t = np.flatnonzero((summed > 0).sum(1) == 2)[0]
    assert t < y.shape[0] // 2
    e = np.argmax(summed[t])
    dropped_term = y.copy()
    dropped_term[t] = (y[t].astype(np.float64) - terms[t, e]).astype(y.dtype)
    negated = y.copy()
    negated[:, 64:128] = -negated[:, 64:128]
    for mutated in (half_row, dropped_term, negated):
        with pytest.raises(AssertionError, match="outside their tolerance"):
            _assert_layer_matches_terms(mutated, terms)
    for mutated in (half_row, dropped_term):  # the former check
        np.testing.assert_allclose(mutated.astype(np.float32), terms.sum(1), rtol=0.05,
                                   atol=0.05)


def test_moe_ffn_rejects_wrong_expert_count():
    _require_devices()
    mesh = Mesh(np.array(jax.devices()[:NUM_DEVICES]), ("ep",))
    buf = jax_ep.Buffer(mesh, "ep", num_experts=16, hidden=128, max_tokens_per_rank=4,
                        num_topk=2, dtype=jnp.float32, backend="reference")

    def layer(x, idx, w, wg):
        return moe.moe_ffn(buf, x, idx, w, wg, wg, jnp.swapaxes(wg, 1, 2))

    f = jax.shard_map(layer, mesh=mesh, in_specs=(P("ep"), P("ep"), P("ep"), P()),
                      out_specs=P("ep"))
    args = (jnp.zeros((32, 128)), jnp.zeros((32, 2), jnp.int32), jnp.zeros((32, 2)),
            jnp.zeros((16, 128, 8)))  # all 16 experts on every rank: wrong, E_loc = 2
    with pytest.raises(ValueError, match="num_local_experts=2"):
        jax.jit(f)(*args)


# ---------------------------------------------------------------------------- the Flax example
def test_flax_example_rule_loss_is_the_language_entropy():
    """The rules' loss of a batch (data.py's Batch.rule_nats) is the negative log-likelihood of
    its sequences under the generating rules, and its mean converges to expected_rule_loss: a
    sample's value lies on either side of the expectation, so it is no floor."""
    sys.path.insert(0, str(EXAMPLE_DIR))
    try:
        data = importlib.import_module("data")  # examples/flax_moe/data.py
    finally:
        sys.path.remove(str(EXAMPLE_DIR))
    lang = data.SyntheticLanguage(seq_len=32, num_symbols=16)
    batch = lang.batch(4000, np.random.default_rng(0))
    positions = batch.mask.sum(1)
    n = lang.num_symbols
    markov = data.TASKS.index("markov")
    for b in np.flatnonzero(batch.tasks == markov)[:20]:  # the chain's likelihood, recounted
        body = batch.targets[b, 1:] - lang.first_symbol
        nats = np.log(n)
        for prev, cur in zip(body[:-1], body[1:], strict=True):
            k = list(lang.successors[prev]).index(cur)
            nats -= np.log(data.MARKOV_PROBS[k])
        np.testing.assert_allclose(batch.rule_nats[b], nats, rtol=1e-12)
    means = {}
    for t, name in enumerate(data.TASKS):
        rows = batch.tasks == t
        means[name] = batch.rule_nats[rows].sum() / positions[rows].sum()
        # ~1000 sequences per task: the markov mean's standard error is about 0.003 nats
        assert abs(means[name] - lang.expected_rule_loss(name)) < 0.02, (name, means)
    for name in ("progression", "mirror"):  # no randomness after the rule's own choices
        assert means[name] == pytest.approx(lang.expected_rule_loss(name), rel=1e-12)
    assert means["progression"] == pytest.approx((np.log(16) + np.log(15)) / 31, rel=1e-12)
    # Samples of ~50 Markov sequences (an evaluation's size) fall on both sides of it.
    chains = np.flatnonzero(batch.tasks == markov)
    samples = [batch.rule_nats[part].sum() / positions[part].sum()
               for part in np.array_split(chains, 20)]
    assert min(samples) < lang.expected_rule_loss("markov") < max(samples), samples


def test_flax_example_loss_decreases(tmp_path):
    _require_devices()
    pytest.importorskip("flax")
    pytest.importorskip("optax")
    spec = importlib.util.spec_from_file_location("flax_moe_train", EXAMPLE_DIR / "train.py")
    train = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)  # puts examples/flax_moe on sys.path for data.py, model.py
    cfg = train.Config(steps=40, batch=16, seq=16, experts=8, topk=2, hidden=128, ffn=64,
                       layers=1, heads=2, symbols=12, lr=1e-2, backend="reference", log_every=10,
                       plot=str(tmp_path / "loss.png"), save_losses=str(tmp_path / "run.json"),
                       progress=False)
    result = train.train(cfg)
    losses = result["losses"]
    assert result["matmul"] == "tiled"  # float32 rows: never the library kernels
    assert losses.shape == (40,) and np.isfinite(losses).all()
    print("first 5 steps", losses[:5].mean(), "last 10 steps", losses[-10:].mean())
    assert losses[-10:].mean() < losses[:5].mean() - 0.3, losses
    assert (tmp_path / "loss.png").stat().st_size > 0
    run = json.loads((tmp_path / "run.json").read_text())
    np.testing.assert_array_equal(np.asarray(run["losses"], np.float32), losses)
    assert run["matmul"] == "tiled" and run["config"]["steps"] == 40
    plot = importlib.import_module("plot")  # examples/flax_moe/plot.py, on sys.path now
    plot.main([str(tmp_path / "run.json"), str(tmp_path / "run.json"),
               "--out", str(tmp_path / "both.png")])
    assert (tmp_path / "both.png").stat().st_size > 0
