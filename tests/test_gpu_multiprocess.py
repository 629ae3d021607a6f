"""One process per GPU (CUDA IPC peers) against one process driving every GPU.

Each test starts ``python -m jax_ep.launch`` in a subprocess (skipped under a launcher: they
start their own). The GPU suite itself runs under the launcher too, from the device script:
``python -m jax_ep.launch -n 2 -- pytest -m gpu tests/test_normal.py ...``.
"""

import os
import subprocess
import sys
import tempfile
import textwrap

import launching
import ml_dtypes
import numpy as np
import pytest
from conftest import require_gpus
from launching import digest_lines, lines_of

from jax_ep import launch
from jax_ep import testing as oracle

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(bool(os.environ.get(launch.ENV_NUM_PROCESSES)),
                       reason="starts launchers; not run inside one"),
]


def test_two_processes_give_the_bits_of_one():
    """Every op's outputs and a gradient: 2 processes x 1 GPU equal 1 process x 2 GPUs."""
    require_gpus(2)
    single = subprocess.run([sys.executable, str(launching.DIGEST_SCRIPT), "cuda"],
                            env=launching.child_env("gpu"), capture_output=True, text=True,
        errors="replace",
                            timeout=300)
    want = digest_lines(single.stdout, rank=None)
    assert single.returncode == 0 and len(want) == 9, single.stdout + single.stderr[-4000:]
    proc, _ = launching.run_launcher("-n", "2", "--", sys.executable,
                                     str(launching.DIGEST_SCRIPT), "cuda", platform="gpu")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert digest_lines(proc.stdout) == want


def test_nvshmem_transport_gives_the_bits_of_one_process():
    """JAX_EP_PEER_MAPPING=nvshmem (workspaces on NVSHMEM's symmetric heap, peers by nvshmem_ptr
    through NVSHMEM's own peer-to-peer transport): the same bits as 1 process x 2 GPUs."""
    require_gpus(2)
    from jax_ep.backends import cuda as _cuda  # noqa: PLC0415
    from jax_ep.peers import nvshmem as _nvshmem  # noqa: PLC0415

    module, _ = _cuda.load_extension()
    if not module.nvshmem_built():
        pytest.skip("jax_ep was built without NVSHMEM's headers")
    try:
        _nvshmem.library_path()
    except RuntimeError as e:
        pytest.skip(str(e))
    single = subprocess.run([sys.executable, str(launching.DIGEST_SCRIPT), "cuda"],
                            env=launching.child_env("gpu"), capture_output=True, text=True,
        errors="replace",
                            timeout=300)
    want = digest_lines(single.stdout, rank=None)
    assert single.returncode == 0 and len(want) == 9, single.stdout + single.stderr[-4000:]
    # Every process sees both GPUs (--share-gpus): NVSHMEM's peer-to-peer transport looks for
    # the peer's GPU among the visible ones.
    proc, _ = launching.run_launcher("-n", "2", "--share-gpus", "--", sys.executable,
                                     str(launching.DIGEST_SCRIPT), "cuda", platform="gpu",
                                     extra_env={_nvshmem.ENV_MAPPING: "nvshmem"})
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert digest_lines(proc.stdout) == want


# What both processes of a pair on one GPU run: the op tests that need no XLA collective between
# the processes (NCCL refuses two ranks on one GPU, so the low-latency backward, whose weights go
# through XLA's all_to_all, is left out).
PAIR_SUITE = ("test_normal.py", "test_split_chains.py", "test_low_latency_split.py",
              "test_faults.py")
PAIR_SELECTION = "not test_gradients_through_send_and_recv_equal_fused"
# Over the emulated transport the plan kernel's grid shapes (~170k tokens a rank, one proxy
# command a row) outlast a kernel wait's bound; the mapped transport covers them.
PAIR_SELECTION_EMULATED = PAIR_SELECTION + " and not plan_grid_shapes"


@pytest.mark.stress  # ~90 s each on one H200
@pytest.mark.parametrize("hosts", ["one_host", "two_fake_hosts"])
def test_the_op_suite_passes_in_both_processes_of_a_pair_on_one_gpu(hosts):
    """2 ranks on one GPU (launcher --processes-per-gpu 2), each process running the op tests
    (normal ops, fused and split low-latency ops, their chains, adversarial routings of both
    modes): as one host, peers through CUDA IPC; as two fake hosts (--fake-hosts 2), peers
    over the emulated transport, whose host proxies carry every row and signal."""
    require_gpus(1)
    flags, env, selection = (), {}, PAIR_SELECTION
    if hosts == "two_fake_hosts":
        flags += ("--fake-hosts", "2")
        env, selection = launching.device_transport_env("emulated"), PAIR_SELECTION_EMULATED
    assert_op_tests_pass_in_every_process(2, PAIR_SUITE, selection, *flags, extra_env=env)


def assert_op_tests_pass_in_every_process(num_processes, test_files, selection,
                                          *launcher_flags, extra_env=None, skips=True):
    """``num_processes`` processes sharing one GPU (``launcher_flags`` added), each running the
    GPU tests of ``test_files`` that ``selection`` (``-k``) picks: every process passes them
    (with ``skips=False``, skipping none)."""
    n = str(num_processes)
    tests = [str(launching.ROOT / "tests" / name) for name in test_files]
    # Each child names its tests as it starts them (-v): a run cut by the launcher's bound shows
    # where every rank was.
    with tempfile.TemporaryDirectory() as cwd:  # children import the installed jax_ep
        proc, _ = launching.run_launcher(
            "-n", n, "--processes-per-gpu", n, *launcher_flags, "--timeout", "500", "--",
            sys.executable, "-X", "faulthandler", "-m", "pytest", "-v", "-p", "no:cacheprovider",
            "-m", launching.EVERY_GPU_TEST, "-k", selection, *tests, platform="gpu",
            extra_env=extra_env, cwd=cwd, timeout=560)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-4000:]
    for rank in range(num_processes):
        summary = [line for line in lines_of(proc.stdout, rank) if " passed" in line]
        assert summary and "failed" not in summary[-1], (rank, proc.stdout[-6000:])
        assert skips or "skipped" not in summary[-1], (rank, summary[-1])


# What moves data (no sums): equal bits on every backend and process layout (docs/api.md,
# "Determinism").
# Left out: sums (combine, gradient, low-latency combine) may differ by float32 order, and the
# low-latency fp8 cast, which the reference backend leaves to XLA:CPU's conversion (one e4m3
# step off at times: docs/api.md, "FP8 scales").
DATA_MOVEMENT_DIGESTS = ("dispatch_bf16", "dispatch_fp8", "cached_dispatch", "layout",
                         "low_latency_dispatch_bf16")


def _by_name(lines):
    """{name: sha} of ``DIGEST name sha`` lines."""
    return dict(line.split()[1:] for line in lines)


def _digests(proc):
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    lines = digest_lines(proc.stdout)
    assert len(lines) == 9, proc.stdout[-4000:]
    return _by_name(lines)


def test_processes_sharing_one_gpu_move_the_bits_of_the_reference():
    """2 ranks on one GPU (2 processes, launcher --processes-per-gpu 2: kernels take turns):
    the multi-process protocol with CUDA IPC peers and with NVSHMEM peers (2 PEs on one GPU)
    gives identical bits, and moves the reference backend's bits. Runs where 2 GPUs are not
    to be had."""
    require_gpus(1)
    from jax_ep.backends import cuda as _cuda  # noqa: PLC0415
    from jax_ep.peers import nvshmem as _nvshmem  # noqa: PLC0415

    reference = subprocess.run(
        [sys.executable, str(launching.DIGEST_SCRIPT), "reference"], capture_output=True, text=True,
        errors="replace",
        timeout=300, env=launching.child_env(
            "cpu", {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}))
    want = _by_name(digest_lines(reference.stdout, rank=None))
    assert reference.returncode == 0 and len(want) == 9, reference.stderr[-4000:]
    shared = ("-n", "2", "--processes-per-gpu", "2")
    ipc = _digests(launching.run_launcher(*shared, "--", sys.executable,
                                          str(launching.DIGEST_SCRIPT), "cuda",
                                          platform="gpu")[0])
    assert {k: ipc[k] for k in DATA_MOVEMENT_DIGESTS} == {k: want[k] for k in
                                                         DATA_MOVEMENT_DIGESTS}
    module, _ = _cuda.load_extension()
    if not module.nvshmem_built():
        pytest.skip("jax_ep was built without NVSHMEM's headers (the IPC part passed)")
    nvshmem = _digests(launching.run_launcher(
        *shared, "--share-gpus", "--", sys.executable, str(launching.DIGEST_SCRIPT), "cuda",
        platform="gpu", extra_env={_nvshmem.ENV_MAPPING: "nvshmem"})[0])
    assert nvshmem == ipc


# The sums of the digest script (DIGEST_SAVE_DIR), with the dtype each was rounded to.
SUM_DTYPES = {"combine": ml_dtypes.bfloat16, "combine_weights": np.float32,
              "gradient": ml_dtypes.bfloat16, "low_latency_combine": ml_dtypes.bfloat16}


def assert_saved_sums_close(got_dir, want_dir, num_terms):
    """Each saved sum of one layout against another's, per element: both are float32 sums of
    the same terms in orders of their own, each rounded once, so they may differ by two
    roundings and two accumulations (``num_terms`` terms at most)."""
    for name, dtype in SUM_DTYPES.items():
        got, want = (np.load(folder / f"{name}.npy") for folder in (got_dir, want_dir))
        magnitude = np.load(want_dir / f"{name}.magnitude.npy")
        oracle.assert_sums_close(got, want, magnitude, term_rtol=2 * oracle.sum_rtol(num_terms),
                                 out_rtol=2 * oracle.rounding_rtol(dtype), what=name)


def assert_launched_digests_match_the_reference(tmp_path, num_ranks, *launcher_flags,
                                                 extra_env=None, digest_env=None):
    """The digest script on the CUDA kernels as ``num_ranks`` processes sharing one GPU
    (``launcher_flags`` added; ``extra_env`` theirs) moves the bits of the reference backend over
    ``num_ranks`` CPU host devices, and its sums match per element (``digest_env``: both runs')."""
    want_dir, got_dir = tmp_path / "xla", tmp_path / "cuda"
    want_dir.mkdir()
    got_dir.mkdir()
    reference = subprocess.run(
        [sys.executable, str(launching.DIGEST_SCRIPT), "xla"], capture_output=True, text=True,
        errors="replace", timeout=300, env=launching.child_env("cpu", {
            "XLA_FLAGS": f"--xla_force_host_platform_device_count={num_ranks}",
            "DIGEST_SAVE_DIR": str(want_dir), **(digest_env or {})}))
    want = _by_name(digest_lines(reference.stdout, rank=None))
    assert reference.returncode == 0 and len(want) == 9, reference.stderr[-4000:]
    n = str(num_ranks)
    proc, _ = launching.run_launcher(
        "-n", n, "--processes-per-gpu", n, *launcher_flags, "--timeout", "500", "--",
        sys.executable, str(launching.DIGEST_SCRIPT), "cuda", platform="gpu", timeout=560,
        extra_env={"DIGEST_SAVE_DIR": str(got_dir), **(digest_env or {}), **(extra_env or {})})
    got = _digests(proc)
    assert {k: got[k] for k in DATA_MOVEMENT_DIGESTS} == {k: want[k] for k in
                                                         DATA_MOVEMENT_DIGESTS}
    assert_saved_sums_close(got_dir, want_dir, num_terms=num_ranks)


# EP groups past one host's 8 GPUs as processes sharing one GPU (launcher --processes-per-gpu):
# the fast tier runs 4 ranks, the stress tier 16 and 32 (the wide kernels: more than 8 ranks).
@pytest.mark.parametrize("num_ranks", [4, pytest.param(16, marks=pytest.mark.stress),
                                       pytest.param(32, marks=pytest.mark.stress)])
def test_an_ep_group_of_processes_on_one_gpu_matches_the_reference(num_ranks, tmp_path):
    """``num_ranks`` processes on one GPU, one rank each (CUDA IPC peers): every op's
    data-movement bits equal the reference backend's on as many CPU host devices, and its sums
    (combine, low-latency combine, a gradient) match per element."""
    require_gpus(1)
    assert_launched_digests_match_the_reference(tmp_path, num_ranks)


# Hosts x ranks per host, faked on one GPU (launcher --fake-hosts): the fast tier runs 2 x 2,
# the stress tier 2 x 8 and 4 x 8.
@pytest.mark.parametrize(("hosts", "ranks_per_host"), [
    (2, 2), pytest.param(2, 8, marks=pytest.mark.stress),
    pytest.param(4, 8, marks=pytest.mark.stress)])
def test_fake_hosts_over_the_emulated_network_match_the_reference(hosts, ranks_per_host,
                                                                  tmp_path):
    """An EP group across ``hosts`` fake hosts, every row and signal carried by the emulated
    transport's adversarial host proxies (flat puts to every rank): the reference backend's
    data-movement bits, and its sums per element."""
    require_gpus(1)
    assert_launched_digests_match_the_reference(
        tmp_path, hosts * ranks_per_host, "--fake-hosts", str(hosts),
        extra_env=launching.device_transport_env("emulated"))


@pytest.mark.stress
@pytest.mark.parametrize(("hosts", "ranks_per_host"), [(2, 2), (2, 8), (4, 8)])
def test_fake_hosts_over_nvshmem_match_the_reference(hosts, ranks_per_host, tmp_path):
    """An EP group across ``hosts`` fake hosts, one process (PE) per rank sharing one GPU, the
    workspaces on NVSHMEM's symmetric heap and every row and signal an NVSHMEM put (the layout
    of a group across real hosts, which NVSHMEM carries over its network transport there): the
    reference backend's data-movement bits, and its sums per element."""
    require_gpus(1)
    from jax_ep.backends import cuda as _cuda  # noqa: PLC0415
    from jax_ep.peers import nvshmem as _nvshmem  # noqa: PLC0415

    module, _ = _cuda.load_extension()
    assert module.nvshmem_built(), "the GPU machine's build has NVSHMEM's headers"
    _nvshmem.library_path()  # raises, naming what is missing
    assert_launched_digests_match_the_reference(
        tmp_path, hosts * ranks_per_host, "--fake-hosts", str(hosts),
        extra_env={_nvshmem.ENV_MAPPING: "nvshmem",
                   **launching.device_transport_env("nvshmem")})


# The smallest normal-mode window (64 rows) against 512 tokens per rank at 4 ranks: a dispatch
# of capacity 2048 streams about 1,400 received rows through 192 slots in ~15 rounds, a combine
# through 64 slots per source in 16 rounds, senders waiting for credits to reuse slots. The fast
# tier runs it over stores; the stress tier as 2 fake hosts x 2 over the emulated network.
ROUNDS_ENV = {"JAX_EP_NORMAL_WINDOW_ROWS": "64"}
ROUNDS_DIGEST_ENV = {"DIGEST_TOKENS": "512"}


@pytest.mark.parametrize("hosts", [1, pytest.param(2, marks=pytest.mark.stress)])
def test_calls_larger_than_the_window_stream_through_it_in_rounds(hosts, tmp_path):
    """4 ranks as processes sharing one GPU, each call many times its normal-mode window: the
    reference backend's data-movement bits, and its sums per element."""
    require_gpus(1)
    flags, env = (), dict(ROUNDS_ENV)
    if hosts > 1:
        flags = ("--fake-hosts", str(hosts))
        env.update(launching.device_transport_env("emulated"))
    assert_launched_digests_match_the_reference(tmp_path, 4, *flags, extra_env=env,
                                                digest_env=ROUNDS_DIGEST_ENV)


@pytest.mark.stress  # 16 processes on one GPU
def test_adversarial_routings_and_split_halves_at_ep16():
    """16 ranks as processes sharing one GPU, each running the op tests against the NumPy
    oracle: both modes under every routing of the suite (one hot expert, empty ranks, all -1,
    skewed, ...) and the split low-latency halves, through the wide kernels."""
    require_gpus(1)
    assert_op_tests_pass_in_every_process(
        16, ("test_normal.py", "test_low_latency_split.py"),
        "cuda and (test_dispatch_combine_match_oracle or test_split_equals_fused)")


# The hierarchical mode (two groups of the flat ops; its own code runs no collective) on fake
# hosts of processes sharing one GPU, over the emulated network: the fast tier 2 x 2 (dispatch
# and combine under every routing), the stress tier every test at 2 x 2, 2 x 8 and 4 x 8.
@pytest.mark.parametrize(("hosts", "ranks_per_host", "selection"), [
    (2, 2, "cuda and test_dispatch_moves_the_flat_bits"),
    pytest.param(2, 2, "cuda", marks=pytest.mark.stress),
    pytest.param(2, 8, "cuda", marks=pytest.mark.stress),
    pytest.param(4, 8, "cuda", marks=pytest.mark.stress)])
def test_the_hierarchical_mode_on_fake_hosts_matches_the_flat_ops(hosts, ranks_per_host,
                                                                  selection):
    """Each process runs tests/test_hierarchical.py's GPU tests (``selection``) as its rank of
    ``hosts`` fake hosts: the dispatch moves the flat dispatch's bits (every routing, a capacity
    that drops rows, the cached form), the combine sums per host as the oracle does, the
    gradients match the flat ops'."""
    require_gpus(1)
    assert_op_tests_pass_in_every_process(
        hosts * ranks_per_host, ("test_hierarchical.py",), selection, "--fake-hosts", str(hosts),
        extra_env={"HIERARCHICAL_HOSTS": str(hosts),
                   **launching.device_transport_env("emulated")}, skips=False)


def test_cuda_buffer_names_a_process_that_never_joins(tmp_path):
    require_gpus(2)
    script = textwrap.dedent("""
        import sys, time
        import jax, numpy as np
        from jax.sharding import Mesh
        from jax_ep import Buffer, launch
        launch.initialize_from_env()
        devices = jax.devices()  # every process takes part in starting the GPU backend
        if jax.process_index() == 1:
            time.sleep(30)
            sys.exit(0)
        mesh = Mesh(np.array(devices), ("ep",))
        start = time.monotonic()
        try:
            Buffer(mesh, "ep", num_experts=8, hidden=128, max_tokens_per_rank=8, num_topk=2,
                   backend="cuda")
        except RuntimeError as e:
            print(f"error after {time.monotonic() - start:.1f} s: {e}")
    """)
    proc, _ = launching.run_launcher("-n", "2", "--", sys.executable, "-c", script,
                                     platform="gpu", timeout=120, cwd=tmp_path,
                                     extra_env={"JAX_EP_JOIN_TIMEOUT_S": "3"})
    lines = [x for x in lines_of(proc.stdout, 0) if x.startswith("error")]
    assert len(lines) == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "process 1 did not publish" in lines[0] and float(lines[0].split()[2]) < 15, lines


KILLED_SCRIPT = textwrap.dedent("""
    import faulthandler, os, signal, threading, time
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import jax_ep
    from jax_ep import launch
    from jax_ep.peers import ipc
    # JAX ends every process when one dies (fate-sharing); off, the survivors live to report.
    jax.config.update("jax_enable_recoverability", True)
    launch.initialize_from_env()
    from jax_ep import _C_testing
    _C_testing.register_emulated_transport()
    T, H, E, K = 16, 256, 16, 2
    mesh = Mesh(np.array(jax.devices()), ("ep",))
    buf = jax_ep.Buffer(mesh, "ep", num_experts=E, hidden=H, max_tokens_per_rank=T,
                        num_topk=K, backend="cuda", timeout_s=3.0)
    # Every token to two ranks: every rank hears from every rank.
    routing = np.stack([(np.arange(T) % 4) * 4, ((np.arange(T) + 1) % 4) * 4], -1)
    routing = np.broadcast_to(routing.astype(np.int32), (4, T, K))
    idx = jax.make_array_from_callback(routing.shape, NamedSharding(mesh, P("ep")),
                                       lambda index: routing[index])

    def step(i):
        x, w = jnp.ones((T, H), jnp.bfloat16), jnp.ones((T, K), jnp.float32)
        return jax_ep.dispatch(buf, x, i[0], w).recv_x.sum(dtype=jnp.float32)[None]

    program = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
    program = program.lower(idx).compile()
    # Every process compiled before any waits on a peer (the waits are bounded at 3 s).
    ipc.kv_client().wait_at_barrier("compiled", 120_000)
    jax.block_until_ready(program(idx))
    # Every rank has received everything before process 3 dies.
    ipc.kv_client().wait_at_barrier("first_call", 60_000)
    if jax.process_index() == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    # A survivor still in the call later shows where: its stacks every 20 s, and at 15 s whether
    # its kernel's wait ended (the timeout record, host memory: no CUDA call).
    faulthandler.dump_traceback_later(20, repeat=True)
    from jax_ep.backends import cuda as _cuda
    module, _ = _cuda.load_extension()
    def native_threads():
        # Each thread's name, state and kernel wait (e.g. XLA's cuda_stream_monitor, which fails
        # a trapped stream's outputs, or py_xla_callback): what faulthandler's stacks leave out.
        rows = []
        for tid in sorted(os.listdir("/proc/self/task"), key=int):
            try:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    name = f.read().strip()
                with open(f"/proc/self/task/{tid}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
                with open(f"/proc/self/task/{tid}/wchan") as f:
                    wait = f.read().strip() or "-"
            except OSError:
                continue
            rows.append(f"{name}:{state}:{wait}")
        return " ".join(rows)
    def watch():
        time.sleep(15)
        print("at 15 s, timeout records:", module.read_timeouts(buf.buffer_id), flush=True)
        print("at 15 s, threads:", native_threads(), flush=True)
        time.sleep(30)
        print("at 45 s, threads:", native_threads(), flush=True)
    threading.Thread(target=watch, daemon=True).start()
    start = time.monotonic()
    try:
        out = program(idx)
        print(f"enqueued after {time.monotonic() - start:.1f} s", flush=True)
        jax.block_until_ready(out)
        print("the second call returned", flush=True)
    except Exception as e:
        print(f"the second call raised after {time.monotonic() - start:.1f} s:",
              str(e).splitlines()[0][:300], flush=True)
    try:
        buf.check()
    except RuntimeError as e:
        print("reported:", e, flush=True)
    os._exit(0)  # a trapped kernel took this process's CUDA context
""")


@pytest.mark.stress  # 4 processes, ~30 s
def test_a_killed_process_ends_its_peers_bounded_waits_naming_it(tmp_path):
    """4 processes as 2 fake hosts x 2 over the emulated network; process 3 is killed (SIGKILL)
    between two dispatches. The other three's second dispatch ends within its bounded wait (3 s),
    and check() names the dead rank, its host and the phase it was waited for in."""
    require_gpus(1)
    proc, seconds = launching.run_launcher(
        "-n", "4", "--processes-per-gpu", "4", "--fake-hosts", "2", "--grace", "60",
        "--timeout", "200", "--", sys.executable, "-c", KILLED_SCRIPT, platform="gpu",
        timeout=240, cwd=tmp_path, extra_env=launching.device_transport_env("emulated"))
    out = proc.stdout[-6000:] + proc.stderr[-12000:]
    assert proc.returncode != 0 and seconds < 150, out  # the launcher reports the killed one
    # Every survivor's outcome first, in full (pytest cuts a long message that is not a str).
    told = ("the second call", "reported:", "at 15 s", "at 45 s", "enqueued")
    said = {rank: [x for x in lines_of(proc.stdout, rank) if x.startswith(told)]
            for rank in range(3)}
    for rank, lines in said.items():
        why = f"rank {rank}; what each survivor said: {said}\n{out}"
        raised = [x for x in lines if x.startswith("the second call raised after")]
        assert raised and float(raised[0].split()[5]) < 30, why  # "... after 9.4 s: error"
        reported = [x for x in lines if x.startswith("reported:")]
        assert reported and "waited for rank 3 on host " in reported[0], why
        assert "/fake1" in reported[0].split("waited for rank 3 on host ")[1], why
        assert " in " in reported[0].split("waited for rank 3")[1], why
