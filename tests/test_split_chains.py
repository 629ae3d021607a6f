"""Chains of low-latency send/receive pairs in one program: 1 to 16 pairs of dispatch and of
combine, alone, with fused calls between the halves and with other XLA work between them, and
(on the GPU) with XLA command buffers on and off.

The programs keep only part of what each receive returns (``recv(...).recv_x``, the combined
rows): a send must still wait for the previous receive of its op, whatever the program keeps.
On the GPU a send that runs ahead of the previous receive waits for a call that never comes
(the bounded wait then traps), so these programs finishing with the fused ops' bits is the test.
"""

import types

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import ep_mesh, per_backend, require_gpus
from harness import run_sharded, shard_spec
from test_low_latency import E, K, fp8_steps_apart, make_buffer, weighted_copies
from test_low_latency_split import assert_split_calls_ordered, lowering_buffer, shard_map_body

import jax_ep
from jax_ep import testing as oracle

T, H = 8, 128
CHAIN_LENGTHS = (1, 2, 3, 8, 16)
PATTERNS = ("alone", "fused_between", "xla_between")


def between(pattern, buf, x, idx, h, pending):
    """What runs between a send and its receive: nothing, a fused call of the same op's
    Buffer, or XLA work tied between the halves. Returns ``(h, pending, extra output)``."""
    if pattern == "fused_between":
        fused = jax_ep.low_latency_dispatch(buf, x, idx, use_fp8=False)
        return h, pending, fused.recv_count
    if pattern == "xla_between":
        h, pending = jax.lax.optimization_barrier((h, pending))
        h = jnp.tanh(h) * 1.5
        h, pending = jax.lax.optimization_barrier((h, pending))
    return h, pending, None


def chain(buf, n, pattern, split, with_combine=True, keep_counts=False):
    """Per-rank step over ``n`` micro-batches: dispatch, stand-in expert, combine, each op split
    into halves (``split``) or fused (the reference). Keeps the combined rows and, of every
    dispatch, its received rows only (``keep_counts``: its recv_count too, last). Pair ``i``:
    ``(recv_x, combined, [fused call's recv_count], [recv_count])``. ``with_combine=False``:
    dispatches only (the combined rows are then the expert's output summed over experts,
    computed by XLA)."""

    def step(x, idx, w):
        h = x[0].astype(jnp.float32)
        outs = []
        for i in range(n):
            use_fp8 = i % 2 == 1
            extra = None
            if not split:
                d = jax_ep.low_latency_dispatch(buf, x[i], idx[i], use_fp8=use_fp8)
                if pattern == "fused_between":
                    extra = jax_ep.low_latency_dispatch(buf, x[i], idx[i], use_fp8=False)
                    extra = extra.recv_count
            else:
                pending = jax_ep.low_latency_dispatch_send(buf, x[i], idx[i], use_fp8=use_fp8)
                h, pending, extra = between(pattern, buf, x[i], idx[i], h, pending)
                if with_combine:
                    d = jax_ep.low_latency_dispatch_recv(buf, pending)
                else:  # keep the received rows only: the counts and the handle are dropped
                    received = jax_ep.low_latency_dispatch_recv(buf, pending)
                    d = types.SimpleNamespace(recv_x=received.recv_x,
                                              recv_scales=received.recv_scales)
                    del received
            y = (jax_ep.per_token_cast_from_fp8(d.recv_x, d.recv_scales) if use_fp8
                 else d.recv_x)
            y = (y.astype(jnp.float32) * (i + 2)).astype(jnp.bfloat16)
            if not with_combine:
                out = jnp.sum(y.astype(jnp.float32), axis=0)
            elif split:
                pending = jax_ep.low_latency_combine_send(buf, y, idx[i], w[i], d.handle)
                h, pending, _ = between(pattern, buf, x[i], idx[i], h, pending)
                # Only a function of the received rows is kept (the receive's own result goes).
                out = jax_ep.low_latency_combine_recv(buf, pending).astype(jnp.float32)
            else:
                out = jax_ep.low_latency_combine(buf, y, idx[i], w[i], d.handle)
                out = out.astype(jnp.float32)
            extras = ([] if extra is None else [extra]) + ([d.recv_count] if keep_counts else [])
            outs.append((d.recv_x, out, *extras))
            del d
        if pattern == "xla_between":
            outs.append(h)
        return outs

    return step


def inputs(rng, R, n):
    routings = [oracle.make_routing("with_minus_one", rng, R, T, E, K) for _ in range(n)]
    idx = np.stack([r[0] for r in routings], axis=1)  # [R, n, T, K]
    w = np.stack([r[1] for r in routings], axis=1)
    x = rng.standard_normal((R, n, T, H)).astype(ml_dtypes.bfloat16)
    return x, idx, w


def assert_chain_equal(got, want, x, idx, n, num_experts=E):
    """Combined rows bit for bit; received rows bit for bit up to each expert's count (the
    oracle's: the programs do not keep recv_count)."""
    for i in range(n):
        np.testing.assert_array_equal(np.asarray(got[i][1]).view(np.uint32),
                                      np.asarray(want[i][1]).view(np.uint32), err_msg=f"pair {i}")
        for r, exp in enumerate(oracle.low_latency_dispatch(x[:, i], idx[:, i], num_experts, T)):
            for e, count in enumerate(exp["recv_count"]):
                a = np.asarray(got[i][0][r, e, :count]).view(np.uint8)
                b = np.asarray(want[i][0][r, e, :count]).view(np.uint8)
                np.testing.assert_array_equal(a, b, err_msg=f"pair {i} rank {r} expert {e}")
        for extra_got, extra_want in zip(got[i][2:], want[i][2:], strict=True):
            np.testing.assert_array_equal(extra_got, extra_want)


def assert_chain_matches_oracle(got, x, idx, w, n, num_experts=E, counts_at=()):
    """Every pair of a chain against the NumPy oracle: the received rows up to each expert's
    count (bf16 pairs bit for bit, fp8 pairs, the odd ones, within docs/api.md's one fp8 step),
    the combined rows per element (``oracle.assert_sums_close``: the stand-in expert scales
    pair i's rows by i + 2 and rounds them to bf16, each term's rounding on top of the fp8
    cast's), and the recv_count outputs at positions ``counts_at`` of a pair's outputs."""
    for i in range(n):
        use_fp8 = i % 2 == 1
        expected = oracle.low_latency_dispatch(x[:, i], idx[:, i], num_experts, T)
        for r, exp in enumerate(expected):
            for at in counts_at:
                np.testing.assert_array_equal(np.asarray(got[i][at][r]), exp["recv_count"],
                                              err_msg=f"pair {i} rank {r} recv_count")
            for e, count in enumerate(exp["recv_count"]):
                if count == 0:
                    continue
                have = np.asarray(got[i][0][r, e, :count])
                if not use_fp8:
                    np.testing.assert_array_equal(have.view(np.uint16),
                                                  exp["recv_x"][e].view(np.uint16),
                                                  err_msg=f"pair {i} rank {r} expert {e}")
                    continue
                scaled, _ = oracle.fp8_cast(exp["recv_x"][e].astype(np.float32))
                steps = fp8_steps_apart(have, scaled.astype(ml_dtypes.float8_e4m3fn))
                assert steps.max() <= 1, (i, r, e)
        want, magnitude = weighted_copies(x[:, i], idx[:, i], w[:, i])
        term_rtol = oracle.BF16_OUT_RTOL + (oracle.FP8_TERM_RTOL if use_fp8
                                            else oracle.F32_SUM_RTOL)
        oracle.assert_sums_close(np.asarray(got[i][1]), (i + 2) * want, (i + 2) * magnitude,
                                 term_rtol=term_rtol, what=f"pair {i} combine")


# On the GPU every length with every pattern. On CPU the reference backend's halves are plain
# XLA ops, which no schedule can pair wrongly: three pairs (the first, and the double buffers'
# parity wrapping) keep its results checked; test_chain_ties_every_send_to_the_previous_receive
# checks the order of 16 in the lowered program.
CHAIN_CASES = per_backend([(n, p) for n in CHAIN_LENGTHS for p in PATTERNS],
                          [(3, p) for p in PATTERNS])


@pytest.mark.parametrize(("backend", "n", "pattern"), CHAIN_CASES, indirect=["backend"])
def test_chain_of_split_pairs_equals_fused(backend, rng, n, pattern):
    mesh = ep_mesh(backend)
    R = mesh.shape["ep"]
    buf = make_buffer(backend, mesh, H, T)
    x, idx, w = inputs(rng, R, n)
    got = run_sharded(mesh, chain(buf, n, pattern, split=True), x, idx, w)
    want = run_sharded(mesh, chain(buf, n, pattern, split=False), x, idx, w)
    assert_chain_equal(got, want, x, idx, n)
    assert_chain_matches_oracle(got, x, idx, w, n,
                                counts_at=(2,) if pattern == "fused_between" else ())


@pytest.mark.parametrize(("backend", "n"), per_backend([(8,), (16,)], [(3,)]),
                         indirect=["backend"])
def test_chain_with_every_slot_written(backend, rng, n):
    """Every token picks every expert (top-k = E), so each expert receives R * T_max rows and no
    row of recv_x is left unspecified: the stand-in expert (XLA) reads written rows only. The
    chain that compute-sanitizer's initcheck can run with every kernel instrumented, XLA's too
    (scripts/sanitize.sh SAN_FILTER=0): any report there is a read of unwritten memory."""
    mesh = ep_mesh(backend)
    R = mesh.shape["ep"]
    num_experts = max(4, R)
    buf = jax_ep.Buffer(mesh, "ep", num_experts=num_experts, hidden=H, max_tokens_per_rank=T,
                        num_topk=num_experts, low_latency=True, backend=backend)
    idx = np.broadcast_to(np.arange(num_experts, dtype=np.int32), (R, n, T, num_experts)).copy()
    w = rng.random((R, n, T, num_experts)).astype(np.float32)
    x = rng.standard_normal((R, n, T, H)).astype(ml_dtypes.bfloat16)
    got, want = (run_sharded(mesh, chain(buf, n, "alone", split, keep_counts=True), x, idx, w)
                 for split in (True, False))
    assert_chain_equal(got, want, x, idx, n, num_experts)
    assert_chain_matches_oracle(got, x, idx, w, n, num_experts, counts_at=(2,))
    for i in range(n):  # the receive's own counts: every slot written
        assert (np.asarray(got[i][2]) == R * T).all(), (i, got[i][2])


@pytest.mark.parametrize("n", (2, 16))
def test_chain_ties_every_send_to_the_previous_receive(n):
    """In the traced program (lowered for CUDA), each send of an op depends on the previous
    receive of that op, although the program drops most of what the receives return."""
    mesh, buf = lowering_buffer()
    R, spec = mesh.shape["ep"], shard_spec(mesh)
    shape = (R, n, buf.max_tokens_per_rank)
    args = (jax.ShapeDtypeStruct((*shape, buf.hidden), jnp.bfloat16),
            jax.ShapeDtypeStruct((*shape, buf.num_topk), jnp.int32),
            jax.ShapeDtypeStruct((*shape, buf.num_topk), jnp.float32))
    for with_combine, ops in ((False, ("dispatch",)), (True, ("dispatch", "combine"))):
        step = chain(buf, n, "alone", split=True, with_combine=with_combine)
        program = jax.jit(jax.shard_map(
            lambda *a, step=step: jax.tree.map(lambda v: v[None], step(*(v[0] for v in a))),
            mesh=mesh, in_specs=(spec,) * 3, out_specs=spec))
        body = shard_map_body(jax.make_jaxpr(program)(*args).jaxpr)
        assert_split_calls_ordered(body, n, ops)


@pytest.mark.gpu
@pytest.mark.parametrize("command_buffers", (
    pytest.param("default", marks=pytest.mark.stress), "off"))
def test_chain_of_16_pairs_with_and_without_command_buffers(rng, command_buffers):
    """The longest chain, every pattern, compiled with XLA's default command buffers and with
    them off (``xla_gpu_enable_command_buffer`` empty): the same bits as the fused ops."""
    require_gpus(1)
    mesh = ep_mesh("cuda")
    R, n = mesh.shape["ep"], 16
    buf = make_buffer("cuda", mesh, H, T)
    options = {} if command_buffers == "default" else {"xla_gpu_enable_command_buffer": ""}
    for pattern in PATTERNS:
        x, idx, w = inputs(rng, R, n)
        got, want = (run_sharded(mesh, chain(buf, n, pattern, split), x, idx, w,
                                 compiler_options=options) for split in (True, False))
        assert_chain_equal(got, want, x, idx, n)
        assert_chain_matches_oracle(got, x, idx, w, n,
                                    counts_at=(2,) if pattern == "fused_between" else ())


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", (8, 64))
def test_independent_sends_of_one_program_wait_for_the_previous_receive(rng, tokens):
    """Eight split dispatches of independent inputs in one program, only the received rows kept
    (profile_ops' pattern): nothing but the ordering operand keeps XLA from running every send
    first, which trapped in the receive's count wait. ``tokens`` 8 and 64: receive by expert and
    by plan (T * K against the grid)."""
    require_gpus(1)
    mesh = ep_mesh("cuda")
    R, n, K8 = mesh.shape["ep"], 8, 8
    buf = jax_ep.Buffer(mesh, "ep", num_experts=64, hidden=256, max_tokens_per_rank=tokens,
                        num_topk=K8, low_latency=True, backend="cuda")
    idx, _ = oracle.make_routing("uniform", rng, R, tokens, 64, K8)
    xs = [rng.standard_normal((R, tokens, 256)).astype(ml_dtypes.bfloat16) for _ in range(n)]

    def step(idx, *xs):
        out = []
        for x in xs:
            pending = jax_ep.low_latency_dispatch_send(buf, x, idx)
            out.append(jax_ep.low_latency_dispatch_recv(buf, pending).recv_x)
        return out

    got = run_sharded(mesh, step, idx, *xs)
    for x, recv_x in zip(xs, got, strict=True):
        for r, exp in enumerate(oracle.low_latency_dispatch(x, idx, 64, tokens)):
            for e, count in enumerate(exp["recv_count"]):
                if count == 0:
                    continue
                scaled, _ = oracle.fp8_cast(exp["recv_x"][e].astype(np.float32))
                want = scaled.astype(ml_dtypes.float8_e4m3fn).view(np.uint8).astype(np.int16)
                have = np.asarray(recv_x[r, e, :count]).view(np.uint8).astype(np.int16)
                assert np.abs(have - want).max(initial=0) <= 1, (r, e)
