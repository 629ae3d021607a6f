"""The hierarchical normal mode (jax_ep.hierarchical) against the flat ops, once per backend:
the devices as 2 hosts of half of them each (8 CPU devices: 2 x 4; the GPUs of one process: 2
GPUs are 2 x 1, one GPU a single rank). Its dispatch gives the flat dispatch's results bit for
bit; its combine sums per host as docs/api.md says a combine across hosts does; its own code
runs no collective (processes sharing one GPU run it: tests/test_gpu_multiprocess.py)."""

import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import ep_mesh
from harness import sharded_program
from jax.sharding import Mesh

import jax_ep
from jax_ep import hierarchical
from jax_ep import testing as oracle
from jax_ep.peers import ipc

T, H, E, K = 8, 128, 16, 8
DISPATCH_FIELDS = ("recv_x", "recv_topk_idx", "recv_topk_weights", "num_recv_tokens",
                   "num_recv_tokens_per_expert")


@pytest.fixture(autouse=True)
def _close_groups():
    """Closes the test's groups after it (every process alike: closing is collective), so that
    a process running these tests holds one test's Buffers, and their proxies, at a time."""
    yield
    while Group.made:
        Group.made.pop().close()


class Group:
    """The hierarchical Buffer over (host, gpu) and the flat one over the same devices, in the
    flat rank order (host by host): ``HIERARCHICAL_HOSTS`` hosts (the launcher's fake hosts,
    which group consecutive processes), else 2 when the devices split in two, else 1."""

    made = []  # the groups of the running test

    def __init__(self, backend, dtype, capacity=None):
        flat_mesh = ep_mesh(backend)
        self.num_ranks = flat_mesh.devices.size
        self.hosts = int(os.environ.get("HIERARCHICAL_HOSTS", 2 if self.num_ranks % 2 == 0 else 1))
        self.rank_hosts = [r * self.hosts // self.num_ranks for r in range(self.num_ranks)]
        mesh = Mesh(flat_mesh.devices.reshape(self.hosts, -1), ("host", "gpu"))
        self.num_experts = E * max(1, self.num_ranks // E)  # one expert a rank, at least
        kw = dict(num_experts=self.num_experts, hidden=H, max_tokens_per_rank=T, num_topk=K,
                  dtype=dtype,
                  capacity=None if capacity is None else capacity * self.num_ranks,
                  backend=backend)
        self.hierarchical = hierarchical.HierarchicalBuffer(mesh, "host", "gpu", **kw)
        self.flat = jax_ep.Buffer(flat_mesh, "ep", **kw)
        Group.made.append(self)

    def flat_spans_hosts(self):
        """Whether the flat group's processes sit on more than one host (the launcher's fake
        hosts), where its combine sums per host too (docs/api.md, "combine"). Collective: every
        process asks."""
        return jax.process_count() > 1 and len(set(ipc.all_gather(
            self.flat, "test_hierarchical/host", ipc.host_name()).values())) > 1

    def close(self):
        self.hierarchical.close()
        self.flat.close()

    def inputs(self, kind, dtype, seed=0):
        rng = np.random.default_rng(seed)
        idx, w = oracle.make_routing(kind, rng, self.num_ranks, T, self.num_experts, K)
        x = rng.standard_normal((self.num_ranks, T, H)).astype(np.float32).astype(dtype)
        return x, idx, w

    def both(self, step, *arrays):
        """``step(module, buffer, *per-rank arrays)`` on the hierarchical and the flat group."""
        return self.programs(step)(*arrays)

    def programs(self, step):
        """``both`` of ``step`` as one callable that compiles each group's program once."""
        hbuf = self.hierarchical
        got = sharded_program(hbuf.mesh, lambda *a: step(hierarchical, hbuf, *a), axis="gpu")
        want = sharded_program(self.flat.mesh, lambda *a: step(jax_ep, self.flat, *a))
        return lambda *arrays: (got(*arrays), want(*arrays))


def bits(a):
    a = np.asarray(a)
    return a.view(np.uint16) if a.dtype == ml_dtypes.bfloat16 else a


def dispatch_and_combine(module, buf, x, idx, w):
    d = module.dispatch(buf, x, idx, w)
    return d, module.combine(buf, d.recv_x, d.handle, d.recv_topk_weights)


def test_dispatch_moves_the_flat_bits_and_combine_sums_per_host(backend):
    """Under every routing, the dispatch's results are the flat dispatch's; the combine is, every
    element, oracle.combine_in_order across the hosts (partial sums rounded to bf16). Under
    uniform routing of 2 hosts x 4 in one process the flat combine differs from it, so the check
    tells the two apart; a flat group across fake hosts sums per host, and equals it."""
    group = Group(backend, jnp.bfloat16)
    both = group.programs(dispatch_and_combine)
    for kind in ("uniform", "with_minus_one", "one_hot_expert", "empty_ranks", "all_minus_one"):
        (d, (y, y_w)), (want, (flat_y, _)) = both(*group.inputs(kind, ml_dtypes.bfloat16))
        for name in DISPATCH_FIELDS:
            np.testing.assert_array_equal(bits(getattr(d, name)), bits(getattr(want, name)),
                                          f"{kind}: {name}")
        for name in ("recv_src", "num_recv_tokens"):
            np.testing.assert_array_equal(getattr(d.handle, name), getattr(want.handle, name),
                                          f"{kind}: {name}")
        expected = oracle.combine_in_order(want.recv_x, want.handle.recv_src, T,
                                           group.rank_hosts)
        np.testing.assert_array_equal(bits(y), bits(expected), f"{kind}: combined")
        expected_w = oracle.combine_in_order(want.recv_topk_weights, want.handle.recv_src, T,
                                             group.rank_hosts)
        np.testing.assert_array_equal(y_w, expected_w, f"{kind}: combined weights")
        if kind == "uniform" and group.hosts > 1 and group.num_ranks >= 8:
            # Inside one host the flat combine sums in one pass and differs from the oracle's
            # per-host sums, so the check tells the two apart; across hosts it sums per host.
            assert np.array_equal(bits(flat_y), bits(expected)) == group.flat_spans_hosts()


def test_a_capacity_drops_the_rows_the_flat_dispatch_drops(backend):
    group = Group(backend, jnp.bfloat16, capacity=T // 4)  # a quarter of T per rank
    (d, _), (want, _) = group.both(dispatch_and_combine,
                                   *group.inputs("one_hot_expert", ml_dtypes.bfloat16))
    assert int(np.max(want.num_recv_tokens)) > group.num_ranks * T // 4  # rows were dropped
    for name in DISPATCH_FIELDS:
        np.testing.assert_array_equal(bits(getattr(d, name)), bits(getattr(want, name)), name)
    np.testing.assert_array_equal(d.handle.recv_src, want.handle.recv_src)


def test_cached_dispatch_moves_the_flat_cached_dispatch_s_bits(backend):
    group = Group(backend, jnp.bfloat16)
    x, idx, w = group.inputs("skewed", ml_dtypes.bfloat16)
    x2 = group.inputs("skewed", ml_dtypes.bfloat16, seed=1)[0]

    def step(module, b, x, idx, w, x2):
        return module.dispatch(b, x2, handle=module.dispatch(b, x, idx, w).handle).recv_x

    got, want = group.both(step, x, idx, w, x2)
    np.testing.assert_array_equal(bits(got), bits(want))


def test_gradients_match_the_flat_ops(backend):
    """d/dx and d/dweights of a dispatch + combine loss, float32: the flat ops' within float32
    roundings of sums taken in another order."""
    group = Group(backend, jnp.float32)
    x, idx, w = group.inputs("with_minus_one", np.float32)
    c = np.random.default_rng(2).standard_normal(x.shape).astype(np.float32)

    def step(module, b, x, idx, w, c):
        def loss(x, w):
            d = module.dispatch(b, x, idx, w)
            y, _ = module.combine(b, d.recv_x * d.recv_topk_weights.sum(1)[:, None], d.handle)
            return jnp.sum(y * c)
        return jax.grad(loss, argnums=(0, 1))(x, w)

    got, want = group.both(step, x, idx, w, c)
    for g, f in zip(got, want, strict=True):
        np.testing.assert_allclose(g, f, rtol=1e-5, atol=1e-5)


def test_bad_axes_are_named():
    mesh = Mesh(ep_mesh("reference").devices.reshape(2, -1), ("host", "gpu"))
    kw = dict(num_experts=E, hidden=H, max_tokens_per_rank=T, num_topk=K, backend="reference")
    with pytest.raises(ValueError, match="host_axis 'hosts' is not an axis of the mesh"):
        hierarchical.HierarchicalBuffer(mesh, "hosts", "gpu", **kw)
    with pytest.raises(ValueError, match="host_axis and gpu_axis must differ"):
        hierarchical.HierarchicalBuffer(mesh, "gpu", "gpu", **kw)


# What XLA lowers to a collective: NCCL's, on GPUs. The flat ops' own (the reference backend's)
# sit inside their custom_vjp calls.
COLLECTIVES = {"all_gather", "all_to_all", "psum", "psum2", "psum_invariant", "pmax", "pmin",
               "ppermute", "reduce_scatter", "psum_scatter", "ragged_all_to_all"}


def collectives_outside_the_ops(jaxpr):
    """The collective primitives of ``jaxpr`` and its sub-programs, not looking inside the flat
    ops (custom_vjp calls)."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in COLLECTIVES:
            found.append(eqn.primitive.name)
        if eqn.primitive.name.startswith("custom_vjp_call"):
            continue
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    sub = sub.jaxpr
                if isinstance(sub, jax.extend.core.Jaxpr):
                    found += collectives_outside_the_ops(sub)
    return found


def test_the_hierarchical_ops_run_no_collective_of_their_own():
    """Dispatch, cached dispatch and combine: every collective of the program is inside a flat
    op (so the mode runs where the flat ops run, e.g. processes sharing one GPU, where NCCL
    refuses XLA's collectives). Their gradients are the transposes of the same local steps
    around the flat ops' own backward rules."""
    group = Group("reference", jnp.float32)
    x, idx, w = group.inputs("uniform", np.float32)

    def step(x, idx, w):
        b = group.hierarchical
        d = hierarchical.dispatch(b, x, idx, w)
        again = hierarchical.dispatch(b, x, handle=d.handle).recv_x
        return hierarchical.combine(b, d.recv_x + again, d.handle, d.recv_topk_weights)

    spec = jax.sharding.PartitionSpec(("host", "gpu"))
    program = jax.jit(jax.shard_map(step, mesh=group.hierarchical.mesh, in_specs=spec,
                                    out_specs=spec))
    per_rank = [a.reshape((-1,) + a.shape[2:]) for a in (x, idx, w)]
    assert collectives_outside_the_ops(jax.make_jaxpr(program)(*per_rank).jaxpr) == []
    # The walk sees through jit and shard_map: a gather of the routing, as the handle's flat
    # send_pos would take, is found.
    gathered = jax.jit(jax.shard_map(lambda i: jax.lax.all_gather(i, ("host", "gpu")),
                                     mesh=group.hierarchical.mesh, in_specs=spec,
                                     out_specs=spec))
    assert collectives_outside_the_ops(jax.make_jaxpr(gathered)(per_rank[1]).jaxpr) == [
        "all_gather"]
