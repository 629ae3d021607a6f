"""What jax_ep will use on this machine, and why: `python -m jax_ep.env [--json]`.

The report lists the versions (jax_ep, jax, jaxlib, CUDA driver and runtime), every local GPU
(name, compute capability, total and free memory), the peer access between local GPUs and whether
it goes over NVLink, whether the CUDA extension `jax_ep._C` imports, the CUDA version and the
architectures it was built for (SASS and PTX), whether the driver runs that CUDA version and the
code each GPU would run, NVSHMEM, XLA's memory settings, the device memory one Buffer of a given
configuration needs, and the backend `Buffer(backend="auto")` would pick, with the reason and the
fix for every "no".

Library use:
  - `auto_backend(devices)` -> `("cuda" | "xla", reasons)`: what `Buffer(backend="auto")` uses for
    the EP group(s) on `devices`; `reasons` says why not "cuda" (empty when "cuda").
  - `check_cuda_backend(devices, workspace_bytes_needed)` raises `RuntimeError` listing every
    reason `Buffer(backend="cuda")` cannot run there.
  - `collect(spec)` -> `EnvReport` (a tree of frozen dataclasses), `format_report(report)` -> text.

Sharding model: a Buffer's mesh is cut into EP groups (the slices along the EP axis); the cuda
backend needs peer access between every two GPUs of one group (they write into each other's
memory), not across groups. GPUs of other processes (one process per GPU) are reached through
CUDA IPC; the Buffer checks that they share this host when it exchanges its workspaces.

None of this initialises JAX's GPU backend except where the backend choice needs `jax.devices()`
(`collect`, and `auto_backend` without an explicit `default_backend`). Free device memory is
measured after that, so it is what a Buffer can still allocate beside XLA's preallocated pool.

JSON schema (`--json`; `schema_version` 1; keys are stable, `null` where unknown):

  {
    "schema_version": 1,
    "versions": {"jax_ep": str|null, "jax": str, "jaxlib": str|null, "python": str,
                 "cuda_driver": str|null (e.g. "12.8"), "cuda_runtime": str ("unknown" if so),
                 "cuda_runtime_source": str|null, "jax_cuda_plugin": str|null},
    "driver": {"available": bool, "reason": str|null, "device_count": int,
               "nvml": bool, "nvml_reason": str|null},
    "jax": {"default_backend": str|null, "process_index": int, "process_count": int,
            "device_count": int, "error": str|null,
            "local_devices": [{"id": int, "platform": str, "kind": str, "process_index": int,
                               "addressable": bool, "local_ordinal": int|null,
                               "compute_capability": str|null, "is_cuda": bool}]},
    "gpus": [{"ordinal": int, "name": str, "compute_capability": str (e.g. "9.0"),
              "total_memory_bytes": int|null, "free_memory_bytes": int|null,
              "pci_bus_id": str|null, "nvlinks_active": int|null,
              "cooperative_launch": bool|null}],
    "peers": [{"src": int, "dst": int, "access": bool|null, "native_atomics": bool|null,
               "performance_rank": int|null, "link": "nvlink"|"pcie"|"none"|"unknown",
               "link_source": "nvml"|"cuda"|null}],
    "extension": {"importable": bool,
                  "cuda_architectures": str|null (e.g. "sm_80 sm_90 compute_90"),
                  "path": str|null, "error": str|null, "nvshmem_built": bool|null,
                  "cuda_runtime_version": int|null (CUDART_VERSION of the build, e.g. 13000)},
    "nvshmem": {"package": str|null, "version": str|null, "host_library": str|null,
                "reason": str|null},
    "xla_memory": {"preallocate": bool, "mem_fraction": float, "allocator": str,
                   "preallocate_env": str|null, "mem_fraction_env": str|null,
                   "allocator_env": str|null, "notes": [str]},
    "workspace": {"spec": {"num_ranks": int, "num_experts": int, "hidden": int,
                           "max_tokens_per_rank": int, "num_topk": int, "capacity": int,
                           "dtype_bytes": int, "low_latency": bool},
                  "bytes": int, "exact": bool, "source": str},
    "backend": {"backend": "cuda"|"xla", "reasons": [str]}
  }

`peers` has one entry per ordered pair of distinct local GPUs; `link` is "nvlink" when NVML says
so (`link_source` "nvml") or, without NVML, when the pair supports native peer atomics, which
PCIe peer links do not (`link_source` "cuda"); "pcie" for other peer access, "none" without.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.metadata
import json
import math
import os
import platform
import re
import sys
from collections.abc import Sequence
from typing import Any

import jax

from jax_ep import _cuda_driver

SCHEMA_VERSION = 1

# What the cuda kernels need of a GPU (csrc/kernels/common/sync.cuh, low_latency_common.cuh):
# loads and stores with acquire/release semantics at system scope and fence.acq_rel.sys (PTX of
# sm_70 and newer), and cooperative launches (every block of a low-latency kernel resident at
# once; the driver's cudaDevAttrCooperativeLaunch, checked per GPU). Nothing newer: fp8 casts
# below sm_89 are converted in software.
MIN_COMPUTE_CAPABILITY = (7, 0)
# The driver a CUDA runtime of each major version needs (the runtime is linked into jax_ep._C).
_MIN_DRIVER_FOR_CUDA_MAJOR = {11: "450", 12: "525", 13: "580"}
# Most ranks in one EP group of the cuda backend (one NVLink domain; csrc/runtime/context.h).
MAX_CUDA_RANKS = 8
# XLA's defaults (XLA_PYTHON_CLIENT_PREALLOCATE / _MEM_FRACTION / _ALLOCATOR unset).
DEFAULT_MEM_FRACTION = 0.75
# Control words at the start of every workspace (approximate formula only).
_WORKSPACE_HEADER_BYTES = 64 * 1024
_SCALE_BLOCK = 128  # channels per fp8 scale
_GIB = 1 << 30
_MIB = 1 << 20

_NVSHMEM_PACKAGES = ("nvidia-nvshmem-cu13", "nvidia-nvshmem-cu12")
_JAX_CUDA_PLUGINS = ("jax-cuda13-plugin", "jax-cuda12-plugin")
# CUDA runtime wheels per CUDA major (CUDA 13 dropped the -cuXX suffix).
_CUDA_RUNTIME_PACKAGES = {
    "13": ("nvidia-cuda-runtime", "nvidia-cuda-runtime-cu13"),
    "12": ("nvidia-cuda-runtime-cu12",),
}
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


# --------------------------------------------------------------------------------------------
# The report tree.


@dataclasses.dataclass(frozen=True)
class Versions:
    """Software versions.

    Attributes:
      jax_ep: the installed jax_ep version, None when running from a source tree.
      jax: jax.__version__.
      jaxlib: the jaxlib version, None if not found.
      python: the interpreter version.
      cuda_driver: the CUDA version the driver supports, e.g. "12.8"; None without a driver.
      cuda_runtime: the CUDA runtime version jax uses, e.g. "12.9.79", or "unknown".
      cuda_runtime_source: where `cuda_runtime` was read (a package, or XLA's platform version).
      jax_cuda_plugin: "jax-cuda12-plugin 0.10.2" when a CUDA plugin of jax is installed.
    """

    jax_ep: str | None
    jax: str
    jaxlib: str | None
    python: str
    cuda_driver: str | None
    cuda_runtime: str
    cuda_runtime_source: str | None
    jax_cuda_plugin: str | None


@dataclasses.dataclass(frozen=True)
class DriverInfo:
    """The CUDA driver and NVML as this process sees them.

    Attributes:
      available: libcuda loaded and cuInit succeeded.
      reason: why not, e.g. "libcuda.so.1 not found (no NVIDIA driver on this machine)".
      device_count: CUDA devices visible to this process (0 when not available).
      nvml: whether NVML (libnvidia-ml) loaded, for NVLink state.
      nvml_reason: why not.
    """

    available: bool
    reason: str | None
    device_count: int
    nvml: bool
    nvml_reason: str | None


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
    """One JAX device, reduced to what the backend choice needs. Tests build these directly.

    Attributes:
      id: jax's global device id.
      platform: "gpu", "cpu", "tpu", ...
      kind: jax's device_kind, e.g. "NVIDIA H200" or "cpu".
      process_index: the process that owns the device.
      addressable: whether this process owns it (its GPUs can be queried here).
      local_ordinal: the CUDA device ordinal in its process (local_hardware_id), None if not a GPU.
      compute_capability: e.g. "9.0" for CUDA GPUs, else None.
      is_cuda: an NVIDIA GPU driven by CUDA (not ROCm, not a CPU).
    """

    id: int
    platform: str
    kind: str
    process_index: int
    addressable: bool
    local_ordinal: int | None
    compute_capability: str | None
    is_cuda: bool


@dataclasses.dataclass(frozen=True)
class JaxInfo:
    """What jax sees.

    Attributes:
      default_backend: jax.default_backend(), None if it failed.
      process_index: this process.
      process_count: processes in the job.
      device_count: global devices.
      local_devices: this process's devices.
      error: the exception text when jax.devices() failed.
    """

    default_backend: str | None
    process_index: int
    process_count: int
    device_count: int
    local_devices: tuple[DeviceInfo, ...]
    error: str | None


@dataclasses.dataclass(frozen=True)
class GpuInfo:
    """One local GPU as the CUDA driver sees it.

    Attributes:
      ordinal: CUDA device ordinal in this process.
      name: e.g. "NVIDIA H200".
      compute_capability: "major.minor", e.g. "9.0".
      total_memory_bytes: device memory, None if the query failed.
      free_memory_bytes: free now (after XLA's pool when JAX runs on it), None if not measured.
      pci_bus_id: e.g. "0000:18:00.0".
      nvlinks_active: NVLinks up according to NVML, None without NVML.
      cooperative_launch: cudaDevAttrCooperativeLaunch (the low-latency kernels launch
        cooperatively), None if unknown.
    """

    ordinal: int
    name: str
    compute_capability: str
    total_memory_bytes: int | None
    free_memory_bytes: int | None
    pci_bus_id: str | None
    nvlinks_active: int | None
    cooperative_launch: bool | None = None


@dataclasses.dataclass(frozen=True)
class PeerLink:
    """Peer access from GPU `src` to GPU `dst` (ordered: access may differ by direction).

    Attributes:
      src: CUDA ordinal of the accessing GPU.
      dst: CUDA ordinal of the GPU whose memory is accessed.
      access: cuDeviceCanAccessPeer, None if unknown.
      native_atomics: CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED, None if unknown.
      performance_rank: CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK (lower is faster), None if unknown.
      link: "nvlink", "pcie", "none" (no peer access) or "unknown".
      link_source: "nvml" (NVML's NVLink P2P status), "cuda" (inferred from native atomics), None.
    """

    src: int
    dst: int
    access: bool | None
    native_atomics: bool | None
    performance_rank: int | None
    link: str
    link_source: str | None


@dataclasses.dataclass(frozen=True)
class ExtensionInfo:
    """The CUDA extension jax_ep._C.

    Attributes:
      importable: whether `import jax_ep._C` works.
      cuda_architectures: the code it carries, "sm_N" for SASS and "compute_N" for PTX, e.g.
        "sm_80 sm_90 compute_90" (builds before that format: their CMAKE_CUDA_ARCHITECTURES,
        e.g. "90"), None if unknown.
      path: the file it was loaded from.
      error: the import error, when not importable.
      nvshmem_built: whether it was built with NVSHMEM's headers (JAX_EP_TRANSPORT=nvshmem),
        None if unknown.
      cuda_runtime_version: CUDART_VERSION of the toolkit that built it, e.g. 13000 for 13.0
        (its CUDA runtime is linked in, so the driver must support it), None if unknown.
    """

    importable: bool
    cuda_architectures: str | None
    path: str | None
    error: str | None
    nvshmem_built: bool | None = None
    cuda_runtime_version: int | None = None


@dataclasses.dataclass(frozen=True)
class NvshmemInfo:
    """NVSHMEM (the JAX_EP_TRANSPORT=nvshmem transport, jax_ep/_nvshmem.py).

    Attributes:
      package: the installed wheel, e.g. "nvidia-nvshmem-cu12", None if none is installed.
      version: its version.
      host_library: path of libnvshmem_host.so* inside the package, None if not found.
      reason: why NVSHMEM is not usable, None when it is.
    """

    package: str | None
    version: str | None
    host_library: str | None
    reason: str | None


@dataclasses.dataclass(frozen=True)
class XlaMemorySettings:
    """XLA's GPU memory pool settings, which decide how much memory is left for a Buffer.

    Attributes:
      preallocate: XLA_PYTHON_CLIENT_PREALLOCATE (default true): XLA takes `mem_fraction` of
        every GPU at start-up.
      mem_fraction: XLA_PYTHON_CLIENT_MEM_FRACTION (default 0.75).
      allocator: XLA_PYTHON_CLIENT_ALLOCATOR ("default" = BFC pool; "platform" = no pool).
      preallocate_env: the raw variable, None when unset (likewise the two below).
      mem_fraction_env: the raw variable.
      allocator_env: the raw variable.
      notes: problems with the values (e.g. unparsable), each with the fix.
    """

    preallocate: bool
    mem_fraction: float
    allocator: str
    preallocate_env: str | None
    mem_fraction_env: str | None
    allocator_env: str | None
    notes: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class BufferSpec:
    """The Buffer configuration whose memory is estimated (Buffer's own arguments).

    Attributes:
      num_ranks: R, devices in one EP group.
      num_experts: E, global experts; a multiple of num_ranks.
      hidden: H, channels per token; a multiple of 128.
      max_tokens_per_rank: T_max.
      num_topk: K.
      capacity: normal-mode receive rows; 0 means the default R * T_max.
      dtype_bytes: bytes per element of the Buffer's dtype (bfloat16: 2, float32: 4).
      low_latency: whether the low-latency regions are allocated too.
    """

    num_ranks: int
    num_experts: int = 256
    hidden: int = 7168
    max_tokens_per_rank: int = 4096
    num_topk: int = 8
    capacity: int = 0
    dtype_bytes: int = 2
    low_latency: bool = False

    def __post_init__(self):
        positive = ("num_ranks", "num_experts", "hidden", "max_tokens_per_rank", "num_topk")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_experts % self.num_ranks:
            raise ValueError(
                f"num_experts ({self.num_experts}) must be a multiple of num_ranks "
                f"({self.num_ranks}): choose num_experts = k * {self.num_ranks}"
            )
        if self.hidden % _SCALE_BLOCK:
            raise ValueError(f"hidden must be a multiple of {_SCALE_BLOCK}, got {self.hidden}")
        if self.num_topk > self.num_experts:
            raise ValueError(
                f"num_topk ({self.num_topk}) must be <= num_experts ({self.num_experts})"
            )
        if not 0 <= self.capacity <= self.num_ranks * self.max_tokens_per_rank:
            raise ValueError(
                f"capacity must be in [0, num_ranks * max_tokens_per_rank = "
                f"{self.num_ranks * self.max_tokens_per_rank}] (0 = that default), "
                f"got {self.capacity}"
            )
        if self.dtype_bytes not in (2, 4):
            raise ValueError(
                f"dtype_bytes must be 2 (bfloat16) or 4 (float32), got {self.dtype_bytes}"
            )


@dataclasses.dataclass(frozen=True)
class WorkspaceEstimate:
    """Device memory one Buffer allocates on every device of its mesh.

    Attributes:
      spec: the configuration.
      bytes: bytes per device.
      exact: True when computed by jax_ep._C.workspace_bytes, False for the approximate formula.
      source: "jax_ep._C.workspace_bytes" or "approximate formula".
    """

    spec: BufferSpec
    bytes: int
    exact: bool
    source: str


@dataclasses.dataclass(frozen=True)
class BackendDecision:
    """The backend Buffer(backend="auto") picks.

    Attributes:
      backend: "cuda" or "xla".
      reasons: why not "cuda", each with its fix; empty when "cuda".
    """

    backend: str
    reasons: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class EnvReport:
    """Everything `python -m jax_ep.env` prints (see the module docstring for the JSON form)."""

    versions: Versions
    driver: DriverInfo
    jax: JaxInfo
    gpus: tuple[GpuInfo, ...]
    peers: tuple[PeerLink, ...]
    extension: ExtensionInfo
    nvshmem: NvshmemInfo
    xla_memory: XlaMemorySettings
    workspace: WorkspaceEstimate
    backend: BackendDecision


# --------------------------------------------------------------------------------------------
# Probes. Each returns a dataclass and never raises for a missing component.


def _package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _jax_ep_version() -> str | None:
    version = _package_version("jax_ep") or _package_version("jax-ep")
    if version is None:  # running from a source tree: the package may say it itself
        version = getattr(sys.modules.get("jax_ep"), "__version__", None)
    return version


def _jaxlib_version() -> str | None:
    version = _package_version("jaxlib")
    if version is None:
        try:
            import jaxlib

            version = getattr(jaxlib, "__version__", None)
        except ImportError:
            pass
    return version


def _cuda_runtime_version(devices: Sequence[Any]) -> tuple[str, str | None, str | None]:
    """(runtime version or "unknown", where it came from, "jax-cudaXX-plugin <version>")."""
    plugin = None
    majors = list(_CUDA_RUNTIME_PACKAGES)
    for name in _JAX_CUDA_PLUGINS:
        version = _package_version(name)
        if version is not None:
            plugin = f"{name} {version}"
            major = re.search(r"cuda(\d+)", name).group(1)
            majors = [major] + [m for m in majors if m != major]
            break
    if plugin is not None:
        for major in majors:
            for package in _CUDA_RUNTIME_PACKAGES[major]:
                version = _package_version(package)
                if version is not None and version.split(".")[0] == major:
                    return version, f"{package} package", plugin
    # A jax built against a local CUDA: XLA's GPU client names the CUDA it was built with.
    for device in devices:
        if getattr(device, "platform", None) != "gpu":
            continue
        try:
            text = str(device.client.platform_version)
        except Exception:  # best effort, the field is informational
            continue
        match = re.search(r"cuda\D{0,3}(\d{4,6})", text, re.IGNORECASE)
        if match:
            return (
                _cuda_driver.format_cuda_version(int(match.group(1))),
                "XLA platform_version (the CUDA XLA was built with)",
                plugin,
            )
    return "unknown", None, plugin


def _describe_device(device: Any) -> DeviceInfo:
    """A DeviceInfo of a jax.Device (DeviceInfo instances pass through)."""
    if isinstance(device, DeviceInfo):
        return device
    device_platform = str(device.platform)
    is_gpu = device_platform in ("gpu", "cuda")
    is_cuda = False
    if is_gpu:
        try:
            is_cuda = "rocm" not in str(device.client.platform_version).lower()
        except Exception:  # a GPU without a readable version: assume CUDA
            is_cuda = True
    process_index = int(getattr(device, "process_index", 0))
    ordinal = getattr(device, "local_hardware_id", None) if is_gpu else None
    cc = getattr(device, "compute_capability", None) if is_cuda else None
    return DeviceInfo(
        id=int(device.id),
        platform="gpu" if is_gpu else device_platform,
        kind=str(getattr(device, "device_kind", device_platform)),
        process_index=process_index,
        addressable=process_index == jax.process_index(),
        local_ordinal=None if ordinal is None else int(ordinal),
        compute_capability=None if cc is None else str(cc),
        is_cuda=is_cuda,
    )


def _probe_jax() -> tuple[JaxInfo, list[Any]]:
    """JaxInfo and the global jax devices (initialises jax's default backend)."""
    try:
        devices = jax.devices()
        backend = jax.default_backend()
    except Exception as e:  # reported, the rest of the report still works
        return JaxInfo(None, 0, 1, 0, (), f"{type(e).__name__}: {e}"), []
    local = tuple(_describe_device(d) for d in jax.local_devices())
    return (
        JaxInfo(backend, jax.process_index(), jax.process_count(), len(devices), local, None),
        devices,
    )


def _probe_driver() -> DriverInfo:
    driver, reason = _cuda_driver.get_driver()
    nvml, nvml_reason = _cuda_driver.get_nvml()
    if driver is not None and not driver.initialized:
        reason = driver.init_error
    count = 0
    if driver is not None and driver.initialized:
        try:
            count = driver.device_count()
        except _cuda_driver.CudaDriverError as e:
            reason = str(e)
    return DriverInfo(
        available=driver is not None and driver.initialized and reason is None,
        reason=reason,
        device_count=count,
        nvml=nvml is not None,
        nvml_reason=nvml_reason,
    )


def _driver_cuda_version() -> int | None:
    """cuDriverGetVersion (= cudaDriverGetVersion), e.g. 12080; None without a driver."""
    driver, _ = _cuda_driver.get_driver()
    if driver is None:
        return None
    try:
        return driver.version()
    except _cuda_driver.CudaDriverError:
        return None


def _driver_version() -> str | None:
    version = _driver_cuda_version()
    return None if version is None else _cuda_driver.format_cuda_version(version)


def _try(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except _cuda_driver.CudaDriverError:
        return None


def _probe_gpus(
    ordinals: Sequence[int] | None = None, *, free_memory: bool = True,
    create_context: bool = True, nvlinks: bool = True,
) -> tuple[GpuInfo, ...]:
    """GpuInfo of the given CUDA ordinals (default: every visible GPU); () without a driver."""
    driver, _ = _cuda_driver.get_driver()
    if driver is None or not driver.initialized:
        return ()
    if ordinals is None:
        ordinals = range(_try(driver.device_count) or 0)
    nvml = _cuda_driver.get_nvml()[0] if nvlinks else None
    gpus = []
    for ordinal in ordinals:
        cc = _try(driver.compute_capability, ordinal)
        bus_id = _try(driver.pci_bus_id, ordinal)
        active = None
        if nvml is not None and bus_id is not None:
            handle = _try(nvml.handle_by_pci_bus_id, bus_id)
            active = None if handle is None else _try(nvml.active_nvlinks, handle)
        gpus.append(GpuInfo(
            ordinal=ordinal,
            name=_try(driver.device_name, ordinal) or "unknown",
            compute_capability="unknown" if cc is None else f"{cc[0]}.{cc[1]}",
            total_memory_bytes=_try(driver.total_memory, ordinal),
            free_memory_bytes=(
                _try(driver.free_memory, ordinal, create_context=create_context)
                if free_memory else None
            ),
            pci_bus_id=bus_id,
            nvlinks_active=active,
            cooperative_launch=_try(driver.cooperative_launch, ordinal),
        ))
    return tuple(gpus)


def _probe_peers(
    ordinals: Sequence[int], bus_ids: dict[int, str | None] | None = None
) -> tuple[PeerLink, ...]:
    """PeerLink for every ordered pair of distinct ordinals; () without a driver.

    `bus_ids` (ordinal -> PCI bus id) enables the NVML NVLink check.
    """
    driver, _ = _cuda_driver.get_driver()
    if driver is None or not driver.initialized:
        return ()
    nvml = _cuda_driver.get_nvml()[0] if bus_ids else None
    handles = {}
    if nvml is not None:
        for ordinal, bus_id in bus_ids.items():
            if bus_id is not None:
                handles[ordinal] = _try(nvml.handle_by_pci_bus_id, bus_id)
    links = []
    for src in ordinals:
        for dst in ordinals:
            if src == dst:
                continue
            access = _try(driver.can_access_peer, src, dst)
            atomics = _try(driver.p2p_attribute, src, dst,
                           _cuda_driver.CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED)
            rank = _try(driver.p2p_attribute, src, dst,
                        _cuda_driver.CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK)
            nvlink = None
            if handles.get(src) is not None and handles.get(dst) is not None:
                nvlink = _try(nvml.nvlink_p2p_ok, handles[src], handles[dst])
            if access is None:
                link, source = "unknown", None
            elif not access:
                link, source = "none", None
            elif nvlink is not None:
                link, source = ("nvlink" if nvlink else "pcie"), "nvml"
            elif atomics is not None:
                link, source = ("nvlink" if atomics else "pcie"), "cuda"
            else:
                link, source = "unknown", None
            links.append(PeerLink(
                src=src, dst=dst, access=access,
                native_atomics=None if atomics is None else bool(atomics),
                performance_rank=rank, link=link, link_source=source,
            ))
    return tuple(links)


def probe_extension() -> ExtensionInfo:
    """Whether jax_ep._C imports, and the CUDA architectures it was built for."""
    try:
        module = importlib.import_module("jax_ep._C")
    except Exception as e:  # ImportError, or OSError from a missing CUDA library
        return ExtensionInfo(False, None, None, f"{type(e).__name__}: {e}")
    archs = None
    try:
        archs = str(module.cuda_architectures())
    except Exception:  # an older build without the function: archs unknown
        pass
    built = getattr(module, "nvshmem_built", None)
    runtime = getattr(module, "cuda_runtime_version", None)
    return ExtensionInfo(True, archs, getattr(module, "__file__", None), None,
                         bool(built()) if built is not None else None,
                         int(runtime()) if runtime is not None else None)


def probe_nvshmem() -> NvshmemInfo:
    for package in _NVSHMEM_PACKAGES:
        try:
            dist = importlib.metadata.distribution(package)
        except importlib.metadata.PackageNotFoundError:
            continue
        library = None
        for file in dist.files or ():
            if re.fullmatch(r"libnvshmem_host\.so(\.\d+)*", file.name):
                path = str(dist.locate_file(file))
                if os.path.exists(path):
                    library = path
                    break
        reason = None if library else f"{package} is installed but has no libnvshmem_host.so"
        return NvshmemInfo(package, dist.version, library, reason)
    return NvshmemInfo(
        None, None, None,
        "not installed; needed only for JAX_EP_TRANSPORT=nvshmem "
        "(pip install nvidia-nvshmem-cu13 to match jax's CUDA, or -cu12)",
    )


def xla_memory_settings(environ: dict[str, str] | None = None) -> XlaMemorySettings:
    """XLA's memory settings from the environment (`os.environ` by default)."""
    environ = os.environ if environ is None else environ
    pre_env = environ.get("XLA_PYTHON_CLIENT_PREALLOCATE")
    frac_env = environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
    alloc_env = environ.get("XLA_PYTHON_CLIENT_ALLOCATOR")
    notes = []
    preallocate = pre_env is None or pre_env.strip().lower() not in ("false", "0")
    fraction = DEFAULT_MEM_FRACTION
    if frac_env is not None:
        try:
            fraction = float(frac_env)
            if not 0.0 < fraction <= 1.0:
                raise ValueError
        except ValueError:
            fraction = DEFAULT_MEM_FRACTION
            notes.append(
                f"XLA_PYTHON_CLIENT_MEM_FRACTION={frac_env!r} is not a fraction in (0, 1]: "
                f"set it to e.g. 0.6"
            )
    allocator = (alloc_env or "default").strip().lower()
    if allocator == "platform":
        preallocate = False  # no pool at all: XLA allocates on demand
    return XlaMemorySettings(preallocate, fraction, allocator, pre_env, frac_env, alloc_env,
                             tuple(notes))


def approximate_workspace_bytes(spec: BufferSpec) -> int:
    """The approximate per-device workspace of a Buffer, without the extension.

    normal = 2 * R*T_max * (H*dtype_bytes + H/128*4 + 2*K*4 + 4) + 64 KiB, plus, with
    low_latency, 2 * E*T_max * (H*2 + H/128*4 + 16) + 2 * T_max*K*H*2 + 64 KiB. The factor 2 is
    the two alternating regions (epoch parity). jax_ep._C.workspace_bytes is the exact figure.
    """
    r, e, h, t, k = (spec.num_ranks, spec.num_experts, spec.hidden, spec.max_tokens_per_rank,
                     spec.num_topk)
    scales = h // _SCALE_BLOCK * 4
    total = 2 * r * t * (h * spec.dtype_bytes + scales + 2 * k * 4 + 4) + _WORKSPACE_HEADER_BYTES
    if spec.low_latency:
        total += 2 * e * t * (h * 2 + scales + 16) + 2 * t * k * h * 2 + _WORKSPACE_HEADER_BYTES
    return total


def workspace_estimate(
    spec: BufferSpec, extension: ExtensionInfo | None = None
) -> WorkspaceEstimate:
    """Per-device workspace of `spec`: exact from jax_ep._C when it imports, else approximate."""
    extension = probe_extension() if extension is None else extension
    if extension.importable:
        try:
            module = importlib.import_module("jax_ep._C")
            capacity = spec.capacity or spec.num_ranks * spec.max_tokens_per_rank
            size = module.workspace_bytes(
                spec.num_ranks, spec.num_experts, spec.hidden, spec.max_tokens_per_rank,
                spec.num_topk, capacity, spec.dtype_bytes, spec.low_latency,
            )
            return WorkspaceEstimate(spec, int(size), True, "jax_ep._C.workspace_bytes")
        except Exception:  # an older build: fall back to the formula
            pass
    return WorkspaceEstimate(spec, approximate_workspace_bytes(spec), False, "approximate formula")


# --------------------------------------------------------------------------------------------
# The backend decision.


def _parse_cc(text: str | None) -> tuple[int, int] | None:
    match = re.fullmatch(r"\s*(\d+)\.(\d+)\s*", text or "")
    return (int(match.group(1)), int(match.group(2))) if match else None


def _arch_tokens(archs: str) -> list[str]:
    return [t for t in re.split(r"[;,\s]+", archs.strip()) if t]


@dataclasses.dataclass(frozen=True)
class BuiltCode:
    """The code of a build, from `jax_ep._C.cuda_architectures()` or a CMake architecture list.

    Attributes:
      sass: architectures with SASS, e.g. ("80", "90a", "100f").
      ptx: architectures with PTX, e.g. ("90",).
      unknown: entries that name no architecture ("native", "all"): what they built is unknown.
    """

    sass: tuple[str, ...]
    ptx: tuple[str, ...]
    unknown: tuple[str, ...]


def parse_architectures(archs: str) -> BuiltCode:
    """The SASS and PTX of `archs`: "sm_N" / "compute_N" entries (what jax_ep._C reports) or
    CMake's CUDA_ARCHITECTURES syntax ("N" = SASS and PTX, "N-real" = SASS, "N-virtual" = PTX)."""
    sass, ptx, unknown = [], [], []
    for token in _arch_tokens(archs):
        match = re.fullmatch(r"(sm_|compute_)?(\d+[af]?)(-real|-virtual)?", token)
        if not match or (match.group(1) and match.group(3)):
            unknown.append(token)
            continue
        prefix, arch, kind = match.groups()
        if prefix != "compute_" and kind != "-virtual":
            sass.append(arch)
        if prefix != "sm_" and kind != "-real":
            ptx.append(arch)
    dedupe = lambda items: tuple(dict.fromkeys(items))
    return BuiltCode(dedupe(sass), dedupe(ptx), dedupe(unknown))


def _arch_cc(arch: str) -> tuple[tuple[int, int], str]:
    """"90a" -> ((9, 0), "a")."""
    major, minor = divmod(int(arch.rstrip("af")), 10)
    return (major, minor), arch[-1] if arch[-1] in "af" else ""


def _sass_runs(arch: str, cc: tuple[int, int]) -> bool:
    """SASS of sm_N runs on its major version from minor N%10 on; "a" on N exactly."""
    target, suffix = _arch_cc(arch)
    return cc == target if suffix == "a" else cc[0] == target[0] and cc[1] >= target[1]


def _ptx_runs(arch: str, cc: tuple[int, int]) -> bool:
    """PTX of compute_N is JIT-compiled for every later GPU; "a" / "f" PTX for N / its family."""
    target, suffix = _arch_cc(arch)
    if suffix == "a":
        return cc == target
    if suffix == "f":
        return cc[0] == target[0] and cc[1] >= target[1]
    return cc >= target


def code_for(archs: str, cc: tuple[int, int]) -> str | None:
    """The code of `archs` that a GPU of compute capability `cc` runs: "sm_N" (SASS; the
    newest that runs) or, without SASS for it, "compute_N" (PTX the driver JIT-compiles; the
    newest that runs, as the driver picks); None when nothing runs on it."""
    code = parse_architectures(archs)
    newest = lambda items: max(items, key=lambda a: _arch_cc(a)[0], default=None)
    sass = newest([a for a in code.sass if _sass_runs(a, cc)])
    if sass is not None:
        return f"sm_{sass}"
    ptx = newest([a for a in code.ptx if _ptx_runs(a, cc)])
    return None if ptx is None else f"compute_{ptx}"


def arch_supports(archs: str, cc: tuple[int, int]) -> bool | None:
    """Whether code built for `archs` (see `parse_architectures`) runs on compute capability
    `cc`: "90" (SASS + PTX) runs on 9.x natively and on newer GPUs through PTX JIT; "90-real"
    on 9.x only; "90-virtual" on >= 9.0; "90a" on exactly 9.0; "100f" on 10.x. Returns None when
    nothing listed runs on it but some entry is unknown ("native", "all")."""
    if code_for(archs, cc) is not None:
        return True
    return None if parse_architectures(archs).unknown else False


def describe_architectures(archs: str) -> str:
    """ "sm_80 sm_90 compute_90" -> "sm_80, sm_90 + PTX compute_90"."""
    code = parse_architectures(archs)
    parts = [", ".join([f"sm_{a}" for a in code.sass] + list(code.unknown))]
    if code.ptx:
        parts.append("PTX " + ", ".join(f"compute_{a}" for a in code.ptx))
    text = " + ".join(p for p in parts if p)
    return text or "no architecture"


def _cmake_architectures(archs: str) -> str:
    """The CMake list of the same code: "sm_80 sm_90 compute_90" -> "80-real;90"."""
    code = parse_architectures(archs)
    entries = [a if a in code.ptx else f"{a}-real" for a in code.sass]
    entries += [f"{a}-virtual" for a in code.ptx if a not in code.sass]
    return ";".join(entries + list(code.unknown))


def _cuda_version_text(version: int) -> str:
    return _cuda_driver.format_cuda_version(version)


def driver_problem(driver_cuda_version: int | None, runtime_version: int | None) -> str | None:
    """Why the driver cannot run a jax_ep._C built with CUDA runtime `runtime_version`
    (CUDART_VERSION, linked in), or None when it can or a version is unknown.

    The driver must support the runtime's major version (a CUDA 13 build needs a CUDA 13 driver,
    r580 or newer). An older minor version of the same major runs the module's SASS (CUDA's
    minor-version compatibility) but cannot JIT-compile its PTX; `decide_backend` reports that
    per GPU, for the GPUs that would run PTX.
    """
    if driver_cuda_version is None or runtime_version is None:
        return None
    if driver_cuda_version // 1000 >= runtime_version // 1000:
        return None
    major = runtime_version // 1000
    minimum = _MIN_DRIVER_FOR_CUDA_MAJOR.get(major)
    driver_text = f"CUDA {major}.0 or newer" + (f" (r{minimum}+)" if minimum else "")
    return (
        f"the CUDA driver supports CUDA {_cuda_version_text(driver_cuda_version)}, but jax_ep._C "
        f"was built with CUDA {_cuda_version_text(runtime_version)} (its CUDA runtime is linked "
        f"in), which needs a driver of {driver_text}: update the driver, or build jax_ep with "
        f"a CUDA {driver_cuda_version // 1000} toolkit (CUDACXX=<that toolkit>/bin/nvcc pip "
        f"install .)"
    )


def _gpus_text(ordinals: Sequence[int]) -> str:
    ordinals = sorted(set(ordinals))
    return ("GPU " if len(ordinals) == 1 else "GPUs ") + ", ".join(str(o) for o in ordinals)


def _gib(n: int) -> str:
    return f"{n / _GIB:.1f} GiB"


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
      BackendDecision("cuda", ()) or BackendDecision("xla", reasons).
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
            text += "; the reference backend (xla) runs here"
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
        reasons.append(
            f"the CUDA extension jax_ep._C does not import ({extension.error}): build it on a "
            f"machine with nvcc (JAX_EP_ENABLE_CUDA=ON pip install .)"
        )

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
        cc = _parse_cc(cc_text)
        if cc is None:
            continue
        who = f"{_gpus_text(labels)} ({kind}): compute capability {cc_text}"
        if cc < MIN_COMPUTE_CAPABILITY:
            reasons.append(
                f"{who}, but the cuda kernels need compute capability {min_text} or newer "
                f"(loads and stores with acquire/release semantics at system scope): use the "
                f"reference backend (xla) on these GPUs"
            )
            continue
        if archs is None:
            continue
        code = code_for(archs, cc)
        rebuild = f"JAX_EP_CUDA_ARCHS=\"{_cmake_architectures(archs)};{cc[0]}{cc[1]}\""
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
                f"but the driver (CUDA {_cuda_version_text(driver_cuda_version)}) is older than "
                f"the toolkit that built that PTX (CUDA {_cuda_version_text(runtime)}) and "
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
            f"(xla)"
        )

    # GPUs of other processes are reached through CUDA IPC (jax_ep/_ipc.py); that they share
    # this host is checked when the Buffer exchanges its workspaces.

    # Group size and peer access (this process's GPUs only).
    groups = [list(g) for g in ep_groups] if ep_groups is not None else [list(devices)]
    largest = max((len(g) for g in groups), default=0)
    if cuda_devices and largest > MAX_CUDA_RANKS:
        reasons.append(
            f"an EP group has {largest} ranks; the cuda backend supports up to {MAX_CUDA_RANKS} "
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
            f"(nvidia-smi topo -p2p r) or use the reference backend (xla)"
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

    return BackendDecision("xla", tuple(reasons)) if reasons else BackendDecision("cuda", ())


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
    infos = [_describe_device(d) for d in devices]
    groups = None if ep_groups is None else [[_describe_device(d) for d in g] for g in ep_groups]
    if default_backend is None:
        default_backend = jax.default_backend()
    if extension is None:
        extension = probe_extension()
    ordinals = sorted({d.local_ordinal for d in infos
                       if d.is_cuda and d.addressable and d.local_ordinal is not None})
    if gpus is None:
        gpus = (_probe_gpus(ordinals, free_memory=workspace_bytes_needed is not None,
                            create_context=False, nvlinks=False)
                if ordinals else ())
    if peers is None:
        peers = _probe_peers(ordinals) if len(ordinals) > 1 else ()
    driver_count = 0
    if not any(d.is_cuda for d in infos):
        driver, _ = _cuda_driver.get_driver()
        if driver is not None and driver.initialized:
            driver_count = _try(driver.device_count) or 0
    if driver_cuda_version is None and any(d.is_cuda for d in infos):
        driver_cuda_version = _driver_cuda_version()
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
    the driver is at least as new as the toolkit that built it), every EP group has at most 8
    ranks whose GPUs (of this process) have peer access to each other, and (when
    `workspace_bytes_needed` is given) every GPU has that much free memory.
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
      ("cuda", []) or ("xla", reasons), each reason naming the problem and its fix.
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
            f"Use backend='auto' (falls back to the reference backend) or backend='xla'; "
            f"`python -m jax_ep.env` shows the details."
        )


# --------------------------------------------------------------------------------------------
# The report.


def _default_spec(num_devices: int) -> BufferSpec:
    """DeepEP's normal test shape on all devices (experts rounded up to a multiple of R)."""
    ranks = max(1, num_devices)
    return BufferSpec(num_ranks=ranks, num_experts=math.ceil(256 / ranks) * ranks)


def collect(spec: BufferSpec | None = None, *, free_memory: bool = True) -> EnvReport:
    """Gathers the report (calls jax.devices(), which starts jax's default backend).

    Args:
      spec: the Buffer configuration to size and to check memory for; default DeepEP's normal
        shape (E=256, H=7168, T_max=4096, K=8, bfloat16) with R = every jax device.
      free_memory: measure free memory per GPU (retains each GPU's primary context for the query).

    Returns:
      The EnvReport. Never raises for a missing GPU, driver, extension or package.
    """
    jax_info, devices = _probe_jax()
    driver = _probe_driver()
    gpus = _probe_gpus(free_memory=free_memory)
    peers = _probe_peers([g.ordinal for g in gpus], {g.ordinal: g.pci_bus_id for g in gpus})
    extension = probe_extension()
    runtime, runtime_source, plugin = _cuda_runtime_version(devices)
    versions = Versions(
        jax_ep=_jax_ep_version(), jax=jax.__version__, jaxlib=_jaxlib_version(),
        python=platform.python_version(), cuda_driver=_driver_version(), cuda_runtime=runtime,
        cuda_runtime_source=runtime_source, jax_cuda_plugin=plugin,
    )
    if spec is None:
        spec = _default_spec(len(devices))
    workspace = workspace_estimate(spec, extension)
    xla_memory = xla_memory_settings()
    infos = [_describe_device(d) for d in devices]
    if jax_info.error is not None:
        backend = BackendDecision("xla", (f"jax failed to start: {jax_info.error}",))
    else:
        group = infos[: spec.num_ranks]
        backend = decide_backend(
            infos, default_backend=jax_info.default_backend, extension=extension, gpus=gpus,
            peers=peers, ep_groups=[group], workspace_bytes_needed=workspace.bytes,
            xla_memory=xla_memory, driver_gpu_count=driver.device_count,
            driver_cuda_version=_driver_cuda_version(),
        )
        if spec.num_ranks > len(infos):
            backend = BackendDecision("xla", backend.reasons + (
                f"an EP group of {spec.num_ranks} ranks needs {spec.num_ranks} devices, jax has "
                f"{len(infos)}: lower --num-ranks (the workspace above is sized for "
                f"{spec.num_ranks})",
            ))
    return EnvReport(versions, driver, jax_info, gpus, peers, extension, probe_nvshmem(),
                     xla_memory, workspace, backend)


def report_to_dict(report: EnvReport) -> dict[str, Any]:
    """The JSON-ready form of the report (schema in the module docstring)."""
    return {"schema_version": SCHEMA_VERSION, **dataclasses.asdict(report)}


def _bytes_text(n: int | None) -> str:
    if n is None:
        return "unknown"
    return _gib(n) if n >= _GIB else f"{n / _MIB:.1f} MiB"


_LINK_CELLS = {"nvlink": "NV", "pcie": "PCIe", "none": "--", "unknown": "?"}


def _peer_matrix(gpus: Sequence[GpuInfo], peers: Sequence[PeerLink]) -> list[str]:
    ordinals = [g.ordinal for g in gpus]
    links = {(p.src, p.dst): p for p in peers}
    width = max(6, *(len(f"GPU{o}") + 2 for o in ordinals))
    lines = [" " * 8 + "".join(f"GPU{o}".rjust(width) for o in ordinals)]
    for src in ordinals:
        cells = []
        for dst in ordinals:
            link = links.get((src, dst))
            if src == dst:
                cell = "X"
            elif link is None:
                cell = "?"
            else:
                cell = _LINK_CELLS.get(link.link, link.link)
                if link.link == "nvlink" and link.link_source == "cuda":
                    cell += "*"
            cells.append(cell.rjust(width))
        lines.append(f"  {'GPU' + str(src):<6}" + "".join(cells))
    legend = "  NV = NVLink, PCIe = peer access over PCIe, -- = no peer access, X = self"
    if any(p.link == "nvlink" and p.link_source == "cuda" for p in peers):
        legend += ", * = inferred from native peer atomics (NVML unavailable)"
    lines.append(legend)
    return lines


def _parse_cuda_version(text: str | None) -> int | None:
    """ "12.8" -> 12080."""
    match = re.fullmatch(r"(\d+)\.(\d+)", text or "")
    return int(match.group(1)) * 1000 + int(match.group(2)) * 10 if match else None


def _driver_and_code_lines(report: EnvReport) -> list[str]:
    """The driver against the extension's CUDA runtime, and the code each GPU would run."""
    ext = report.extension
    driver = _parse_cuda_version(report.versions.cuda_driver)
    lines = []
    if driver is not None and ext.cuda_runtime_version is not None:
        problem = driver_problem(driver, ext.cuda_runtime_version)
        lines.append(f"driver check: {problem}" if problem else (
            f"driver check: the driver (CUDA {_cuda_version_text(driver)}) runs a CUDA "
            f"{_cuda_version_text(ext.cuda_runtime_version)} build"))
    if not ext.cuda_architectures:
        return lines
    for g in report.gpus:
        cc = _parse_cc(g.compute_capability)
        if cc is None:
            continue
        code = code_for(ext.cuda_architectures, cc)
        if code is None:
            runs = "no code for it"
        elif code.startswith("sm_"):
            runs = f"runs SASS {code}"
        else:
            runs = f"runs PTX {code}, JIT-compiled by the driver at first use"
        lines.append(f"[{g.ordinal}] {g.name} (compute capability {g.compute_capability}): "
                     f"{runs}")
    return lines


def format_report(report: EnvReport) -> str:
    """Human-readable text of the report (what `python -m jax_ep.env` prints)."""
    v, drv, jx = report.versions, report.driver, report.jax
    out = ["jax_ep environment", ""]

    out.append("Versions")
    out.append(f"  jax_ep          {v.jax_ep or 'not installed (source tree)'}")
    out.append(f"  jax / jaxlib    {v.jax} / {v.jaxlib or 'unknown'}")
    out.append(f"  python          {v.python}")
    out.append(f"  jax CUDA plugin {v.jax_cuda_plugin or 'none'}")
    out.append(f"  CUDA driver     {v.cuda_driver or 'none'}"
               + (f" ({drv.reason})" if drv.reason else ""))
    runtime = v.cuda_runtime + (f" ({v.cuda_runtime_source})" if v.cuda_runtime_source else "")
    out.append(f"  CUDA runtime    {runtime}")
    out.append("")

    out.append("JAX")
    if jx.error:
        out.append(f"  error: {jx.error}")
    else:
        kinds = sorted({d.kind for d in jx.local_devices})
        out.append(f"  default backend {jx.default_backend}")
        out.append(f"  devices         {len(jx.local_devices)} local ({', '.join(kinds)}), "
                   f"{jx.device_count} in all; process {jx.process_index} of {jx.process_count}")
    out.append("")

    out.append(f"GPUs (CUDA driver: {drv.device_count} visible)")
    if not report.gpus:
        out.append(f"  none: {drv.reason or 'the driver sees no GPU'}")
    for g in report.gpus:
        nvlinks = "" if g.nvlinks_active is None else f", {g.nvlinks_active} NVLinks up"
        out.append(
            f"  [{g.ordinal}] {g.name}  compute capability {g.compute_capability}  memory "
            f"{_bytes_text(g.total_memory_bytes)} total, {_bytes_text(g.free_memory_bytes)} free"
            f"{nvlinks}"
        )
    if len(report.gpus) > 1:
        out.append("")
        out.append("Peer access (row GPU reads/writes column GPU's memory)")
        out.extend(_peer_matrix(report.gpus, report.peers))
        if not drv.nvml:
            out.append(f"  NVML: {drv.nvml_reason}")
    out.append("")

    ext = report.extension
    out.append("CUDA extension jax_ep._C")
    if ext.importable:
        archs = (describe_architectures(ext.cuda_architectures) if ext.cuda_architectures
                 else "unknown architectures")
        cuda = (f"CUDA {_cuda_version_text(ext.cuda_runtime_version)}"
                if ext.cuda_runtime_version else "an unknown CUDA")
        out.append(f"  imports ({ext.path})")
        out.append(f"  built with {cuda} for {archs}")
        out.extend(f"  {line}" for line in _driver_and_code_lines(report))
    else:
        out.append(f"  does not import: {ext.error}")
    out.append("")

    nv = report.nvshmem
    out.append("NVSHMEM")
    if nv.package:
        library = nv.host_library or "not found"
        out.append(f"  {nv.package} {nv.version}; libnvshmem_host: {library}")
    if nv.reason:
        out.append(f"  {nv.reason}")
    if ext.nvshmem_built is not None:
        built = "yes" if ext.nvshmem_built else "no"
        out.append(f"  jax_ep._C built with NVSHMEM's headers: {built}")
    out.append("")

    mem = report.xla_memory
    out.append("XLA memory (decides what is left for a Buffer)")
    out.append(f"  XLA_PYTHON_CLIENT_PREALLOCATE  {mem.preallocate_env or 'unset'} -> "
               f"{'preallocate' if mem.preallocate else 'no preallocation'}")
    out.append(f"  XLA_PYTHON_CLIENT_MEM_FRACTION {mem.mem_fraction_env or 'unset'} -> "
               f"{mem.mem_fraction:g}")
    out.append(f"  XLA_PYTHON_CLIENT_ALLOCATOR    {mem.allocator_env or 'unset'} -> "
               f"{mem.allocator}")
    out.extend(f"  note: {n}" for n in mem.notes)
    out.append("")

    ws = report.workspace
    s = ws.spec
    capacity = s.capacity or s.num_ranks * s.max_tokens_per_rank
    out.append("Buffer workspace per device")
    out.append(
        f"  R={s.num_ranks} E={s.num_experts} H={s.hidden} T_max={s.max_tokens_per_rank} "
        f"K={s.num_topk} C={capacity} dtype_bytes={s.dtype_bytes} "
        f"{'normal+low_latency' if s.low_latency else 'normal'}: {_bytes_text(ws.bytes)} "
        f"({ws.bytes} bytes, {'exact' if ws.exact else 'approximate'}: {ws.source})"
    )
    out.append("")

    out.append(f"Buffer(backend=\"auto\") -> {report.backend.backend}")
    out.extend(f"  - {r}" for r in report.backend.reasons)
    from jax_ep import grouped_gemm  # the MoE layer's expert matmul choice (jax_ep.moe)

    out.append(f"MoE expert matmul (matmul=\"auto\") -> {grouped_gemm.selection_report()}")
    return "\n".join(out) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m jax_ep.env [--json] [Buffer flags]`: prints the report; returns 0."""
    parser = argparse.ArgumentParser(
        prog="python -m jax_ep.env",
        description="What jax_ep will use on this machine, and why.",
    )
    parser.add_argument("--json", action="store_true", help="print JSON (schema: module docstring)")
    parser.add_argument("--num-experts", type=int, default=None,
                        help="global experts (default 256, rounded up to a multiple of R)")
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--max-tokens-per-rank", type=int, default=4096)
    parser.add_argument("--num-topk", type=int, default=8)
    parser.add_argument("--num-ranks", type=int, default=None,
                        help="ranks per EP group (default: every jax device)")
    parser.add_argument("--capacity", type=int, default=0,
                        help="normal-mode receive rows (default num_ranks * max_tokens_per_rank)")
    parser.add_argument("--dtype", choices=sorted(_DTYPE_BYTES), default="bfloat16")
    parser.add_argument("--low-latency", action="store_true",
                        help="size the low-latency regions too")
    parser.add_argument("--no-free-memory", action="store_true",
                        help="do not create CUDA contexts to measure free memory")
    args = parser.parse_args(argv)

    num_ranks = args.num_ranks
    if num_ranks is None:
        try:
            num_ranks = len(jax.devices())
        except Exception:  # collect() reports the failure
            num_ranks = 1
    num_experts = args.num_experts
    if num_experts is None:
        num_experts = _default_spec(num_ranks).num_experts
    try:
        spec = BufferSpec(
            num_ranks=num_ranks, num_experts=num_experts, hidden=args.hidden,
            max_tokens_per_rank=args.max_tokens_per_rank, num_topk=args.num_topk,
            capacity=args.capacity, dtype_bytes=_DTYPE_BYTES[args.dtype],
            low_latency=args.low_latency,
        )
    except ValueError as e:
        parser.error(f"{e} (flags use dashes: --num-experts, --num-ranks, ...)")
    report = collect(spec, free_memory=not args.no_free_memory)
    if args.json:
        print(json.dumps(report_to_dict(report), indent=2))
    else:
        print(format_report(report), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
