"""Probes of this machine: versions, jax's devices, the CUDA driver, GPUs, peer links, the
extension jax_ep._C, NVSHMEM and XLA's memory settings.

Each returns a record of `jax_ep.system.records` and never raises for a missing component. Only
`probe_jax` (and `describe_device` through `jax.process_index`) start jax's default backend.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.metadata
import os
import re
import sys
from collections.abc import Sequence
from typing import Any

import jax

from jax_ep import settings
from jax_ep.system import cuda_driver
from jax_ep.system.records import (
    DeviceInfo,
    DriverInfo,
    ExtensionInfo,
    GpuInfo,
    JaxInfo,
    NvshmemInfo,
    PeerLink,
    XlaMemorySettings,
)

# XLA's defaults (XLA_PYTHON_CLIENT_PREALLOCATE / _MEM_FRACTION / _ALLOCATOR unset).
DEFAULT_MEM_FRACTION = 0.75

_NVSHMEM_PACKAGES = ("nvidia-nvshmem-cu13", "nvidia-nvshmem-cu12")
_JAX_CUDA_PLUGINS = ("jax-cuda13-plugin", "jax-cuda12-plugin")
# CUDA runtime wheels per CUDA major (CUDA 13 dropped the -cuXX suffix).
_CUDA_RUNTIME_PACKAGES = {
    "13": ("nvidia-cuda-runtime", "nvidia-cuda-runtime-cu13"),
    "12": ("nvidia-cuda-runtime-cu12",),
}

def _package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def jax_ep_version() -> str | None:
    version = _package_version("jax_ep") or _package_version("jax-ep")
    if version is None:  # running from a source tree: the package may say it itself
        version = getattr(sys.modules.get("jax_ep"), "__version__", None)
    return version


def jaxlib_version() -> str | None:
    version = _package_version("jaxlib")
    if version is None:
        try:
            import jaxlib

            version = getattr(jaxlib, "__version__", None)
        except ImportError:
            pass
    return version


def cuda_runtime_version(devices: Sequence[Any]) -> tuple[str, str | None, str | None]:
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
                cuda_driver.format_cuda_version(int(match.group(1))),
                "XLA platform_version (the CUDA XLA was built with)",
                plugin,
            )
    return "unknown", None, plugin


def describe_device(device: Any) -> DeviceInfo:
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


def probe_jax() -> tuple[JaxInfo, list[Any]]:
    """JaxInfo and the global jax devices (initialises jax's default backend)."""
    try:
        devices = jax.devices()
        backend = jax.default_backend()
    except Exception as e:  # reported, the rest of the report still works
        return JaxInfo(None, 0, 1, 0, (), f"{type(e).__name__}: {e}"), []
    local = tuple(describe_device(d) for d in jax.local_devices())
    return (
        JaxInfo(backend, jax.process_index(), jax.process_count(), len(devices), local, None),
        devices,
    )


def probe_driver() -> DriverInfo:
    driver, reason = cuda_driver.get_driver()
    nvml, nvml_reason = cuda_driver.get_nvml()
    if driver is not None and not driver.initialized:
        reason = driver.init_error
    count = 0
    if driver is not None and driver.initialized:
        try:
            count = driver.device_count()
        except cuda_driver.CudaDriverError as e:
            reason = str(e)
    return DriverInfo(
        available=driver is not None and driver.initialized and reason is None,
        reason=reason,
        device_count=count,
        nvml=nvml is not None,
        nvml_reason=nvml_reason,
    )


def driver_cuda_version() -> int | None:
    """cuDriverGetVersion (= cudaDriverGetVersion), e.g. 12080; None without a driver."""
    driver, _ = cuda_driver.get_driver()
    if driver is None:
        return None
    try:
        return driver.version()
    except cuda_driver.CudaDriverError:
        return None


def driver_version_text() -> str | None:
    version = driver_cuda_version()
    return None if version is None else cuda_driver.format_cuda_version(version)


def try_driver(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except cuda_driver.CudaDriverError:
        return None


def probe_gpus(
    ordinals: Sequence[int] | None = None, *, free_memory: bool = True,
    create_context: bool = True, nvlinks: bool = True,
) -> tuple[GpuInfo, ...]:
    """GpuInfo of the given CUDA ordinals (default: every visible GPU); () without a driver."""
    driver, _ = cuda_driver.get_driver()
    if driver is None or not driver.initialized:
        return ()
    if ordinals is None:
        ordinals = range(try_driver(driver.device_count) or 0)
    nvml = cuda_driver.get_nvml()[0] if nvlinks else None
    gpus = []
    for ordinal in ordinals:
        cc = try_driver(driver.compute_capability, ordinal)
        bus_id = try_driver(driver.pci_bus_id, ordinal)
        active = None
        if nvml is not None and bus_id is not None:
            handle = try_driver(nvml.handle_by_pci_bus_id, bus_id)
            active = None if handle is None else try_driver(nvml.active_nvlinks, handle)
        gpus.append(GpuInfo(
            ordinal=ordinal,
            name=try_driver(driver.device_name, ordinal) or "unknown",
            compute_capability="unknown" if cc is None else f"{cc[0]}.{cc[1]}",
            total_memory_bytes=try_driver(driver.total_memory, ordinal),
            free_memory_bytes=(
                try_driver(driver.free_memory, ordinal, create_context=create_context)
                if free_memory else None
            ),
            pci_bus_id=bus_id,
            nvlinks_active=active,
            cooperative_launch=try_driver(driver.cooperative_launch, ordinal),
        ))
    return tuple(gpus)


def probe_peers(
    ordinals: Sequence[int], bus_ids: dict[int, str | None] | None = None
) -> tuple[PeerLink, ...]:
    """PeerLink for every ordered pair of distinct ordinals; () without a driver.

    `bus_ids` (ordinal -> PCI bus id) enables the NVML NVLink check.
    """
    driver, _ = cuda_driver.get_driver()
    if driver is None or not driver.initialized:
        return ()
    nvml = cuda_driver.get_nvml()[0] if bus_ids else None
    handles = {}
    if nvml is not None:
        for ordinal, bus_id in bus_ids.items():
            if bus_id is not None:
                handles[ordinal] = try_driver(nvml.handle_by_pci_bus_id, bus_id)
    links = []
    for src in ordinals:
        for dst in ordinals:
            if src == dst:
                continue
            access = try_driver(driver.can_access_peer, src, dst)
            atomics = try_driver(driver.p2p_attribute, src, dst,
                           cuda_driver.CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED)
            rank = try_driver(driver.p2p_attribute, src, dst,
                        cuda_driver.CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK)
            nvlink = None
            if handles.get(src) is not None and handles.get(dst) is not None:
                nvlink = try_driver(nvml.nvlink_p2p_ok, handles[src], handles[dst])
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


def _built_extension(package_dir: str) -> str | None:
    """The file of a built `_C` module in a `jax_ep` package folder, or None."""
    try:
        names = sorted(os.listdir(package_dir))
    except OSError:
        return None
    for name in names:
        if name.startswith("_C.") and name.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES)):
            return os.path.join(package_dir, name)
    return None


def source_tree(package_dir: str) -> str | None:
    """The source checkout a `jax_ep` package folder sits in (pyproject.toml and CMakeLists.txt
    beside it), or None for an installed package."""
    root = os.path.dirname(os.path.abspath(package_dir))
    if all(os.path.isfile(os.path.join(root, f)) for f in ("pyproject.toml", "CMakeLists.txt")):
        return root
    return None


def shadowed_build(package_dir: str, search_path: Sequence[str] | None = None) -> str | None:
    """A built `jax_ep/_C` in another entry of `search_path` (default `sys.path`) when the
    imported package folder `package_dir` has none: an installed build that `import jax_ep`
    never reached, because the folder came first (a source checkout in the current directory).
    """
    if _built_extension(package_dir) is not None:
        return None
    here = os.path.realpath(package_dir)
    for entry in sys.path if search_path is None else search_path:
        candidate = os.path.join(entry or os.getcwd(), "jax_ep")
        if os.path.realpath(candidate) != here:
            built = _built_extension(candidate)
            if built is not None:
                return built
    return None


def probe_extension() -> ExtensionInfo:
    """Whether jax_ep._C imports, and the CUDA architectures it was built for. When it does not
    import because `jax_ep` came from a source checkout without a build, says so (with the
    installed build that the checkout hides, if there is one)."""
    try:
        module = importlib.import_module("jax_ep._C")
    except Exception as e:  # ImportError, or OSError from a missing CUDA library
        error = f"{type(e).__name__}: {e}"
        package = sys.modules.get("jax_ep")
        package_dir = os.path.dirname(getattr(package, "__file__", None) or "")
        if (isinstance(e, ModuleNotFoundError) and package_dir
                and _built_extension(package_dir) is None):
            tree = source_tree(package_dir)
            if tree is not None:
                return ExtensionInfo(False, None, None, error, source_tree=tree,
                                     shadowed_build=shadowed_build(package_dir))
        return ExtensionInfo(False, None, None, error)
    archs = None
    try:
        archs = str(module.cuda_architectures())
    except Exception:  # an older build without the function: archs unknown
        pass
    built = getattr(module, "nvshmem_built", None)
    runtime = getattr(module, "cuda_runtime_version", None)
    max_ranks = getattr(module, "max_ranks", None)
    return ExtensionInfo(True, archs, getattr(module, "__file__", None), None,
                         bool(built()) if built is not None else None,
                         int(runtime()) if runtime is not None else None,
                         int(max_ranks()) if max_ranks is not None else None)


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
        "not installed; needed only for JAX_EP_PEER_MAPPING=nvshmem "
        "(pip install nvidia-nvshmem-cu13 to match jax's CUDA, or -cu12)",
    )


def nvshmem_host_library(environ=None) -> tuple[str | None, str | None]:
    """(path of NVSHMEM's host library, None) or (None, why not): ``JAX_EP_NVSHMEM_LIB`` when
    set in ``environ`` (default ``os.environ``), else the nvidia-nvshmem wheel's. Its folder holds
    NVSHMEM's bootstrap and transport plugins."""
    explicit = settings.value("JAX_EP_NVSHMEM_LIB", environ)
    if explicit:
        return explicit, None
    found = probe_nvshmem()
    return found.host_library, found.reason


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
