"""The cross-host preflight: whether this host has what an EP group across hosts needs.

An EP group across hosts reaches its peers through NVSHMEM over an RDMA network (InfiniBand,
RoCE or EFA): NVSHMEM's host library with its bootstrap and network transport plugins (and the
system libraries its chosen network transport loads), RDMA devices with a port up (and their
device files inside a container), GPUDirect RDMA (the `nvidia_peermem` module, or dma-buf),
optionally IBGDA (GPU-initiated network requests), a NIC near each GPU on the PCIe tree, and an
environment that lets NVSHMEM use the network. Each check here reads the system through `root`
(default "/": `root/sys/class/infiniband`, `root/proc/...`) and the environment through
`environ`, so tests run them on a folder of faked files. None raises for a missing file: a
missing file is a finding.

`preflight(...)` -> tuple of `PreflightCheck` (name, "ok" | "warn" | "fail", what was found,
the fix, detail lines); `jax-ep-env --cluster` prints them (`jax_ep.tools.env_report`).

Sharding model: none; the checks concern one host, and every host of a job runs them.
"""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Mapping, Sequence

from jax_ep.system import probes
from jax_ep.system.records import GpuInfo, PreflightCheck  # noqa: F401 - re-exported

OK, WARN, FAIL = "ok", "warn", "fail"

# NVSHMEM's plugins beside its host library (the nvidia-nvshmem wheel's lib folder). jax_ep
# joins NVSHMEM by unique id, which the "uid" bootstrap plugin carries.
NVSHMEM_BOOTSTRAP_UID = "nvshmem_bootstrap_uid"
NVSHMEM_TRANSPORTS = ("ibrc", "ibgda", "ucx", "libfabric")
# NVSHMEM_REMOTE_TRANSPORT's values, and its default when unset.
REMOTE_TRANSPORTS = ("ibrc", "ucx", "libfabric", "ibdevx", "none")
DEFAULT_REMOTE_TRANSPORT = "ibrc"
# The first Linux with dma-buf import of device memory by RDMA drivers (ib_umem_dmabuf).
DMABUF_MIN_KERNEL = (5, 12)
_PORT_ACTIVE = "ACTIVE"
_NVIDIA_VENDOR = "0x10de"
_TRUE = ("1", "true", "yes", "on", "y", "t")

_INSTALL_NVSHMEM = ("pip install nvidia-nvshmem-cu13 (or -cu12, matching jax's CUDA), or point "
                    "JAX_EP_NVSHMEM_LIB at a libnvshmem_host.so.3 with its plugins beside it")


def _path(root: str, *parts: str) -> str:
    return os.path.join(root, *parts)


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return None


def _truthy(text: str | None) -> bool:
    return (text or "").strip().lower() in _TRUE


# --------------------------------------------------------------------------------- NVSHMEM


def check_nvshmem(lib_dir: str | None = None, environ: Mapping[str, str] | None = None
                  ) -> PreflightCheck:
    """NVSHMEM's host library and its plugins, in the folder of the host library jax_ep loads
    (`probes.nvshmem_host_library`), or in `lib_dir` when given (tests)."""
    name = "NVSHMEM and its plugins"
    if lib_dir is None:
        library, reason = probes.nvshmem_host_library(environ)
        if library is None:
            found = ("no nvidia-nvshmem wheel installed and JAX_EP_NVSHMEM_LIB unset"
                     if reason.startswith("not installed") else reason)
            return PreflightCheck(name, FAIL, found, _INSTALL_NVSHMEM)
        if not os.path.isfile(library):
            return PreflightCheck(name, FAIL, f"{library} does not exist", _INSTALL_NVSHMEM)
        lib_dir = os.path.dirname(library)
    hosts = sorted(glob.glob(_path(lib_dir, "libnvshmem_host.so*")))
    if not hosts:
        return PreflightCheck(name, FAIL, f"no libnvshmem_host.so* in {lib_dir}", _INSTALL_NVSHMEM)
    bootstraps = sorted({_plugin_stem(p)
                         for p in glob.glob(_path(lib_dir, "nvshmem_bootstrap_*.so*"))})
    transports = {t for t in NVSHMEM_TRANSPORTS
                  if glob.glob(_path(lib_dir, f"nvshmem_transport_{t}.so*"))}
    details = (f"host library: {hosts[0]}",
               f"bootstrap plugins: {', '.join(bootstraps) or 'none'}",
               f"network transport plugins: {', '.join(sorted(transports)) or 'none'}")
    found = f"{os.path.basename(hosts[0])} in {lib_dir}"
    if NVSHMEM_BOOTSTRAP_UID not in bootstraps:
        return PreflightCheck(name, FAIL, f"{found}, without {NVSHMEM_BOOTSTRAP_UID}.so",
                              f"jax_ep joins NVSHMEM by unique id: reinstall the wheel "
                              f"({_INSTALL_NVSHMEM})", details)
    if not transports:
        return PreflightCheck(name, FAIL, f"{found}, without network transport plugins",
                              f"NVSHMEM reaches other hosts through nvshmem_transport_ibrc, "
                              f"_ibgda, _ucx or _libfabric: reinstall the wheel "
                              f"({_INSTALL_NVSHMEM})", details)
    missing = [t for t in NVSHMEM_TRANSPORTS if t not in transports]
    if missing:
        return PreflightCheck(name, WARN, f"{found}; no {', '.join(missing)} transport",
                              "the network transport NVSHMEM_REMOTE_TRANSPORT names must be "
                              "among the plugins (IBGDA needs nvshmem_transport_ibgda)", details)
    return PreflightCheck(name, OK, found, "", details)


def _plugin_stem(path: str) -> str:
    return os.path.basename(path).split(".so")[0]


# ------------------------------------------------------------------------------ RDMA devices


def _rdma_ports(root: str) -> list[tuple[str, str, str, str, str]]:
    """(device, port, state, link layer, rate) of every port under sys/class/infiniband."""
    ports = []
    base = _path(root, "sys", "class", "infiniband")
    for device in sorted(os.listdir(base)) if os.path.isdir(base) else ():
        port_dir = _path(base, device, "ports")
        for port in sorted(os.listdir(port_dir)) if os.path.isdir(port_dir) else ():
            state = _read(_path(port_dir, port, "state")) or "unknown"
            # "4: ACTIVE" -> "ACTIVE"
            state = state.split(":", 1)[-1].strip()
            layer = _read(_path(port_dir, port, "link_layer")) or "unknown"
            rate = _read(_path(port_dir, port, "rate")) or "unknown rate"
            ports.append((device, port, state, layer, rate))
    return ports


def rdma_devices(root: str = "/") -> list[str]:
    """The RDMA devices under `root`/sys/class/infiniband, sorted."""
    base = _path(root, "sys", "class", "infiniband")
    return sorted(os.listdir(base)) if os.path.isdir(base) else []


def active_rdma_devices(root: str = "/") -> list[str]:
    """The RDMA devices with at least one ACTIVE port."""
    return sorted({dev for dev, _, state, _, _ in _rdma_ports(root) if state == _PORT_ACTIVE})


def check_rdma_devices(root: str = "/") -> PreflightCheck:
    """InfiniBand / RoCE / EFA devices and the state of their ports."""
    name = "RDMA devices (InfiniBand, RoCE, EFA)"
    ports = _rdma_ports(root)
    if not ports:
        return PreflightCheck(
            name, FAIL, f"none under {_path(root, 'sys/class/infiniband')}",
            "no RDMA NIC is visible: install the NIC's driver (rdma-core / MLNX_OFED / DOCA for "
            "ConnectX, the efa driver on AWS) and, in a container, pass the devices in "
            "(--device=/dev/infiniband, or the RDMA device plugin on Kubernetes)")
    details = tuple(f"{dev} port {port}: {state}, {layer}, {rate}"
                    for dev, port, state, layer, rate in ports)
    active = [p for p in ports if p[2] == _PORT_ACTIVE]
    if not active:
        return PreflightCheck(
            name, FAIL, f"{len(ports)} port(s), none ACTIVE",
            "no port is up: check the cable and the switch (ibstat); an InfiniBand port that "
            "stays INIT has no subnet manager (start opensm or the switch's)", details)
    layers = sorted({p[3] for p in active})
    return PreflightCheck(name, OK, f"{len(active)} of {len(ports)} port(s) ACTIVE "
                          f"({', '.join(layers)})", "", details)


def check_rdma_device_files(root: str = "/") -> PreflightCheck:
    """The verbs device files NVSHMEM opens (`/dev/infiniband/uverbs*`)."""
    name = "RDMA device files"
    files = sorted(os.path.basename(p)
                   for p in glob.glob(_path(root, "dev", "infiniband", "uverbs*")))
    if files:
        return PreflightCheck(name, OK, f"{len(files)} in /dev/infiniband ({', '.join(files)})", "")
    where = ("the kernel shows RDMA devices but this process cannot open them"
             if rdma_devices(root) else "no RDMA device")
    return PreflightCheck(
        name, FAIL, f"no /dev/infiniband/uverbs* ({where})",
        "load ib_uverbs (modprobe ib_uverbs); in a container, pass --device=/dev/infiniband "
        "(Docker) or request the RDMA devices (Kubernetes RDMA device plugin), and allow locked "
        "memory (--ulimit memlock=-1)")


# --------------------------------------------------------------------------- GPUDirect RDMA


def _kernel_version(root: str) -> tuple[int, int] | None:
    release = _read(_path(root, "proc", "sys", "kernel", "osrelease"))
    match = re.match(r"(\d+)\.(\d+)", release or "")
    return (int(match.group(1)), int(match.group(2))) if match else None


def nvidia_driver_text(root: str = "/") -> str | None:
    """The first line of /proc/driver/nvidia/version, None without the NVIDIA driver."""
    text = _read(_path(root, "proc", "driver", "nvidia", "version"))
    return text.splitlines()[0].strip() if text else None


def check_gpudirect_rdma(root: str = "/") -> PreflightCheck:
    """Whether the RDMA driver can register GPU memory: `nvidia_peermem` (or the older
    `nv_peer_mem`) loaded, or dma-buf (Linux >= 5.12 with NVIDIA's open GPU kernel module)."""
    name = "GPUDirect RDMA"
    for module in ("nvidia_peermem", "nv_peer_mem"):
        if os.path.isdir(_path(root, "sys", "module", module)):
            return PreflightCheck(name, OK, f"{module} loaded", "")
    driver = nvidia_driver_text(root)
    kernel = _kernel_version(root)
    kernel_text = "unknown" if kernel is None else f"{kernel[0]}.{kernel[1]}"
    if driver is None:
        return PreflightCheck(name, FAIL, "no NVIDIA driver (/proc/driver/nvidia/version)",
                              "install the NVIDIA driver on this host")
    open_module = "open kernel module" in driver.lower()
    if open_module and kernel is not None and kernel >= DMABUF_MIN_KERNEL:
        return PreflightCheck(name, OK, f"dma-buf (Linux {kernel_text}, open GPU kernel module); "
                              f"nvidia_peermem not loaded", "", (driver,))
    why = ("the GPU kernel module is NVIDIA's proprietary one" if not open_module else
           f"Linux {kernel_text} is older than "
           f"{DMABUF_MIN_KERNEL[0]}.{DMABUF_MIN_KERNEL[1]}")
    return PreflightCheck(
        name, FAIL, f"nvidia_peermem not loaded, and no dma-buf: {why}",
        "sudo modprobe nvidia_peermem (shipped with the NVIDIA driver; load it after the NIC's "
        "driver, and add it to /etc/modules-load.d to keep it), or use dma-buf: NVIDIA's open "
        "GPU kernel module on Linux 5.12 or newer", (driver,))


# ----------------------------------------------------------------------------------- IBGDA


def peer_mapping_override(root: str = "/") -> bool:
    """Whether the NVIDIA driver runs with RegistryDwords PeerMappingOverride=1."""
    params = _read(_path(root, "proc", "driver", "nvidia", "params")) or ""
    for line in params.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "RegistryDwords" and re.search(r"PeerMappingOverride\s*=\s*1\b", value):
            return True
    return False


def check_ibgda(root: str = "/", environ: Mapping[str, str] | None = None) -> PreflightCheck:
    """IBGDA (GPU-initiated InfiniBand requests): NVSHMEM_IB_ENABLE_IBGDA, the NVSHMEM_IBGDA_*
    settings and the driver's PeerMappingOverride=1. Optional (NVSHMEM's proxy transport works
    without it), so a gap is a warning."""
    name = "IBGDA (optional)"
    environ = os.environ if environ is None else environ
    enabled = _truthy(environ.get("NVSHMEM_IB_ENABLE_IBGDA"))
    settings = sorted(f"{k}={v}" for k, v in environ.items() if k.startswith("NVSHMEM_IBGDA_"))
    override = peer_mapping_override(root)
    details = (f"NVSHMEM_IB_ENABLE_IBGDA={environ.get('NVSHMEM_IB_ENABLE_IBGDA', '(unset)')}",
               f"NVSHMEM_IBGDA_*: {', '.join(settings) or 'none set'}",
               f"driver RegistryDwords PeerMappingOverride=1: {'yes' if override else 'no'}")
    regkey_fix = ("for GPU-initiated doorbells add options nvidia "
                  "NVreg_RegistryDwords=\"PeerMappingOverride=1;\" to /etc/modprobe.d/nvidia.conf "
                  "and reload the driver (NVSHMEM 3.4 and newer otherwise fall back to "
                  "CPU-assisted IBGDA)")
    if enabled and override:
        return PreflightCheck(name, OK, "on; the driver has PeerMappingOverride=1", "", details)
    if enabled:
        return PreflightCheck(name, WARN, "on, but the driver lacks PeerMappingOverride=1",
                              regkey_fix, details)
    if override:
        return PreflightCheck(name, OK, "off (NVSHMEM's proxy transport); the driver is ready for "
                              "it (PeerMappingOverride=1)", "", details)
    return PreflightCheck(name, WARN, "off (NVSHMEM's proxy transport); the driver lacks "
                          "PeerMappingOverride=1",
                          f"to use IBGDA set NVSHMEM_IB_ENABLE_IBGDA=1; {regkey_fix}", details)


# ------------------------------------------------------------------------------ NIC per GPU


def _normal_bus_id(bus_id: str) -> str:
    """"00000000:1B:00.0" (NVML) or "0000:1B:00.0" (CUDA) -> "0000:1b:00.0" (sysfs)."""
    text = bus_id.strip().lower()
    match = re.fullmatch(r"(?:([0-9a-f]{1,8}):)?([0-9a-f]{2}:[0-9a-f]{2}\.[0-7])", text)
    if match is None:  # not a bus id: look it up as given
        return text
    return f"{int(match.group(1) or '0', 16):04x}:{match.group(2)}"


def _pci_chain(path: str) -> list[str] | None:
    """The PCI path of a device, from its sysfs node: ["pci0000:00", "0000:00:01.0", ...]."""
    if not os.path.exists(path):
        return None
    parts = os.path.realpath(path).split(os.sep)
    if "devices" not in parts:
        return None
    chain = parts[len(parts) - parts[::-1].index("devices"):]
    return chain if chain and chain[0].startswith("pci") else None


def nvidia_gpus(root: str = "/") -> list[str]:
    """PCI bus ids of NVIDIA display and 3D controllers under `root`/sys/bus/pci/devices."""
    found = []
    for path in sorted(glob.glob(_path(root, "sys", "bus", "pci", "devices", "*"))):
        vendor = (_read(_path(path, "vendor")) or "").lower()
        pci_class = (_read(_path(path, "class")) or "").lower()
        if vendor == _NVIDIA_VENDOR and pci_class.startswith("0x03"):
            found.append(os.path.basename(path))
    return found


def _numa_node(root: str, bus_id: str) -> int | None:
    text = _read(_path(root, "sys", "bus", "pci", "devices", bus_id, "numa_node"))
    try:
        node = int(text or "")
    except ValueError:
        return None
    return node if node >= 0 else None


def _relation(gpu: list[str], nic: list[str], gpu_numa: int | None, nic_numa: int | None
              ) -> tuple[int, str]:
    """(closeness, words): 3 same switch, 2 same root complex, 1 same socket, 0 further."""
    common = 0
    for a, b in zip(gpu, nic, strict=False):
        if a != b:
            break
        common += 1
    if common >= 2:  # below one root port: a PCIe switch shared by both
        return 3, "same switch"
    if common == 1:
        return 2, "same root complex"
    if gpu_numa is not None and gpu_numa == nic_numa:
        return 1, "same socket, different root complex"
    if gpu_numa is None or nic_numa is None:
        return 0, "different root complex, socket unknown"
    return 0, "different socket"


def gpu_nics(root: str = "/", gpus: Sequence[GpuInfo] = ()
             ) -> list[tuple[str, str | None, str]]:
    """(GPU label, nearest RDMA device or None, relation) for every GPU.

    The GPUs are `gpus` (labelled by CUDA ordinal) when they carry PCI bus ids, else every
    NVIDIA GPU under sys/bus/pci/devices (labelled by bus id). The nearest device is the one
    with the longest common PCI path (ports ACTIVE first), as NVSHMEM and NCCL choose.
    """
    labelled = [(f"GPU {g.ordinal} ({_normal_bus_id(g.pci_bus_id)})", _normal_bus_id(g.pci_bus_id))
                for g in gpus if g.pci_bus_id]
    if not labelled:
        labelled = [(f"GPU {bus_id}", bus_id) for bus_id in nvidia_gpus(root)]
    active = set(active_rdma_devices(root))
    nics = []
    for dev in rdma_devices(root):
        chain = _pci_chain(_path(root, "sys", "class", "infiniband", dev, "device"))
        if chain is not None:
            nics.append((dev, chain, _numa_node(root, chain[-1])))
    pairs = []
    for label, bus_id in labelled:
        chain = _pci_chain(_path(root, "sys", "bus", "pci", "devices", bus_id))
        if chain is None or not nics:
            pairs.append((label, None, "not on the PCI tree" if chain is None else "no RDMA NIC"))
            continue
        numa = _numa_node(root, bus_id)
        # max keeps the first of equals: the first device by name.
        best = max(nics, key=lambda n: (n[0] in active, _relation(chain, n[1], numa, n[2])[0]))
        pairs.append((label, best[0], _relation(chain, best[1], numa, best[2])[1]))
    return pairs


def check_gpu_nics(root: str = "/", gpus: Sequence[GpuInfo] = ()) -> PreflightCheck:
    """Which NIC each GPU uses: ok when every GPU has one behind the same PCIe switch."""
    name = "NIC per GPU (PCI topology)"
    pairs = gpu_nics(root, gpus)
    if not pairs:
        return PreflightCheck(name, FAIL, "no NVIDIA GPU under /sys/bus/pci/devices",
                              "run the preflight on a GPU host (in a container: with its GPUs)")
    details = tuple(f"{label} -> {nic or 'none'} ({relation})" for label, nic, relation in pairs)
    without = [label for label, nic, _ in pairs if nic is None]
    if without:
        return PreflightCheck(name, FAIL, f"{len(without)} of {len(pairs)} GPU(s) without a NIC",
                              "see 'RDMA devices' above; a GPU that is not on the PCI tree is "
                              "hidden from this container's /sys", details)
    far = [label for label, _, relation in pairs if relation != "same switch"]
    if far:
        return PreflightCheck(
            name, WARN, f"{len(far)} of {len(pairs)} GPU(s) without a NIC behind their PCIe switch",
            "GPUDirect RDMA through the CPU's root complex is slower (nvidia-smi topo -m shows "
            "the paths); if the node has such NICs, make them visible here", details)
    return PreflightCheck(name, OK, f"{len(pairs)} GPU(s), each with a NIC behind its PCIe "
                          f"switch", "", details)


# ---------------------------------------------------------------------------- environment


def check_nvlink_multicast(environ: Mapping[str, str] | None = None) -> PreflightCheck:
    """NVLink multicast (NVLS) off in NVSHMEM and NCCL: jax_ep's runs and tests set
    NVSHMEM_DISABLE_NVLS=1 and NCCL_NVLS_ENABLE=0 (docs/process_models.md)."""
    name = "NVLink multicast off"
    environ = os.environ if environ is None else environ
    nvshmem, nccl = environ.get("NVSHMEM_DISABLE_NVLS"), environ.get("NCCL_NVLS_ENABLE")
    found = (f"NVSHMEM_DISABLE_NVLS={nvshmem if nvshmem is not None else '(unset)'}, "
             f"NCCL_NVLS_ENABLE={nccl if nccl is not None else '(unset)'}")
    if _truthy(nvshmem) and (nccl or "").strip() == "0":
        return PreflightCheck(name, OK, found, "")
    return PreflightCheck(name, WARN, found,
                          "export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 in every process "
                          "(jax_ep uses no NVLink multicast, which NVSHMEM and NCCL may "
                          "otherwise set up where NVSwitches offer it)")


def check_remote_transport(environ: Mapping[str, str] | None = None, root: str = "/"
                           ) -> PreflightCheck:
    """NVSHMEM_REMOTE_TRANSPORT: the network transport NVSHMEM uses to reach other hosts."""
    name = "NVSHMEM_REMOTE_TRANSPORT"
    environ = os.environ if environ is None else environ
    raw = environ.get("NVSHMEM_REMOTE_TRANSPORT")
    value = (raw or "").strip().lower() or None
    efa = any(dev.startswith(("efa", "rdmap")) for dev in rdma_devices(root))
    shown = f"{raw!r}" if value else f"unset ({DEFAULT_REMOTE_TRANSPORT}, NVSHMEM's default)"
    if value is not None and value not in REMOTE_TRANSPORTS:
        return PreflightCheck(name, FAIL, shown,
                              f"choose one of {', '.join(REMOTE_TRANSPORTS[:-1])}")
    if value == "none":
        return PreflightCheck(name, FAIL, f"{shown}: NVSHMEM uses no network",
                              "unset it, or set ibrc (InfiniBand/RoCE), ucx or libfabric (EFA)")
    if efa and (value or DEFAULT_REMOTE_TRANSPORT) != "libfabric":
        return PreflightCheck(name, WARN, f"{shown} on EFA devices", "EFA is reached "
                              "through libfabric: NVSHMEM_REMOTE_TRANSPORT=libfabric")
    return PreflightCheck(name, OK, shown, "")


# The libraries NVSHMEM's network transport plugins need from the system (the dependencies
# `ldd` finds missing from the nvidia-nvshmem-cu13 wheel's plugins; ibrc opens libibverbs when
# it starts). The wheel carries none of them.
TRANSPORT_LIBRARIES = {"ibrc": ("libibverbs.so.1",), "ucx": ("libucp.so.0", "libucs.so.0"),
                       "libfabric": ("libfabric.so.1",)}
_TRANSPORT_LIBRARY_FIX = {
    "ibrc": "install rdma-core's libibverbs (Debian/Ubuntu: libibverbs1; RHEL: rdma-core)",
    "ucx": "install UCX (a system package, or `pip install libucx-cu13`) and put its lib folder "
           "on LD_LIBRARY_PATH in every process",
    "libfabric": "install libfabric (on EFA: the AWS EFA installer) and put its lib folder on "
                 "LD_LIBRARY_PATH in every process",
}
# Where the dynamic loader looks besides LD_LIBRARY_PATH and /etc/ld.so.conf.d's folders.
_LIBRARY_DIRS = ("lib", "lib64", "usr/lib", "usr/lib64", "usr/local/lib",
                 "lib/x86_64-linux-gnu", "usr/lib/x86_64-linux-gnu", "lib/aarch64-linux-gnu",
                 "usr/lib/aarch64-linux-gnu")


def library_dirs(root: str = "/", environ: Mapping[str, str] | None = None) -> list[str]:
    """The folders the dynamic loader searches: LD_LIBRARY_PATH's, those listed in
    `root`/etc/ld.so.conf.d/*.conf, and the system's default ones (under `root`)."""
    environ = os.environ if environ is None else environ
    dirs = [d for d in environ.get("LD_LIBRARY_PATH", "").split(":") if d]
    for conf in sorted(glob.glob(_path(root, "etc", "ld.so.conf.d", "*.conf"))):
        for line in (_read(conf) or "").splitlines():
            line = line.split("#")[0].strip()
            if line.startswith("/"):
                dirs.append(_path(root, line.lstrip("/")))
    return dirs + [_path(root, d) for d in _LIBRARY_DIRS]


def check_network_libraries(environ: Mapping[str, str] | None = None, root: str = "/"
                            ) -> PreflightCheck:
    """The system libraries of the network transport NVSHMEM_REMOTE_TRANSPORT selects: without
    them NVSHMEM cannot load its plugin, and a job across hosts fails to start."""
    name = "Network transport libraries"
    environ = os.environ if environ is None else environ
    transport = (environ.get("NVSHMEM_REMOTE_TRANSPORT") or "").strip().lower() or (
        DEFAULT_REMOTE_TRANSPORT)
    needed = TRANSPORT_LIBRARIES.get(transport)
    if needed is None:
        return PreflightCheck(name, OK, f"{transport}: no system library to check", "")
    dirs = library_dirs(root, environ)
    where = {lib: next((d for d in dirs if os.path.exists(os.path.join(d, lib))), None)
             for lib in needed}
    missing = [lib for lib, d in where.items() if d is None]
    if missing:
        return PreflightCheck(name, FAIL, f"{transport}: no {', '.join(missing)} where the "
                              "dynamic loader looks", _TRANSPORT_LIBRARY_FIX[transport],
                              tuple(f"searched: {d}" for d in dirs))
    return PreflightCheck(name, OK, f"{transport}: " + ", ".join(
        f"{lib} in {d}" for lib, d in where.items()), "")


# --------------------------------------------------------------------------------- all


def preflight(root: str = "/", environ: Mapping[str, str] | None = None,
              gpus: Sequence[GpuInfo] = (), nvshmem_lib_dir: str | None = None
              ) -> tuple[PreflightCheck, ...]:
    """Every check of this module on one host.

    Args:
      root: where the system's files are read ("/"; tests: a folder of faked files).
      environ: the environment the job's processes get (default os.environ).
      gpus: this process's GPUs (probes.probe_gpus) to name them by CUDA ordinal; default
        every NVIDIA GPU under `root`/sys/bus/pci/devices.
      nvshmem_lib_dir: the folder of NVSHMEM's host library and plugins; default the one jax_ep
        loads (JAX_EP_NVSHMEM_LIB, else the nvidia-nvshmem wheel's).

    Returns:
      The checks, in the order a fix is best made.
    """
    return (
        check_nvshmem(nvshmem_lib_dir, environ),
        check_rdma_devices(root),
        check_rdma_device_files(root),
        check_gpudirect_rdma(root),
        check_ibgda(root, environ),
        check_gpu_nics(root, gpus),
        check_remote_transport(environ, root),
        check_network_libraries(environ, root),
        check_nvlink_multicast(environ),
    )
