"""Normal-mode ops against the NumPy oracle (docs/api.md, "Normal mode"), once per backend."""

import types

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import covering, ep_mesh, per_backend, require_gpus
from harness import run_sharded

import jax_ep
from jax_ep import buffer as buffer_module
from jax_ep import testing as oracle
from jax_ep.backends import reference

E, K = 32, 4


def make_buffer(backend, mesh, hidden=256, tokens=16, dtype=jnp.float32, **kw):
    return jax_ep.Buffer(mesh, "ep", num_experts=kw.pop("num_experts", E), hidden=hidden,
                         max_tokens_per_rank=tokens, num_topk=kw.pop("num_topk", K),
                         dtype=dtype, backend=backend, **kw)


def random_x(rng, shape, dtype):
    return rng.standard_normal(shape).astype(np.float32).astype(dtype)


def dispatch_and_combine(buf, x, idx, w):
    def step(x, idx, w):
        d = jax_ep.dispatch(buf, x, idx, w)
        y, y_w = jax_ep.combine(buf, d.recv_x, d.handle, d.recv_topk_weights)
        return d, y, y_w
    return step


def assert_dispatch_matches(out, expected, num_tokens):
    d, y, y_w = out
    for r, exp in enumerate(expected):
        np.testing.assert_array_equal(d.recv_x[r].view(np.uint8), exp["recv_x"].view(np.uint8))
        np.testing.assert_array_equal(d.recv_topk_idx[r], exp["recv_topk_idx"])
        np.testing.assert_array_equal(d.recv_topk_weights[r], exp["recv_topk_weights"])
        assert int(d.num_recv_tokens[r]) == exp["num_recv_tokens"]
        np.testing.assert_array_equal(d.num_recv_tokens_per_expert[r],
                                      exp["num_recv_tokens_per_expert"])
        np.testing.assert_array_equal(d.handle.recv_src[r], exp["recv_src"])
        np.testing.assert_array_equal(d.handle.send_pos[r], exp["send_pos"])
    oracle.assert_combine_close(y, d.recv_x, d.handle.recv_src, num_tokens)
    oracle.assert_combine_close(y_w, d.recv_topk_weights, d.handle.recv_src, num_tokens,
                                what="combined weights")


def test_combine_check_catches_kernel_like_mutations(rng):
    """The per-element check of the normal combine (``oracle.assert_combine_close``) passes
    the reference backend's combine and fails kernel-like mutations of it: (a) half a row
    zeroed, (b) one rank's row left out of a token sent to several, (c) channels 128-255
    negated in every row. The inputs' channels 128-255 are 10^4 x smaller than the rest (small
    activations), where the former check (rtol = atol = 1e-2) lets (c) through."""
    mesh = ep_mesh("reference")
    R, T, H = mesh.shape["ep"], 16, 256
    buf = make_buffer("reference", mesh, H, T, jnp.bfloat16)
    idx, w = oracle.make_routing("with_minus_one", rng, R, T, E, K)
    x = rng.standard_normal((R, T, H)).astype(np.float32)
    x[..., 128:] *= 1e-4
    x = x.astype(ml_dtypes.bfloat16)
    d, y, _ = run_sharded(mesh, dispatch_and_combine(buf, x, idx, w), x, idx, w)

    def check(out):
        oracle.assert_combine_close(out, d.recv_x, d.handle.recv_src, T)

    check(y)
    # (a) a received token; (b) a row of a token that two or more ranks received
    sources = np.concatenate([src[src >= 0] for src in d.handle.recv_src])
    counts = np.bincount(sources, minlength=R * T)
    half_row = y.copy()
    s, t = divmod(int(np.flatnonzero(counts)[0]), T)
    half_row[s, t, H // 2:] = 0
    dropped_row = y.copy()
    r, i = np.argwhere(np.isin(d.handle.recv_src, np.flatnonzero(counts > 1)))[0]
    s, t = divmod(int(d.handle.recv_src[r, i]), T)
    dropped_row[s, t] = (y[s, t].astype(np.float32)
                         - d.recv_x[r, i].astype(np.float32)).astype(ml_dtypes.bfloat16)
    negated = y.copy()
    negated[..., 128:256] = -negated[..., 128:256]
    for mutated in (half_row, dropped_row, negated):
        with pytest.raises(AssertionError, match="outside their tolerance"):
            check(mutated)
    former = oracle.combine(d.recv_x.astype(np.float32), d.handle.recv_src, T)
    np.testing.assert_allclose(negated.astype(np.float64), former, rtol=1e-2, atol=1e-2)


def cancelling(rng, shape, dtype):
    """Values ``[R, ...]`` whose sums over ranks (axis 0) mostly cancel: a part shared by the
    ranks times a coefficient per rank (the coefficients sum to zero, 16x the rest), plus
    N(0, 1). Partial sums over some of the ranks are then much larger than the whole sum, so
    rounding them shows in the result."""
    coefficient = rng.standard_normal(shape[0])
    coefficient = 16 * (coefficient - coefficient.mean())
    shared = rng.standard_normal(shape[1:])
    values = coefficient.reshape((-1,) + (1,) * (len(shape) - 1)) * shared
    return (values + rng.standard_normal(shape)).astype(np.float32).astype(dtype)


def dispatch_and_combine_rows(buf):
    """A step that combines, at each rank, its row of ``z [R * T, H]`` (one per source token,
    different at each rank) for every token it received: ``(recv_src, y, combined)``."""

    def step(x, idx, w, z):
        d = jax_ep.dispatch(buf, x, idx, w)
        src = d.handle.recv_src
        y = jnp.where((src >= 0)[:, None], z[jnp.maximum(src, 0)], jnp.zeros((), z.dtype))
        combined, _ = jax_ep.combine(buf, y, d.handle)
        return src, y, combined
    return step


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_combine_inside_one_host_is_the_flat_sum(rng, dtype):
    """A group inside one host has no host layout, and the reference backend's combine stays
    the flat sum: float32 accumulation over the ranks (in XLA's order), rounded once. The
    float32 sums of these bfloat16 rows are exact in any order, so their bits are
    ``oracle.combine_in_order``'s without hosts; float32 rows match per element."""
    mesh = ep_mesh("reference")
    R, T, H = mesh.shape["ep"], 16, 256
    buf = make_buffer("reference", mesh, H, T, dtype)
    assert buf._rank_hosts is None
    idx, w = oracle.make_routing("uniform", rng, R, T, E, K)
    x = random_x(rng, (R, T, H), dtype)
    z = cancelling(rng, (R, R * T, H), dtype)
    src, y, combined = run_sharded(mesh, dispatch_and_combine_rows(buf), x, idx, w, z)
    oracle.assert_combine_close(combined, y, src, T)
    if dtype == jnp.bfloat16:
        want = oracle.combine_in_order(y, src, T)
        np.testing.assert_array_equal(combined.view(np.uint8), want.view(np.uint8))


# Hosts of 8 ranks: halves, pairs, interleaved (ranks need not be contiguous), one host.
HOST_LAYOUTS = [(0, 0, 0, 0, 1, 1, 1, 1), (0, 0, 1, 1, 2, 2, 3, 3), (0, 1, 0, 1, 0, 1, 0, 1),
                (0,) * 8]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("rank_hosts", HOST_LAYOUTS)
def test_reference_sums_a_combine_per_host_as_the_oracle(rng, rank_hosts, dtype):
    """``reference.sum_over_sources`` (the sum of the reference backend's combine) with the
    host of each rank equals ``oracle.sum_by_host`` bit for bit: per host the float32 sum in
    rank order rounded to the dtype, then the float32 sum over hosts rounded again. Across hosts
    it differs from the flat sum (and, in bfloat16, from float32 partial sums); in one host it
    is the flat sum."""
    R, T, H = len(rank_hosts), 32, 256
    got = cancelling(rng, (R, T, H), dtype).astype(np.float32)
    sent = rng.random((R, T)) < 0.7
    got = np.where(sent[:, :, None], got, np.float32(0))
    out = jax.jit(lambda g: reference.sum_over_sources(g, rank_hosts, dtype))(got)
    out = np.asarray(out)
    terms, ranks = got.transpose(1, 0, 2), np.where(sent.T, np.arange(R), -1)
    want = oracle.sum_by_host(terms, ranks, rank_hosts, dtype=dtype)
    np.testing.assert_array_equal(out.view(np.uint8), want.view(np.uint8))
    flat = oracle.sum_by_host(terms, ranks, None, dtype=dtype)
    if len(set(rank_hosts)) == 1:
        np.testing.assert_array_equal(out.view(np.uint8), flat.view(np.uint8))
        return
    assert (out != flat).any()
    if dtype == jnp.bfloat16:
        fp32_partials = oracle.sum_by_host(terms, ranks, rank_hosts, dtype=dtype,
                                           partial_dtype=np.float32)
        assert (out != fp32_partials).any()


def test_combine_tolerance_across_hosts_holds_the_partial_roundings(rng):
    """``oracle.assert_combine_close`` with the hosts of the ranks passes the per-host sum of
    bfloat16 rows that cancel, which the one-host tolerance (half an ulp of the result) rejects,
    and still rejects partial sums rounded coarser (float8 e4m3) or one host's partial sum left
    out: the tolerance is per element and not vacuous."""
    R, T, H = 8, 16, 256
    rank_hosts = (0, 0, 0, 0, 1, 1, 1, 1)
    idx, w = oracle.make_routing("uniform", rng, R, T, E, K)
    src = np.stack([d["recv_src"] for d in oracle.dispatch(np.zeros((R, T, 1)), idx, w, E)])
    z = cancelling(rng, (R, R * T, H), ml_dtypes.bfloat16)
    y = np.where((src >= 0)[:, :, None], np.take_along_axis(
        z, np.maximum(src, 0)[:, :, None], axis=1), 0).astype(ml_dtypes.bfloat16)
    got = oracle.combine_in_order(y, src, T, rank_hosts)
    oracle.assert_combine_close(got, y, src, T, rank_hosts=rank_hosts)
    with pytest.raises(AssertionError, match="outside their tolerance"):
        oracle.assert_combine_close(got, y, src, T)
    terms = np.zeros((R * T, R, H), np.float32)
    ranks = np.full((R * T, R), -1)
    for r in range(R):
        rows = np.flatnonzero(src[r] >= 0)
        terms[src[r, rows], r], ranks[src[r, rows], r] = y[r, rows], r
    coarse = oracle.sum_by_host(terms, ranks, rank_hosts, dtype=ml_dtypes.bfloat16,
                                partial_dtype=ml_dtypes.float8_e4m3fn).reshape(R, T, H)
    one_host = oracle.sum_by_host(np.where((ranks < 4)[:, :, None], terms, 0), ranks,
                                  rank_hosts, dtype=ml_dtypes.bfloat16).reshape(R, T, H)
    for mutated in (coarse, one_host):
        with pytest.raises(AssertionError, match="outside their tolerance"):
            oracle.assert_combine_close(mutated, y, src, T, rank_hosts=rank_hosts)


def test_rank_hosts_number_the_hosts_of_a_group_in_rank_order():
    """``Buffer``'s host layout of its EP groups: None inside one host; the hosts numbered in
    rank order; groups that place their ranks on hosts differently are refused."""
    hosts = {0: "node-a", 1: "node-b", 2: "node-a", 3: "node-b"}
    device = lambda p: types.SimpleNamespace(process_index=p)  # noqa: E731
    assert buffer_module.rank_hosts([[device(0), device(2)], [device(1), device(3)]],
                                    hosts) is None
    assert buffer_module.rank_hosts([[device(1), device(3), device(0)],
                                     [device(1), device(1), device(2)]], hosts) == (0, 0, 1)
    with pytest.raises(ValueError, match="place their ranks on hosts in different ways"):
        buffer_module.rank_hosts([[device(0), device(1)], [device(0), device(2)]], hosts)


# Every pair on the GPU; on CPU each routing once, the dtypes alternating (the reference's
# routing and its row copies are separate code).
DTYPES = [jnp.float32, jnp.bfloat16]
ROUTING_DTYPE_CASES = per_backend([(d, r) for d in DTYPES for r in oracle.ROUTINGS],
                                  [(d, r) for r, d in covering(oracle.ROUTINGS, DTYPES)])


@pytest.mark.parametrize(("backend", "dtype", "routing"), ROUTING_DTYPE_CASES,
                         indirect=["backend"])
def test_dispatch_combine_match_oracle(backend, rng, routing, dtype):
    mesh = ep_mesh(backend)
    R, T, H = mesh.shape["ep"], 16, 256
    buf = make_buffer(backend, mesh, H, T, dtype)
    idx, w = oracle.make_routing(routing, rng, R, T, E, K)
    x = random_x(rng, (R, T, H), dtype)
    out = run_sharded(mesh, dispatch_and_combine(buf, x, idx, w), x, idx, w)
    assert_dispatch_matches(out, oracle.dispatch(x, idx, w, E), T)
    buf.check()


def test_fewer_tokens_than_max_and_changing_t(backend, rng):
    mesh = ep_mesh(backend)
    R, H = mesh.shape["ep"], 128
    buf = make_buffer(backend, mesh, H, tokens=32)
    for T in (5, 32, 1):
        idx, w = oracle.make_routing("uniform", rng, R, T, E, K)
        x = random_x(rng, (R, T, H), np.float32)
        out = run_sharded(mesh, dispatch_and_combine(buf, x, idx, w), x, idx, w)
        assert out[0].recv_x.shape == (R, R * T, H)
        assert_dispatch_matches(out, oracle.dispatch(x, idx, w, E), T)


def sequential_send_pos(idx, num_experts):
    """send_pos of every rank ``[R, T, R]`` as one sequential scan: rows at rank r are numbered
    over (source rank, token) in order (oracle.dispatch's rule, vectorised for large T)."""
    R, T = idx.shape[:2]
    owner = np.where((idx >= 0) & (idx < num_experts), idx // (num_experts // R), -1)
    sent = (owner[..., None] == np.arange(R)).any(2).reshape(R * T, R)
    return np.where(sent, np.cumsum(sent, 0) - sent, -1).reshape(R, T, R).astype(np.int32)


@pytest.mark.gpu
@pytest.mark.stress
def test_plan_grid_shapes(rng):
    """The dispatch plan's grid (a block per 256 tokens, at most one per SM, more rounds per
    block past that) numbers rows as one sequential scan: T at block and round boundaries, up to
    past 4 rounds per block (its mask scratch), with -1, all -1 and invalid ids; the cached
    dispatch's plan (routing from send_pos) too."""
    require_gpus(1)
    mesh = ep_mesh("cuda")
    R, H = mesh.shape["ep"], 128
    num_sms = mesh.devices.flat[0].core_count
    cases = [(1, "with_minus_one"), (255, "uniform"), (257, "skewed"), (1000, "all_minus_one"),
             (num_sms * 256 + 1, "with_minus_one"), (num_sms * 256 * 5 + 77, "uniform")]
    buf = make_buffer("cuda", mesh, H, tokens=max(t for t, _ in cases))

    def step(x, idx, w):
        d = jax_ep.dispatch(buf, x, idx, w)
        again = jax_ep.dispatch(buf, x, handle=d.handle)
        # Channel 0 of a row is its source index: the rows' order without moving [C, H] back.
        return (d.handle.send_pos, d.num_recv_tokens, d.handle.recv_src, d.recv_x[:, 0],
                again.recv_x[:, 0])

    for T, routing in cases:
        idx, w = oracle.make_routing(routing, rng, R, T, E, K)
        if routing != "all_minus_one":
            idx[:, ::97, 0] = E + 3
        x = np.zeros((R, T, H), np.float32)
        x[..., 0] = np.arange(R * T, dtype=np.float32).reshape(R, T)
        send_pos, num_recv, recv_src, first, first_again = run_sharded(mesh, step, x, idx, w)
        expected = sequential_send_pos(idx, E)
        np.testing.assert_array_equal(send_pos, expected, err_msg=f"T={T}")
        for r in range(R):
            sources = np.flatnonzero(expected[:, :, r].reshape(-1) >= 0)
            n = len(sources)
            assert int(num_recv[r]) == n
            np.testing.assert_array_equal(recv_src[r][:n], sources, err_msg=f"T={T}")
            np.testing.assert_array_equal(first[r][:n], sources.astype(np.float32))
            np.testing.assert_array_equal(first_again[r][:n], sources.astype(np.float32))
        if routing == "all_minus_one":
            buf.check()
        else:
            with pytest.raises(RuntimeError, match=f"{R * len(range(0, T, 97))} expert ids"):
                buf.check()


def test_fp8_pair_moves_bit_exact(backend, rng):
    mesh = ep_mesh(backend)
    R, T, H = mesh.shape["ep"], 16, 384
    buf = make_buffer(backend, mesh, H, T, jnp.bfloat16)
    idx, w = oracle.make_routing("with_minus_one", rng, R, T, E, K)
    x = random_x(rng, (R, T, H), np.float32)
    x_fp8, scales = jax.jit(jax_ep.per_token_cast_to_fp8)(x)
    x_fp8, scales = np.asarray(x_fp8), np.asarray(scales)

    def step(x_fp8, scales, idx, w):
        return jax_ep.dispatch(buf, (x_fp8, scales), idx, w)

    d = run_sharded(mesh, step, x_fp8, scales, idx, w)
    expected = oracle.dispatch(x_fp8, idx, w, E, scales=scales)
    for r, exp in enumerate(expected):
        assert d.recv_x[r].dtype == ml_dtypes.float8_e4m3fn
        np.testing.assert_array_equal(d.recv_x[r].view(np.uint8), exp["recv_x"].view(np.uint8))
        np.testing.assert_array_equal(d.recv_scales[r], exp["recv_scales"])
        np.testing.assert_array_equal(d.handle.recv_src[r], exp["recv_src"])


def test_layout_matches_oracle(backend, rng):
    mesh = ep_mesh(backend)
    R, T = mesh.shape["ep"], 24
    buf = make_buffer(backend, mesh, 128, T)
    idx, _ = oracle.make_routing("with_minus_one", rng, R, T, E, K)
    lay = run_sharded(mesh, lambda i: jax_ep.get_dispatch_layout(buf, i), idx)
    for r, exp in enumerate(oracle.layout(idx, E, R)):
        np.testing.assert_array_equal(lay.num_tokens_per_rank[r], exp["num_tokens_per_rank"])
        np.testing.assert_array_equal(lay.num_tokens_per_expert[r],
                                      exp["num_tokens_per_expert"])
        np.testing.assert_array_equal(lay.is_token_in_rank[r], exp["is_token_in_rank"])


def test_cached_dispatch_repeats_routing(backend, rng):
    mesh = ep_mesh(backend)
    R, T, H = mesh.shape["ep"], 16, 256
    buf = make_buffer(backend, mesh, H, T)
    idx, w = oracle.make_routing("skewed", rng, R, T, E, K)
    x = random_x(rng, (R, T, H), np.float32)
    x2 = random_x(rng, (R, T, H), np.float32)

    def step(x, x2, idx, w):
        d = jax_ep.dispatch(buf, x, idx, w)
        return d.handle.recv_src, jax_ep.dispatch(buf, x2, handle=d.handle).recv_x

    recv_src, recv_x2 = run_sharded(mesh, step, x, x2, idx, w)
    expected = oracle.dispatch(x2, idx, w, E)
    for r in range(R):
        np.testing.assert_array_equal(recv_x2[r], expected[r]["recv_x"])
        np.testing.assert_array_equal(recv_src[r], expected[r]["recv_src"])


def test_data_axis_mesh(backend, rng):
    mesh = ep_mesh(backend, num_ranks=4 if backend == "reference" else 1, data=2)
    D, R = mesh.shape["data"], mesh.shape["ep"]
    T, H = 8, 128
    buf = make_buffer(backend, mesh, H, T)
    idx, w = oracle.make_routing("uniform", rng, D * R, T, E, K)
    x = random_x(rng, (D * R, T, H), np.float32)
    d, y, y_w = run_sharded(mesh, dispatch_and_combine(buf, x, idx, w), x, idx, w)
    for g in range(D):
        group = slice(g * R, (g + 1) * R)
        expected = oracle.dispatch(x[group], idx[group], w[group], E)
        sub = jax.tree.map(lambda a, s=group: a[s], (d, y, y_w))
        assert_dispatch_matches(sub, expected, T)


def test_capacity_overflow_is_reported(backend, rng):
    mesh = ep_mesh(backend)
    R, T, H = mesh.shape["ep"], 16, 128
    capacity = 3
    buf = make_buffer(backend, mesh, H, T, capacity=capacity)
    idx, w = oracle.make_routing("one_hot_expert", rng, R, T, E, K)
    x = random_x(rng, (R, T, H), np.float32)
    d, y, _ = run_sharded(mesh, dispatch_and_combine(buf, x, idx, w), x, idx, w)
    expected = oracle.dispatch(x, idx, w, E, capacity=capacity)
    assert d.recv_x.shape == (R, capacity, H)
    assert int(d.num_recv_tokens[0]) == R * T  # the true count, past the capacity
    for r, exp in enumerate(expected):
        np.testing.assert_array_equal(d.recv_x[r], exp["recv_x"])
        np.testing.assert_array_equal(d.handle.recv_src[r], exp["recv_src"])
    oracle.assert_combine_close(y, d.recv_x, d.handle.recv_src, T)
    with pytest.raises(RuntimeError, match="capacity 3 overflowed"):
        buf.check()
    buf.check()  # reset after raising


def test_invalid_expert_ids_are_dropped_and_reported(backend, rng):
    mesh = ep_mesh(backend)
    R, T, H = mesh.shape["ep"], 8, 128
    buf = make_buffer(backend, mesh, H, T)
    idx, w = oracle.make_routing("uniform", rng, R, T, E, K)
    bad = idx.copy()
    bad[:, 0, 0] = E + 5
    bad[:, 1, 1] = -7
    x = random_x(rng, (R, T, H), np.float32)
    d, _, _ = run_sharded(mesh, dispatch_and_combine(buf, x, bad, w), x, bad, w)
    cleaned = np.where((bad >= 0) & (bad < E), bad, -1).astype(np.int32)
    for r, exp in enumerate(oracle.dispatch(x, cleaned, w, E)):
        np.testing.assert_array_equal(d.recv_x[r], exp["recv_x"])
        np.testing.assert_array_equal(d.recv_topk_idx[r], exp["recv_topk_idx"])
    with pytest.raises(RuntimeError, match=f"{2 * R} expert ids outside"):
        buf.check()


def test_nan_and_inf_rows_move_bit_exact(backend, rng):
    mesh = ep_mesh(backend)
    R, T, H = mesh.shape["ep"], 8, 128
    buf = make_buffer(backend, mesh, H, T)
    idx, w = oracle.make_routing("uniform", rng, R, T, E, K)
    x = random_x(rng, (R, T, H), np.float32)
    x[:, 0, :3] = [np.nan, np.inf, -np.inf]
    d, _, _ = run_sharded(mesh, dispatch_and_combine(buf, x, idx, w), x, idx, w)
    for r, exp in enumerate(oracle.dispatch(x, idx, w, E)):
        np.testing.assert_array_equal(d.recv_x[r].view(np.uint32), exp["recv_x"].view(np.uint32))


def test_two_buffers_alive(backend, rng):
    mesh = ep_mesh(backend)
    R, T = mesh.shape["ep"], 8
    first = make_buffer(backend, mesh, 128, T)
    second = make_buffer(backend, mesh, 256, T, num_experts=16, num_topk=2)
    for buf, H, experts, topk in ((first, 128, E, K), (second, 256, 16, 2), (first, 128, E, K)):
        idx, w = oracle.make_routing("uniform", rng, R, T, experts, topk)
        x = random_x(rng, (R, T, H), np.float32)
        d, _, _ = run_sharded(mesh, dispatch_and_combine(buf, x, idx, w), x, idx, w)
        for r, exp in enumerate(oracle.dispatch(x, idx, w, experts)):
            np.testing.assert_array_equal(d.recv_x[r], exp["recv_x"])
    first.close()
    second.close()
