"""Low-latency ops against the NumPy oracle, once per backend."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import covering, ep_mesh, per_backend
from harness import run_sharded

import jax_ep
from jax_ep import testing as oracle

E, K = 32, 4
# What every low-latency op test covers: routings, (use_fp8, round_scale), the Buffer's shape.
ROUTINGS = ["uniform", "with_minus_one", "one_hot_expert", "empty_ranks", "all_minus_one"]
FP8_MODES = [(False, False), (True, False), (True, True)]
# (backend, routing, use_fp8, round_scale): every pair on the GPU; on CPU each routing and each
# fp8 mode once (the reference's routing and quantization are separate code).
ROUTING_FP8_CASES = per_backend(
    [(r, *m) for r in ROUTINGS for m in FP8_MODES],
    [(r, *m) for r, m in covering(ROUTINGS, FP8_MODES)])
T_MAX, HIDDEN = 8, 256


def make_buffer(backend, mesh, hidden, tokens):
    return jax_ep.Buffer(mesh, "ep", num_experts=E, hidden=hidden, max_tokens_per_rank=tokens,
                         num_topk=K, dtype=jnp.bfloat16, low_latency=True, backend=backend)


def routed_inputs(rng, routing, num_ranks):
    """``(idx, w, x)`` for T_MAX tokens per rank and for fewer; x has 128-channel blocks of
    different magnitude."""
    for T in (T_MAX, 3):
        idx, w = oracle.make_routing(routing, rng, num_ranks, T, E, K)
        x = rng.standard_normal((num_ranks, T, HIDDEN)).astype(ml_dtypes.bfloat16)
        x[:, :, :128] *= 100.0
        yield idx, w, x


def weighted_copies(x, idx, w):
    """``(sum_k w * x, sum_k |w * x|)`` over the valid k of each token: ``[..., T, H]`` float64
    (``x [..., T, H]``, ``idx`` and ``w [..., T, K]``)."""
    gain = np.where(idx >= 0, w, 0.0).astype(np.float64)
    x = x.astype(np.float64)
    return gain.sum(-1)[..., None] * x, np.abs(gain).sum(-1)[..., None] * np.abs(x)


def fp8_steps_apart(a, b):
    """Distance in fp8 code points between two float8_e4m3fn arrays of the same sign."""
    ia = a.view(np.uint8).astype(np.int16)
    ib = b.view(np.uint8).astype(np.int16)
    return np.abs(ia - ib)


def check_low_latency_dispatch(out, x, idx, T_max, use_fp8, round_scale, backend):
    expected = oracle.low_latency_dispatch(x, idx, E, T_max)
    for r, exp in enumerate(expected):
        np.testing.assert_array_equal(out.recv_count[r], exp["recv_count"])
        np.testing.assert_array_equal(out.recv_src[r], exp["recv_src"])
        for e, n in enumerate(exp["recv_count"]):
            if n == 0:
                continue
            got = out.recv_x[r][e][:n]
            rows = exp["recv_x"][e]
            if not use_fp8:
                np.testing.assert_array_equal(got.view(np.uint16), rows.view(np.uint16))
                continue
            scaled, scales = oracle.fp8_cast(rows.astype(np.float32), round_scale)
            want = scaled.astype(ml_dtypes.float8_e4m3fn)
            np.testing.assert_allclose(out.recv_scales[r][e][:n], scales, rtol=1e-6)
            # docs/api.md allows one fp8 step: kernels multiply by the reciprocal, and XLA's
            # f32 -> e4m3fn conversion may round twice (through f16).
            assert fp8_steps_apart(got, want).max() <= 1


@pytest.mark.parametrize(("backend", "routing", "use_fp8", "round_scale"), ROUTING_FP8_CASES,
                         indirect=["backend"])
def test_low_latency_matches_oracle(backend, rng, routing, use_fp8, round_scale):
    mesh = ep_mesh(backend)
    buf = make_buffer(backend, mesh, HIDDEN, T_MAX)
    for idx, w, x in routed_inputs(rng, routing, mesh.shape["ep"]):

        def step(x, idx, w):
            ll = jax_ep.low_latency_dispatch(buf, x, idx, use_fp8=use_fp8,
                                             round_scale=round_scale)
            y = ll.recv_x if not use_fp8 else jax_ep.per_token_cast_from_fp8(
                ll.recv_x, ll.recv_scales)
            return ll, jax_ep.low_latency_combine(buf, y, idx, w, ll.handle)

        ll, combined = run_sharded(mesh, step, x, idx, w)
        check_low_latency_dispatch(ll, x, idx, T_MAX, use_fp8, round_scale, backend)
        # combine of the dispatched rows = sum_k w * x (fp8 rounding of x only)
        want, magnitude = weighted_copies(x, idx, w)
        oracle.assert_sums_close(
            combined, want, magnitude, what="combine",
            term_rtol=oracle.FP8_TERM_RTOL if use_fp8 else oracle.F32_SUM_RTOL)


def test_low_latency_combine_matches_oracle(backend, rng):
    mesh = ep_mesh(backend)
    R, T, H = mesh.shape["ep"], 8, 128
    buf = make_buffer(backend, mesh, H, T)
    idx, w = oracle.make_routing("with_minus_one", rng, R, T, E, K)
    x = rng.standard_normal((R, T, H)).astype(ml_dtypes.bfloat16)
    y = rng.standard_normal((R, E // R, R * T, H)).astype(ml_dtypes.bfloat16)

    def step(x, y, idx, w):
        ll = jax_ep.low_latency_dispatch(buf, x, idx, use_fp8=False)
        return jax_ep.low_latency_combine(buf, y, idx, w, ll.handle)

    out = run_sharded(mesh, step, x, y, idx, w)
    rows = oracle.low_latency_dispatch(x, idx, E, T)
    oracle.assert_sums_close(out, oracle.low_latency_combine(y, idx, w, rows),
                             oracle.low_latency_combine(np.abs(y.astype(np.float64)), idx,
                                                        np.abs(w), rows))


def test_back_to_back_pairs_with_different_inputs(backend, rng):
    """Alternating dispatch/combine pairs in one program (parity of the double buffers)."""
    mesh = ep_mesh(backend)
    R, T, H, steps = mesh.shape["ep"], 8, 128, 5
    buf = make_buffer(backend, mesh, H, T)
    routings = [oracle.make_routing("uniform", rng, R, T, E, K) for _ in range(steps)]
    idx = np.stack([r[0] for r in routings], axis=1)  # [R, steps, T, K]
    w = np.stack([r[1] for r in routings], axis=1)
    x = rng.standard_normal((R, steps, T, H)).astype(ml_dtypes.bfloat16)

    def step(x, idx, w):
        outs = []
        for i in range(steps):
            ll = jax_ep.low_latency_dispatch(buf, x[i], idx[i], use_fp8=False)
            outs.append(jax_ep.low_latency_combine(buf, ll.recv_x, idx[i], w[i], ll.handle))
        return jnp.stack(outs)

    out = run_sharded(mesh, step, x, idx, w)
    oracle.assert_sums_close(out, *weighted_copies(x, idx, w))


def test_low_latency_needs_low_latency_buffer(rng):
    mesh = ep_mesh("reference")
    buf = jax_ep.Buffer(mesh, "ep", num_experts=E, hidden=128, max_tokens_per_rank=4,
                        num_topk=K, backend="reference")
    x = np.zeros((8, 4, 128), ml_dtypes.bfloat16)
    idx = np.zeros((8, 4, K), np.int32)
    with pytest.raises(ValueError, match="low_latency=True"):
        run_sharded(mesh, lambda x, i: jax_ep.low_latency_dispatch(buf, x, i).recv_x, x, idx)


@pytest.mark.parametrize("use_fp8", [False, True])
def test_combine_check_catches_kernel_like_mutations(rng, use_fp8):
    """The per-element check these tests use (``oracle.assert_sums_close``) passes a correct
    low-latency combine and fails kernel-like mutations of it: (a) half a row zeroed, (b) one
    summed term left out of one token, (c) channels 128-255 negated in every row. The inputs
    are those of the op tests (channels 0-127 100x larger), where a tolerance relative to the
    tensor's maximum, as these tests had, lets (c) through."""
    mesh = ep_mesh("reference")
    R = mesh.shape["ep"]
    buf = make_buffer("reference", mesh, HIDDEN, T_MAX)
    idx, w, x = next(routed_inputs(rng, "with_minus_one", R))

    def step(x, idx, w):
        ll = jax_ep.low_latency_dispatch(buf, x, idx, use_fp8=use_fp8)
        y = ll.recv_x if not use_fp8 else jax_ep.per_token_cast_from_fp8(ll.recv_x,
                                                                          ll.recv_scales)
        return jax_ep.low_latency_combine(buf, y, idx, w, ll.handle)

    combined = run_sharded(mesh, step, x, idx, w)
    want, magnitude = weighted_copies(x, idx, w)
    term_rtol = oracle.FP8_TERM_RTOL if use_fp8 else oracle.F32_SUM_RTOL

    def check(out):
        oracle.assert_sums_close(out, want, magnitude, term_rtol=term_rtol)

    check(combined)
    half_row = combined.copy()
    r, t = np.argwhere((idx >= 0).any(-1))[0]
    half_row[r, t, HIDDEN // 2:] = 0
    # (b) the term with the largest share of its token's weights, in a token with two or more
    share = np.where(idx >= 0, np.abs(w), 0.0)
    share = np.where((idx >= 0).sum(-1, keepdims=True) > 1,
                     share / np.maximum(share.sum(-1, keepdims=True), 1e-30), 0.0)
    r, t, k = np.unravel_index(np.argmax(share), share.shape)
    dropped_term = combined.copy()
    dropped_term[r, t] = (combined[r, t].astype(np.float64)
                          - w[r, t, k] * x[r, t].astype(np.float64)).astype(ml_dtypes.bfloat16)
    negated = combined.copy()
    negated[..., 128:256] = -negated[..., 128:256]
    for mutated in (half_row, dropped_term, negated):
        with pytest.raises(AssertionError, match="outside their tolerance"):
            check(mutated)
    tol = 0.07 if use_fp8 else 0.02  # the former check
    np.testing.assert_allclose(negated.astype(np.float64), want, rtol=tol,
                               atol=tol * np.abs(want).max())
