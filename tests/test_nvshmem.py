"""The NVSHMEM transport's host-side rules (CPU): the switch, the library lookup, the layout it
needs. Its GPU test is in test_gpu_multiprocess.py."""

import importlib.metadata
import types

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from jax_ep.peers import nvshmem as _nvshmem


@pytest.mark.parametrize("value,want", [(None, "ipc"), ("", "ipc"), ("ipc", "ipc"),
                                        ("nvshmem", "nvshmem"), (" NVSHMEM ", "nvshmem")])
def test_peer_mapping_switch(monkeypatch, value, want):
    if value is None:
        monkeypatch.delenv(_nvshmem.ENV_MAPPING, raising=False)
    else:
        monkeypatch.setenv(_nvshmem.ENV_MAPPING, value)
    assert _nvshmem.requested_peer_mapping() == want


def test_unknown_peer_mapping_names_the_variable(monkeypatch):
    monkeypatch.setenv(_nvshmem.ENV_MAPPING, "rdma")
    with pytest.raises(ValueError, match="JAX_EP_PEER_MAPPING='rdma'.*ipc, nvshmem"):
        _nvshmem.requested_peer_mapping()


def test_library_path_prefers_the_variable(monkeypatch):
    monkeypatch.setenv(_nvshmem.ENV_LIBRARY, "/opt/nvshmem/lib/libnvshmem_host.so.3")
    assert _nvshmem.library_path() == "/opt/nvshmem/lib/libnvshmem_host.so.3"


def test_library_path_without_the_wheel_says_what_to_install(monkeypatch):
    monkeypatch.delenv(_nvshmem.ENV_LIBRARY, raising=False)
    monkeypatch.setattr(importlib.metadata, "distribution", missing_distribution)
    with pytest.raises(RuntimeError, match="nvidia-nvshmem-cu13.*JAX_EP_NVSHMEM_LIB"):
        _nvshmem.library_path()


def test_library_path_finds_the_wheel(monkeypatch, tmp_path):
    monkeypatch.delenv(_nvshmem.ENV_LIBRARY, raising=False)
    (tmp_path / "lib").mkdir()
    library = tmp_path / "lib" / "libnvshmem_host.so.3"
    library.write_bytes(b"")
    wheel = types.SimpleNamespace(
        version="3.8.0", files=[types.SimpleNamespace(name=library.name)],
        locate_file=lambda file: library)
    monkeypatch.setattr(importlib.metadata, "distribution",
                        lambda name: wheel if name == "nvidia-nvshmem-cu13"
                        else missing_distribution(name))
    assert _nvshmem.library_path() == str(library)


def missing_distribution(name):
    raise importlib.metadata.PackageNotFoundError(name)


class FakeDevice:
    def __init__(self, id, process_index):
        self.id, self.process_index = id, process_index


class FakeBuffer:
    """What check_usable and pes read of a Buffer."""

    def __init__(self, devices, groups):
        self.mesh = types.SimpleNamespace(devices=np.array(devices, dtype=object))
        self._groups = groups

    def _ep_group_devices(self):
        return self._groups


def test_one_process_driving_several_devices_is_refused():
    devices = jax.devices("cpu")[:2]
    buf = FakeBuffer(devices, [devices])
    with pytest.raises(ValueError, match="one process per GPU .*drives 2"):
        _nvshmem.check_usable(buf)
    mesh = Mesh(np.array(devices), ("ep",))  # the real mesh type says the same
    buf.mesh = mesh
    with pytest.raises(ValueError, match="one process per GPU"):
        _nvshmem.check_usable(buf)


def test_one_process_with_one_device_is_a_job_of_one_pe():
    (device,) = jax.devices("cpu")[:1]
    buf = FakeBuffer([device], [[device]])
    _nvshmem.check_usable(buf)  # no error: EP=1 on one GPU
    assert _nvshmem.pes(buf) == [[0]]


def test_release_of_one_pe_needs_no_barrier(monkeypatch):
    def barrier(buf, name):
        raise AssertionError("a job of one PE has nobody to meet")

    monkeypatch.setattr(_nvshmem.ipc, "barrier", barrier)
    module = FakeModule()
    _nvshmem.release(types.SimpleNamespace(buffer_id=3), module)
    assert module.destroyed == [3]


def test_pes_are_the_process_of_every_rank():
    groups = [[FakeDevice(0, 0), FakeDevice(1, 1)], [FakeDevice(2, 2), FakeDevice(3, 3)]]
    buf = FakeBuffer([d for g in groups for d in g], groups)
    assert _nvshmem.pes(buf) == [[0, 1], [2, 3]]


class FakeModule:
    def __init__(self):
        self.destroyed = []

    def destroy_buffer(self, buffer_id):
        self.destroyed.append(buffer_id)


def test_release_frees_after_every_process_arrived(monkeypatch):
    monkeypatch.setattr(_nvshmem.jax, "process_count", lambda: 2)
    monkeypatch.setattr(_nvshmem.ipc, "barrier", lambda buf, name: None)
    module = FakeModule()
    _nvshmem.release(types.SimpleNamespace(buffer_id=7), module)
    assert module.destroyed == [7]


def test_release_never_waits_for_a_dead_process(monkeypatch):
    def barrier(buf, name):
        raise RuntimeError(f"not every process reached {name!r}")

    monkeypatch.setattr(_nvshmem.jax, "process_count", lambda: 2)
    monkeypatch.setattr(_nvshmem.ipc, "barrier", barrier)
    module = FakeModule()
    with pytest.warns(RuntimeWarning, match="stays allocated"):
        _nvshmem.release(types.SimpleNamespace(buffer_id=7), module)
    assert module.destroyed == []  # nvshmem_free would block on the missing PE


@pytest.mark.parametrize(("text", "want"), [("1073741824", 1 << 30), ("2G", 2 << 30),
                                            ("512M", 512 << 20), ("1.5g", 3 << 29),
                                            ("64KB", 64 << 10)])
def test_symmetric_size_reads_nvshmems_units(text, want):
    assert _nvshmem.symmetric_size_bytes(text) == want


def test_a_heap_set_too_small_names_both_numbers():
    """The symmetric heap is sized from the first Buffer; a size the user set that cannot hold
    its workspace is refused before NVSHMEM starts, naming the size and the workspace."""
    workspace = 3 << 30
    assert _nvshmem.heap_bytes(workspace, {}) == workspace + (1 << 30)
    assert _nvshmem.heap_bytes(workspace, {"NVSHMEM_SYMMETRIC_SIZE": "8G"}) == 8 << 30
    with pytest.raises(ValueError, match=rf"NVSHMEM_SYMMETRIC_SIZE=2G \({2 << 30} bytes\) "
                                         rf"cannot hold .*\({workspace} bytes.*at least "
                                         rf"{workspace + (1 << 30)}"):
        _nvshmem.heap_bytes(workspace, {"NVSHMEM_SYMMETRIC_SIZE": "2G"})
    with pytest.raises(ValueError, match="NVSHMEM_SYMMETRIC_SIZE='lots' is not a size"):
        _nvshmem.heap_bytes(workspace, {"NVSHMEM_SYMMETRIC_SIZE": "lots"})
