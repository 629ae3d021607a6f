"""Send/receive halves of the low-latency ops, once per backend: the split pair gives the fused
op's results bit for bit, also interleaved with another micro-batch, over repeated calls with
changing inputs (parity of the double buffers), and the same gradients; misuse is refused at
trace time and XLA is kept to the program order."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import ep_mesh, require_gpus
from harness import fetch, run_sharded, shard_spec, sharded_loss, sharded_program
from jax.sharding import Mesh
from test_low_latency import (
    HIDDEN,
    ROUTING_FP8_CASES,
    T_MAX,
    E,
    K,
    check_low_latency_dispatch,
    make_buffer,
    routed_inputs,
    weighted_copies,
)

import jax_ep
from jax_ep import testing as oracle
from jax_ep.backends import cuda as _cuda
from jax_ep.backends.custom_call import custom_call_p


def bits(a):
    return np.ascontiguousarray(np.asarray(a)).view(np.uint8)


def assert_dispatch_equal(got, want, use_fp8):
    """Bit-exact on everything the contract defines (rows past recv_count are unspecified)."""
    np.testing.assert_array_equal(got.recv_count, want.recv_count)
    np.testing.assert_array_equal(got.recv_src, want.recv_src)
    for field in ("recv_src", "recv_k", "recv_count"):
        np.testing.assert_array_equal(getattr(got.handle, field), getattr(want.handle, field))
    assert (got.recv_scales is None) == (not use_fp8)
    for r, counts in enumerate(want.recv_count):
        for e, n in enumerate(counts):
            np.testing.assert_array_equal(bits(got.recv_x[r, e, :n]), bits(want.recv_x[r, e, :n]))
            if use_fp8:
                np.testing.assert_array_equal(bits(got.recv_scales[r, e, :n]),
                                              bits(want.recv_scales[r, e, :n]))


def split_dispatch(buf, x, idx, **options):
    return jax_ep.low_latency_dispatch_recv(
        buf, jax_ep.low_latency_dispatch_send(buf, x, idx, **options))


def split_combine(buf, y, idx, w, handle):
    return jax_ep.low_latency_combine_recv(
        buf, jax_ep.low_latency_combine_send(buf, y, idx, w, handle))


@pytest.mark.parametrize(("backend", "routing", "use_fp8", "round_scale"), ROUTING_FP8_CASES,
                         indirect=["backend"])
def test_split_equals_fused(backend, rng, routing, use_fp8, round_scale):
    mesh = ep_mesh(backend)
    R = mesh.shape["ep"]
    buf = make_buffer(backend, mesh, HIDDEN, T_MAX)
    for idx, w, x in routed_inputs(rng, routing, R):
        y = rng.standard_normal((R, E // R, R * T_MAX, HIDDEN)).astype(ml_dtypes.bfloat16)

        def step(x, idx, w, y):
            options = dict(use_fp8=use_fp8, round_scale=round_scale)
            fused = jax_ep.low_latency_dispatch(buf, x, idx, **options)
            split = split_dispatch(buf, x, idx, **options)
            fused_out = jax_ep.low_latency_combine(buf, y, idx, w, fused.handle)
            split_out = split_combine(buf, y, idx, w, split.handle)
            return fused, split, fused_out, split_out

        fused, split, fused_out, split_out = run_sharded(mesh, step, x, idx, w, y)
        assert_dispatch_equal(split, fused, use_fp8)
        check_low_latency_dispatch(split, x, idx, T_MAX, use_fp8, round_scale, backend)
        np.testing.assert_array_equal(bits(split_out), bits(fused_out))


def expert(recv_x, scale):
    """A stand-in expert layer: every local expert scales its rows by its own factor."""
    return (recv_x.astype(jnp.float32) * scale[:, None, None]).astype(jnp.bfloat16)


def two_micro_batches(buf, split):
    """Per-rank step over micro-batches A and B, overlapped as a decode step would be: B's
    dispatch and A's combine are in flight together, compute sits between send and receive.
    ``split=False`` runs the fused ops in the same order (the reference)."""

    def dispatch_send(x, idx):
        if split:
            return jax_ep.low_latency_dispatch_send(buf, x, idx, use_fp8=False)
        return jax_ep.low_latency_dispatch(buf, x, idx, use_fp8=False)

    def dispatch_recv(pending):
        return jax_ep.low_latency_dispatch_recv(buf, pending) if split else pending

    def combine_send(y, idx, w, handle):
        if split:
            return jax_ep.low_latency_combine_send(buf, y, idx, w, handle)
        return jax_ep.low_latency_combine(buf, y, idx, w, handle)

    def combine_recv(pending):
        return jax_ep.low_latency_combine_recv(buf, pending) if split else pending

    def step(xa, ia, wa, xb, ib, wb, scale):
        pa = dispatch_send(xa, ia)
        h = jnp.tanh(xb.astype(jnp.float32))  # unrelated compute between A's halves
        h, pa = jax.lax.optimization_barrier((h, pa))
        da = dispatch_recv(pa)
        ya = expert(da.recv_x, scale)
        pb = dispatch_send(xb, ib)  # B's dispatch and A's combine in flight together
        pca = combine_send(ya, ia, wa, da.handle)
        h = jnp.sin(h)
        h, pb, pca = jax.lax.optimization_barrier((h, pb, pca))
        db = dispatch_recv(pb)
        out_a = combine_recv(pca)
        yb = expert(db.recv_x, scale + 1.0)
        out_b = combine_recv(combine_send(yb, ib, wb, db.handle))
        return da, db, out_a, out_b, h

    return step


def test_two_micro_batches_interleaved(backend, rng):
    mesh = ep_mesh(backend)
    R, T, H = mesh.shape["ep"], 8, 256
    buf = make_buffer(backend, mesh, H, T)
    ia, wa = oracle.make_routing("with_minus_one", rng, R, T, E, K)
    ib, wb = oracle.make_routing("uniform", rng, R, T, E, K)
    xa, xb = (rng.standard_normal((R, T, H)).astype(ml_dtypes.bfloat16) for _ in range(2))
    scale = rng.standard_normal((R, E // R)).astype(np.float32)
    args = (xa, ia, wa, xb, ib, wb, scale)

    want = run_sharded(mesh, two_micro_batches(buf, split=False), *args)
    got = run_sharded(mesh, two_micro_batches(buf, split=True), *args)
    for g, w in zip(got[:2], want[:2], strict=True):
        assert_dispatch_equal(g, w, use_fp8=False)
    for g, w in zip(got[2:], want[2:], strict=True):
        np.testing.assert_array_equal(bits(g), bits(w))
    # And against the oracle: out = sum_k w * scale[e_k] * x (each term rounded to bf16 once
    # by the expert).
    for x, idx, w, out, shift in ((xa, ia, wa, got[2], 0.0), (xb, ib, wb, got[3], 1.0)):
        gain = np.where(idx >= 0, w * (scale.reshape(-1)[np.maximum(idx, 0)] + shift), 0.0)
        oracle.assert_sums_close(out, *weighted_copies(x, idx, gain),
                                 term_rtol=oracle.BF16_OUT_RTOL)


def test_repeated_calls_with_changing_inputs(backend, rng):
    """Split and fused calls mixed in one program, the program run twice: every call pairs
    with the right parity whatever the number of calls before it."""
    mesh = ep_mesh(backend)
    R, T, H, steps = mesh.shape["ep"], 8, 128, 3
    buf = make_buffer(backend, mesh, H, T)

    def inputs():
        routings = [oracle.make_routing("uniform", rng, R, T, E, K) for _ in range(steps)]
        idx = np.stack([r[0] for r in routings], axis=1)  # [R, steps, T, K]
        w = np.stack([r[1] for r in routings], axis=1)
        x = rng.standard_normal((R, steps, T, H)).astype(ml_dtypes.bfloat16)
        return x, idx, w

    def program(kinds):
        def step(x, idx, w):
            outs = []
            for i, kind in enumerate(kinds):
                if kind == "split":
                    d = split_dispatch(buf, x[i], idx[i], use_fp8=i % 2 == 1)
                else:
                    d = jax_ep.low_latency_dispatch(buf, x[i], idx[i], use_fp8=i % 2 == 1)
                y = d.recv_x if i % 2 == 0 else jax_ep.per_token_cast_from_fp8(d.recv_x,
                                                                              d.recv_scales)
                if kind == "split":
                    out = split_combine(buf, y, idx[i], w[i], d.handle)
                else:
                    out = jax_ep.low_latency_combine(buf, y, idx[i], w[i], d.handle)
                outs.append((d.recv_count, d.recv_src, out))
            return outs
        return step

    fused = sharded_program(mesh, program(["fused"] * steps))
    for kinds in (["split"] * steps, ["split", "fused", "split"]):
        mixed = sharded_program(mesh, program(kinds))
        for _ in range(2):  # the second run starts at the parity the first one left
            x, idx, w = inputs()
            got, want = mixed(x, idx, w), fused(x, idx, w)
            for g, wnt in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
                np.testing.assert_array_equal(bits(g), bits(wnt))
            for i, (count, _, _) in enumerate(got):
                for r, exp in enumerate(oracle.low_latency_dispatch(x[:, i], idx[:, i], E, T)):
                    np.testing.assert_array_equal(count[r], exp["recv_count"])


def test_gradients_through_send_and_recv_equal_fused(backend, rng):
    mesh = ep_mesh(backend)
    R, T, H = mesh.shape["ep"], 8, 128
    buf = make_buffer(backend, mesh, H, T)
    idx, w = oracle.make_routing("with_minus_one", rng, R, T, E, K)
    x = rng.standard_normal((R, T, H)).astype(ml_dtypes.bfloat16)
    scale = rng.standard_normal((R, E // R)).astype(np.float32)
    c = rng.standard_normal((R, T, H)).astype(np.float32)

    def per_rank(split):
        def loss(x, w, idx, scale, c):
            if split:
                d = split_dispatch(buf, x, idx, use_fp8=False)
                out = split_combine(buf, expert(d.recv_x, scale), idx, w, d.handle)
            else:
                d = jax_ep.low_latency_dispatch(buf, x, idx, use_fp8=False)
                out = jax_ep.low_latency_combine(buf, expert(d.recv_x, scale), idx, w, d.handle)
            return jnp.sum(out.astype(jnp.float32) * c)
        return loss

    grads = {}
    for split in (False, True):
        grad = jax.jit(jax.grad(sharded_loss(mesh, per_rank(split)), argnums=(0, 1)))
        grads[split] = [fetch(g) for g in grad(x, w, idx, scale, c)]
    for got, want in zip(grads[True], grads[False], strict=True):
        np.testing.assert_array_equal(bits(got), bits(want))
    assert np.abs(np.asarray(grads[True][0], np.float32)).max() > 0


# ------------------------------------------------------------------------------------ misuse


def trace(mesh, fn, *arrays):
    """Traces (does not run) ``fn`` per rank under shard_map."""
    spec = shard_spec(mesh)
    per_rank = jax.shard_map(lambda *xs: fn(*(a[0] for a in xs)), mesh=mesh,
                             in_specs=(spec,) * len(arrays), out_specs=spec)
    return jax.make_jaxpr(per_rank)(*arrays)


def misuse_inputs(backend, rng):
    mesh = ep_mesh(backend)
    R, T, H = mesh.shape["ep"], 4, 128
    buf = make_buffer(backend, mesh, H, T)
    idx, w = oracle.make_routing("uniform", rng, R, T, E, K)
    x = rng.standard_normal((R, T, H)).astype(ml_dtypes.bfloat16)
    return mesh, buf, x, idx, w


def test_second_send_before_receive_is_refused(backend, rng):
    mesh, buf, x, idx, _ = misuse_inputs(backend, rng)

    def step(x, idx):
        jax_ep.low_latency_dispatch_send(buf, x, idx)
        jax_ep.low_latency_dispatch_send(buf, x, idx)

    with pytest.raises(ValueError, match="has not been received yet"):
        trace(mesh, step, x, idx)


def test_fused_calls_between_send_and_receive(backend, rng):
    """Fused calls run in a channel of their own: several of them between a send and its
    receive (where XLA may place autodiff's backward ops) change no result."""
    mesh = ep_mesh(backend)
    R, T, H = mesh.shape["ep"], 8, 128
    buf = make_buffer(backend, mesh, H, T)
    idx, w = oracle.make_routing("uniform", rng, R, T, E, K)
    x = rng.standard_normal((R, 2, T, H)).astype(ml_dtypes.bfloat16)

    def fused_pairs(x, idx, w, count):
        outs = []
        for _ in range(count):
            d = jax_ep.low_latency_dispatch(buf, x, idx, use_fp8=False)
            outs.append((d.recv_x, jax_ep.low_latency_combine(buf, d.recv_x, idx, w, d.handle)))
        return outs

    def step(x, idx, w):
        pending = jax_ep.low_latency_dispatch_send(buf, x[0], idx, use_fp8=False)
        x1, pending = jax.lax.optimization_barrier((x[1], pending))  # fused calls after the send
        inner = fused_pairs(x1, idx, w, 2)
        inner, pending = jax.lax.optimization_barrier((inner, pending))  # ... before the receive
        d = jax_ep.low_latency_dispatch_recv(buf, pending)
        pending = jax_ep.low_latency_combine_send(buf, d.recv_x, idx, w, d.handle)
        y, pending = jax.lax.optimization_barrier((d.recv_x, pending))
        inner_combine = jax_ep.low_latency_combine(buf, y, idx, w, d.handle)
        inner_combine, pending = jax.lax.optimization_barrier((inner_combine, pending))
        return d, jax_ep.low_latency_combine_recv(buf, pending), inner, inner_combine

    def reference(x, idx, w):
        d = jax_ep.low_latency_dispatch(buf, x[0], idx, use_fp8=False)
        return (d, jax_ep.low_latency_combine(buf, d.recv_x, idx, w, d.handle),
                fused_pairs(x[1], idx, w, 1)[0])

    d, out, inner, inner_combine = run_sharded(mesh, step, x, idx, w)
    want_d, want_out, (want_inner_x, want_inner_out) = run_sharded(mesh, reference, x, idx, w)
    assert_dispatch_equal(d, want_d, use_fp8=False)
    np.testing.assert_array_equal(bits(out), bits(want_out))
    np.testing.assert_array_equal(bits(inner_combine), bits(want_out))
    for recv_x, inner_out in inner:
        for r, counts in enumerate(want_d.recv_count):  # x[1] routed like x[0]: same counts
            for e, n in enumerate(counts):
                np.testing.assert_array_equal(bits(recv_x[r, e, :n]), bits(want_inner_x[r, e, :n]))
        np.testing.assert_array_equal(bits(inner_out), bits(want_inner_out))


def test_receiving_twice_is_refused(backend, rng):
    mesh, buf, x, idx, _ = misuse_inputs(backend, rng)

    def step(x, idx):
        pending = jax_ep.low_latency_dispatch_send(buf, x, idx)
        jax_ep.low_latency_dispatch_recv(buf, pending)
        return jax_ep.low_latency_dispatch_recv(buf, pending).recv_count

    with pytest.raises(ValueError, match="already received"):
        trace(mesh, step, x, idx)


def test_receive_needs_a_pending_object(backend, rng):
    mesh, buf, x, idx, _ = misuse_inputs(backend, rng)

    def step(x, idx):
        d = jax_ep.low_latency_dispatch(buf, x, idx)
        return jax_ep.low_latency_dispatch_recv(buf, d).recv_count

    with pytest.raises(ValueError, match="LowLatencyPendingDispatch"):
        trace(mesh, step, x, idx)


def test_a_new_trace_starts_clean(backend, rng):
    """A send left pending in one (failed) trace does not refuse the next trace's send."""
    mesh, buf, x, idx, _ = misuse_inputs(backend, rng)
    def two_sends(x, idx):
        jax_ep.low_latency_dispatch_send(buf, x, idx)
        jax_ep.low_latency_dispatch_send(buf, x, idx)

    with pytest.raises(ValueError, match="has not been received yet"):
        trace(mesh, two_sends, x, idx)
    trace(mesh, lambda x, i: split_dispatch(buf, x, i).recv_count, x, idx)


# ------------------------------------------------------------------ lowering (CPU, for CUDA)

R_LOWER, T_LOWER, H_LOWER, E_LOWER, K_LOWER = 2, 16, 256, 16, 2


def lowering_buffer():
    mesh = Mesh(np.array(jax.devices("cpu")[:R_LOWER]), ("ep",))
    buf = jax_ep.Buffer(mesh, "ep", num_experts=E_LOWER, hidden=H_LOWER,
                        max_tokens_per_rank=T_LOWER, num_topk=K_LOWER, low_latency=True,
                        backend="cuda", lowering_only=True)
    return mesh, buf


def lowering_args():
    """Global ``[R, ...]`` shapes of two_micro_batches' arguments."""
    R, T, H, K = R_LOWER, T_LOWER, H_LOWER, K_LOWER
    tokens = (jax.ShapeDtypeStruct((R, T, H), jnp.bfloat16),
              jax.ShapeDtypeStruct((R, T, K), jnp.int32),
              jax.ShapeDtypeStruct((R, T, K), jnp.float32))
    return (*tokens, *tokens, jax.ShapeDtypeStruct((R, E_LOWER // R), jnp.float32))


def cuda_step(mesh, buf):
    spec = shard_spec(mesh)
    step = two_micro_batches(buf, split=True)

    def per_rank(*xs):
        _, _, out_a, out_b, h = step(*(x[0] for x in xs))
        return out_a[None], out_b[None], h[None]
    return jax.jit(jax.shard_map(per_rank, mesh=mesh, in_specs=(spec,) * 7,
                                 out_specs=spec))


def sub_jaxprs(eqn):
    for param in eqn.params.values():
        inner = getattr(param, "jaxpr", param)
        if hasattr(inner, "eqns"):
            yield inner


def custom_calls(eqns):
    """Target names of every custom call of ours in ``eqns``, recursively, in program order."""
    found = []
    for eqn in eqns:
        if eqn.primitive is custom_call_p:
            found.append(eqn.params["target_name"])
        for inner in sub_jaxprs(eqn):
            found += custom_calls(inner.eqns)
    return found


def shard_map_body(jaxpr):
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "shard_map":
            return eqn.params["jaxpr"]
        for inner in sub_jaxprs(eqn):
            body = shard_map_body(inner)
            if body is not None:
                return body
    return None


def assert_split_calls_ordered(body, num_pairs, ops=("dispatch", "combine")):
    """In the shard_map ``body``, the split calls of each op come as ``num_pairs`` (send,
    receive) pairs, and each call depends on the one before it: a receive on its send, a send on
    the previous receive of its op (XLA orders custom calls only by data).

    Dependences are followed as XLA keeps them: output i of an optimization barrier depends on
    its input i only (XLA prunes a barrier's unused values, so a barrier ties nothing by
    itself), and through custom calls (a side-effecting call keeps every operand)."""
    calls = [(eqn, name) for eqn in body.eqns for name in custom_calls([eqn])]
    producer = {v: eqn for eqn in body.eqns for v in eqn.outvars}

    def inputs_of(eqn, var):
        if eqn.primitive.name == "optimization_barrier":
            return [eqn.invars[eqn.outvars.index(var)]]
        return list(eqn.invars)

    def ancestors(eqn):
        seen, todo = set(), [v for v in eqn.invars if not hasattr(v, "val")]
        while todo:
            var = todo.pop()
            e = producer.get(var)
            if e is not None and (id(e), id(var)) not in seen:
                seen.add((id(e), id(var)))
                todo += [v for v in inputs_of(e, var) if not hasattr(v, "val")]
        return {eqn_id for eqn_id, _ in seen}

    for op in ops:
        send = _cuda.target_name(f"low_latency_{op}_send")
        recv = _cuda.target_name(f"low_latency_{op}_recv")
        ordered = [(eqn, name) for eqn, name in calls if name in (send, recv)]
        assert [name for _, name in ordered] == [send, recv] * num_pairs, (op, ordered)
        for i, ((earlier, _), (later, _)) in enumerate(zip(ordered[:-1], ordered[1:],
                                                           strict=True)):
            assert id(earlier) in ancestors(later), f"{op}: call {i + 1} does not wait for call {i}"


def test_every_call_depends_on_the_previous_receive_of_its_op():
    """XLA orders custom calls only by data: in the step's shard_map body, each send of an op
    must depend on the previous receive of the same op, and each receive on its send."""
    mesh, buf = lowering_buffer()
    body = shard_map_body(jax.make_jaxpr(cuda_step(mesh, buf))(*lowering_args()).jaxpr)
    assert_split_calls_ordered(body, 2)


def test_split_lowers_for_cuda():
    """The four targets lower (export for cuda from a CPU machine) and are covered by
    export_safety_checks()."""
    mesh, buf = lowering_buffer()
    exported = jax.export.export(cuda_step(mesh, buf), platforms=("cuda",),
                                 disabled_checks=jax_ep.export_safety_checks())(
        *lowering_args())
    text = jax.export.deserialize(exported.serialize()).mlir_module()
    for op in ("dispatch_send", "dispatch_recv", "combine_send", "combine_recv"):
        name = _cuda.target_name(f"low_latency_{op}")
        assert text.count(f"@{name}(") == 2, name
    send = next(line for line in text.splitlines()
                if "@jax_ep_low_latency_dispatch_send_v2(" in line)
    assert "use_fp8 = false" in send and "tensor<1xi32>" in send
    assert "stablehlo.optimization_barrier" in text


def test_gradient_through_split_lowers_for_cuda():
    """jax.grad through the four custom calls traces and lowers for cuda: the sends carry no
    derivative (integer handle operands would otherwise reach our custom call, which has no JVP)."""
    mesh, buf = lowering_buffer()
    spec = shard_spec(mesh)

    def per_rank(x, w, idx):
        d = split_dispatch(buf, x[0], idx[0], use_fp8=False)
        out = split_combine(buf, d.recv_x, idx[0], w[0], d.handle)
        # Squared: the gradient needs the forward's output (of a plain sum it does not, and jit
        # then drops the forward combine, as it drops any call whose results are unused).
        return jnp.sum(out.astype(jnp.float32) ** 2)[None]

    loss = jax.shard_map(per_rank, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
    grad = jax.jit(jax.grad(lambda *a: jnp.sum(loss(*a)), argnums=(0, 1)))
    x, idx, w, *_ = lowering_args()
    text = grad.trace(x, w, idx).lower(lowering_platforms=("cuda",)).as_text()
    for op in ("dispatch_send", "dispatch_recv", "combine_send", "combine_recv"):
        assert f"@{_cuda.target_name(f'low_latency_{op}')}(" in text, op
    # The backward passes are the fused ops (as for the fused forward).
    assert f"@{_cuda.target_name('low_latency_dispatch')}(" in text
    assert f"@{_cuda.target_name('low_latency_combine')}(" in text


def sliced_calls_program(mesh, buf, kinds, T, H, K):
    """``(jitted program, argument shapes)``: per rank, one low-latency call pair per kind on
    slices ``x[i]`` of stacked inputs (micro-batches), the pattern XLA:GPU's dynamic-slice
    fusion rewrites."""

    def step(x, idx, w):
        outs = []
        for i, kind in enumerate(kinds):
            dispatch = split_dispatch if kind == "split" else jax_ep.low_latency_dispatch
            combine = split_combine if kind == "split" else jax_ep.low_latency_combine
            d = dispatch(buf, x[i], idx[i], use_fp8=False)
            outs.append((d.recv_count, combine(buf, d.recv_x, idx[i], w[i], d.handle)))
        return outs

    R, n, spec = mesh.shape["ep"], len(kinds), shard_spec(mesh)
    program = jax.jit(jax.shard_map(lambda *a: step(*(v[0] for v in a)), mesh=mesh,
                                    in_specs=(spec,) * 3, out_specs=spec))
    args = (jax.ShapeDtypeStruct((R, n, T, H), jnp.bfloat16),
            jax.ShapeDtypeStruct((R, n, T, K), jnp.int32),
            jax.ShapeDtypeStruct((R, n, T, K), jnp.float32))
    return program, args


def fenced_custom_calls(jaxpr):
    """(call, barrier before it, barrier after it) for every ffi call in ``jaxpr``, recursively."""
    found = []
    producer = {v: e for e in jaxpr.eqns for v in e.outvars}
    consumers = {}
    for e in jaxpr.eqns:
        for v in e.invars:
            if not hasattr(v, "val"):  # literals (constants) have no consumers to track
                consumers.setdefault(v, []).append(e)
    for eqn in jaxpr.eqns:
        if eqn.primitive is custom_call_p:
            before = {producer[v].primitive.name if v in producer else "input" for v in eqn.invars}
            after = {c.primitive.name for v in eqn.outvars for c in consumers.get(v, [])}
            found.append((eqn.params["target_name"], before, after))
        for inner in sub_jaxprs(eqn):
            found += fenced_custom_calls(inner)
    return found


def test_custom_calls_are_fenced_by_optimization_barriers():
    """Every custom call's operands come from, and its results go to, an optimization barrier:
    XLA:GPU's dynamic-slice fusion would otherwise clone a multi-result call with sliced
    operands and keep the side-effecting original too (each kernel would run twice; a second
    low-latency receive then waits forever)."""
    mesh, buf = lowering_buffer()
    program, args = sliced_calls_program(mesh, buf, ["split", "fused", "split"], T_LOWER, H_LOWER,
                                         K_LOWER)
    calls = fenced_custom_calls(jax.make_jaxpr(program)(*args).jaxpr)
    assert len(calls) == 10, calls  # 2 split calls x 2 ops x 2 halves + 1 fused call x 2 ops
    for name, before, after in calls:
        assert before == {"optimization_barrier"}, (name, before)
        assert after == {"optimization_barrier"}, (name, after)


@pytest.mark.gpu
def test_each_call_compiles_to_one_custom_call(rng):
    """On the GPU the compiled program holds each call exactly once although every operand is a
    slice of a stacked input (the dynamic-slice fusion rewrite must not duplicate any)."""
    require_gpus(2)
    mesh = ep_mesh("cuda")
    T, H = 8, 128
    buf = make_buffer("cuda", mesh, H, T)
    program, args = sliced_calls_program(mesh, buf, ["split", "fused", "split"], T, H, K)
    text = program.trace(*args).lower().compile().as_text()
    for op, count in (("dispatch", 1), ("combine", 1), ("dispatch_send", 2),
                      ("dispatch_recv", 2), ("combine_send", 2), ("combine_recv", 2)):
        name = _cuda.target_name(f"low_latency_{op}")
        assert text.count(f'custom_call_target="{name}"') == count, (name, text)
