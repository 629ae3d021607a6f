"""``jax_ep.Buffer``: the communication state of one expert-parallel configuration.

Sharding model: ``mesh`` may have any axes; every slice of it along ``axis_name`` is one EP
group of ``R = mesh.shape[axis_name]`` ranks, and expert ``e`` lives on rank
``e // (num_experts // R)`` of its group. The ops run inside ``jax.shard_map`` that is manual over
``axis_name`` (and possibly other axes), under ``jax.jit``; each rank passes its own ``[T, ...]``
tokens.
"""

from __future__ import annotations

import itertools
import os
import threading

import jax
import jax.numpy as jnp
import numpy as np

from jax_ep import _vma, backends, settings
from jax_ep.backends import cuda, gate
from jax_ep.peers import ipc, nvshmem
from jax_ep.system import config, cuda_driver

BACKENDS = ("auto", "cuda", "reference")
# The reference backend's earlier name, still accepted: Buffer(backend="xla") is "reference".
BACKEND_ALIASES = {"xla": "reference"}
SUPPORTED_DTYPES = (jnp.bfloat16, jnp.float32)
# The configuration's limits and rules live in jax_ep.system.config. tests/test_facts.py checks
# its limits and ERROR_COUNTERS below against the kernels' (_C.max_topk(),
# _C.max_low_latency_hidden(), _C.error_counter_names()).
# Bad-input counters of errors() (the CUDA backend's ErrorCounters, csrc/kernels/context.h).
ERROR_COUNTERS = ("invalid_expert_ids", "overflow_rows", "dropped_low_latency_rows")
# JAX_EP_DEVICE_TRANSPORT's values, in the order of the C++ DeviceTransport enum.
DEVICE_TRANSPORTS = ("stores", "mapped", "emulated", "nvshmem")
# The CUDA_DEVICE_MAX_CONNECTIONS (hardware queues) the emulated transport wants: its proxy
# copies on a stream of its own, which must not share a queue with a stream that waits for the
# kernel waiting for those copies (CUDA's default, 8, is fewer than XLA's streams).
EMULATED_TRANSPORT_CONNECTIONS = 32

_buffer_ids = itertools.count(1)



def describe_timeout(record, host_of_rank=None) -> str:
    """A wait that outlasted its bound, from its timeout record (``_C.read_timeouts``): the rank
    and device that waited, the rank it waited for and the phase; with ``host_of_rank`` (rank ->
    host name) the hosts of both."""
    phase = cuda.wait_phase_names().get(record["timeout_phase"], record["timeout_phase"])

    def on_host(rank):
        host = host_of_rank(rank) if host_of_rank is not None else None
        return f" on host {host}" if host else ""

    return (f"rank {record['rank']}{on_host(record['rank'])} (device {record['device']}) waited "
            f"for rank {record['timeout_peer']}{on_host(record['timeout_peer'])} in {phase} "
            f"(call {record['seq']}) longer than the timeout; the GPU context of that device is "
            f"lost: restart the process")


def emulated_transport_hint(environ=None) -> str:
    """Why a wait over the emulated transport may time out with every peer alive, or "": its
    copies' stream may share a hardware queue with one that waits for the waiting kernel."""
    if settings.value("JAX_EP_DEVICE_TRANSPORT", environ) != "emulated":
        return ""
    environ = os.environ if environ is None else environ
    asked = (environ.get(cuda_driver.ENV_MAX_CONNECTIONS, "").strip()
             or f"{cuda_driver.DEFAULT_MAX_CONNECTIONS} (CUDA's default)")
    if asked.isdigit() and int(asked) >= EMULATED_TRANSPORT_CONNECTIONS:
        return ""
    return (f"the emulated transport copies on a stream of its own, and with "
            f"{cuda_driver.ENV_MAX_CONNECTIONS}={asked}, under {EMULATED_TRANSPORT_CONNECTIONS}, "
            f"that stream may share a hardware queue with one that waits for the waiting "
            f"kernel: its copies then never start, whether or not the peer is alive")


def rank_hosts(ep_groups, process_hosts, axis_name="ep"):
    """Host of each rank of an EP group, numbered 0, 1, ... in rank order, or None when every
    group lies inside one host.

    Args:
      ep_groups: the devices of every EP group, in rank order (each with ``process_index``).
      process_hosts: host name of every process, by process index.
      axis_name: the EP axis, for the message.

    Raises:
      ValueError: the groups place their ranks on hosts in different ways (a combine across
        hosts sums per host in one order for every group).
    """
    layouts = set()
    for group in ep_groups:
        names = [process_hosts[d.process_index] for d in group]
        numbers = {name: i for i, name in enumerate(dict.fromkeys(names))}
        layouts.add(tuple(numbers[n] for n in names))
    if len(layouts) > 1:
        raise ValueError(
            f"the EP groups along {axis_name!r} place their ranks on hosts in different ways "
            f"(host of each rank, numbered in rank order: {sorted(layouts)}): a combine across "
            f"hosts sums per host, in one order for every group, so the ranks that share a host "
            f"must be the same in every group (e.g. ranks 0-7 on one host, 8-15 on another)")
    (layout,) = layouts
    return layout if max(layout) > 0 else None


class Buffer:
    """Communication memory and configuration for dispatch/combine over one mesh axis.

    Built eagerly on the host, outside jit. With the CUDA backend it allocates on every device
    of ``mesh`` one workspace with cudaMalloc beside XLA's pool (``workspace_bytes`` per device,
    the kernels' own size: ``jax-ep-env --num-ranks R ...`` prints it for a configuration, and
    docs/api.md, "Buffer", says what it holds), exchanges peer addresses and preloads every
    kernel.

    Args:
      mesh: a ``jax.sharding.Mesh`` containing ``axis_name``.
      axis_name: the expert-parallel mesh axis.
      num_experts: global number of experts ``E``; a multiple of the number of ranks.
      hidden: channels per token ``H``; a multiple of 128 (with ``low_latency``: at most 32768).
      max_tokens_per_rank: largest ``T`` any call will pass (``T_max``).
      num_topk: experts per token ``K`` (at most 32).
      dtype: data dtype of ``x``/``y`` (bfloat16 or float32); fp8 inputs come as a pair.
      low_latency: also set up the low-latency (decode) mode.
      backend: ``"cuda"`` (our kernels), ``"reference"`` (the pure-JAX reference backend, any
        platform; ``"xla"``, its earlier name, is accepted too) or ``"auto"`` (cuda when every
        device is a CUDA GPU and the extension is built).
      capacity: static receive rows ``C`` of the normal mode (default ``R * T`` per call).
        Tokens past it are dropped and reported by ``check()``.
      timeout_s: bound on every wait for a peer (default ``$JAX_EP_TIMEOUT_S`` or 10 s).
      report_errors: reference backend only: count invalid ids and overflow through one host
        callback per call, for ``check()``. False keeps its programs device-only (benchmarks,
        CUDA graphs). The CUDA kernels always count on the device, for free.
      lowering_only: build a CUDA Buffer without touching devices: it traces, lowers and
        exports (e.g. ``jax.export`` for platform cuda from a CPU machine) but cannot run.
      num_sms: SM budget of this Buffer's kernels, normal and low-latency (CUDA backend): each
        launch takes at most this many SMs (one block per SM), leaving the others to compute
        that runs beside it. Default: the normal kernels take every SM, the low-latency ones
        all but 8 (``$JAX_EP_NORMAL_BLOCKS`` / ``$JAX_EP_LOW_LATENCY_BLOCKS`` tune them).
      overlap: run every op asynchronously (CUDA backend): its kernels on a stream of the
        Buffer's own (highest priority), joined by XLA's stream at the op's wait, so that
        compute between the start and the wait overlaps it (``jax_ep.moe``'s two-micro-batch
        layer places another micro-batch's experts there). The ops then run outside XLA's
        command buffers (a CUDA graph cannot hold a fork and a join of two calls).

    Buffer ids are handed out in creation order within a process (1, 2, ...) and baked into the
    compiled programs; an exported program runs in a process whose Buffer of the same
    configuration was created in the same order.
    """

    def __init__(self, mesh, axis_name, *, num_experts, hidden, max_tokens_per_rank, num_topk,
                 dtype=jnp.bfloat16, low_latency=False, backend="auto", capacity=None,
                 timeout_s=None, report_errors=True, lowering_only=False, num_sms=None,
                 overlap=False):
        if not isinstance(mesh, jax.sharding.Mesh):
            raise ValueError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
        if axis_name not in mesh.axis_names:
            raise ValueError(
                f"axis_name {axis_name!r} is not an axis of the mesh (axes: {mesh.axis_names})")
        self.mesh = mesh
        self.axis_name = axis_name
        self.num_ranks = int(mesh.shape[axis_name])
        if jnp.dtype(dtype) not in [jnp.dtype(d) for d in SUPPORTED_DTYPES]:
            raise ValueError(f"dtype must be bfloat16 or float32, got {jnp.dtype(dtype)}")
        self.dtype = jnp.dtype(dtype)
        self.low_latency = bool(low_latency)
        checked = config.check_config(
            num_ranks=self.num_ranks, num_experts=num_experts, hidden=hidden,
            max_tokens_per_rank=max_tokens_per_rank, num_topk=num_topk, capacity=capacity,
            low_latency=self.low_latency, dtype_bytes=self.dtype.itemsize)
        self.num_experts, self.hidden = checked["num_experts"], checked["hidden"]
        self.max_tokens_per_rank = checked["max_tokens_per_rank"]
        self.num_topk, self._capacity = checked["num_topk"], checked["capacity"]
        self.num_sms = None if num_sms is None else config.positive_int("num_sms", num_sms)
        self.overlap = bool(overlap)
        self.timeout_s = (settings.value("JAX_EP_TIMEOUT_S")
                          if timeout_s is None else float(timeout_s))
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
        if isinstance(backend, str):
            backend = BACKEND_ALIASES.get(backend, backend)
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        # How the ops reach peers (CUDA backend; the others ignore the setting): "stores"
        # through peer mappings, or the put-protocol kernels written for peers without a
        # mapping ("mapped", "emulated", "nvshmem"; docs/transport.md), for the normal and the
        # low-latency ops alike.
        self.device_transport = settings.value("JAX_EP_DEVICE_TRANSPORT")
        self.buffer_id = next(_buffer_ids)
        self._closed = False
        self._errors_lock = threading.Lock()
        self._host_errors = dict.fromkeys(ERROR_COUNTERS, 0)
        self._error_sums = 0  # errors() calls summed over processes: one store key each
        self.report_errors = bool(report_errors)
        self._allocated = False
        self.backend_reasons = []  # why "auto" did not pick cuda (see `python -m jax_ep.env`)
        self.backend = self._resolve_backend(backend, lowering_only)
        # Host of each rank of the EP groups, None inside one host: the reference backend sums
        # a combine across hosts per host (docs/api.md, "combine").
        self._rank_hosts = self._ep_rank_hosts() if self.backend == "reference" else None
        # How peers' memory is mapped (CUDA backend): "local" (one process: unified
        # addressing), "ipc" (CUDA IPC between the processes of one host) or "nvshmem"
        # (JAX_EP_PEER_MAPPING=nvshmem: NVSHMEM's symmetric heap, one process per GPU).
        self.peer_mapping = None
        if self.backend == "cuda":
            self.peer_mapping = self._resolve_peer_mapping(lowering_only)
        # The calls of the ops (jax_ep.backends.Backend).
        self._impl: backends.Backend = backends.create(self.backend, self)
        if self.backend == "cuda" and not lowering_only:
            self._allocate()

    # ---------------------------------------------------------------------------- properties
    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.num_ranks

    @property
    def capacity(self) -> int:
        """Static receive capacity if set, else the largest one: ``R * max_tokens_per_rank``."""
        return self._capacity or self.num_ranks * self.max_tokens_per_rank

    def capacity_for(self, num_tokens: int):
        """Receive rows ``C`` of a normal-mode call with ``num_tokens`` tokens per rank."""
        return self._capacity if self._capacity is not None else self.num_ranks * num_tokens

    @property
    def workspace_bytes(self) -> int:
        """Device memory the CUDA backend allocates per device (0 for the reference backend)."""
        if self.backend != "cuda":
            return 0
        module, _ = cuda.load_extension()
        return module.workspace_bytes(self._runtime_config(module)) if module else 0

    def __repr__(self):
        if "backend" not in self.__dict__:  # the constructor raised before it chose a backend
            return "Buffer(<constructor failed>)"
        return (f"Buffer(id={self.buffer_id}, backend={self.backend!r}, ranks={self.num_ranks}, "
                f"experts={self.num_experts}, hidden={self.hidden}, "
                f"max_tokens_per_rank={self.max_tokens_per_rank}, topk={self.num_topk}, "
                f"dtype={self.dtype.name}, low_latency={self.low_latency}"
                + (f", num_sms={self.num_sms}" if self.num_sms else "")
                + (", overlap=True" if self.overlap else "") + ")")

    # ------------------------------------------------------------------------------ set-up
    def _resolve_backend(self, backend, lowering_only):
        devices = list(self.mesh.devices.flat)
        if backend == "reference":
            return "reference"
        module, reason = cuda.load_extension()
        if backend == "cuda" and lowering_only:
            if module is None:  # the target names and limits come from it
                raise ValueError(f"backend='cuda': {reason}; use backend='reference'")
            return "cuda"
        all_gpus = all(d.platform == "gpu" for d in devices)
        if backend == "auto":
            if not all_gpus or module is None:
                choice, self.backend_reasons = "reference", []
            else:
                choice, self.backend_reasons = gate.auto_backend(
                    devices, ep_groups=self._ep_group_devices())
            if ipc.spans_processes(devices):
                choice = self._agree_across_processes(choice)
            return choice
        if not all_gpus:
            raise ValueError(f"backend='cuda' needs every mesh device to be a CUDA GPU, got "
                             f"{sorted({d.platform for d in devices})}; use backend='reference'")
        if module is None:
            raise ValueError(f"backend='cuda': {reason}; use backend='reference'")
        if self.num_ranks > cuda.max_ranks():
            raise ValueError(f"backend='cuda' supports at most {cuda.max_ranks()} ranks along "
                             f"{self.axis_name!r}, got {self.num_ranks}")
        gate.check_cuda_backend(devices, module.workspace_bytes(self._runtime_config(module)),
                               ep_groups=self._ep_group_devices())
        if ipc.spans_processes(devices):
            problem = self._other_hosts()
            if problem:
                raise ValueError(f"backend='cuda': {problem}; or use backend='reference'")
        return "cuda"

    def _resolve_peer_mapping(self, lowering_only):
        requested = nvshmem.requested_peer_mapping()
        if requested == "nvshmem":
            if not lowering_only:
                nvshmem.check_usable(self)
            return "nvshmem"
        return "ipc" if ipc.spans_processes(self.mesh.devices.flat) else "local"

    def _other_hosts(self):
        """Why a group spanning hosts cannot run the cuda backend with this Buffer's transport,
        or ""; it names the layout or the settings to use. Keeps every process's host, so that a
        timeout later names the hosts without another collective."""
        self._process_hosts = ipc.hosts(self)
        return gate.cross_host_problem(self._ep_group_devices(), self._process_hosts,
                                       self.device_transport)

    def _ep_rank_hosts(self):
        """``rank_hosts`` of this Buffer's EP groups; gathers the processes' hosts (a
        collective) on a mesh of several processes, unless done already."""
        if not ipc.spans_processes(self.mesh.devices.flat):
            return None
        if getattr(self, "_process_hosts", None) is None:
            self._process_hosts = ipc.hosts(self)
        return rank_hosts(self._ep_group_devices(), self._process_hosts, self.axis_name)

    def _agree_across_processes(self, choice):
        """backend="auto" on a mesh of several processes: "cuda" only where every process
        chose it (all processes must run the same programs)."""
        problem = self._other_hosts()  # collective: every process gathers, whatever its choice
        if choice == "cuda" and problem:
            choice, self.backend_reasons = "reference", [problem]
        choices = ipc.all_gather(self, "backend", choice)
        others = sorted(p for p, c in choices.items() if c != "cuda")
        if choice == "cuda" and others:
            self.backend_reasons = [f"processes {others} cannot use the cuda backend (their "
                                    f"Buffer.backend_reasons say why)"]
            return "reference"
        return choice

    def _ep_group_devices(self):
        """The devices of every EP group, in rank order."""
        axis = self.mesh.axis_names.index(self.axis_name)
        return [list(g) for g in
                np.moveaxis(self.mesh.devices, axis, -1).reshape(-1, self.num_ranks)]

    def _ep_groups(self):
        """Device ordinals of every EP group, in rank order (-1: a device of another process)."""
        me = jax.process_index()
        return [[-1 if d.process_index != me else
                 int(d.local_hardware_id if d.local_hardware_id is not None else d.id)
                 for d in group] for group in self._ep_group_devices()]

    def _runtime_config(self, module):
        """This Buffer as the C++ ``BufferConfig``, grids from the settings (0: the device's)."""
        grids = {key: settings.value(f"JAX_EP_{key.upper()}") or 0
                 for key in ("normal_blocks", "normal_push_blocks", "low_latency_blocks",
                             "normal_send_slots", "normal_window_rows")}
        if self.num_sms is not None:  # one block per SM, within the budget
            grids.update(normal_blocks=self.num_sms, low_latency_blocks=self.num_sms)
            if grids["normal_push_blocks"] > self.num_sms:
                grids["normal_push_blocks"] = 0
        config = cuda.buffer_config(
            module, num_ranks=self.num_ranks, num_experts=self.num_experts, hidden=self.hidden,
            max_tokens_per_rank=self.max_tokens_per_rank, num_topk=self.num_topk,
            capacity=self.capacity, dtype_bytes=self.dtype.itemsize,
            low_latency=self.low_latency, timeout_s=self.timeout_s,
            device_transport=DEVICE_TRANSPORTS.index(self.device_transport),
            emulator_seed=settings.value("JAX_EP_EMULATOR_SEED"), **grids)
        return config

    def _check_num_sms(self):
        """``num_sms`` within every local GPU's multiprocessors."""
        if self.num_sms is None:
            return
        counts = {getattr(d, "core_count", None) for d in self.mesh.devices.flat
                  if d.process_index == jax.process_index()}
        fewest = min((c for c in counts if c), default=None)
        if fewest is not None and self.num_sms > fewest:
            raise ValueError(f"num_sms must be at most the GPUs' {fewest} multiprocessors, got "
                             f"{self.num_sms}")

    def _allocate(self):
        if self.backend == "cuda":
            self._check_num_sms()
            cuda.register_targets()
            module, _ = cuda.load_extension()
            multiprocess = ipc.spans_processes(self.mesh.devices.flat)
            if multiprocess:
                ipc.check_same_configuration(self)
            pes = []
            if self.peer_mapping == "nvshmem":
                nvshmem.join(self, module, self.workspace_bytes)
                if self.device_transport == "nvshmem":
                    nvshmem.load_device_transport(module)
                pes = nvshmem.pes(self)
            module.create_buffer(self.buffer_id, self._ep_groups(),
                                 self._runtime_config(module), pes=pes)
            self._allocated = True
            if multiprocess and not pes:
                try:
                    ipc.exchange_workspaces(self, module)
                except BaseException:
                    self._allocated = False
                    module.destroy_buffer(self.buffer_id)
                    raise

    # -------------------------------------------------------------------------- lifecycle
    def _check_open(self):
        if self._closed:
            raise ValueError(f"{self!r} is closed")

    def _check_call(self, op):
        """The checks of every op: this Buffer is open and ``op`` is traced inside
        ``jax.shard_map`` manual over its axis, with its number of ranks."""
        self._check_open()
        _vma.check_manual_axis(self.axis_name, self.num_ranks, op)

    def close(self) -> None:
        """Frees the device memory. Later calls with this Buffer raise. Idempotent.

        On a mesh of several processes this is collective: every process closes the Buffer (a
        bounded barrier orders the unmapping of peers' memory before anyone frees its own).
        """
        if self._closed:
            return
        self._closed = True
        if self._allocated:
            module, _ = cuda.load_extension()
            self._allocated = False
            if self.overlap:
                module.release_side_streams(self.buffer_id)
            if self.peer_mapping == "nvshmem":
                nvshmem.release(self, module)  # a collective: every process closes
            elif ipc.spans_processes(self.mesh.devices.flat):
                ipc.release_workspaces(self, module)  # a collective: every process closes
            else:
                module.destroy_buffer(self.buffer_id)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def warmup(self) -> None:
        """Runs every op of this Buffer once at ``max_tokens_per_rank`` tokens per rank.

        Loads and initialises everything a first call would (kernels were already preloaded at
        creation; this also touches all communication memory, lines the ranks up and compiles
        the small warm-up programs), so that the first real step costs what every step costs.
        """
        self._check_open()
        from jax_ep import warmup as _warmup  # noqa: PLC0415

        _warmup.run(self)

    # ------------------------------------------------------------------------------ errors
    def _report_errors(self, invalid_ids, overflow_rows, dropped_low_latency_rows=0):
        """Reference backend: forwards per-rank error counts to the host (jit-safe)."""
        if not self.report_errors:
            return

        def record(*counts):
            with self._errors_lock:
                for name, count in zip(ERROR_COUNTERS, counts, strict=True):
                    self._host_errors[name] += int(count)

        jax.debug.callback(record, invalid_ids, overflow_rows,
                           jnp.asarray(dropped_low_latency_rows, jnp.int32))

    def errors(self) -> dict:
        """Totals since creation (or the last ``check``), summed over ranks: a dict with
        ``invalid_expert_ids`` (ids outside ``[-1, E)`` met by get_dispatch_layout, dispatch and
        low_latency_dispatch; combines and cached dispatches do not count), ``overflow_rows``
        (normal dispatch rows past ``capacity``), ``dropped_low_latency_rows`` (low-latency
        selections past the ``max_tokens_per_rank`` rows a source has at one expert: only
        possible when a token repeats an expert in its top-k), ``timeouts`` (a description
        of every timed-out wait) and ``transport`` (what the emulated transport's host proxies
        of this process found, each once: ``JAX_EP_DEVICE_TRANSPORT=emulated`` only)."""
        self._check_open()
        if self.backend == "cuda" and self._allocated:
            module, _ = cuda.load_extension()
            # Timeout records live in host memory: read them first, without a CUDA call, since
            # a device whose kernel trapped has lost its context.
            transport = list(module.take_transport_errors(self.buffer_id))
            stuck = [r for r in module.read_timeouts(self.buffer_id) if r["timed_out"]]
            if stuck:
                return dict(dict.fromkeys(ERROR_COUNTERS, 0), transport=transport,
                            timeouts=[describe_timeout(r, self._host_of_rank(r["device"]))
                                      for r in stuck])
            records = module.read_errors(self.buffer_id)
            counts = {name: sum(r[name] for r in records) for name in ERROR_COUNTERS}
        else:
            transport = []
            jax.effects_barrier()
            with self._errors_lock:
                counts = dict(self._host_errors)
        if ipc.spans_processes(self.mesh.devices.flat):
            # Each process counts only its own ranks: sum over processes (a collective, so
            # every process calls errors()/check() at the same point). Through the key-value
            # store, not an XLA all-gather: no NCCL communicator to set up (~0.5 s the first
            # time), and it works where NCCL refuses (processes sharing a GPU).
            self._error_sums += 1
            counts = ipc.sum_over_processes(self, f"errors{self._error_sums}", counts)
        return dict(counts, timeouts=[], transport=transport)

    def _host_of_rank(self, ordinal):
        """``rank -> host`` of the EP group of this process's CUDA device ``ordinal``, from the
        hosts gathered at creation (none when the mesh has one process: all ranks are here)."""
        hosts = getattr(self, "_process_hosts", None)
        if hosts is None:
            return None
        for group in self._ep_group_devices():
            if any(d.process_index == jax.process_index() and d.local_hardware_id == ordinal
                   for d in group):
                return lambda rank, group=group: (
                    hosts.get(group[rank].process_index) if 0 <= rank < len(group) else None)
        return None

    def check(self) -> None:
        """Raises RuntimeError if any call so far met bad input or a timeout, then resets.

        Waits for pending work (host synchronisation: call it between steps, not inside one).
        """
        errors = self.errors()
        problems = [f"the emulated transport: {e}" for e in errors["transport"]]
        if errors["invalid_expert_ids"]:
            problems.append(f"{errors['invalid_expert_ids']} expert ids outside "
                            f"[-1, {self.num_experts}) were treated as -1")
        if errors["overflow_rows"]:
            problems.append(f"receive capacity {self.capacity} overflowed: "
                            f"{errors['overflow_rows']} rows were dropped (raise capacity)")
        if errors["dropped_low_latency_rows"]:
            problems.append(f"{errors['dropped_low_latency_rows']} low-latency dispatch rows "
                            f"were dropped: a rank sent more than max_tokens_per_rank="
                            f"{self.max_tokens_per_rank} rows to one expert (a token repeats "
                            f"an expert in its top-k)")
        problems += [f"timeout: {t}" for t in errors["timeouts"]]
        hint = emulated_transport_hint() if errors["timeouts"] else ""
        if hint:
            problems.append(hint)
        if not errors["timeouts"]:  # a device that timed out cannot be reset
            self._reset_errors()
        if problems:
            raise RuntimeError(f"jax_ep {self!r}: " + "; ".join(problems))

    def _reset_errors(self):
        if self.backend == "cuda" and self._allocated:
            module, _ = cuda.load_extension()
            module.reset_errors(self.buffer_id)
        with self._errors_lock:
            self._host_errors = dict.fromkeys(ERROR_COUNTERS, 0)
