"""Runs N dispatch+combine steps with changing inputs on every GPU, checking each step against
the oracle. test_gpu.py runs it under XLA command buffers (CUDA graphs); by hand:
``python tests/command_buffer_replay.py N [split|normal]`` (low-latency ops by default;
``split``: their send/receive halves; ``normal``: normal-mode dispatch, combine and layout)."""

import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep import testing as oracle


def normal_steps(mesh, num_steps):
    """Normal-mode layout, dispatch and combine, each step against the oracle."""
    R, T, H, E, K = mesh.shape["ep"], 32, 512, 32, 4
    buf = jax_ep.Buffer(mesh, "ep", num_experts=E, hidden=H, max_tokens_per_rank=T,
                        num_topk=K, dtype=jnp.bfloat16, backend="cuda")

    def step(x, idx, w):
        layout = jax_ep.get_dispatch_layout(buf, idx)
        d = jax_ep.dispatch(buf, x, idx, w)
        out, _ = jax_ep.combine(buf, d.recv_x, d.handle)
        return layout.num_tokens_per_rank, d.num_recv_tokens[None], out

    run = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
    rng = np.random.default_rng(7)
    for i in range(num_steps):
        idx, w = oracle.make_routing(oracle.ROUTINGS[i % 5], rng, R, T, E, K)
        x = rng.standard_normal((R, T, H)).astype(ml_dtypes.bfloat16)
        per_rank, num_recv, out = run(x.reshape(R * T, H), idx.reshape(R * T, K),
                                      w.reshape(R * T, K))
        expected = oracle.dispatch(x, idx, w, E)
        assert np.array_equal(np.asarray(num_recv), [e["num_recv_tokens"] for e in expected]), i
        want_layout = np.stack([e["num_tokens_per_rank"] for e in oracle.layout(idx, E, R)])
        assert np.array_equal(np.asarray(per_rank).reshape(R, R), want_layout), i
        # combine of the dispatched rows: x times the number of ranks the token went to
        oracle.assert_combine_close(np.asarray(out).reshape(R, T, H),
                                    np.stack([e["recv_x"] for e in expected]),
                                    np.stack([e["recv_src"] for e in expected]), T,
                                    what=f"step {i}")


def main(num_steps, split=False, normal=False):
    mesh = Mesh(np.array(jax.devices()), ("ep",))
    if normal:
        normal_steps(mesh, num_steps)
        _report(num_steps)
        return
    R, T, H, E, K = mesh.shape["ep"], 32, 512, 32, 4
    buf = jax_ep.Buffer(mesh, "ep", num_experts=E, hidden=H, max_tokens_per_rank=T,
                        num_topk=K, dtype=jnp.bfloat16, low_latency=True, backend="cuda")

    def step(x, idx, w):
        if split:
            ll = jax_ep.low_latency_dispatch_recv(
                buf, jax_ep.low_latency_dispatch_send(buf, x, idx, use_fp8=False))
            return ll.recv_count, jax_ep.low_latency_combine_recv(
                buf, jax_ep.low_latency_combine_send(buf, ll.recv_x, idx, w, ll.handle))
        ll = jax_ep.low_latency_dispatch(buf, x, idx, use_fp8=False)
        return ll.recv_count, jax_ep.low_latency_combine(buf, ll.recv_x, idx, w, ll.handle)

    run = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
    rng = np.random.default_rng(7)
    for i in range(num_steps):
        idx, w = oracle.make_routing(oracle.ROUTINGS[i % 5], rng, R, T, E, K)
        x = rng.standard_normal((R, T, H)).astype(ml_dtypes.bfloat16)
        count, out = run(x.reshape(R * T, H), idx.reshape(R * T, K), w.reshape(R * T, K))
        expected = oracle.low_latency_dispatch(x, idx, E, T)
        assert np.array_equal(np.asarray(count).reshape(R, -1),
                              np.stack([e["recv_count"] for e in expected])), i
        gain = np.where(idx >= 0, w, 0.0).astype(np.float64)
        oracle.assert_sums_close(np.asarray(out).reshape(R, T, H),
                                 gain.sum(-1)[..., None] * x.astype(np.float64),
                                 np.abs(gain).sum(-1)[..., None] * np.abs(x.astype(np.float64)),
                                 what=f"step {i}")
    _report(num_steps)


def _report(num_steps):
    from jax_ep import _C

    counts = _C.handler_call_counts()
    print("steps ok", num_steps)
    print(f"handler calls {counts['calls']} captured {counts['captured']}")


if __name__ == "__main__":
    main(int(sys.argv[1]), split=sys.argv[2:] == ["split"], normal=sys.argv[2:] == ["normal"])
