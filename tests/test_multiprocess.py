"""The launcher (``python -m jax_ep.launch``) and the reference backend across processes (CPU).

Each test runs the launcher in a subprocess; the children are fresh interpreters. Under the
launcher itself (``JAX_EP_NUM_PROCESSES`` set) these tests skip: they start launchers.
"""

import os
import signal
import subprocess
import sys
import textwrap
import time

import jax
import launching
import multiprocess_digest
import pytest
from launching import digest_lines, lines_of

from jax_ep import launch

pytestmark = pytest.mark.skipif(bool(os.environ.get(launch.ENV_NUM_PROCESSES)),
                                reason="starts launchers; not run inside one")


def run_launcher(*args, timeout=300, extra_env=None):
    # The children's XLA:CPU at -O0 as in this process (conftest): they compile every op and run
    # it once or twice (the digest script: ~20% less time). A test's own XLA_FLAGS replace it.
    env = {"XLA_FLAGS": "--xla_backend_optimization_level=0", **(extra_env or {})}
    return launching.run_launcher(*args, platform="cpu", timeout=timeout, extra_env=env)


def test_children_get_the_documented_environment():
    script = textwrap.dedent("""
        import os
        for k in ("JAX_EP_COORDINATOR", "JAX_EP_NUM_PROCESSES", "JAX_EP_PROCESS_ID",
                  "XLA_FLAGS"):
            print(f"{k}={os.environ.get(k)}")
        import sys; print("to stderr", file=sys.stderr)
    """)
    proc, _ = run_launcher("-n", "3", "--devices-per-process", "2",
                           "--coordinator", "127.0.0.1:12345", "--", sys.executable, "-c", script,
                           timeout=60, extra_env={"XLA_FLAGS": "--xla_dump_to=/tmp/x "
                                                  "--xla_force_host_platform_device_count=8"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for rank in range(3):
        got = dict(line.split("=", 1) for line in lines_of(proc.stdout, rank))
        assert got["JAX_EP_COORDINATOR"] == "127.0.0.1:12345"
        assert got["JAX_EP_NUM_PROCESSES"] == "3"
        assert got["JAX_EP_PROCESS_ID"] == str(rank)
        # the launcher's device count replaces the inherited one; other flags stay
        assert got["XLA_FLAGS"] == "--xla_dump_to=/tmp/x --xla_force_host_platform_device_count=2"
        assert lines_of(proc.stderr, rank) == ["to stderr"]


def test_gpu_slices_and_default_coordinator():
    envs = launch.child_environments(2, "h:1", 2, environ={"CUDA_VISIBLE_DEVICES": "4,5,6,7"})
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["4,5", "6,7"]
    assert "xla_force_host_platform_device_count" not in envs[0].get("XLA_FLAGS", "")
    envs = launch.child_environments(4, "h:1", environ={"CUDA_VISIBLE_DEVICES": "0,1,2,3"})
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["0", "1", "2", "3"]
    with pytest.raises(ValueError, match="need 6 GPUs, 4 visible"):
        launch.child_environments(3, "h:1", 2, environ={"CUDA_VISIBLE_DEVICES": "0,1,2,3"})
    envs = launch.child_environments(2, "h:1", 4, platform="cpu",
                                     environ={"CUDA_VISIBLE_DEVICES": "0,1"})
    assert envs[1]["XLA_FLAGS"] == "--xla_force_host_platform_device_count=4"
    assert envs[1]["CUDA_VISIBLE_DEVICES"] == "0,1"  # untouched: JAX_PLATFORMS=cpu rules
    assert envs[1]["JAX_PLATFORMS"] == "cpu"
    host, port = f"127.0.0.1:{launch.free_port()}".rsplit(":", 1)
    assert host == "127.0.0.1" and 0 < int(port) < 65536


def test_shared_gpus_give_local_device_ids():
    """--share-gpus: every child sees every GPU and takes its K of them through
    jax.distributed's local_device_ids (ordinals among the visible GPUs)."""
    envs = launch.child_environments(2, "h:1", 2, environ={"CUDA_VISIBLE_DEVICES": "4,5,6,7"},
                                     share_gpus=True)
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["4,5,6,7"] * 2
    assert [e[launch.ENV_LOCAL_DEVICE_IDS] for e in envs] == ["0,1", "2,3"]
    cpu = launch.child_environments(2, "h:1", 2, platform="cpu", share_gpus=True,
                                    environ={"CUDA_VISIBLE_DEVICES": "0,1"})
    assert launch.ENV_LOCAL_DEVICE_IDS not in cpu[0]  # host devices: nothing to share


def test_processes_per_gpu_share_each_gpu():
    """--processes-per-gpu P: process i runs on GPU i // P with a 1/P share of its memory."""
    envs = launch.child_environments(4, "h:1", environ={"CUDA_VISIBLE_DEVICES": "6,7"},
                                     processes_per_gpu=2)
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["6", "6", "7", "7"]
    assert {e["XLA_PYTHON_CLIENT_MEM_FRACTION"] for e in envs} == {"0.350"}
    shared = launch.child_environments(2, "h:1", environ={"CUDA_VISIBLE_DEVICES": "3"},
                                       share_gpus=True, processes_per_gpu=2)
    assert [e["CUDA_VISIBLE_DEVICES"] for e in shared] == ["3", "3"]
    assert [e[launch.ENV_LOCAL_DEVICE_IDS] for e in shared] == ["0", "0"]
    mine = launch.child_environments(2, "h:1", processes_per_gpu=2,
                                     environ={"CUDA_VISIBLE_DEVICES": "0",
                                              "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.2"})
    assert mine[1]["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.2"  # an explicit share is kept
    with pytest.raises(ValueError, match="need 2 GPUs, 1 visible"):
        launch.child_environments(3, "h:1", environ={"CUDA_VISIBLE_DEVICES": "0"},
                                  processes_per_gpu=2)
    with pytest.raises(ValueError, match="one GPU"):
        launch.child_environments(2, "h:1", 2, environ={"CUDA_VISIBLE_DEVICES": "0,1"},
                                  processes_per_gpu=2)
    with pytest.raises(ValueError, match="needs visible GPUs"):
        launch.child_environments(2, "h:1", platform="cpu", processes_per_gpu=2)


def test_processes_sharing_a_gpu_ask_for_no_more_connections_than_its_channels_hold():
    """16 processes on one GPU that each asked for 32 connections left 4 without CUDA: the
    launcher lowers the ask to what P contexts fit, keeps a smaller one, and never goes below
    CUDA's default."""
    def connections(p, asked):
        environ = {"CUDA_VISIBLE_DEVICES": "0", **({} if asked is None else
                                                   {"CUDA_DEVICE_MAX_CONNECTIONS": asked})}
        envs = launch.child_environments(p, "h:1", processes_per_gpu=p, environ=environ)
        return {e.get("CUDA_DEVICE_MAX_CONNECTIONS") for e in envs}

    assert connections(16, "32") == {"20"}
    assert connections(32, "32") == {"8"}
    assert connections(4, "32") == {"32"}
    assert connections(16, "4") == {"4"}
    assert connections(16, None) == {None}
    # Within the budget, down to CUDA's default (at which 32 processes started on an H100).
    assert all(p * (launch.max_connections(p) + launch.CHANNELS_PER_CONTEXT)
               <= launch.GPU_CHANNELS for p in (2, 4, 8, 16))


def test_initialize_from_env_without_variables(monkeypatch):
    monkeypatch.delenv(launch.ENV_NUM_PROCESSES, raising=False)
    assert launch.initialize_from_env() is False
    monkeypatch.setenv(launch.ENV_NUM_PROCESSES, "2")
    monkeypatch.delenv(launch.ENV_COORDINATOR, raising=False)
    with pytest.raises(ValueError, match="JAX_EP_COORDINATOR"):
        launch.initialize_from_env()


def test_failure_propagates_and_terminates_the_others(tmp_path):
    pid_file = tmp_path / "sleeper.pid"
    script = textwrap.dedent(f"""
        import os, sys, time
        if os.environ["JAX_EP_PROCESS_ID"] == "1":
            time.sleep(0.5)
            print("failing", flush=True)
            sys.exit(3)
        open({str(pid_file)!r}, "w").write(str(os.getpid()))
        time.sleep(120)
    """)
    proc, elapsed = run_launcher("-n", "2", "--grace", "1", "--",
                                 sys.executable, "-c", script, timeout=60)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert elapsed < 30, elapsed
    assert "[1] failing" in proc.stdout
    assert "process 1 exited with 3" in proc.stderr
    sleeper = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(sleeper, 0)


def test_timeout_terminates_everything():
    proc, elapsed = run_launcher("-n", "2", "--timeout", "2", "--grace", "1", "--",
                                 sys.executable, "-c", "import time; time.sleep(60)", timeout=60)
    assert proc.returncode == launch.TIMEOUT_EXIT_CODE, proc.stderr
    assert elapsed < 30, elapsed
    assert "timeout after 2 s" in proc.stderr


def test_children_that_ignore_sigterm_end_when_the_launchers_reader_is_gone(tmp_path):
    """As when a bounded run kills the launcher's parent: its output pipes have no reader, the
    children ignore SIGTERM (JAX's preemption notifier takes it) and keep printing. The
    launcher's own SIGTERM still ends every child, by SIGKILL after the grace."""
    script = textwrap.dedent(f"""
        import os, signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        open(os.path.join({str(tmp_path)!r}, os.environ["JAX_EP_PROCESS_ID"]), "w").write(
            str(os.getpid()))
        while True:
            try:
                print("x" * 200, flush=True)
            except OSError:  # no reader: live on, as a child blocked in a kernel would
                pass
            time.sleep(0.001)
    """)
    launcher = subprocess.Popen(
        [sys.executable, "-m", "jax_ep.launch", "--platform", "cpu", "-n", "2", "--grace", "1",
         "--", sys.executable, "-c", script], cwd=launching.ROOT,
        env=launching.child_env("cpu"), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while len(list(tmp_path.iterdir())) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    pids = [int(f.read_text()) for f in tmp_path.iterdir()]
    assert len(pids) == 2, "the children did not start"
    launcher.stdout.close()  # the reader is gone
    launcher.stderr.close()
    time.sleep(0.5)
    launcher.send_signal(signal.SIGTERM)
    launcher.wait(timeout=30)
    alive = []
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)  # leaves nothing behind when the launcher failed
            alive.append(pid)
        except ProcessLookupError:
            pass
    assert not alive, f"children {alive} outlived the launcher"


def test_reference_backend_across_two_processes():
    """2 processes x 4 CPU devices, one mesh of 8: every gradient test vs the oracle (the ops
    themselves across processes: the digests below, and the multihost suite's oracle checks)."""
    script = textwrap.dedent("""
        import sys
        import jax, pytest
        from jax_ep import launch
        assert launch.initialize_from_env()
        print("devices:", jax.process_count(), jax.device_count(), jax.local_device_count())
        sys.exit(pytest.main(sys.argv[1:]))  # conftest's initialize_from_env is then a no-op
    """)
    proc, _ = run_launcher(
        "-n", "2", "--devices-per-process", "4", "--timeout", "240", "--",
        sys.executable, "-c", script, "-q", "-p", "no:cacheprovider", "tests/test_gradients.py",
        timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    for rank in range(2):
        lines = lines_of(proc.stdout, rank)
        assert "devices: 2 8 4" in lines, out[-6000:]  # one mesh of 8 spans both processes
        summary = [line for line in lines if " passed" in line]
        assert summary and "failed" not in summary[-1] and "error" not in summary[-1], out[-6000:]
        assert "3 passed" in summary[-1], summary  # the 3 gradient tests, no skips


def test_two_processes_give_the_bits_of_one(capsys):
    """Every op's outputs (and a gradient) on fixed inputs: 2 processes x 2 CPU devices equal
    1 process x 4 devices (this one's) bit for bit (tests/multiprocess_digest.py)."""
    multiprocess_digest.main("reference", devices=jax.devices("cpu")[:4])
    single = digest_lines(capsys.readouterr().out, rank=None)
    assert len(single) == 9, single
    proc, _ = run_launcher("-n", "2", "--devices-per-process", "2", "--",
                           sys.executable, str(launching.DIGEST_SCRIPT), "reference", timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert digest_lines(proc.stdout) == single


def test_a_failed_process_leaves_at_once_and_the_launcher_ends_its_peer():
    """The digest script's failed process exits at once (no wait for its peer in
    jax.distributed's shutdown), so the launcher ends the other, which waits in the first
    program for it, after --grace: a caught protocol mutant's run (tests/test_device_transport.py)
    then costs seconds, not the launcher's --timeout. (Here on CPU the peer would give up by
    itself after 30 s, gloo's wait for the failed process, and both exit then.)"""
    proc, seconds = run_launcher("-n", "2", "--devices-per-process", "2", "--timeout", "90",
                                 "--grace", "1", "--", sys.executable,
                                 str(launching.DIGEST_SCRIPT), "reference", "normal",
                                 extra_env={"DIGEST_FAIL_PROCESS": "1"}, timeout=150)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "fails on purpose" in proc.stdout + proc.stderr
    assert seconds < 25, f"{seconds:.0f} s: the failed process did not leave at once"


PROTOCOL_SCRIPT = textwrap.dedent("""
    import os, sys, time
    import jax, numpy as np
    from jax.sharding import Mesh
    from jax_ep import Buffer, launch
    from jax_ep.peers import ipc as _ipc
    assert launch.initialize_from_env()
    me = jax.process_index()
    mesh = Mesh(np.array(jax.devices()), ("ep",))
    experts = 16 if (sys.argv[1] == "mismatch" and me == 1) else 8
    buf = Buffer(mesh, "ep", num_experts=experts, hidden=128, max_tokens_per_rank=4, num_topk=2,
                 backend="auto" if sys.argv[1] == "auto" else "reference")
    if sys.argv[1] == "auto":
        print("backend", buf.backend)
        print("host", _ipc.host_name())  # the name this process gave the others
        sys.exit(0)
    if sys.argv[1] == "absent" and me == 1:
        # Never publishes: leaves once process 0 has timed out waiting for it.
        _ipc.kv_client().blocking_key_value_get("test/reported", 60_000)
        sys.exit(0)
    start = time.monotonic()
    try:
        _ipc.check_same_configuration(buf)
        print("agreed")
    except RuntimeError as e:
        print(f"error after {time.monotonic() - start:.1f} s: {e}")
    if sys.argv[1] == "absent":
        _ipc.kv_client().key_value_set("test/reported", "1")
""")


def test_processes_agree_on_the_settings_that_shape_a_workspace(monkeypatch):
    """The configuration every process of a Buffer must share includes its device transport
    and its normal-mode window (JAX_EP_NORMAL_WINDOW_ROWS), which size and lay out the
    workspaces the ranks address in one another."""
    from conftest import ep_mesh  # noqa: PLC0415

    from jax_ep import Buffer  # noqa: PLC0415
    from jax_ep.peers import ipc as _ipc  # noqa: PLC0415

    monkeypatch.setenv("JAX_EP_NORMAL_WINDOW_ROWS", "128")
    buf = Buffer(ep_mesh("reference"), "ep", num_experts=8, hidden=128, max_tokens_per_rank=4,
                 num_topk=2, backend="reference")
    config = _ipc.configuration(buf)
    assert config["normal_window_rows"] == 128
    assert config["device_transport"] == buf.device_transport


def test_mismatched_configuration_is_named():
    proc, _ = run_launcher("-n", "2", "--devices-per-process", "2", "--",
                           sys.executable, "-c", PROTOCOL_SCRIPT, "mismatch", timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for rank in range(2):
        (line,) = [x for x in lines_of(proc.stdout, rank) if x.startswith(("error", "agreed"))]
        assert "num_experts=" in line and "every process must create the same Buffers" in line


def test_process_that_never_joins_is_named_within_the_timeout():
    proc, _ = run_launcher("-n", "2", "--devices-per-process", "2", "--",
                           sys.executable, "-c", PROTOCOL_SCRIPT, "absent", timeout=120,
                           extra_env={"JAX_EP_JOIN_TIMEOUT_S": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (line,) = [x for x in lines_of(proc.stdout, 0) if x.startswith(("error", "agreed"))]
    assert "process 1 did not publish 'config' within 1 s" in line, line
    assert float(line.split()[2]) < 5, line


def test_auto_backend_agrees_across_processes():
    """backend="auto" on a mesh of two processes, each a host of its own (``--fake-hosts 2``):
    both gather hosts and choices (no process waits for a key another never publishes), each
    under its own fake host name, and pick the same backend."""
    proc, _ = run_launcher("-n", "2", "--devices-per-process", "2", "--fake-hosts", "2", "--",
                           sys.executable, "-c", PROTOCOL_SCRIPT, "auto", timeout=120,
                           extra_env={"JAX_EP_JOIN_TIMEOUT_S": "20"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for rank in range(2):
        lines = lines_of(proc.stdout, rank)
        assert "backend reference" in lines, proc.stdout
        host = next(line for line in lines if line.startswith("host "))
        assert host.endswith(f"/fake{rank}"), host


def test_fake_hosts_group_consecutive_processes():
    """--fake-hosts H: H groups of N/H consecutive processes, one host name per group for jax_ep
    and for NCCL; H must divide N."""
    envs = launch.child_environments(4, "h:1", platform="cpu", fake_hosts=2)
    names = [e[launch.ENV_HOST] for e in envs]
    assert names[0] == names[1] != names[2] == names[3], names
    assert names[0].endswith("/fake0") and names[2].endswith("/fake1"), names
    assert [e["NCCL_HOSTID"] for e in envs] == names
    assert all(launch.ENV_HOST not in e for e in launch.child_environments(2, "h:1",
                                                                           platform="cpu"))
    for bad in (0, 3, 5):
        with pytest.raises(ValueError, match="--fake-hosts must divide"):
            launch.child_environments(4, "h:1", platform="cpu", fake_hosts=bad)


def test_multihost_suite_on_fake_hosts():
    """tests/test_multihost.py (the real-cluster tests, ``-m multihost``) on 2 processes
    under ``--fake-hosts 2``: they run, and say that their hosts were fake."""
    proc, _ = run_launcher("-n", "2", "--devices-per-process", "4", "--fake-hosts", "2",
                           "--timeout", "200", "--", sys.executable, "-m", "pytest", "-q", "-s",
                           "-p", "no:cacheprovider", "-m", "multihost", "tests/test_multihost.py",
                           timeout=240, extra_env={"JAX_EP_JOIN_TIMEOUT_S": "60"})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    for rank in range(2):
        lines = lines_of(proc.stdout, rank)
        assert any(line.startswith("multihost: fake hosts") for line in lines), out[-6000:]
        summary = [line for line in lines if " passed" in line]
        assert summary and summary[-1].startswith("4 passed"), out[-6000:]


def test_multihost_suite_on_one_host_skips_saying_so():
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                           "-m", "multihost", "tests/test_multihost.py"],
                          cwd=launching.ROOT, capture_output=True, text=True, timeout=120,
                          env=launching.child_env("cpu", None))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "4 skipped" in out, out[-3000:]
    assert "not run here" in out, out[-3000:]
