"""Tiny ctypes wrappers over the CUDA driver API (libcuda.so.1) and NVML (libnvidia-ml.so.1).

Used by the probes (`jax_ep.system.probes`) to describe the machine (driver version, GPUs,
memory, peer access, NVLink) without the CUDA toolkit, without the jax_ep extension and without
initialising JAX's GPU backend. Both libraries are optional: on a machine without an NVIDIA
driver `get_driver()` and `get_nvml()` return `(None, reason)` and nothing here raises on import.

Device numbers are CUDA device ordinals as the driver sees them in this process (after
`CUDA_VISIBLE_DEVICES`), which are also the `local_hardware_id` of JAX's GPU devices.

Only read-only queries are made. The one side effect is `CudaDriver.free_memory`, which needs a
context: it retains the device's primary context (the one XLA uses too), so when JAX has already
started on that GPU nothing new is created; otherwise the context is created for the query and
destroyed again on release (pass `create_context=False` to skip the query instead).
"""

from __future__ import annotations

import ctypes
import functools
import sys

# The hardware queues (connections) a context's streams are spread over, and how many there are
# when the variable is unset: streams past them share a queue, and work on a shared queue waits
# for the work queued before it, whatever its stream.
ENV_MAX_CONNECTIONS = "CUDA_DEVICE_MAX_CONNECTIONS"
DEFAULT_MAX_CONNECTIONS = 8

# CUresult values named in messages (cuda.h).
CUDA_SUCCESS = 0
CUDA_ERROR_NO_DEVICE = 100

# CUdevice_attribute (cuda.h).
CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75
CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76
CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH = 95  # = cudaDevAttrCooperativeLaunch

# CUdevice_P2PAttribute (cuda.h).
CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK = 1
CU_DEVICE_P2P_ATTRIBUTE_ACCESS_SUPPORTED = 2
CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED = 3

# NVML (nvml.h).
NVML_SUCCESS = 0
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_FEATURE_ENABLED = 1
NVML_P2P_CAPS_INDEX_NVLINK = 2
NVML_P2P_STATUS_OK = 0
# Upper bound on NVLinks per GPU in current nvml.h (NVML_NVLINK_MAX_LINKS; 18 on Hopper).
NVML_NVLINK_MAX_LINKS = 18

_PCI_BUS_ID_CHARS = 64  # cuDeviceGetPCIBusId needs >= 13; NVML bus ids are up to 32.
_NAME_CHARS = 256

_CUDA_LIBRARY_NAMES = ("libcuda.so.1", "libcuda.so") if sys.platform != "win32" else ("nvcuda.dll",)
_NVML_LIBRARY_NAMES = (
    ("libnvidia-ml.so.1", "libnvidia-ml.so") if sys.platform != "win32" else ("nvml.dll",)
)


class CudaDriverError(RuntimeError):
    """A CUDA driver or NVML call returned an error.

    Attributes:
      function: the C function that failed, e.g. "cuDeviceGetName".
      code: its return code (CUresult or nvmlReturn_t).
      name: the code's symbolic name where the library tells it, e.g. "CUDA_ERROR_NO_DEVICE".
    """

    def __init__(self, function: str, code: int, name: str):
        super().__init__(f"{function} failed: {name} ({code})")
        self.function = function
        self.code = code
        self.name = name


def _load_library(names: tuple[str, ...]) -> tuple[ctypes.CDLL | None, str | None]:
    """(library, None), or (None, the loader's error when it is more than "not found")."""
    errors = []
    for name in names:
        try:
            return ctypes.CDLL(name), None
        except OSError as e:
            if "cannot open shared object file" not in str(e):
                errors.append(str(e))
    return None, "; ".join(errors) or None


class CudaDriver:
    """The CUDA driver API of this process. Get it with `get_driver()`, do not construct it.

    Every method raises `CudaDriverError` when the driver call fails. `initialized` is False when
    `cuInit` failed (e.g. no GPU visible); then only `version()` works and `init_error` says why.
    """

    def __init__(self, lib: ctypes.CDLL):
        self._lib = lib
        self.init_error: str | None = None
        code = lib.cuInit(ctypes.c_uint(0))
        if code != CUDA_SUCCESS:
            self.init_error = f"cuInit failed: {self.error_name(code)} ({code})"

    @property
    def initialized(self) -> bool:
        """Whether cuInit succeeded, so devices can be queried."""
        return self.init_error is None

    def _fn(self, *names: str):
        """Returns the first of `names` the library exports (newest versioned symbol first)."""
        for name in names:
            fn = getattr(self._lib, name, None)
            if fn is not None:
                return fn
        raise CudaDriverError(names[0], -1, "symbol not found in libcuda (driver too old)")

    def _call(self, name: str, *args, aliases: tuple[str, ...] = ()) -> None:
        code = self._fn(name, *aliases)(*args)
        if code != CUDA_SUCCESS:
            raise CudaDriverError(name, code, self.error_name(code))

    def error_name(self, code: int) -> str:
        """The CUresult's name, e.g. "CUDA_ERROR_NO_DEVICE", or "CUresult <code>"."""
        text = ctypes.c_char_p()
        fn = getattr(self._lib, "cuGetErrorName", None)
        if fn is not None and fn(ctypes.c_int(code), ctypes.byref(text)) == 0 and text.value:
            return text.value.decode(errors="replace")
        return f"CUresult {code}"

    def version(self) -> int:
        """The driver's CUDA version as an int, e.g. 12080 for 12.8 (works without cuInit)."""
        value = ctypes.c_int()
        self._call("cuDriverGetVersion", ctypes.byref(value))
        return value.value

    def _device(self, ordinal: int) -> ctypes.c_int:
        dev = ctypes.c_int()
        self._call("cuDeviceGet", ctypes.byref(dev), ctypes.c_int(ordinal))
        return dev

    def device_count(self) -> int:
        """Number of CUDA devices visible to this process (0 when cuInit failed)."""
        if not self.initialized:
            return 0
        value = ctypes.c_int()
        self._call("cuDeviceGetCount", ctypes.byref(value))
        return value.value

    def device_name(self, ordinal: int) -> str:
        """The marketing name, e.g. "NVIDIA H200"."""
        buf = ctypes.create_string_buffer(_NAME_CHARS)
        self._call("cuDeviceGetName", buf, ctypes.c_int(_NAME_CHARS), self._device(ordinal))
        return buf.value.decode(errors="replace")

    def attribute(self, ordinal: int, attribute: int) -> int:
        """cuDeviceGetAttribute(attribute) of one device."""
        value = ctypes.c_int()
        self._call(
            "cuDeviceGetAttribute", ctypes.byref(value), ctypes.c_int(attribute),
            self._device(ordinal),
        )
        return value.value

    def compute_capability(self, ordinal: int) -> tuple[int, int]:
        """(major, minor), e.g. (9, 0) for H100/H200."""
        return (
            self.attribute(ordinal, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
            self.attribute(ordinal, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR),
        )

    def cooperative_launch(self, ordinal: int) -> bool:
        """Whether the device runs cooperative launches (all blocks of a grid resident at once)."""
        return bool(self.attribute(ordinal, CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH))

    def total_memory(self, ordinal: int) -> int:
        """Total device memory in bytes (no context needed)."""
        value = ctypes.c_size_t()
        self._call(
            "cuDeviceTotalMem_v2", ctypes.byref(value), self._device(ordinal),
            aliases=("cuDeviceTotalMem",),
        )
        return value.value

    def pci_bus_id(self, ordinal: int) -> str:
        """PCI address "domain:bus:device.function", e.g. "0000:18:00.0" (what NVML looks up)."""
        buf = ctypes.create_string_buffer(_PCI_BUS_ID_CHARS)
        self._call(
            "cuDeviceGetPCIBusId", buf, ctypes.c_int(_PCI_BUS_ID_CHARS), self._device(ordinal)
        )
        return buf.value.decode(errors="replace")

    def primary_context_active(self, ordinal: int) -> bool:
        """Whether the device's primary context exists (e.g. because XLA is running on it)."""
        flags, active = ctypes.c_uint(), ctypes.c_int()
        self._call(
            "cuDevicePrimaryCtxGetState", self._device(ordinal), ctypes.byref(flags),
            ctypes.byref(active),
        )
        return bool(active.value)

    def free_memory(self, ordinal: int, *, create_context: bool = True) -> int | None:
        """Free device memory in bytes, as cudaMalloc would see it now.

        Args:
          ordinal: the CUDA device ordinal.
          create_context: when the primary context does not exist yet, create it for the query
            (it is destroyed again afterwards unless someone else retained it meanwhile). With
            False, returns None in that case instead.

        Returns:
          The free bytes, or None when `create_context` is False and no context exists.
        """
        dev = self._device(ordinal)
        if not create_context and not self.primary_context_active(ordinal):
            return None
        ctx = ctypes.c_void_p()
        self._call("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), dev)
        try:
            self._call("cuCtxPushCurrent_v2", ctx, aliases=("cuCtxPushCurrent",))
            try:
                free, total = ctypes.c_size_t(), ctypes.c_size_t()
                self._call(
                    "cuMemGetInfo_v2", ctypes.byref(free), ctypes.byref(total),
                    aliases=("cuMemGetInfo",),
                )
                return free.value
            finally:
                popped = ctypes.c_void_p()
                self._call("cuCtxPopCurrent_v2", ctypes.byref(popped), aliases=("cuCtxPopCurrent",))
        finally:
            self._call("cuDevicePrimaryCtxRelease_v2", dev, aliases=("cuDevicePrimaryCtxRelease",))

    def can_access_peer(self, ordinal: int, peer: int) -> bool:
        """cuDeviceCanAccessPeer: whether `ordinal` can map and access `peer`'s memory."""
        value = ctypes.c_int()
        self._call(
            "cuDeviceCanAccessPeer", ctypes.byref(value), self._device(ordinal), self._device(peer)
        )
        return bool(value.value)

    def p2p_attribute(self, ordinal: int, peer: int, attribute: int) -> int:
        """cuDeviceGetP2PAttribute(attribute) of the link from `ordinal` to `peer`."""
        value = ctypes.c_int()
        self._call(
            "cuDeviceGetP2PAttribute", ctypes.byref(value), ctypes.c_int(attribute),
            self._device(ordinal), self._device(peer),
        )
        return value.value


@functools.lru_cache(maxsize=1)
def get_driver() -> tuple[CudaDriver | None, str | None]:
    """Loads libcuda once per process.

    Returns:
      (driver, None) when libcuda loads (check `driver.initialized` before device queries), or
      (None, reason) when it cannot be loaded, e.g. on a machine without an NVIDIA driver.
    """
    lib, error = _load_library(_CUDA_LIBRARY_NAMES)
    if lib is None:
        detail = f": {error}" if error else ""
        name = _CUDA_LIBRARY_NAMES[0]
        return None, f"{name} not found (no NVIDIA driver on this machine){detail}"
    try:
        return CudaDriver(lib), None
    except AttributeError as e:  # not a CUDA driver after all
        return None, f"{_CUDA_LIBRARY_NAMES[0]} is not a usable CUDA driver: {e}"


def format_cuda_version(version: int) -> str:
    """12080 -> "12.8" (the encoding of cuDriverGetVersion and CUDA_VERSION)."""
    return f"{version // 1000}.{version % 1000 // 10}"


class Nvml:
    """NVML of this machine, for NVLink state. Get it with `get_nvml()`, do not construct it.

    Methods raise `CudaDriverError` when an NVML call fails (NVML return codes).
    """

    def __init__(self, lib: ctypes.CDLL):
        self._lib = lib
        init = getattr(lib, "nvmlInit_v2", None) or lib.nvmlInit
        code = init()
        if code != NVML_SUCCESS:
            raise CudaDriverError("nvmlInit_v2", code, self.error_name(code))

    def error_name(self, code: int) -> str:
        """nvmlErrorString of the code."""
        fn = getattr(self._lib, "nvmlErrorString", None)
        if fn is None:
            return f"nvmlReturn {code}"
        fn.restype = ctypes.c_char_p
        text = fn(ctypes.c_int(code))
        return text.decode(errors="replace") if text else f"nvmlReturn {code}"

    def _call(self, name: str, *args, aliases: tuple[str, ...] = ()) -> int:
        fn = None
        for candidate in (name, *aliases):
            fn = getattr(self._lib, candidate, None)
            if fn is not None:
                break
        if fn is None:
            raise CudaDriverError(name, -1, "symbol not found in NVML")
        return fn(*args)

    def handle_by_pci_bus_id(self, pci_bus_id: str) -> ctypes.c_void_p:
        """The nvmlDevice_t of the GPU at a PCI address as `CudaDriver.pci_bus_id` gives it."""
        handle = ctypes.c_void_p()
        code = self._call(
            "nvmlDeviceGetHandleByPciBusId_v2", pci_bus_id.encode(), ctypes.byref(handle),
            aliases=("nvmlDeviceGetHandleByPciBusId",),
        )
        if code != NVML_SUCCESS:
            raise CudaDriverError("nvmlDeviceGetHandleByPciBusId_v2", code, self.error_name(code))
        return handle

    def active_nvlinks(self, handle: ctypes.c_void_p) -> int:
        """Number of NVLinks of the GPU that are up (nvmlDeviceGetNvLinkState); 0 without NVLink."""
        count = 0
        for link in range(NVML_NVLINK_MAX_LINKS):
            state = ctypes.c_int()
            code = self._call("nvmlDeviceGetNvLinkState", handle, ctypes.c_uint(link),
                              ctypes.byref(state))
            if code in (NVML_ERROR_INVALID_ARGUMENT, NVML_ERROR_NOT_SUPPORTED):
                continue  # link index beyond this GPU's links, or no NVLink at all
            if code != NVML_SUCCESS:
                raise CudaDriverError("nvmlDeviceGetNvLinkState", code, self.error_name(code))
            count += state.value == NVML_FEATURE_ENABLED
        return count

    def nvlink_p2p_ok(self, handle: ctypes.c_void_p, peer: ctypes.c_void_p) -> bool:
        """Whether the two GPUs reach each other over NVLink (directly or via NVSwitch)."""
        status = ctypes.c_int()
        code = self._call(
            "nvmlDeviceGetP2PStatus", handle, peer, ctypes.c_int(NVML_P2P_CAPS_INDEX_NVLINK),
            ctypes.byref(status),
        )
        if code != NVML_SUCCESS:
            raise CudaDriverError("nvmlDeviceGetP2PStatus", code, self.error_name(code))
        return status.value == NVML_P2P_STATUS_OK


@functools.lru_cache(maxsize=1)
def get_nvml() -> tuple[Nvml | None, str | None]:
    """Loads and initialises NVML once per process.

    Returns:
      (nvml, None), or (None, reason) when libnvidia-ml is absent or does not initialise.
    """
    lib, error = _load_library(_NVML_LIBRARY_NAMES)
    if lib is None:
        return None, f"{_NVML_LIBRARY_NAMES[0]} not found" + (f": {error}" if error else "")
    try:
        return Nvml(lib), None
    except (CudaDriverError, AttributeError) as e:
        return None, f"NVML unusable: {e}"
