"""The facts jax_ep gathers about a machine, as frozen dataclasses.

The probes (`jax_ep.system.probes`) fill them, the backend gate (`jax_ep.backends.gate`)
decides from them and the environment report (`jax_ep.tools.env_report`, `jax-ep-env`) prints
them; tests build them directly.
"""

from __future__ import annotations

import dataclasses

from jax_ep.system import config


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
      nvshmem_built: whether it was built with NVSHMEM's headers (JAX_EP_PEER_MAPPING=nvshmem),
        None if unknown.
      cuda_runtime_version: CUDART_VERSION of the toolkit that built it, e.g. 13000 for 13.0
        (its CUDA runtime is linked in, so the driver must support it), None if unknown.
      max_ranks: most ranks in one EP group its kernels support (_C.max_ranks()), None if
        unknown.
      source_tree: when not importable because the imported `jax_ep` is a source checkout
        without a build (run from inside the checkout): the checkout's folder; else None.
      shadowed_build: in that case, a built jax_ep._C of an installed jax_ep further down
        sys.path, which the checkout hides; else None.
    """

    importable: bool
    cuda_architectures: str | None
    path: str | None
    error: str | None
    nvshmem_built: bool | None = None
    cuda_runtime_version: int | None = None
    max_ranks: int | None = None
    source_tree: str | None = None
    shadowed_build: str | None = None


@dataclasses.dataclass(frozen=True)
class NvshmemInfo:
    """NVSHMEM (the JAX_EP_PEER_MAPPING=nvshmem peer mapping, jax_ep/peers/nvshmem.py).

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
    """The Buffer configuration whose memory is reported (Buffer's own arguments and rules).

    Attributes:
      num_ranks: R, devices in one EP group.
      num_experts: E, global experts; a multiple of num_ranks.
      hidden: H, channels per token; a multiple of 128 (with low_latency at most 32768).
      max_tokens_per_rank: T_max.
      num_topk: K, at most min(32, E).
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

    def __post_init__(self):  # the Buffer's own rules (capacity 0: the default)
        config.check_config(
            num_ranks=self.num_ranks, num_experts=self.num_experts, hidden=self.hidden,
            max_tokens_per_rank=self.max_tokens_per_rank, num_topk=self.num_topk,
            capacity=self.capacity or None, low_latency=self.low_latency,
            dtype_bytes=self.dtype_bytes)


@dataclasses.dataclass(frozen=True)
class WorkspaceEstimate:
    """Device memory one Buffer allocates on every device of its mesh.

    Attributes:
      spec: the configuration.
      bytes: bytes per device, from jax_ep._C.workspace_bytes (the kernels' own size); None
        where jax_ep._C does not load (no CUDA backend here to allocate it).
      source: "jax_ep._C.workspace_bytes", or why the size is unknown.
    """

    spec: BufferSpec
    bytes: int | None
    source: str


@dataclasses.dataclass(frozen=True)
class BackendDecision:
    """The backend Buffer(backend="auto") picks.

    Attributes:
      backend: "cuda" or "reference".
      reasons: why not "cuda", each with its fix; empty when "cuda".
    """

    backend: str
    reasons: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class PreflightCheck:
    """One check of the cross-host preflight (`jax_ep.system.cluster`, `jax-ep-env --cluster`).

    Attributes:
      name: what is checked, e.g. "GPUDirect RDMA".
      status: "ok", "warn" (works, or optional, but not as well as it could) or "fail".
      found: what the check found on this host, one line.
      fix: what to do about a "warn" or "fail"; "" when "ok".
      details: one line per item behind `found` (ports, plugins, GPU -> NIC pairs).
    """

    name: str
    status: str
    found: str
    fix: str
    details: tuple[str, ...] = ()


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
    cluster: tuple[PreflightCheck, ...] | None = None  # --cluster only


# --------------------------------------------------------------------------------------------


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
