"""A job whose processes run on two or more hosts: what it can use today.

On a cluster, one process per GPU on every host of the job, every process running the same
command, e.g. under SLURM:

    srun --ntasks-per-node=<GPUs per host> --gpus-per-task=1 --gpu-bind=none \
         python -m pytest -m multihost tests/test_multihost.py

(each process joins the job with ``jax.distributed.initialize()``, which reads it from SLURM or
Open MPI; ``python -m jax_ep.launch`` starts the processes of one host only). On one machine the
same tests run under ``python -m jax_ep.launch --fake-hosts 2`` (tests/test_multiprocess.py does
so on CPU devices) and print that their hosts were fake; with every process on one host they
skip, saying so. README, "Several hosts", says which of these runs happened where.
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

from jax_ep import testing as oracle
from jax_ep.peers import ipc

pytestmark = pytest.mark.multihost

E, K, T, H = 32, 4, 8, 128


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


def test_ep_group_spanning_hosts_runs_on_the_reference_backend(hosts):
    """One EP group over every device of every host: backend="auto" picks the reference
    backend (on GPUs saying that the group spans hosts), its results equal the oracle's, and
    backend="cuda" is refused, naming why."""
    rng = np.random.default_rng(0)  # the same data in every process
    mesh = Mesh(np.array(jax.devices()), ("ep",))
    R = mesh.shape["ep"]
    buf = make_buffer("auto", mesh, H, T)
    assert buf.backend == "reference", buf.backend
    if on_gpus():  # why: the group spans hosts (or, past 8 ranks, the rank limit comes first)
        said = " ".join(buf.backend_reasons)
        assert "spans hosts" in said or "ranks" in said, buf.backend_reasons
    idx, w = oracle.make_routing("uniform", rng, R, T, E, K)
    x = random_x(rng, (R, T, H), np.float32)
    out = run_sharded(mesh, dispatch_and_combine(buf, x, idx, w), x, idx, w)
    assert_dispatch_matches(out, oracle.dispatch(x, idx, w, E), T)
    with pytest.raises((ValueError, RuntimeError)) as refused:
        make_buffer("cuda", mesh, H, T)
    message = str(refused.value)
    # On GPUs the first check that fails names the group spanning hosts, or the rank limit
    # (more than 8 ranks), or the device checks of the gate; on CPU the devices' platform.
    reasons = ("spans hosts", "at most", "cannot run on these devices") if on_gpus() else (
        "to be a CUDA GPU",)
    assert "backend='cuda'" in message and any(r in message for r in reasons), message


def test_ep_groups_inside_hosts_with_data_parallel_across_them(hosts):
    """Mesh ("data", "ep"): one EP group per host, data-parallel across hosts (the layout the
    README recommends today): backend="auto" gives the CUDA kernels on GPUs, and every group's
    results equal the oracle's."""
    rng = np.random.default_rng(1)
    by_host = {}
    for device in jax.devices():
        by_host.setdefault(hosts[device.process_index], []).append(device)
    groups = list(by_host.values())
    if len({len(g) for g in groups}) != 1:
        pytest.skip(f"hosts have different device counts {[len(g) for g in groups]}")
    mesh = Mesh(np.array(groups), ("data", "ep"))
    D, R = mesh.shape["data"], mesh.shape["ep"]
    buf = make_buffer("auto", mesh, H, T)
    assert buf.backend == ("cuda" if on_gpus() else "reference"), (buf.backend, buf.backend_reasons)
    idx, w = oracle.make_routing("uniform", rng, D * R, T, E, K)
    x = random_x(rng, (D * R, T, H), np.float32)
    d, y, y_w = run_sharded(mesh, dispatch_and_combine(buf, x, idx, w), x, idx, w)
    for g in range(D):
        group = slice(g * R, (g + 1) * R)
        sub = jax.tree.map(lambda a, s=group: a[s], (d, y, y_w))
        assert_dispatch_matches(sub, oracle.dispatch(x[group], idx[group], w[group], E), T)


def test_combine_across_hosts_sums_per_host(hosts):
    """One EP group over every device of every host: the reference backend knows the host of
    each rank and sums a combine per host, each host's partial sum rounded to bfloat16 before
    the sum over hosts (docs/api.md, "combine"): bfloat16 rows that cancel give the bits of
    ``oracle.combine_in_order`` with those hosts, unlike the flat sum's, within the per-element
    tolerance with the hosts."""
    rng = np.random.default_rng(2)  # the same data in every process
    mesh = Mesh(np.array(jax.devices()), ("ep",))
    R = mesh.shape["ep"]
    buf = make_buffer("reference", mesh, H, T, jnp.bfloat16)
    names = [hosts[d.process_index] for d in mesh.devices.flat]
    numbers = {name: i for i, name in enumerate(dict.fromkeys(names))}
    assert buf._rank_hosts == tuple(numbers[n] for n in names), buf._rank_hosts
    idx, w = oracle.make_routing("uniform", rng, R, T, E, K)
    x = random_x(rng, (R, T, H), jnp.bfloat16)
    z = cancelling(rng, (R, R * T, H), jnp.bfloat16)
    src, y, combined = run_sharded(mesh, dispatch_and_combine_rows(buf), x, idx, w, z)
    want = oracle.combine_in_order(y, src, T, buf._rank_hosts)
    np.testing.assert_array_equal(combined.view(np.uint8), want.view(np.uint8))
    assert (combined != oracle.combine_in_order(y, src, T)).any()
    oracle.assert_combine_close(combined, y, src, T, rank_hosts=buf._rank_hosts)
