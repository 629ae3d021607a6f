"""The NVSHMEM peer mapping of the CUDA backend: ``JAX_EP_PEER_MAPPING=nvshmem``.

With one process per GPU, a Buffer's workspaces can live on NVSHMEM's symmetric heap instead of
``cudaMalloc`` + CUDA IPC: every peer table entry is then ``nvshmem_ptr`` of the same symmetric
object at the peer's PE, and the kernels are unchanged (csrc/runtime/nvshmem_host.h). NVSHMEM is
joined once per process, at the first such Buffer: process 0 makes a unique id and sends it
through ``jax.distributed``'s key-value store; every process is PE ``jax.process_index()`` of
``jax.process_count()``. Peers that NVSHMEM can only reach over the network (other hosts) need
device-initiated puts, which the kernels do not have yet: creating such a Buffer raises.

Settings: ``JAX_EP_PEER_MAPPING`` (``ipc``, the default, or ``nvshmem``), ``JAX_EP_NVSHMEM_LIB``
(the host library; default the nvidia-nvshmem wheel's ``libnvshmem_host.so.3``),
``NVSHMEM_SYMMETRIC_SIZE`` (the heap; when unset, jax_ep sets it to the first Buffer's workspace
plus 1 GiB; a size set too small for that workspace is refused, naming both numbers),
``NVSHMEM_REMOTE_TRANSPORT`` (jax_ep sets ``none`` when unset and the ops use stores through the
mappings; over NVSHMEM's device API, ``JAX_EP_DEVICE_TRANSPORT=nvshmem``, NVSHMEM's default).
Start the processes with ``python -m jax_ep.launch --share-gpus`` so that each sees the peers'
GPUs.
"""

from __future__ import annotations

import os
import warnings

import jax

from jax_ep import settings
from jax_ep.peers import ipc
from jax_ep.system import probes

# The setting of a Buffer's peer mapping ("ipc" or "nvshmem").
ENV_MAPPING = "JAX_EP_PEER_MAPPING"
ENV_LIBRARY = "JAX_EP_NVSHMEM_LIB"
_UNIQUE_ID_KEY = "jax_ep/nvshmem/unique_id"
_HEAP_HEADROOM_BYTES = 1 << 30


def requested_peer_mapping() -> str:
    """``JAX_EP_PEER_MAPPING`` (default ``ipc``); ValueError naming the variable when unknown,
    or when the name it replaced (``JAX_EP_TRANSPORT``) is set."""
    return settings.value(ENV_MAPPING)


def library_path() -> str:
    """The NVSHMEM host library: ``JAX_EP_NVSHMEM_LIB``, else the nvidia-nvshmem wheel's (found
    as ``python -m jax_ep.env`` finds it: `probes.nvshmem_host_library`)."""
    path, reason = probes.nvshmem_host_library()
    if path is None:
        raise RuntimeError(f"{ENV_MAPPING}=nvshmem needs NVSHMEM's host library: {reason}; "
                           f"or set {ENV_LIBRARY}")
    return path


def _local_devices(buf) -> list:
    return [d for d in buf.mesh.devices.flat if d.process_index == jax.process_index()]


def check_usable(buf) -> None:
    """The layout the NVSHMEM mapping needs: one process per GPU (NVSHMEM binds a PE to one GPU).
    A single process with a one-device mesh is a job of one PE (EP=1: it runs the whole path,
    heap and kernels, on one GPU)."""
    local = _local_devices(buf)
    if len(local) != 1 or (buf.mesh.devices.size > 1
                           and not ipc.spans_processes(buf.mesh.devices.flat)):
        raise ValueError(
            f"{ENV_MAPPING}=nvshmem needs one process per GPU (this process drives "
            f"{len(local)} of the mesh's {buf.mesh.devices.size} devices); start one process per "
            f"GPU (python -m jax_ep.launch) or use the default peer mapping (ipc)")
    processes = ipc.process_indices(buf.mesh.devices.flat)
    if processes != list(range(jax.process_count())):
        raise ValueError(f"{ENV_MAPPING}=nvshmem needs a mesh over every process of the job "
                         f"(NVSHMEM's PEs), this one has processes {processes} of "
                         f"{jax.process_count()}")


def pes(buf) -> list[list[int]]:
    """The NVSHMEM PE (= process index) of every rank of every EP group."""
    return [[d.process_index for d in group] for group in buf._ep_group_devices()]


# The NVSHMEM device transport's kernels, next to jax_ep._C where NVSHMEM was found at build time.
PLUGIN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                      "libjax_ep_nvshmem.so")


def load_device_transport(module) -> None:
    """Loads the kernels of JAX_EP_DEVICE_TRANSPORT=nvshmem (after join: they need NVSHMEM's
    host library)."""
    if not os.path.exists(PLUGIN):
        raise RuntimeError(f"JAX_EP_DEVICE_TRANSPORT=nvshmem: {PLUGIN} was not built (jax_ep "
                           f"builds it where the nvidia-nvshmem-cu13 wheel's headers and device "
                           f"library are found)")
    module.transport_plugin_load(PLUGIN)


# NVSHMEM_SYMMETRIC_SIZE's units: a number of bytes, optionally with one of these suffixes.
_SIZE_SUFFIXES = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def symmetric_size_bytes(text: str) -> int:
    """``NVSHMEM_SYMMETRIC_SIZE``'s value in bytes (``"1073741824"``, ``"2G"``, ``"512M"``, ...);
    ValueError naming the variable for anything else."""
    raw = text.strip().upper().removesuffix("B")
    number, suffix = (raw[:-1], raw[-1]) if raw[-1:] in _SIZE_SUFFIXES else (raw, "")
    try:
        value = float(number)
    except ValueError:
        raise ValueError(f"NVSHMEM_SYMMETRIC_SIZE={text!r} is not a size (bytes, or a number "
                         f"with K, M, G or T)") from None
    return int(value * _SIZE_SUFFIXES[suffix])


def heap_bytes(workspace_bytes: int, environ=os.environ) -> int:
    """The symmetric heap NVSHMEM will reserve for a job whose first Buffer needs
    ``workspace_bytes``: ``NVSHMEM_SYMMETRIC_SIZE`` when set, else that workspace plus 1 GiB
    (what ``join`` sets). ValueError naming both numbers when a set size cannot hold it."""
    text = environ.get("NVSHMEM_SYMMETRIC_SIZE")
    if text is None:
        return workspace_bytes + _HEAP_HEADROOM_BYTES
    size = symmetric_size_bytes(text)
    if size < workspace_bytes:
        raise ValueError(
            f"NVSHMEM_SYMMETRIC_SIZE={text} ({size} bytes) cannot hold this Buffer's workspace "
            f"({workspace_bytes} bytes, Buffer.workspace_bytes): set it to at least "
            f"{workspace_bytes + _HEAP_HEADROOM_BYTES} (the workspace plus 1 GiB for NVSHMEM's "
            f"own objects), or unset it and jax_ep sizes the heap from the first Buffer")
    return size


def join(buf, module, workspace_bytes: int) -> None:
    """Joins NVSHMEM in this process (once; collective over every process of the job)."""
    if module.nvshmem_initialized():
        return
    if not module.nvshmem_built():
        raise RuntimeError(f"{ENV_MAPPING}=nvshmem: jax_ep was built without NVSHMEM's headers "
                           f"(install nvidia-nvshmem-cu13, then rebuild jax_ep)")
    size = heap_bytes(workspace_bytes)  # a size set too small fails here, naming both numbers
    os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str(size))
    module.nvshmem_load(library_path())
    # With stores through its mappings, only NVSHMEM's peer-to-peer transport is used (peers it
    # cannot map are refused), so it need not bring up a network transport (InfiniBand) that
    # nothing would use. Its device API (JAX_EP_DEVICE_TRANSPORT=nvshmem) reaches ranks on other
    # hosts through it: NVSHMEM's own default then.
    if buf.device_transport != "nvshmem":
        os.environ.setdefault("NVSHMEM_REMOTE_TRANSPORT", "none")
    (device,) = _local_devices(buf)  # check_usable made sure there is exactly one
    ordinal = device.local_hardware_id if device.local_hardware_id is not None else device.id
    if jax.process_count() == 1:  # a job of one PE: nobody to send the id to or wait for
        module.nvshmem_initialize(module.nvshmem_unique_id(), 0, 1, int(ordinal))
        return
    client, timeout_s = ipc.kv_client(), ipc.join_timeout_s()
    if jax.process_index() == 0:
        client.key_value_set(_UNIQUE_ID_KEY, module.nvshmem_unique_id().hex())
    try:
        unique_id = bytes.fromhex(client.blocking_key_value_get(_UNIQUE_ID_KEY,
                                                                int(timeout_s * 1000)))
    except Exception as e:  # noqa: BLE001 - jaxlib raises its own error types
        raise RuntimeError(f"process 0 did not publish the NVSHMEM unique id within "
                           f"{timeout_s:g} s ({ipc.ENV_JOIN_TIMEOUT})") from e
    # NVSHMEM's initialisation waits for every PE without a bound: meet at ours first.
    ipc.barrier(buf, "nvshmem")
    module.nvshmem_initialize(unique_id, jax.process_index(), jax.process_count(), int(ordinal))


def release(buf, module) -> None:
    """Frees ``buf``'s symmetric workspace. ``nvshmem_free`` waits for every PE without a bound,
    so the processes first meet at our bounded barrier; if one never comes (it died), the
    memory is left allocated with a warning instead of waiting forever."""
    try:
        if jax.process_count() > 1:
            ipc.barrier(buf, "released")
    except RuntimeError as e:
        warnings.warn(f"{e}; its NVSHMEM workspace stays allocated (nvshmem_free would wait for "
                      f"the missing process forever)", RuntimeWarning, stacklevel=3)
        return
    module.destroy_buffer(buf.buffer_id)
