"""Gradients of every op against a dense single-device formulation of the same MoE layer.

The layer: each expert e multiplies its token by a scalar ``a[e]``. Through expert parallelism
(dispatch -> weight and scale per received row -> combine) its output is
``out[t] = sum_k w[t,k] * a[idx[t,k]] * x[t]`` over valid k, which is the dense formulation.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from conftest import ep_mesh
from harness import fetch, sharded_loss

import jax_ep
from jax_ep import testing as oracle

E, K = 32, 4


def dense_layer(x, idx, w, a):
    valid = idx >= 0
    gain = jnp.sum(jnp.where(valid, w * a[jnp.where(valid, idx, 0)], 0.0), axis=-1)
    return gain[..., None] * x.astype(jnp.float32)


def test_dispatch_combine_gradients(backend, rng):
    mesh = ep_mesh(backend)
    R, T, H = mesh.shape["ep"], 8, 128
    buf = jax_ep.Buffer(mesh, "ep", num_experts=E, hidden=H, max_tokens_per_rank=T,
                        num_topk=K, dtype=jnp.float32, backend=backend)
    idx, w = oracle.make_routing("with_minus_one", rng, R, T, E, K)
    x = rng.standard_normal((R, T, H)).astype(np.float32)
    a = rng.standard_normal((E,)).astype(np.float32)
    c = rng.standard_normal((R, T, H)).astype(np.float32)
    cw = rng.standard_normal((R, T, K)).astype(np.float32)
    a_local = a.reshape(R, E // R)

    def per_rank(x, w, idx, a_loc, c, cw):
        d = jax_ep.dispatch(buf, x, idx, w)
        valid = d.recv_topk_idx >= 0
        gain = jnp.sum(jnp.where(valid, d.recv_topk_weights * a_loc[jnp.where(valid,
                                                                    d.recv_topk_idx, 0)], 0.0), -1)
        y = gain[:, None] * d.recv_x
        out, out_w = jax_ep.combine(buf, y, d.handle, d.recv_topk_weights)
        return jnp.sum(out * c) + jnp.sum(out_w * cw)

    loss = sharded_loss(mesh, per_rank)
    gx, gw = map(fetch, jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w, idx, a_local, c, cw))

    def dense(x, w):
        valid = idx >= 0
        return jnp.sum(dense_layer(x, idx, w, a) * c) + jnp.sum(jnp.where(valid, w, 0.0) * cw)

    ex, ew = jax.grad(dense, argnums=(0, 1))(x, w)
    np.testing.assert_allclose(gx, ex, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(gw, ew, rtol=1e-4, atol=1e-4)


def test_cached_dispatch_gradient(backend, rng):
    """d/dx of sum(c_rows * cached_dispatch(x)) = combine(c_rows)."""
    mesh = ep_mesh(backend)
    R, T, H = mesh.shape["ep"], 8, 128
    buf = jax_ep.Buffer(mesh, "ep", num_experts=E, hidden=H, max_tokens_per_rank=T,
                        num_topk=K, dtype=jnp.float32, backend=backend)
    idx, w = oracle.make_routing("uniform", rng, R, T, E, K)
    x = rng.standard_normal((R, T, H)).astype(np.float32)
    c = rng.standard_normal((R, R * T, H)).astype(np.float32)

    def per_rank(x, idx, w, c):
        d = jax_ep.dispatch(buf, jax.lax.stop_gradient(x), idx, w)
        again = jax_ep.dispatch(buf, x, handle=d.handle)
        return jnp.sum(again.recv_x * c)

    gx = fetch(jax.jit(jax.grad(sharded_loss(mesh, per_rank)))(x, idx, w, c))
    expected = oracle.dispatch(x, idx, w, E)
    oracle.assert_combine_close(gx, c, np.stack([e["recv_src"] for e in expected]), T,
                                what="d/dx")


def test_low_latency_gradients(backend, rng):
    mesh = ep_mesh(backend)
    R, T, H = mesh.shape["ep"], 8, 128
    buf = jax_ep.Buffer(mesh, "ep", num_experts=E, hidden=H, max_tokens_per_rank=T,
                        num_topk=K, dtype=jnp.bfloat16, low_latency=True, backend=backend)
    idx, w = oracle.make_routing("with_minus_one", rng, R, T, E, K)
    x = rng.standard_normal((R, T, H)).astype(ml_dtypes.bfloat16)
    a = rng.standard_normal((E,)).astype(np.float32)
    c = rng.standard_normal((R, T, H)).astype(np.float32)
    a_local = a.reshape(R, E // R)

    def per_rank(x, w, idx, a_loc, c):
        ll = jax_ep.low_latency_dispatch(buf, x, idx, use_fp8=False)
        y = (ll.recv_x.astype(jnp.float32) * a_loc[:, None, None]).astype(jnp.bfloat16)
        out = jax_ep.low_latency_combine(buf, y, idx, w, ll.handle)
        return jnp.sum(out.astype(jnp.float32) * c)

    gx, gw = map(fetch, jax.jit(jax.grad(sharded_loss(mesh, per_rank), argnums=(0, 1)))(
        x, w, idx, a_local, c))

    def dense(x, w):
        return jnp.sum(dense_layer(x, idx, w, a) * c)

    ex, ew = jax.grad(dense, argnums=(0, 1))(x.astype(np.float32), w)
    # Per element: gx[t] = sum_k w a_k c[t], gw[t, k] = a_k sum_h x[t] c[t] (the same sums on
    # |w|, |a|, |x|, |c| are their magnitudes); every term passes through three bf16 roundings
    # (the cotangent of the bf16 output, its product with w, the expert's product with a).
    abs_x, abs_c = np.abs(x.astype(np.float32)), np.abs(c)
    mx = jax.grad(lambda v: jnp.sum(dense_layer(v, idx, np.abs(w), np.abs(a)) * abs_c))(abs_x)
    mw = jax.grad(lambda v: jnp.sum(dense_layer(abs_x, idx, v, np.abs(a)) * abs_c))(w)
    oracle.assert_sums_close(gx, ex, mx, term_rtol=3 * oracle.BF16_OUT_RTOL, what="d/dx")
    oracle.assert_sums_close(gw, ew, np.abs(mw), term_rtol=3 * oracle.BF16_OUT_RTOL, what="d/dw")
