"""Starts N local processes of one command for multi-process JAX (``jax.distributed``).

    python -m jax_ep.launch -n N [--coordinator HOST:PORT] [--devices-per-process K]
                            [--platform auto|gpu|cpu] [--share-gpus] [--processes-per-gpu P]
                            [--fake-hosts H] [--timeout S] [--grace S] -- COMMAND...

Each child gets, besides the launcher's own environment:

- ``JAX_EP_COORDINATOR``: ``host:port`` of the coordinator (process 0 serves it); default
  ``127.0.0.1`` and a free port.
- ``JAX_EP_NUM_PROCESSES``: ``N``; ``JAX_EP_PROCESS_ID``: ``0 .. N-1``.
- with GPUs: ``CUDA_VISIBLE_DEVICES`` = the GPUs ``[i*K, (i+1)*K)`` of the launcher's visible
  GPUs (default ``K`` = visible GPUs // N); with ``--share-gpus`` every child sees every GPU
  and ``JAX_EP_LOCAL_DEVICE_IDS`` = ``i*K, ..., (i+1)*K - 1`` (passed to
  ``jax.distributed.initialize(local_device_ids=...)``: NVSHMEM's peer-to-peer transport wants
  to see the peers' GPUs); on CPU: ``XLA_FLAGS`` with ``--xla_force_host_platform_device_count=K``
  (default ``K`` = 1).
- with ``--processes-per-gpu P`` (P > 1, GPUs only): ``P`` consecutive processes share each
  GPU (one GPU per process: process ``i`` gets GPU ``i // P``), and each gets
  ``XLA_PYTHON_CLIENT_MEM_FRACTION`` = ``0.7 / P`` unless set, and ``CUDA_DEVICE_MAX_CONNECTIONS``
  at most :func:`max_connections` ``(P)``: the contexts sharing a GPU share its hardware
  channels, and a process that finds none left cannot start CUDA. This runs the multi-process
  protocol (CUDA IPC or NVSHMEM peers) on fewer GPUs than ranks, for correctness only: kernels
  of processes on one GPU take turns (time slices), so their timings mean nothing, and NCCL
  refuses two ranks on one GPU (XLA collectives across those processes fail).
- with ``--fake-hosts H`` (H divides N): the processes form H groups of N/H consecutive
  processes, each group pretending to be a host of its own: ``JAX_EP_HOST`` (the name jax_ep
  tells hosts apart by) and ``NCCL_HOSTID`` (NCCL's) = ``<this host>/fake<h>`` for group h.
  An EP group then "spans hosts" on one machine, with processes sharing a GPU or one per GPU,
  so the multi-host code paths run where only one host is at hand.
- ``PYTHONUNBUFFERED=1`` (unless set), so output lines arrive as they are printed.

The command then calls :func:`initialize_from_env` (``tests/conftest.py`` does) before it touches
any device. Every child line is printed with the prefix ``[i] `` (stdout to stdout, stderr to
stderr). The launcher waits for all children; when one fails it gives the others ``--grace``
seconds to finish, then terminates them (SIGTERM to their process group, SIGKILL after another
grace period) and exits with the first non-zero exit code (128 + signal for a child killed by a
signal). ``--timeout`` bounds the whole run: past it every child is terminated and the launcher
exits 124. The launcher never imports jax, so it holds no device.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

from jax_ep.system.cuda_driver import DEFAULT_MAX_CONNECTIONS, ENV_MAX_CONNECTIONS

ENV_COORDINATOR = "JAX_EP_COORDINATOR"
ENV_NUM_PROCESSES = "JAX_EP_NUM_PROCESSES"
ENV_LOCAL_DEVICE_IDS = "JAX_EP_LOCAL_DEVICE_IDS"
ENV_PROCESS_ID = "JAX_EP_PROCESS_ID"
ENV_HOST = "JAX_EP_HOST"
TIMEOUT_EXIT_CODE = 124

_HOST_DEVICES_FLAG = re.compile(r"--xla_force_host_platform_device_count=\S*")


# ------------------------------------------------------------------------------ in the child
def initialize_from_env() -> bool:
    """Calls ``jax.distributed.initialize`` from the launcher's variables, if they are set.

    Does nothing and returns False when ``JAX_EP_NUM_PROCESSES`` is unset. Otherwise selects gloo
    for cross-process collectives on CPU (unless another implementation was configured), then
    initialises with ``JAX_EP_COORDINATOR``, ``JAX_EP_NUM_PROCESSES`` and ``JAX_EP_PROCESS_ID``
    and returns True (also when this process was already initialised). Call it before anything
    touches jax devices.
    """
    raw_num = os.environ.get(ENV_NUM_PROCESSES)
    if not raw_num:
        return False
    missing = [v for v in (ENV_COORDINATOR, ENV_PROCESS_ID) if not os.environ.get(v)]
    if missing:
        raise ValueError(f"{ENV_NUM_PROCESSES} is set but {', '.join(missing)} is not "
                         f"(start the processes with `python -m jax_ep.launch`)")
    try:
        num_processes = int(raw_num)
        process_id = int(os.environ[ENV_PROCESS_ID])
    except ValueError:
        raise ValueError(f"{ENV_NUM_PROCESSES}={raw_num!r} and {ENV_PROCESS_ID}="
                         f"{os.environ[ENV_PROCESS_ID]!r} must be integers") from None
    if num_processes < 1 or not 0 <= process_id < num_processes:
        raise ValueError(f"need 0 <= {ENV_PROCESS_ID} ({process_id}) < {ENV_NUM_PROCESSES} "
                         f"({num_processes})")

    import jax  # noqa: PLC0415 - the launcher itself never imports jax

    if jax.distributed.is_initialized():
        return True
    # Cross-process collectives between CPU devices need an implementation (XLA:CPU has none
    # by default in older jax); respect an explicit choice such as "mpi".
    if jax.config.jax_cpu_collectives_implementation in (None, "none"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    local_ids = os.environ.get(ENV_LOCAL_DEVICE_IDS)
    jax.distributed.initialize(
        coordinator_address=os.environ[ENV_COORDINATOR], num_processes=num_processes,
        process_id=process_id,
        local_device_ids=[int(i) for i in local_ids.split(",")] if local_ids else None)
    return True


# ---------------------------------------------------------------------------- in the launcher
def free_port(host="127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (another program may take it before the child)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def visible_gpus(environ=None) -> list[str]:
    """The GPUs the launcher may hand out, as ``CUDA_VISIBLE_DEVICES`` entries.

    ``CUDA_VISIBLE_DEVICES`` when set (empty = none), else the indices ``nvidia-smi`` lists,
    else none. Never initialises CUDA.
    """
    environ = os.environ if environ is None else environ
    if "CUDA_VISIBLE_DEVICES" in environ:
        return [d.strip() for d in environ["CUDA_VISIBLE_DEVICES"].split(",") if d.strip()
                and d.strip() != "-1"]
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run([smi, "--query-gpu=index", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip().isdigit()]


# The hardware channels of one GPU that the launched contexts sharing it may take, and what a
# context takes besides one per connection. Inferred on an H100: 16 contexts of 32 connections
# each left 4 processes without CUDA ("no supported devices found"), 12 started; 32 contexts of
# the default 8 all started. Both fit about 512 channels and 8 a context; the budget leaves 64
# of them to other contexts on the GPU (the test runner's own, a profiler's).
GPU_CHANNELS = 448
CHANNELS_PER_CONTEXT = 8


def max_connections(processes_per_gpu: int) -> int:
    """The most ``CUDA_DEVICE_MAX_CONNECTIONS`` that ``processes_per_gpu`` processes sharing a
    GPU may each ask for and all start CUDA (never below CUDA's default, 8)."""
    return max(DEFAULT_MAX_CONNECTIONS, GPU_CHANNELS // processes_per_gpu - CHANNELS_PER_CONTEXT)


def child_environments(num_processes, coordinator, devices_per_process=None, platform="auto",
                       environ=None, share_gpus=False, processes_per_gpu=1, fake_hosts=None):
    """The environment of every child (see the module docstring). Raises ValueError on a
    request the machine cannot meet."""
    environ = dict(os.environ if environ is None else environ)
    if num_processes < 1:
        raise ValueError(f"-n must be at least 1, got {num_processes}")
    if processes_per_gpu < 1:
        raise ValueError(f"--processes-per-gpu must be at least 1, got {processes_per_gpu}")
    if devices_per_process is not None and devices_per_process < 1:
        raise ValueError(f"--devices-per-process must be at least 1, got {devices_per_process}")
    if fake_hosts is not None and not (1 <= fake_hosts <= num_processes
                                       and num_processes % fake_hosts == 0):
        raise ValueError(f"--fake-hosts must divide -n ({num_processes}) into groups of "
                         f"processes, got {fake_hosts}")
    gpus = visible_gpus(environ) if platform in ("auto", "gpu") else []
    if platform == "gpu" and not gpus:
        raise ValueError("--platform gpu: no GPU visible (CUDA_VISIBLE_DEVICES / nvidia-smi)")
    use_gpus = bool(gpus)
    if processes_per_gpu > 1:
        if not use_gpus:
            raise ValueError("--processes-per-gpu needs visible GPUs")
        if devices_per_process not in (None, 1):
            raise ValueError(f"--processes-per-gpu gives each process one GPU, got "
                             f"--devices-per-process {devices_per_process}")
        if num_processes > processes_per_gpu * len(gpus):
            raise ValueError(f"{num_processes} processes at {processes_per_gpu} per GPU need "
                             f"{-(-num_processes // processes_per_gpu)} GPUs, {len(gpus)} "
                             f"visible")
        # Process i runs on GPU i // P: the device list below then repeats each GPU P times.
        gpus = [g for g in gpus for _ in range(processes_per_gpu)]
        devices_per_process = 1
    if use_gpus:
        k = devices_per_process or len(gpus) // num_processes
        if k < 1 or k * num_processes > len(gpus):
            raise ValueError(f"{num_processes} processes x {max(k, 1)} GPUs need "
                             f"{num_processes * max(k, 1)} GPUs, {len(gpus)} visible")
    else:
        k = devices_per_process or 1
    envs = []
    for i in range(num_processes):
        env = dict(environ)
        env[ENV_COORDINATOR] = coordinator
        env[ENV_NUM_PROCESSES] = str(num_processes)
        env[ENV_PROCESS_ID] = str(i)
        env.setdefault("PYTHONUNBUFFERED", "1")
        if fake_hosts is not None:
            host = f"{socket.gethostname()}/fake{i // (num_processes // fake_hosts)}"
            env[ENV_HOST] = env["NCCL_HOSTID"] = host
        if processes_per_gpu > 1:
            env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{0.7 / processes_per_gpu:.3f}")
            cap = max_connections(processes_per_gpu)
            if int(env.get(ENV_MAX_CONNECTIONS, 0) or 0) > cap:
                env[ENV_MAX_CONNECTIONS] = str(cap)
        if use_gpus and share_gpus:
            first = (i * k) // processes_per_gpu  # the index among the visible GPUs
            env[ENV_LOCAL_DEVICE_IDS] = ",".join(str(d) for d in range(first, first + k))
        elif use_gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[i * k:(i + 1) * k])
        else:
            flags = _HOST_DEVICES_FLAG.sub("", env.get("XLA_FLAGS", "")).split()
            env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={k}"])
            if platform == "cpu":
                env["JAX_PLATFORMS"] = "cpu"
        envs.append(env)
    return envs


def _write(sink, data, lock):
    """Writes ``data`` to ``sink``; False once the sink is gone (the reader of a pipe died, as
    when the launcher's parent was killed), so that no writer stops on it."""
    try:
        with lock:
            sink.write(data)
            sink.flush()
        return True
    except (OSError, ValueError):
        return False


def _pump(stream, sink, prefix, lock):
    """Copies ``stream`` line by line to ``sink`` (a binary file), each line prefixed. Once the
    sink is gone it keeps reading and drops the lines: a child never blocks on a full pipe."""
    live = True
    with stream:
        for line in iter(stream.readline, b""):
            if not line.endswith(b"\n"):
                line += b"\n"
            live = live and _write(sink, prefix + line, lock)


def _exit_code(returncode):
    return 128 - returncode if returncode < 0 else returncode


def _signal_group(proc, sig):
    try:
        os.killpg(proc.pid, sig)  # the child leads its own process group: its subprocesses too
    except (ProcessLookupError, PermissionError):
        pass


def _terminate(procs, grace_s, say):
    """SIGTERM to every running child's process group; SIGKILL to those alive after grace_s."""
    running = [p for p in procs if p.poll() is None]
    for p in running:
        _signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in running:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(p, signal.SIGKILL)
            say(f"process {procs.index(p)} ignored SIGTERM for {grace_s:g} s: SIGKILL")
            p.wait()


def launch(command, num_processes, *, coordinator=None, devices_per_process=None,
           platform="auto", timeout_s=None, grace_s=10.0, stdout=None, stderr=None,
           share_gpus=False, processes_per_gpu=1, fake_hosts=None) -> int:
    """Runs ``command`` (a list) in ``num_processes`` children; returns the exit code (see the
    module docstring)."""
    if not command:
        raise ValueError("no command given (usage: python -m jax_ep.launch -n N -- COMMAND...)")
    coordinator = coordinator or f"127.0.0.1:{free_port()}"
    envs = child_environments(num_processes, coordinator, devices_per_process, platform,
                              share_gpus=share_gpus, processes_per_gpu=processes_per_gpu,
                              fake_hosts=fake_hosts)
    stdout = stdout or sys.stdout.buffer
    stderr = stderr or sys.stderr.buffer
    lock = threading.Lock()

    def say(message):
        _write(stderr, f"[launch] {message}\n".encode(), lock)

    procs, pumps = [], []
    # The launcher's own SIGTERM / SIGINT end the children too.
    stop = threading.Event()
    received = []

    def on_signal(signum, _frame):
        received.append(signum)
        stop.set()

    old_handlers = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            old_handlers[sig] = signal.signal(sig, on_signal)
    say(f"{num_processes} processes, coordinator {coordinator}")
    try:
        for i, env in enumerate(envs):
            proc = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    start_new_session=True)
            procs.append(proc)
            for stream, sink in ((proc.stdout, stdout), (proc.stderr, stderr)):
                t = threading.Thread(target=_pump, args=(stream, sink, f"[{i}] ".encode(), lock),
                                     daemon=True)
                t.start()
                pumps.append(t)

        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        first_failure = None  # (process index, exit code)
        failed_at = None
        result = 0
        while True:
            codes = [p.poll() for p in procs]
            if first_failure is None:
                for i, code in enumerate(codes):
                    if code not in (None, 0):
                        first_failure = (i, _exit_code(code))
                        failed_at = time.monotonic()
                        if any(c is None for c in codes):
                            say(f"process {i} exited with {code}; terminating the others in "
                                f"{grace_s:g} s unless they exit")
                        break
            if all(c is not None for c in codes):
                result = first_failure[1] if first_failure else 0
                break
            if stop.is_set():
                say(f"got signal {received[0]}: terminating every process")
                _terminate(procs, grace_s, say)
                result = 128 + received[0]
                break
            if deadline is not None and time.monotonic() > deadline:
                say(f"timeout after {timeout_s:g} s: terminating every process")
                _terminate(procs, grace_s, say)
                result = TIMEOUT_EXIT_CODE
                break
            if first_failure is not None and time.monotonic() > failed_at + grace_s:
                alive = [i for i, c in enumerate(codes) if c is None]
                say(f"terminating process(es) {alive}")
                _terminate(procs, grace_s, say)
                result = first_failure[1]
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:  # an exception in the launcher: leave nothing behind
                _terminate([p], grace_s, say)
        for t in pumps:
            t.join(timeout=5)
        for sig, handler in old_handlers.items():
            signal.signal(sig, handler)
    if result:
        say(f"exit code {result}")
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m jax_ep.launch",
        description="Start N local processes of COMMAND for jax.distributed "
                    "(COMMAND calls jax_ep.launch.initialize_from_env()).",
        epilog="Variables set for each child: JAX_EP_COORDINATOR, JAX_EP_NUM_PROCESSES, "
               "JAX_EP_PROCESS_ID, and CUDA_VISIBLE_DEVICES "
               "(GPUs) or XLA_FLAGS=--xla_force_host_platform_device_count=K (CPU).")
    parser.add_argument("-n", "--num-processes", type=int, required=True)
    parser.add_argument("--coordinator", default=None,
                        help="HOST:PORT of the coordinator (default 127.0.0.1 and a free port)")
    parser.add_argument("--devices-per-process", type=int, default=None, metavar="K",
                        help="GPUs (default: visible GPUs // N) or host CPU devices (default 1) "
                             "per process")
    parser.add_argument("--platform", choices=("auto", "gpu", "cpu"), default="auto",
                        help="auto: GPUs when any is visible, else CPU; cpu also sets "
                             "JAX_PLATFORMS=cpu")
    parser.add_argument("--share-gpus", action="store_true",
                        help="every process sees every GPU and uses its own K of them "
                             "(JAX_EP_LOCAL_DEVICE_IDS) instead of CUDA_VISIBLE_DEVICES")
    parser.add_argument("--processes-per-gpu", type=int, default=1, metavar="P",
                        help="P processes share each GPU (one GPU each; correctness runs on "
                             "fewer GPUs than ranks: timings mean nothing, NCCL refuses it)")
    parser.add_argument("--fake-hosts", type=int, default=None, metavar="H",
                        help="H groups of N/H consecutive processes, each pretending to be a "
                             "host of its own (JAX_EP_HOST, NCCL_HOSTID)")
    parser.add_argument("--timeout", type=float, default=None, metavar="S",
                        help="terminate everything after S seconds and exit 124")
    parser.add_argument("--grace", type=float, default=10.0, metavar="S",
                        help="seconds the others may take to exit after one fails, and after "
                             "SIGTERM (default 10)")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="-- COMMAND ARGS... (the command every process runs)")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given: python -m jax_ep.launch -n N -- COMMAND...")
    try:
        return launch(command, args.num_processes, coordinator=args.coordinator,
                      devices_per_process=args.devices_per_process, platform=args.platform,
                      timeout_s=args.timeout, grace_s=args.grace, share_gpus=args.share_gpus,
                      processes_per_gpu=args.processes_per_gpu, fake_hosts=args.fake_hosts)
    except ValueError as e:
        parser.error(str(e))
    except OSError as e:  # the command could not be started
        print(f"[launch] cannot start {command[0]!r}: {e}", file=sys.stderr)
        return 127
    return 2  # unreachable: parser.error exits


if __name__ == "__main__":
    sys.exit(main())
