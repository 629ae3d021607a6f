"""The backend gate: whether the cuda backend runs on a Buffer's devices, and why not.

  - `auto_backend(devices)` -> `("cuda" | "reference", reasons)`: what `Buffer(backend="auto")`
    uses for the EP group(s) on `devices`; `reasons` says why not "cuda" (empty when "cuda").
  - `check_cuda_backend(devices, workspace_bytes_needed)` raises `RuntimeError` listing every
    reason `Buffer(backend="cuda")` cannot run there.
  - `decide_backend(...)`: the same decision from facts already gathered (pure; tests).
  - `cross_host_problem(ep_groups, hosts)`: why EP groups that span hosts cannot use the cuda
    backend, naming the process layout to use (pure; the Buffer calls it once it knows every
    process's host).

Sharding model: a Buffer's mesh is cut into EP groups (the slices along the EP axis); the cuda
backend needs peer access between every two GPUs of one group (they write into each other's
memory), not across groups. GPUs of other processes (one process per GPU) are reached through
CUDA IPC; the Buffer checks that they share this host when it exchanges its workspaces.

Nothing here initialises JAX's GPU backend except where the choice needs `jax.default_backend()`
(`auto_backend` without an explicit `default_backend`). The runtime imports this module; the
environment report (`jax_ep.tools.env_report`) builds on it, never the other way round.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import jax

from jax_ep.system import cuda_driver, probes
from jax_ep.system.compat import (
    cmake_architectures,
    code_for,
    cuda_version_text,
    describe_architectures,
    driver_problem,
    parse_architectures,
    parse_cc,
)
from jax_ep.system.probes import (
    describe_device,
    probe_extension,
    probe_gpus,
    probe_peers,
    try_driver,
    xla_memory_settings,
)
from jax_ep.system.records import (
    BackendDecision,
    DeviceInfo,
    ExtensionInfo,
    GpuInfo,
    PeerLink,
    XlaMemorySettings,
)

# What the cuda kernels need of a GPU (csrc/common/sync.cuh, low_latency/common.cuh):
# loads and stores with acquire/release semantics at system scope and fence.acq_rel.sys (PTX of
# sm_70 and newer), and cooperative launches (every block of a low-latency kernel resident at
# once; the driver's cudaDevAttrCooperativeLaunch, checked per GPU). Nothing newer: fp8 casts
# below sm_89 are converted in software.
MIN_COMPUTE_CAPABILITY = (7, 0)
_GIB = 1 << 30

def _gpus_text(ordinals: Sequence[int]) -> str:
    ordinals = sorted(set(ordinals))
    return ("GPU " if len(ordinals) == 1 else "GPUs ") + ", ".join(str(o) for o in ordinals)


def _gib(n: int) -> str:
    return f"{n / _GIB:.1f} GiB"



def _extension_reason(extension: ExtensionInfo) -> str:
    """Why jax_ep._C does not import, and the fix. A source checkout on the import path (Python
    run from inside it) hides an installed build: then the build is fine, and the fix is where
    Python runs, not nvcc."""
    head = f"the CUDA extension jax_ep._C does not import ({extension.error})"
    if extension.shadowed_build:
        return (
            f"{head}: jax_ep was imported from the source tree {extension.source_tree}, which "
            f"has no build and hides the installed one ({extension.shadowed_build}); run from "
            f"another directory (the console scripts jax-ep-env and jax-ep-demo work from "
            f"anywhere)"
        )
    if extension.source_tree:
        return (
            f"{head}: jax_ep was imported from the source tree {extension.source_tree}, which "
            f"has no build, and no installed jax_ep has one: on a machine with nvcc, pip "
            f"install . there, then run from another directory"
        )
    return f"{head}: build it on a machine with nvcc (JAX_EP_ENABLE_CUDA=ON pip install .)"


def decide_backend(
    devices: Sequence[DeviceInfo],
    *,
    default_backend: str | None,
    extension: ExtensionInfo,
    gpus: Sequence[GpuInfo] = (),
    peers: Sequence[PeerLink] = (),
    ep_groups: Sequence[Sequence[DeviceInfo]] | None = None,
    workspace_bytes_needed: int | None = None,
    xla_memory: XlaMemorySettings | None = None,
    driver_gpu_count: int = 0,
    driver_cuda_version: int | None = None,
) -> BackendDecision:
    """The backend for `devices` from facts already gathered (pure; see `auto_backend`).

    Args:
      devices: every device of the Buffer's mesh.
      default_backend: jax.default_backend().
      extension: the state of jax_ep._C.
      gpus: driver facts of this process's GPUs (memory, cooperative launch); a GPU missing
        here skips those checks.
      peers: peer access between this process's GPUs; a missing pair is not held against "cuda".
      ep_groups: the EP groups (slices of the mesh along the EP axis); default: one group of all
        `devices`. Peer access is needed within a group only.
      workspace_bytes_needed: per-device workspace of the Buffer; None skips the memory check.
      xla_memory: XLA's memory settings, named in the memory fix.
      driver_gpu_count: GPUs the CUDA driver sees, to explain a jax that sees none.
      driver_cuda_version: cuDriverGetVersion (e.g. 12080), checked against the CUDA runtime
        jax_ep._C was built with; None skips that check.

    Returns:
      BackendDecision("cuda", ()) or BackendDecision("reference", reasons).
    """
    reasons: list[str] = []
    cuda_devices = [d for d in devices if d.is_cuda]

    # Platform.
    if not cuda_devices:
        text = f"no GPU: jax's default backend is {default_backend or 'unavailable'}"
        if driver_gpu_count:
            text += (
                f", although the CUDA driver sees {driver_gpu_count} GPU(s): install a CUDA "
                f"build of jax (pip install -U \"jax[cuda12]\") and check JAX_PLATFORMS"
            )
        else:
            text += "; the reference backend runs here"
        reasons.append(text)
    else:
        if default_backend != "gpu":
            reasons.append(
                f"jax's default backend is {default_backend}, not gpu: unset JAX_PLATFORMS "
                f"or set it to cuda"
            )
        others = [d for d in devices if not d.is_cuda]
        if others:
            kinds = sorted({d.platform if d.platform != "gpu" else "non-CUDA gpu" for d in others})
            ids = ", ".join(str(d.id) for d in others[:8]) + (", ..." if len(others) > 8 else "")
            reasons.append(
                f"devices {ids} are {'/'.join(kinds)}, not CUDA GPUs: build the mesh from "
                f"jax.devices('gpu')"
            )

    # Extension.
    if not extension.importable:
        reasons.append(_extension_reason(extension))

    # The driver against the CUDA runtime linked into jax_ep._C.
    runtime = extension.cuda_runtime_version if extension.importable else None
    old_driver = driver_problem(driver_cuda_version, runtime) if cuda_devices else None
    if old_driver:
        reasons.append(old_driver)

    # Compute capability, cooperative launch and the code built for it, one line per (name, cc).
    by_kind: dict[tuple[str, str], list[int]] = {}
    for d in cuda_devices:
        label = d.local_ordinal if d.local_ordinal is not None else d.id
        by_kind.setdefault((d.kind, d.compute_capability or "unknown"), []).append(label)
    archs = extension.cuda_architectures if extension.importable else None
    min_text = f"{MIN_COMPUTE_CAPABILITY[0]}.{MIN_COMPUTE_CAPABILITY[1]}"
    for (kind, cc_text), labels in by_kind.items():
        cc = parse_cc(cc_text)
        if cc is None:
            continue
        who = f"{_gpus_text(labels)} ({kind}): compute capability {cc_text}"
        if cc < MIN_COMPUTE_CAPABILITY:
            reasons.append(
                f"{who}, but the cuda kernels need compute capability {min_text} or newer "
                f"(loads and stores with acquire/release semantics at system scope): use the "
                f"reference backend (backend='reference') on these GPUs"
            )
            continue
        if archs is None:
            continue
        code = code_for(archs, cc)
        rebuild = f"JAX_EP_CUDA_ARCHS=\"{cmake_architectures(archs)};{cc[0]}{cc[1]}\""
        if code is None and not parse_architectures(archs).unknown:
            reasons.append(
                f"{who}, but jax_ep._C carries no code that runs on it (built for "
                f"{describe_architectures(archs)}; SASS sm_N runs on compute capability N/10.x, "
                f"PTX compute_N on N/10 and newer): rebuild with {rebuild}"
            )
        elif (code is not None and code.startswith("compute_") and not old_driver
              and runtime is not None and driver_cuda_version is not None
              and driver_cuda_version < runtime):
            reasons.append(
                f"{who} runs jax_ep._C through its PTX {code}, which the driver JIT-compiles, "
                f"but the driver (CUDA {cuda_version_text(driver_cuda_version)}) is older than "
                f"the toolkit that built that PTX (CUDA {cuda_version_text(runtime)}) and "
                f"cannot read it: update the driver, or rebuild with {rebuild} to carry SASS "
                f"for these GPUs"
            )
    no_cooperative = [g for g in gpus if g.cooperative_launch is False and g.ordinal in
                      {d.local_ordinal for d in cuda_devices if d.addressable}]
    if no_cooperative:
        names = sorted({g.name for g in no_cooperative})
        reasons.append(
            f"{_gpus_text([g.ordinal for g in no_cooperative])} ({', '.join(names)}): no "
            f"cooperative launch (cudaDevAttrCooperativeLaunch is 0), which the low-latency "
            f"kernels need (all blocks of a launch resident at once): use the reference backend "
            f"(backend='reference')"
        )

    # GPUs of other processes are reached through CUDA IPC (jax_ep/peers/ipc.py); that
    # they share this host is checked when the Buffer exchanges its workspaces.

    # Group size and peer access (this process's GPUs only).
    groups = [list(g) for g in ep_groups] if ep_groups is not None else [list(devices)]
    largest = max((len(g) for g in groups), default=0)
    # The limit is the kernels' (jax_ep._C.max_ranks()): unknown without the extension.
    limit = extension.max_ranks
    if cuda_devices and limit is not None and largest > limit:
        reasons.append(
            f"an EP group has {largest} ranks; the cuda backend supports up to {limit} "
            f"(one NVLink domain): use a smaller EP axis"
        )
    access = {(p.src, p.dst): p.access for p in peers}
    missing: dict[int, set[int]] = {}
    for group in groups:
        local = [d.local_ordinal for d in group
                 if d.is_cuda and d.addressable and d.local_ordinal is not None]
        for src in local:
            for dst in local:
                if src != dst and access.get((src, dst)) is False:
                    missing.setdefault(src, set()).add(dst)
    for src in sorted(missing):
        reasons.append(
            f"GPU {src} has no peer access to {_gpus_text(missing[src])}: the cuda backend writes "
            f"into its peers' memory; put each EP group on GPUs that reach each other "
            f"(nvidia-smi topo -p2p r) or use the reference backend (backend='reference')"
        )

    # Memory for the workspace.
    if workspace_bytes_needed is not None and cuda_devices:
        ordinals = {d.local_ordinal for d in cuda_devices if d.addressable}
        short = [g for g in gpus if g.ordinal in ordinals and g.free_memory_bytes is not None
                 and g.free_memory_bytes < workspace_bytes_needed]
        if short:
            settings = xla_memory or xla_memory_settings()
            have = min(g.free_memory_bytes for g in short)
            fix = (
                f"lower XLA_PYTHON_CLIENT_MEM_FRACTION (now {settings.mem_fraction:g}) or set "
                f"XLA_PYTHON_CLIENT_PREALLOCATE=false before jax starts"
                if settings.preallocate else "free device memory held by other arrays or processes"
            )
            reasons.append(
                f"not enough free device memory on {_gpus_text([g.ordinal for g in short])}: "
                f"need {_gib(workspace_bytes_needed)}, have {_gib(have)}; {fix}, or lower "
                f"max_tokens_per_rank"
            )

    return BackendDecision("reference", tuple(reasons)) if reasons else BackendDecision("cuda", ())


# The layout a job across hosts takes: one process per GPU (docs/process_models.md).
ONE_PROCESS_PER_GPU = (
    "one process per GPU on every host (srun --ntasks-per-node=<GPUs> --gpus-per-task=1 "
    "--gpu-bind=none, mpirun --map-by ppr:<GPUs>:node, or python -m jax_ep.launch -n <GPUs> on "
    "each host; docs/process_models.md, \"A job across hosts\")"
)


# How the cuda backend reaches ranks on other hosts: NVSHMEM's device API, the workspaces on its
# symmetric heap (docs/process_models.md, "What spans hosts").
ACROSS_HOSTS_SETTINGS = "JAX_EP_PEER_MAPPING=nvshmem and JAX_EP_DEVICE_TRANSPORT=nvshmem"


def cross_host_problem(ep_groups: Sequence[Sequence[Any]], hosts: Mapping[int, str],
                       device_transport: str = "stores") -> str:
    """Why the cuda backend cannot run `ep_groups`, or "" when it can.

    A group inside one host reaches its peers through peer mappings. A group across hosts needs
    a transport that reaches other hosts: NVSHMEM's device API (`device_transport` "nvshmem"),
    which binds each process to one GPU (PE), or the emulated one, which stands in for a
    network between hosts faked on one machine (jax_ep.launch --fake-hosts). So a group across
    hosts driven by processes of several GPUs each is in a layout that cannot cross hosts at
    all, and the reason names the layout to use; with one process per GPU it names the
    settings.

    Args:
      ep_groups: the devices of every EP group (jax.Device or DeviceInfo: `process_index` is
        read), in rank order.
      hosts: the host name of every process index of the mesh.
      device_transport: how the Buffer's ops reach peers (`JAX_EP_DEVICE_TRANSPORT`).

    Returns:
      "" or the reason, naming the first group that spans hosts, its hosts and the fix.
    """
    per_process = Counter(d.process_index for g in ep_groups for d in g)
    for g, group in enumerate(ep_groups):
        names = sorted({hosts[d.process_index] for d in group})
        if len(names) < 2:
            continue
        several = sorted(p for p in {d.process_index for d in group} if per_process[p] > 1)
        if several:
            most = max(per_process[p] for p in several)
            who = (f"process {several[0]} drives {most} GPUs" if len(several) == 1 else
                   f"processes {several} drive up to {most} GPUs each")
            return (f"EP group {g} spans hosts {names} while {who} of the mesh, a layout that "
                    f"cannot cross hosts (NVSHMEM, which reaches other hosts, binds one process "
                    f"to one GPU): start {ONE_PROCESS_PER_GPU}, with {ACROSS_HOSTS_SETTINGS}")
        if device_transport in ("nvshmem", "emulated"):
            continue
        return (f"EP group {g} spans hosts {names}: the cuda backend reaches ranks on other "
                f"hosts through NVSHMEM's device API only: set {ACROSS_HOSTS_SETTINGS} "
                f"(docs/process_models.md, \"What spans hosts\")")
    return ""


def _gather_and_decide(
    devices: Sequence[Any],
    *,
    ep_groups: Sequence[Sequence[Any]] | None,
    workspace_bytes_needed: int | None,
    default_backend: str | None,
    extension: ExtensionInfo | None,
    gpus: Sequence[GpuInfo] | None,
    peers: Sequence[PeerLink] | None,
    driver_cuda_version: int | None = None,
) -> BackendDecision:
    infos = [describe_device(d) for d in devices]
    groups = None if ep_groups is None else [[describe_device(d) for d in g] for g in ep_groups]
    if default_backend is None:
        default_backend = jax.default_backend()
    if extension is None:
        extension = probe_extension()
    ordinals = sorted({d.local_ordinal for d in infos
                       if d.is_cuda and d.addressable and d.local_ordinal is not None})
    if gpus is None:
        gpus = (probe_gpus(ordinals, free_memory=workspace_bytes_needed is not None,
                            create_context=False, nvlinks=False)
                if ordinals else ())
    if peers is None:
        peers = probe_peers(ordinals) if len(ordinals) > 1 else ()
    driver_count = 0
    if not any(d.is_cuda for d in infos):
        driver, _ = cuda_driver.get_driver()
        if driver is not None and driver.initialized:
            driver_count = try_driver(driver.device_count) or 0
    if driver_cuda_version is None and any(d.is_cuda for d in infos):
        driver_cuda_version = probes.driver_cuda_version()
    return decide_backend(
        infos, default_backend=default_backend, extension=extension, gpus=gpus, peers=peers,
        ep_groups=groups, workspace_bytes_needed=workspace_bytes_needed,
        driver_gpu_count=driver_count, driver_cuda_version=driver_cuda_version,
    )


def auto_backend(
    devices: Sequence[Any],
    *,
    ep_groups: Sequence[Sequence[Any]] | None = None,
    workspace_bytes_needed: int | None = None,
    default_backend: str | None = None,
    extension: ExtensionInfo | None = None,
    gpus: Sequence[GpuInfo] | None = None,
    peers: Sequence[PeerLink] | None = None,
    driver_cuda_version: int | None = None,
) -> tuple[str, list[str]]:
    """The backend Buffer(backend="auto") uses on `devices`, and why.

    "cuda" only when jax's default backend is gpu, jax_ep._C imports and the driver supports
    the CUDA runtime it was built with, every device is a CUDA GPU of compute capability >= 7.0
    that supports cooperative launches and for which jax_ep._C carries SASS or PTX (PTX only when
    the driver is at least as new as the toolkit that built it), every EP group has at most
    jax_ep._C.max_ranks() ranks whose GPUs (of this process) have peer access to each other,
    and (when `workspace_bytes_needed` is given) every GPU has that much free memory.
    Call on the host, outside jit.

    Args:
      devices: the Buffer's devices (jax.Device, or DeviceInfo for tests), e.g. mesh.devices.flat.
      ep_groups: the EP groups as sequences of the same kind of device; default one group.
      workspace_bytes_needed: per-device workspace; None skips the memory check.
      default_backend: overrides jax.default_backend() (tests).
      extension: overrides the probe of jax_ep._C (tests).
      gpus: overrides the driver's GPU facts: free memory, cooperative launch (tests).
      peers: overrides the driver's peer access facts (tests).
      driver_cuda_version: overrides cuDriverGetVersion, e.g. 12080 (tests).

    Returns:
      ("cuda", []) or ("reference", reasons), each reason naming the problem and its fix.
    """
    decision = _gather_and_decide(
        devices, ep_groups=ep_groups, workspace_bytes_needed=workspace_bytes_needed,
        default_backend=default_backend, extension=extension, gpus=gpus, peers=peers,
        driver_cuda_version=driver_cuda_version,
    )
    return decision.backend, list(decision.reasons)


def check_cuda_backend(
    devices: Sequence[Any],
    workspace_bytes_needed: int | None,
    *,
    ep_groups: Sequence[Sequence[Any]] | None = None,
    default_backend: str | None = None,
    extension: ExtensionInfo | None = None,
    gpus: Sequence[GpuInfo] | None = None,
    peers: Sequence[PeerLink] | None = None,
    driver_cuda_version: int | None = None,
) -> None:
    """The start-up checks of Buffer(backend="cuda"); same arguments as `auto_backend`.

    Raises:
      RuntimeError: listing every reason the cuda backend cannot run on `devices`, each with
        its fix.
    """
    backend, reasons = auto_backend(
        devices, ep_groups=ep_groups, workspace_bytes_needed=workspace_bytes_needed,
        default_backend=default_backend, extension=extension, gpus=gpus, peers=peers,
        driver_cuda_version=driver_cuda_version,
    )
    if backend != "cuda":
        lines = "\n".join(f"  - {r}" for r in reasons)
        raise RuntimeError(
            f"Buffer(backend='cuda') cannot run on these devices:\n{lines}\n"
            f"Use backend='auto' (falls back to the reference backend) or backend='reference'; "
            f"`python -m jax_ep.env` shows the details."
        )
