"""A job whose processes run on two or more hosts: what it can use today.

On a cluster, one process per GPU on every host of the job, every process running the same
command, e.g. under SLURM:

    srun --ntasks-per-node=<GPUs per host> --gpus-per-task=1 --gpu-bind=none \
         python -m pytest -m multihost tests/test_multihost.py

(each process joins the job with ``jax.distributed.initialize()``, which reads it from SLURM or
Open MPI; ``python -m jax_ep.launch`` starts the processes of one host only). With
``JAX_EP_PEER_MAPPING=nvshmem JAX_EP_DEVICE_TRANSPORT=nvshmem`` in every process's environment
the groups across hosts run the CUDA kernels, over NVSHMEM's device API; without them, the
reference backend. On one machine the same tests run under ``python -m jax_ep.launch
--fake-hosts 2`` (tests/test_multiprocess.py does so on CPU devices) and print that their hosts
were fake; with every process on one host they skip, saying so. docs/decisions.md ("Open, and
why it waits") says which of these runs have happened where.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import run_sharded
from jax.sharding import Mesh
from test_normal import (
    assert_dispatch_matches,
    cancelling,
    dispatch_and_combine,
    dispatch_and_combine_rows,
    make_buffer,
    random_x,
)

from jax_ep import hierarchical, settings
from jax_ep import testing as oracle
from jax_ep.backends import gate
from jax_ep.peers import ipc

pytestmark = pytest.mark.multihost

E, K, T, H = 32, 4, 8, 128


def experts(num_ranks):
    """E experts, or one a rank past E ranks (a cluster's group may be larger)."""
    return num_ranks * max(1, E // num_ranks)


@pytest.fixture(scope="module")
def hosts():
    """Host name of every process (jax_ep's names: ``JAX_EP_HOST`` where the launcher fakes
    hosts, else the machine's), after joining the cluster job when no launcher did."""
    try:
        client = ipc.kv_client()  # jax.distributed already joined (the launcher's children)
    except RuntimeError:
        # Before anything touches a device (jax.distributed's rule).
        try:
            jax.distributed.initialize()
        except (ValueError, RuntimeError) as e:  # not inside a SLURM / Open MPI job
            pytest.skip(f"one process and no cluster job to join ({e}); the multihost tests "
                        "need processes on two or more hosts: not run here")
        client = ipc.kv_client()
    client.key_value_set(f"multihost/host/p{jax.process_index()}", ipc.host_name())
    names = {p: client.blocking_key_value_get(f"multihost/host/p{p}", 60_000)
             for p in range(jax.process_count())}
    if len(set(names.values())) < 2:
        pytest.skip(f"all {len(names)} processes run on host {names[0]!r}; the multihost "
                    "tests need two or more hosts: not run here")
    kind = "fake" if os.environ.get("JAX_EP_HOST") else "real"
    print(f"multihost: {kind} hosts {sorted(set(names.values()))}, {jax.process_count()} "
          f"processes, {jax.device_count()} devices")
    return names


def on_gpus():
    return all(d.platform == "gpu" for d in jax.devices())


def devices_by_host(hosts):
    """The devices as ``[host][device of the host]`` (hosts in the order of their first
    process); skips when hosts have different device counts."""
    by_host = {}
    for device in jax.devices():
        by_host.setdefault(hosts[device.process_index], []).append(device)
    groups = list(by_host.values())
    if len({len(g) for g in groups}) != 1:
        pytest.skip(f"hosts have different device counts {[len(g) for g in groups]}")
    return groups


def crosses_hosts():
    """Whether the cuda backend reaches ranks on other hosts here: GPUs, and a device transport
    that crosses hosts (NVSHMEM's device API; on fake hosts also the emulated network)."""
    return on_gpus() and settings.value("JAX_EP_DEVICE_TRANSPORT") in ("nvshmem", "emulated")


def test_ep_group_spanning_hosts_runs_where_its_transport_reaches(hosts):
    """One EP group over every device of every host: backend="auto" picks the CUDA kernels
    where the device transport crosses hosts (docs/process_models.md, "What spans hosts"), else
    the reference backend, saying why on GPUs, with backend="cuda" refused naming the settings.
    Either way the results equal the oracle's."""
    rng = np.random.default_rng(0)  # the same data in every process
    mesh = Mesh(np.array(jax.devices()), ("ep",))
    R = mesh.shape["ep"]
    buf = make_buffer("auto", mesh, H, T, num_experts=experts(R))
    assert buf.backend == ("cuda" if crosses_hosts() else "reference"), buf.backend_reasons
    if on_gpus() and buf.backend == "reference":
        assert "spans hosts" in " ".join(buf.backend_reasons), buf.backend_reasons
    idx, w = oracle.make_routing("uniform", rng, R, T, experts(R), K)
    x = random_x(rng, (R, T, H), np.float32)
    out = run_sharded(mesh, dispatch_and_combine(buf, x, idx, w), x, idx, w)
    assert_dispatch_matches(out, oracle.dispatch(x, idx, w, experts(R)), T)
    if buf.backend == "cuda":
        return
    with pytest.raises((ValueError, RuntimeError)) as refused:
        make_buffer("cuda", mesh, H, T, num_experts=experts(R))
    message = str(refused.value)
    # On GPUs the first check that fails names the group spanning hosts and the settings that
    # let it cross them, or the device checks of the gate; on CPU the devices' platform.
    reasons = (gate.ACROSS_HOSTS_SETTINGS, "cannot run on these devices") if on_gpus() else (
        "to be a CUDA GPU",)
    assert "backend='cuda'" in message and any(r in message for r in reasons), message


def test_hierarchical_group_across_hosts_moves_the_flat_bits(hosts):
    """The hierarchical mode over (host, GPU of the host), backend="auto" (the CUDA kernels where
    the device transport crosses hosts): the flat dispatch's results bit for bit, and a combine
    that sums per host (bf16 partial sums) as the oracle does."""
    rng = np.random.default_rng(3)
    mesh = Mesh(np.array(devices_by_host(hosts)), ("host", "gpu"))
    R = mesh.devices.size
    hbuf = hierarchical.HierarchicalBuffer(mesh, "host", "gpu", num_experts=experts(R), hidden=H,
                                           max_tokens_per_rank=T, num_topk=K,
                                           dtype=jnp.bfloat16, backend="auto")
    assert hbuf.across.backend == ("cuda" if crosses_hosts() else "reference"), (
        hbuf.across.backend_reasons)
    idx, w = oracle.make_routing("uniform", rng, R, T, experts(R), K)
    x = random_x(rng, (R, T, H), jnp.bfloat16)

    def step(x, idx, w):
        d = hierarchical.dispatch(hbuf, x, idx, w)
        return d, hierarchical.combine(hbuf, d.recv_x, d.handle)[0]

    d, y = run_sharded(mesh, step, x, idx, w, axis="gpu")
    for r, want in enumerate(oracle.dispatch(x, idx, w, experts(R))):
        np.testing.assert_array_equal(d.recv_x[r].view(np.uint16),
                                      want["recv_x"].view(np.uint16))
        for name in ("recv_topk_idx", "recv_topk_weights", "num_recv_tokens",
                     "num_recv_tokens_per_expert"):
            np.testing.assert_array_equal(getattr(d, name)[r], want[name], name)
        np.testing.assert_array_equal(d.handle.recv_src[r], want["recv_src"])
    rank_hosts = [r // mesh.shape["gpu"] for r in range(R)]
    want_y = oracle.combine_in_order(d.recv_x, d.handle.recv_src, T, rank_hosts)
    np.testing.assert_array_equal(y.view(np.uint16), want_y.view(np.uint16))


def test_ep_groups_inside_hosts_with_data_parallel_across_them(hosts):
    """Mesh ("data", "ep"): one EP group per host, data-parallel across hosts (the layout the
    README recommends today): backend="auto" gives the CUDA kernels on GPUs, and every group's
    results equal the oracle's."""
    rng = np.random.default_rng(1)
    mesh = Mesh(np.array(devices_by_host(hosts)), ("data", "ep"))
    D, R = mesh.shape["data"], mesh.shape["ep"]
    buf = make_buffer("auto", mesh, H, T, num_experts=experts(R))
    assert buf.backend == ("cuda" if on_gpus() else "reference"), (buf.backend, buf.backend_reasons)
    idx, w = oracle.make_routing("uniform", rng, D * R, T, experts(R), K)
    x = random_x(rng, (D * R, T, H), np.float32)
    d, y, y_w = run_sharded(mesh, dispatch_and_combine(buf, x, idx, w), x, idx, w)
    for g in range(D):
        group = slice(g * R, (g + 1) * R)
        sub = jax.tree.map(lambda a, s=group: a[s], (d, y, y_w))
        assert_dispatch_matches(sub, oracle.dispatch(x[group], idx[group], w[group], experts(R)),
                                T)


def test_combine_across_hosts_sums_per_host(hosts):
    """One EP group over every device of every host: the reference backend knows the host of
    each rank and sums a combine per host, each host's partial sum rounded to bfloat16 before
    the sum over hosts (docs/api.md, "combine"): bfloat16 rows that cancel give the bits of
    ``oracle.combine_in_order`` with those hosts, unlike the flat sum's, within the per-element
    tolerance with the hosts."""
    rng = np.random.default_rng(2)  # the same data in every process
    mesh = Mesh(np.array(jax.devices()), ("ep",))
    R = mesh.shape["ep"]
    buf = make_buffer("reference", mesh, H, T, jnp.bfloat16, num_experts=experts(R))
    names = [hosts[d.process_index] for d in mesh.devices.flat]
    numbers = {name: i for i, name in enumerate(dict.fromkeys(names))}
    assert buf._rank_hosts == tuple(numbers[n] for n in names), buf._rank_hosts
    idx, w = oracle.make_routing("uniform", rng, R, T, experts(R), K)
    x = random_x(rng, (R, T, H), jnp.bfloat16)
    z = cancelling(rng, (R, R * T, H), jnp.bfloat16)
    src, y, combined = run_sharded(mesh, dispatch_and_combine_rows(buf), x, idx, w, z)
    want = oracle.combine_in_order(y, src, T, buf._rank_hosts)
    np.testing.assert_array_equal(combined.view(np.uint8), want.view(np.uint8))
    assert (combined != oracle.combine_in_order(y, src, T)).any()
    oracle.assert_combine_close(combined, y, src, T, rank_hosts=buf._rank_hosts)
