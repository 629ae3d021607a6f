"""The ops over a device transport (JAX_EP_DEVICE_TRANSPORT): the put-protocol kernels
written for peers without a peer mapping (low-latency mode), and the normal-mode kernels' transport
path, under the FFI ops.

On CPU: the setting reaches the Buffer, the workspace grows by the transports' areas, and what a
transport does not carry is refused by name. On a GPU: the low-latency op suite (fused ops, split
halves and their chains, adversarial routings) and the normal-mode suite (its ops against the
oracle, adversarial routings) pass over each transport, two processes on one GPU faked as two
hosts give the same bits under every seed of the emulator (and the reference's, where only data
moves), and the emulator catches every protocol mutant of the low-latency kernels there.
"""

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import jax.numpy as jnp
import launching
import pytest
from conftest import ep_mesh, require_gpus

import jax_ep
from jax_ep import settings
from jax_ep.backends import cuda

TESTS = Path(__file__).resolve().parent
# What runs over each transport in a child process: the fused low-latency ops, the adversarial
# routings (invalid ids, repeated experts: check()'s counters), the split halves and their
# chains (16 pairs, fused calls and XLA work between the halves).
SUITE = ("test_low_latency.py", "test_faults.py", "test_low_latency_split.py",
         "test_split_chains.py")
# The normal mode's: its ops against the oracle (dispatch, cached dispatch, combine, layout, fp8,
# capacity overflow, invalid ids, changing T, two Buffers) and the adversarial routings.
NORMAL_SUITE = ("test_normal.py", "test_faults.py")
# Outputs of tests/multiprocess_digest.py's parts.
NORMAL_DIGESTS = 6
LOW_LATENCY_DIGESTS = 3


def make_buffer(backend, low_latency=True):
    return jax_ep.Buffer(ep_mesh(backend), "ep", num_experts=8, hidden=256, max_tokens_per_rank=8,
                         num_topk=2, dtype=jnp.bfloat16, low_latency=low_latency,
                         backend=backend)


def test_the_setting_reaches_every_buffer(monkeypatch):
    for transport in ("emulated", "nvshmem"):
        monkeypatch.setenv("JAX_EP_DEVICE_TRANSPORT", transport)
        assert make_buffer("reference").device_transport == transport
        assert make_buffer("reference", low_latency=False).device_transport == transport
    monkeypatch.setenv("JAX_EP_DEVICE_TRANSPORT", "rdma")
    with pytest.raises(ValueError, match="JAX_EP_DEVICE_TRANSPORT"):
        make_buffer("reference")
    monkeypatch.setenv("JAX_EP_DEVICE_TRANSPORT", "mapped")
    monkeypatch.setenv("JAX_EP_EMULATOR_SEED", "-1")
    with pytest.raises(ValueError, match="JAX_EP_EMULATOR_SEED"):
        settings.value("JAX_EP_EMULATOR_SEED")


def test_the_reference_backend_reports_no_transport_errors():
    buf = make_buffer("reference")
    assert buf.errors()["transport"] == []
    buf.check()


@pytest.mark.usefixtures("extension")  # conftest's rule for a missing _C
def test_the_workspace_holds_the_transports_area():
    module, reason = cuda.load_extension()
    if module is None:
        pytest.skip(f"the CUDA extension is not built here: {reason}")

    def workspace(low_latency, transport):
        config = cuda.buffer_config(
            module, num_ranks=2, num_experts=8, hidden=256, max_tokens_per_rank=8, num_topk=2,
            capacity=16, dtype_bytes=2, low_latency=low_latency, timeout_s=10.0,
            device_transport=transport)
        return module.workspace_bytes(config)

    # the low-latency kernels' area and the normal mode's send region, whatever performs the puts
    stores, mapped, emulated, nvshmem = (workspace(True, t) for t in range(4))
    assert mapped == emulated == nvshmem > stores
    # the send region holds what the data region does: at least the capacity's 16 dispatch rows
    # (512 bytes of x, then 5 aux words: ids and weights of 2 selections and the source)
    normal_stores, *normal_transports = (workspace(False, t) for t in range(4))
    assert len(set(normal_transports)) == 1
    send_region = normal_transports[0] - normal_stores
    assert send_region >= 16 * (512 + 5 * 4)
    # and the low-latency area at least: 2 channels (fused, split) x 2 parities x 4 local
    # experts x 2 sources x 8 slots of a 512-byte row
    assert mapped - stores >= send_region + 2 * 2 * 4 * 2 * 8 * 512


@pytest.mark.usefixtures("extension")  # conftest's rule for a missing _C
def test_what_a_device_transport_does_not_carry_is_refused_by_name():
    """A negative slot count is no count, and NVSHMEM's device transport needs the symmetric
    heap: each is refused before any device is touched, naming why. NVSHMEM's device transport
    carries the normal ops too: a normal-only Buffer over it is refused only for want of the
    symmetric heap."""
    module, reason = cuda.load_extension()
    if module is None:
        pytest.skip(f"the CUDA extension is not built here: {reason}")

    def config(transport, send_slots=0):
        return cuda.buffer_config(
            module, num_ranks=2, num_experts=8, hidden=256, max_tokens_per_rank=8, num_topk=2,
            capacity=16, dtype_bytes=2, low_latency=False, timeout_s=10.0,
            device_transport=transport, normal_send_slots=send_slots)

    with pytest.raises(RuntimeError, match="set JAX_EP_PEER_MAPPING=nvshmem too"):
        module.create_buffer(2**40, [[0, 1]], config(3))
    with pytest.raises(RuntimeError, match="normal_send_slots must be >= 0, got -1"):
        module.create_buffer(2**40, [[0, 1]], config(2, send_slots=-1))


@pytest.mark.usefixtures("extension")  # conftest's rule for a missing _C
def test_the_emulated_transport_is_the_test_modules_and_registered_on_request():
    """jax_ep._C carries no emulated transport: a Buffer over it, in a process that has not
    registered the test module's (conftest does, for the tests), is refused before it touches a
    device, naming what to do; once registered, the refusal is gone (the same configuration
    fails further on, on a machine without the devices, or not at all)."""
    script = (
        "import sys\n"
        "from jax_ep.backends import cuda\n"
        "module, _ = cuda.load_extension()\n"
        "config = cuda.buffer_config(module, num_ranks=1, num_experts=8, hidden=256, "
        "max_tokens_per_rank=8, num_topk=2, capacity=8, dtype_bytes=2, low_latency=True, "
        "timeout_s=10.0, device_transport=2)\n"
        "def create():\n"
        "    try:\n"
        "        module.create_buffer(2**40, [[0]], config)\n"
        "    except RuntimeError as e:\n"
        "        return str(e)\n"
        "    module.destroy_buffer(2**40)\n"
        "    return 'created'\n"
        "print('BEFORE', create())\n"
        "from jax_ep import _C_testing\n"
        "_C_testing.register_emulated_transport()\n"
        "_C_testing.register_emulated_transport()  # again: harmless\n"
        "print('AFTER', create())\n")
    with tempfile.TemporaryDirectory() as cwd:  # the installed jax_ep, not the checkout
        proc = subprocess.run([sys.executable, "-c", script], cwd=cwd, capture_output=True,
                              text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    before = next(line for line in proc.stdout.splitlines() if line.startswith("BEFORE"))
    after = next(line for line in proc.stdout.splitlines() if line.startswith("AFTER"))
    assert "JAX_EP_DEVICE_TRANSPORT=emulated" in before, before
    assert "jax_ep._C_testing.register_emulated_transport()" in before, before
    assert "register_emulated_transport" not in after, after


@pytest.mark.usefixtures("extension")  # conftest's rule for a missing _C
def test_a_protocol_mutant_is_the_test_modules_and_needs_the_emulated_transport():
    """Protocol mutants are set by the test module (jax_ep._C_testing) on a Buffer after its
    creation: the user's configuration carries none. An unknown name is an error naming the
    known ones; a mutant without a device transport, over another than the emulated one, or
    no_fence on a Buffer without the low-latency kernels is refused, naming why."""
    module, _ = cuda.load_extension()
    from jax_ep import _C_testing  # noqa: PLC0415

    assert not hasattr(module.BufferConfig(), "transport_mutant")
    assert _C_testing.mutant_names() == ["none", "no_fence", "signal_before_data",
                                         "reuse_before_quiet", "unregistered_source",
                                         "no_final_quiet", "lost_signals"]
    with pytest.raises(ValueError, match=r"one of none, .*lost_signals, not 'no_quiet'"):
        _C_testing.check_transport_mutant("no_quiet", 2, True)
    with pytest.raises(ValueError, match="set JAX_EP_DEVICE_TRANSPORT too"):
        _C_testing.check_transport_mutant("no_fence", 0, True)
    for transport in (1, 3):
        with pytest.raises(ValueError, match="is for the emulated transport"):
            _C_testing.check_transport_mutant("signal_before_data", transport, True)
    with pytest.raises(ValueError, match=r"no_fence breaks the low-latency put-protocol kernels "
                                         r"only \(the normal kernels issue no fence"):
        _C_testing.check_transport_mutant("no_fence", 2, False)
    _C_testing.check_transport_mutant("no_fence", 2, True)
    _C_testing.check_transport_mutant("none", 0, False)
    with pytest.raises(ValueError, match="no jax_ep Buffer with id"):
        _C_testing.set_transport_mutant(2**40, "no_fence")


def _run_suite_over(transport, *pytest_args, suite=SUITE, seed=7, **extra_env):
    """`suite`'s GPU cases in a child process with the transport set."""
    env = dict(os.environ, **launching.device_transport_env(transport, seed, **extra_env))
    with tempfile.TemporaryDirectory() as cwd:  # not the checkout: jax_ep must be the installed
        proc = subprocess.run(
            [sys.executable, "-X", "faulthandler", "-m", "pytest", "-q", "-p", "no:cacheprovider",
             "-m", launching.EVERY_GPU_TEST, *(str(TESTS / f) for f in suite), *pytest_args],
            cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    return proc.returncode, proc.stdout[-4000:] + proc.stderr[-4000:]


def _nvshmem_env():
    """What a child needs to run over NVSHMEM's device API (one PE: the process itself); skips
    where jax_ep was built without NVSHMEM."""
    module, _ = cuda.load_extension()
    if not module.nvshmem_built():
        pytest.skip("jax_ep was built without NVSHMEM (the nvidia-nvshmem wheel's headers "
                    "and device library)")
    return {"JAX_EP_PEER_MAPPING": "nvshmem"}


@pytest.mark.gpu
@pytest.mark.parametrize("transport", [pytest.param("mapped", marks=pytest.mark.stress),
                                       "emulated",
                                       pytest.param("nvshmem", marks=pytest.mark.stress)])
def test_low_latency_ops_over_a_device_transport(transport):
    """Over NVSHMEM's device API the process is one PE whose puts reach itself (the
    NVSHMEM build forced onto its put path for peers that do have a mapping)."""
    require_gpus(1)
    extra = _nvshmem_env() if transport == "nvshmem" else {}
    # Every chain length, alone and with a fused call between the halves (the two channels);
    # not XLA work between them (the stores path's suite covers that): ~1 minute a transport.
    rc, output = _run_suite_over(
        transport, "-k", "cuda and not hundred_buffers and not xla_between", **extra)
    assert rc == 0 and " passed" in output and "failed" not in output, output


@pytest.mark.gpu
@pytest.mark.parametrize(("transport", "seed"),
                         [pytest.param("mapped", 0, marks=pytest.mark.stress), ("emulated", 7),
                          pytest.param("emulated", 8, marks=pytest.mark.stress),
                          pytest.param("emulated", 9, marks=pytest.mark.stress),
                          pytest.param("nvshmem", 0, marks=pytest.mark.stress)])
def test_normal_ops_over_a_device_transport(transport, seed):
    """The normal-mode suite in a child process per transport (and per emulator seed). Its
    ranks are the GPUs of one process: on one GPU a single rank, whose transport carries the
    combine's barrier word to itself only; the fake-hosts digests below move rows between
    ranks. Over NVSHMEM's device API the process is one PE, as for the low-latency suite. The
    plan kernel's grid shapes (up to ~170k tokens a rank) stay with the mapped transport: one
    proxy command per row is too slow for them."""
    require_gpus(1)
    extra = _nvshmem_env() if transport == "nvshmem" else {}
    selected = ("(cuda or plan_grid) and not hundred_buffers" if transport == "mapped"
                else "cuda and not hundred_buffers")
    rc, output = _run_suite_over(transport, "-k", selected, suite=NORMAL_SUITE, seed=seed,
                                 **extra)
    assert rc == 0 and " passed" in output and "failed" not in output, output


def _digests(proc, count=LOW_LATENCY_DIGESTS, rank=0):
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    lines = launching.digest_lines(proc.stdout, rank)
    assert len(lines) == count, proc.stdout[-4000:]
    return dict(line.split()[1:] for line in lines)


def _two_processes_digest(transport, seed=0, mutant="none", part="low_latency", bound=(),
                          **extra_env):
    """tests/multiprocess_digest.py's ops of `part` (normal, low_latency) in two processes on
    one GPU: as two hosts (launcher --fake-hosts 2) over the emulated transport; the mapped
    transport needs a peer mapping, so jax_ep keeps it within a host, and its run is the two
    processes as one (as is the stores path's). `mutant`: the script sets it on its Buffers
    through the test module. `bound`: launcher flags that bound the run."""
    env = launching.device_transport_env(transport, seed, JAX_EP_TRANSPORT_MUTANT=mutant,
                                         **extra_env)
    hosts = ("--fake-hosts", "2") if transport == "emulated" else ()
    with tempfile.TemporaryDirectory() as cwd:
        proc, _ = launching.run_launcher(
            "-n", "2", "--processes-per-gpu", "2", *hosts, *bound, "--",
            sys.executable, str(launching.DIGEST_SCRIPT), "cuda", part,
            platform="gpu", extra_env=env, cwd=cwd)
    return proc


def _reference_digests(part, count):
    """The reference backend's digests of `part` (two CPU devices, one process)."""
    reference = subprocess.run(
        [sys.executable, str(launching.DIGEST_SCRIPT), "reference", part],
        capture_output=True, text=True, errors="replace", timeout=300,
        env=launching.child_env("cpu", {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}))
    return _digests(reference, count, rank=None)  # the script alone: no prefix


@pytest.fixture(scope="module")
def mapped_digests():
    require_gpus(1)
    return _digests(_two_processes_digest("mapped"))


@pytest.fixture(scope="module")
def mapped_normal_digests():
    require_gpus(1)
    return _digests(_two_processes_digest("mapped", part="normal"), NORMAL_DIGESTS)


@pytest.mark.gpu
@pytest.mark.stress
def test_emulated_transport_across_fake_hosts_moves_the_bits_of_the_reference(mapped_digests):
    """Two processes on one GPU, each a host of its own (launcher --fake-hosts 2), their
    low-latency ops over the emulated transport: under every seed (JAX_EP_TRANSPORT_SEEDS,
    default 3) the same bits, those of the mapped transport, and
    for what only moves data (bf16 dispatch) those of the reference backend."""
    want = _reference_digests("low_latency", LOW_LATENCY_DIGESTS)
    assert mapped_digests["low_latency_dispatch_bf16"] == want["low_latency_dispatch_bf16"]
    for seed in range(settings.value("JAX_EP_TRANSPORT_SEEDS")):  # ~7 s each
        proc = _two_processes_digest("emulated", seed)
        assert _digests(proc) == mapped_digests, f"seed {seed}"
        print(f"emulator seed {seed}: the mapped transport's digests", flush=True)  # with -s


# The normal ops whose outputs only move data: the reference backend's bits (the combine and the
# gradient sum in float32 in an order of their own).
NORMAL_DATA_MOVEMENT = ("dispatch_bf16", "dispatch_fp8", "cached_dispatch", "layout")


# 16 push warps of one slot each: a warp restages its slot within a call (the digest program's
# dispatch sends up to 64 rows to the peer), after the quiet that covers the slot's last put.
RESTAGING = {"JAX_EP_NORMAL_PUSH_BLOCKS": "1", "JAX_EP_NORMAL_SEND_SLOTS": "1"}


@pytest.mark.gpu
@pytest.mark.stress
def test_normal_ops_across_fake_hosts_move_the_bits_of_the_stores_path(mapped_normal_digests):
    """The normal-mode ops (dispatch bf16 and fp8, combine, cached dispatch, layout, a gradient)
    of two processes on one GPU, as two hosts over the emulated transport: under every seed
    (JAX_EP_TRANSPORT_SEEDS) the bits of the mapped transport, which are the stores path's
    (the same rows, reduced in the same order), and where only data moves the reference's."""
    stores = _digests(_two_processes_digest("stores", part="normal"), NORMAL_DIGESTS)
    assert mapped_normal_digests == stores
    want = _reference_digests("normal", NORMAL_DIGESTS)
    assert ({k: stores[k] for k in NORMAL_DATA_MOVEMENT} ==
            {k: want[k] for k in NORMAL_DATA_MOVEMENT})
    for seed in range(settings.value("JAX_EP_TRANSPORT_SEEDS")):
        proc = _two_processes_digest("emulated", seed, part="normal")
        assert _digests(proc, NORMAL_DIGESTS) == mapped_normal_digests, f"seed {seed}"
        proc = _two_processes_digest("emulated", seed, part="normal", **RESTAGING)
        assert _digests(proc, NORMAL_DIGESTS) == mapped_normal_digests, f"restaging, seed {seed}"
        print(f"emulator seed {seed}: the stores path's digests", flush=True)  # with -s


# The faults the emulated transport's proxies report (ProxyErrorKind,
# csrc/transport/emulator/host_proxy.h).
PROXY_FAULTS = ("bad_command", "source_out_of_region", "destination_out_of_region",
                "signal_out_of_region", "misaligned", "source_reused")


def _caught_evidence(output):
    """The lines of a failed run's `output` that name what the emulated transport caught: a
    proxy's report of a fault (check()'s "the emulated transport: ..." or the digest script's
    "CAUGHT transport: ..."), or a bounded wait's timeout record, which names the rank, the peer
    it waited for and the phase (check()'s text, the handlers' or the script's "CAUGHT timeout:
    ..."). A bare launch failure (CUDA_ERROR_LAUNCH_FAILED) names no rule and is no evidence."""
    phases = [name for name in cuda.wait_phase_names().values() if name != "none"]
    faults = "|".join(PROXY_FAULTS)
    fault = re.compile(rf"(the emulated transport: |CAUGHT transport: ).*\b({faults})\b")
    waits = "|".join(re.escape(p) for p in phases)
    timeout = re.compile(rf"waited for rank \d+ in (phase ')?({waits})")
    return [line for line in output.splitlines() if fault.search(line) or timeout.search(line)]


@pytest.mark.gpu
@pytest.mark.stress
@pytest.mark.parametrize("mutant", ["no_fence", "signal_before_data", "unregistered_source",
                                    "no_final_quiet"])
def test_every_protocol_mutant_is_caught_under_the_ops(mapped_digests, mutant):
    """Each protocol mutant (transport/emulator/mutant.h) in the ops' kernels, one process per
    rank as two hosts: the emulated transport must catch it under every seed (a surviving mutant
    means the emulator is too weak). no_final_quiet shows only here: with a launch per rank, the
    second dispatch of the digest program restages rows the proxy may still be reading.
    (reuse_before_quiet needs more combine rows per warp than its 8 slots, which the digest
    program does not send: tests/test_transport_gpu.py catches it.)"""
    for seed in range(2):
        proc = _two_processes_digest("emulated", seed, mutant)
        output = proc.stdout + proc.stderr
        if proc.returncode != 0:
            assert _caught_evidence(output), (mutant, seed, output[-4000:])
            continue
        digests = _digests(proc)
        assert digests != mapped_digests, f"{mutant} survived seed {seed}: the mapped bits"


@pytest.mark.gpu
@pytest.mark.stress
@pytest.mark.parametrize("mutant", ["signal_before_data", "reuse_before_quiet",
                                    "unregistered_source"])
def test_every_normal_protocol_mutant_is_caught_under_the_ops(mapped_normal_digests, mutant):
    """Each protocol mutant the normal kernels honour, their slots restaged within a call, two
    processes as two hosts over the emulated transport: caught under every seed, by a proxy's
    report, a wait that times out, or other bits than the mapped transport's. (no_final_quiet is
    not among them: the next call's exchange waits for every row's flag, which the transport
    sets only after it has read the row, so the last quiet of a push warp orders nothing that
    is not ordered already; no_fence is refused, the normal kernels issue no fence.)"""
    for seed in range(2):
        # A caught mutant traps a kernel (a wait past its bound): that rank leaves at once
        # (multiprocess_digest's os._exit) and the launcher ends its peer after the grace; the
        # run is bounded as a whole too. The waits keep the correct runs' bound, so a slow
        # emulator cannot pass for a caught mutant.
        proc = _two_processes_digest("emulated", seed, mutant, part="normal",
                                     bound=("--timeout", "150", "--grace", "5"), **RESTAGING)
        output = proc.stdout + proc.stderr
        if proc.returncode != 0:
            assert _caught_evidence(output), (mutant, seed, output[-4000:])
            continue
        digests = _digests(proc, NORMAL_DIGESTS)
        assert digests != mapped_normal_digests, f"{mutant} survived seed {seed}: the mapped bits"


@pytest.mark.gpu
@pytest.mark.stress
@pytest.mark.parametrize("part", ["normal", "low_latency"])
def test_signals_that_never_land_end_in_bounded_waits_naming_the_rank(part):
    """A network that loses every signal between the ranks (lost_signals: their puts land), two
    processes on one GPU as two hosts over the emulated transport: the run fails within its
    bound, and each process names the rank it waited for and the phase (no hang, no result)."""
    proc = _two_processes_digest("emulated", 0, "lost_signals", part=part,
                                 bound=("--timeout", "150", "--grace", "30"))
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-4000:]
    for rank, peer in ((0, 1), (1, 0)):
        caught = _caught_evidence("\n".join(launching.lines_of(proc.stdout, rank)))
        assert any(f"waited for rank {peer} in" in line for line in caught), (rank, output[-4000:])


@pytest.mark.usefixtures("extension")  # conftest's rule for a missing _C
def test_the_nvshmem_device_transport_loads_where_it_is_built():
    """The NVSHMEM device transport's kernels are a plugin (libjax_ep_nvshmem.so): jax_ep._C
    imports without NVSHMEM, and where NVSHMEM was found at build time the plugin loads after
    NVSHMEM's host library and has its entry points (no GPU needed to load it)."""
    from jax_ep.peers import nvshmem

    module, reason = cuda.load_extension()
    if module is None:
        pytest.skip(f"the CUDA extension is not built here: {reason}")
    if not module.nvshmem_built():
        assert not os.path.exists(nvshmem.PLUGIN)
        pytest.skip("jax_ep was built without NVSHMEM (no nvidia-nvshmem-cu13 wheel at build time)")
    module.nvshmem_load(nvshmem.library_path())
    module.transport_plugin_load(nvshmem.PLUGIN)
    module.transport_plugin_load(nvshmem.PLUGIN)  # once: later calls are no-ops
