"""The cross-host preflight (jax_ep/system/cluster.py, `jax-ep-env --cluster`) on faked system
files: each check passes on a healthy faked host and turns to warn or fail when one file of it
is broken."""

import dataclasses
import json
import os

import pytest

from jax_ep import env
from jax_ep.system import cluster
from jax_ep.tools import env_report

# A two-socket host: GPU 0 and mlx5_0 behind one PCIe switch of root complex pci0000:00, GPU 1
# and mlx5_1 behind one of pci0000:80.
TOPOLOGY = {
    "gpu0": ("pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:00.0/0000:03:00.0", 0),
    "mlx5_0": ("pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:01.0/0000:04:00.0", 0),
    "gpu1": ("pci0000:80/0000:80:01.0/0000:81:00.0/0000:82:00.0/0000:83:00.0", 1),
    "mlx5_1": ("pci0000:80/0000:80:01.0/0000:81:00.0/0000:82:01.0/0000:84:00.0", 1),
}
HEALTHY_ENV = {"NVSHMEM_DISABLE_NVLS": "1", "NCCL_NVLS_ENABLE": "0"}
NVSHMEM_FILES = ("libnvshmem_host.so.3", "nvshmem_bootstrap_uid.so.3",
                 "nvshmem_bootstrap_pmi.so.3", "nvshmem_transport_ibrc.so.3",
                 "nvshmem_transport_ibgda.so.3", "nvshmem_transport_ucx.so.3",
                 "nvshmem_transport_libfabric.so.3")
OPEN_DRIVER = ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.124.06  Release "
               "Build  (dvs-builder@U16-I3-B03-4-3)")
PROPRIETARY_DRIVER = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  570.124.06  Release Build"


def write(path, text=""):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def fake_device(root, name, numa_node, vendor, pci_class):
    """The sysfs node of a PCI device, linked from /sys/bus/pci/devices/<bus id>."""
    chain, node = TOPOLOGY[name]
    real = os.path.join(root, "sys", "devices", chain)
    write(os.path.join(real, "vendor"), vendor)
    write(os.path.join(real, "class"), pci_class)
    write(os.path.join(real, "numa_node"), f"{numa_node}\n")
    link = os.path.join(root, "sys", "bus", "pci", "devices", os.path.basename(chain))
    os.makedirs(os.path.dirname(link), exist_ok=True)
    os.symlink(real, link)
    return real


def fake_port(root, dev, port=1, state="4: ACTIVE", layer="InfiniBand",
              rate="400 Gb/sec (4X NDR)"):
    base = os.path.join(root, "sys", "class", "infiniband", dev, "ports", str(port))
    write(os.path.join(base, "state"), state + "\n")
    write(os.path.join(base, "link_layer"), layer + "\n")
    write(os.path.join(base, "rate"), rate + "\n")


@pytest.fixture
def host(tmp_path):
    """A healthy faked host: its root folder and NVSHMEM's lib folder."""
    root = str(tmp_path / "root")
    for gpu in ("gpu0", "gpu1"):
        fake_device(root, gpu, TOPOLOGY[gpu][1], "0x10de", "0x030200")
    for i, nic in enumerate(("mlx5_0", "mlx5_1")):
        real = fake_device(root, nic, TOPOLOGY[nic][1], "0x15b3", "0x020700")
        os.makedirs(os.path.join(root, "sys", "class", "infiniband", nic))
        os.symlink(real, os.path.join(root, "sys", "class", "infiniband", nic, "device"))
        fake_port(root, nic)
        write(os.path.join(root, "dev", "infiniband", f"uverbs{i}"))
    os.makedirs(os.path.join(root, "sys", "module", "nvidia_peermem"))
    write(os.path.join(root, "proc", "driver", "nvidia", "version"), OPEN_DRIVER + "\n")
    write(os.path.join(root, "proc", "driver", "nvidia", "params"),
          'ResmanDebugLevel: 4294967295\nRegistryDwords: "PeerMappingOverride=1;"\n')
    write(os.path.join(root, "proc", "sys", "kernel", "osrelease"), "6.8.0-52-generic\n")
    lib = str(tmp_path / "nvshmem" / "lib")
    for name in NVSHMEM_FILES:
        write(os.path.join(lib, name))
    write(os.path.join(root, "usr", "lib", "x86_64-linux-gnu", "libibverbs.so.1"))
    return root, lib


def run(host, environ=None, gpus=()):
    root, lib = host
    return {c.name: c for c in cluster.preflight(root, dict(HEALTHY_ENV, **(environ or {})),
                                                 gpus, lib)}


def status(host, name, **kw):
    return run(host, **kw)[name].status


def test_every_check_passes_on_a_healthy_host(host):
    checks = run(host, environ={"NVSHMEM_IB_ENABLE_IBGDA": "1"})
    assert {n: c.status for n, c in checks.items() if c.status != "ok"} == {}
    assert all(c.fix == "" for c in checks.values())
    assert checks["NIC per GPU (PCI topology)"].details == (
        "GPU 0000:03:00.0 -> mlx5_0 (same switch)", "GPU 0000:83:00.0 -> mlx5_1 (same switch)")
    assert "mlx5_0 port 1: ACTIVE, InfiniBand, 400 Gb/sec (4X NDR)" in checks[
        "RDMA devices (InfiniBand, RoCE, EFA)"].details


def test_nvshmem_plugins(host):
    root, lib = host
    name = "NVSHMEM and its plugins"
    os.remove(os.path.join(lib, "nvshmem_transport_ibgda.so.3"))
    check = run(host)[name]
    assert check.status == "warn" and "ibgda" in check.found
    for t in ("ibrc", "ucx", "libfabric"):
        os.remove(os.path.join(lib, f"nvshmem_transport_{t}.so.3"))
    check = run(host)[name]
    assert check.status == "fail" and "without network transport plugins" in check.found
    os.remove(os.path.join(lib, "nvshmem_bootstrap_uid.so.3"))
    assert "nvshmem_bootstrap_uid" in run(host)[name].found
    os.remove(os.path.join(lib, "libnvshmem_host.so.3"))
    check = run(host)[name]
    assert check.status == "fail" and "pip install nvidia-nvshmem-cu13" in check.fix


def test_nvshmem_lookup_is_the_peer_mappings(host, monkeypatch):
    """Without a folder, the check reads the library jax_ep would load (JAX_EP_NVSHMEM_LIB)."""
    _, lib = host
    library = os.path.join(lib, "libnvshmem_host.so.3")
    assert cluster.check_nvshmem(environ={"JAX_EP_NVSHMEM_LIB": library}).status == "ok"
    check = cluster.check_nvshmem(environ={"JAX_EP_NVSHMEM_LIB": library + ".9"})
    assert check.status == "fail" and check.found.endswith("libnvshmem_host.so.3.9 does not exist")
    monkeypatch.setattr(cluster.probes, "probe_nvshmem",
                        lambda: env.NvshmemInfo(None, None, None, "not installed; ..."))
    check = cluster.check_nvshmem(environ={})
    assert check.status == "fail" and "JAX_EP_NVSHMEM_LIB unset" in check.found


def test_rdma_ports_down_or_missing(host):
    root, _ = host
    name = "RDMA devices (InfiniBand, RoCE, EFA)"
    fake_port(root, "mlx5_0", state="1: DOWN")
    assert status(host, name) == "ok"  # mlx5_1 is still up
    fake_port(root, "mlx5_1", state="2: INIT", layer="Ethernet", rate="200 Gb/sec (4X HDR)")
    check = run(host)[name]
    assert check.status == "fail" and "none ACTIVE" in check.found
    assert "subnet manager" in check.fix
    assert "mlx5_1 port 1: INIT, Ethernet, 200 Gb/sec (4X HDR)" in check.details
    for nic in ("mlx5_0", "mlx5_1"):
        os.remove(os.path.join(root, "sys", "class", "infiniband", nic, "device"))
        for f in ("state", "link_layer", "rate"):
            os.remove(os.path.join(root, "sys", "class", "infiniband", nic, "ports", "1", f))
        os.rmdir(os.path.join(root, "sys", "class", "infiniband", nic, "ports", "1"))
        os.rmdir(os.path.join(root, "sys", "class", "infiniband", nic, "ports"))
        os.rmdir(os.path.join(root, "sys", "class", "infiniband", nic))
    check = run(host)[name]
    assert check.status == "fail" and "/dev/infiniband" in check.fix


def test_rdma_device_files_missing_in_a_container(host):
    root, _ = host
    for i in range(2):
        os.remove(os.path.join(root, "dev", "infiniband", f"uverbs{i}"))
    check = run(host)["RDMA device files"]
    assert check.status == "fail" and "cannot open them" in check.found
    assert "--device=/dev/infiniband" in check.fix


def test_gpudirect_rdma_routes(host):
    root, _ = host
    name = "GPUDirect RDMA"
    os.rmdir(os.path.join(root, "sys", "module", "nvidia_peermem"))
    check = run(host)[name]
    assert check.status == "ok" and "dma-buf" in check.found  # open module, Linux 6.8
    write(os.path.join(root, "proc", "sys", "kernel", "osrelease"), "5.4.0-150-generic\n")
    check = run(host)[name]
    assert check.status == "fail" and "Linux 5.4 is older than 5.12" in check.found
    assert "modprobe nvidia_peermem" in check.fix
    write(os.path.join(root, "proc", "sys", "kernel", "osrelease"), "6.8.0\n")
    write(os.path.join(root, "proc", "driver", "nvidia", "version"), PROPRIETARY_DRIVER)
    check = run(host)[name]
    assert check.status == "fail" and "proprietary" in check.found
    os.makedirs(os.path.join(root, "sys", "module", "nv_peer_mem"))
    assert status(host, name) == "ok"


def test_ibgda_settings(host):
    root, _ = host
    name = "IBGDA (optional)"
    on = {"NVSHMEM_IB_ENABLE_IBGDA": "1", "NVSHMEM_IBGDA_NUM_RC_PER_PE": "4"}
    check = run(host, environ=on)[name]
    assert check.status == "ok"
    assert "NVSHMEM_IBGDA_*: NVSHMEM_IBGDA_NUM_RC_PER_PE=4" in check.details
    assert status(host, name) == "ok"  # off, driver ready
    write(os.path.join(root, "proc", "driver", "nvidia", "params"),
          'RegistryDwords: ""\nPeerMappingOverride: 1\n')  # not the registry key
    check = run(host, environ=on)[name]
    assert check.status == "warn" and "PeerMappingOverride=1" in check.fix
    check = run(host)[name]
    assert check.status == "warn" and "NVSHMEM_IB_ENABLE_IBGDA=1" in check.fix


def test_nic_per_gpu_relations(host):
    root, _ = host
    name = "NIC per GPU (PCI topology)"
    gpus = (env.GpuInfo(0, "NVIDIA H200", "9.0", None, None, "00000000:83:00.0", None),)
    check = run(host, gpus=gpus)[name]  # CUDA's GPUs, named by ordinal (an NVML bus id)
    assert check.details == ("GPU 0 (0000:83:00.0) -> mlx5_1 (same switch)",)
    gpus = (dataclasses.replace(gpus[0], pci_bus_id="0000:83:00.0"),
            dataclasses.replace(gpus[0], ordinal=1, pci_bus_id="not-a-bus-id"))
    check = run(host, gpus=gpus)[name]  # CUDA's form; a GPU this /sys does not show
    assert check.status == "fail"
    assert check.details[1] == "GPU 1 (not-a-bus-id) -> none (not on the PCI tree)"
    fake_port(root, "mlx5_1", state="1: DOWN")  # GPU 1's NIC is down: the up one, across
    check = run(host)[name]
    assert check.status == "warn"
    assert "GPU 0000:83:00.0 -> mlx5_0 (different socket)" in check.details
    write(os.path.join(root, "sys", "bus", "pci", "devices", "0000:04:00.0", "numa_node"), "1\n")
    assert "GPU 0000:83:00.0 -> mlx5_0 (same socket, different root complex)" in run(host)[
        name].details
    fake_port(root, "mlx5_1")
    os.remove(os.path.join(root, "sys", "class", "infiniband", "mlx5_1", "device"))
    assert "GPU 0000:83:00.0 -> mlx5_0 (same socket, different root complex)" in run(host)[
        name].details
    # A NIC on the GPU's root complex but not behind its switch.
    chain = "pci0000:80/0000:80:02.0/0000:90:00.0"
    write(os.path.join(root, "sys", "devices", chain, "numa_node"), "1\n")
    os.symlink(os.path.join(root, "sys", "devices", chain),
               os.path.join(root, "sys", "class", "infiniband", "mlx5_1", "device"))
    assert "GPU 0000:83:00.0 -> mlx5_1 (same root complex)" in run(host)[name].details
    for bus_id in ("0000:03:00.0", "0000:83:00.0"):
        write(os.path.join(root, "sys", "bus", "pci", "devices", bus_id, "vendor"), "0x1002")
    check = run(host)[name]
    assert check.status == "fail" and "no NVIDIA GPU" in check.found


def test_nic_per_gpu_without_a_nic(host):
    root, _ = host
    for nic in ("mlx5_0", "mlx5_1"):
        os.remove(os.path.join(root, "sys", "class", "infiniband", nic, "device"))
    check = run(host)["NIC per GPU (PCI topology)"]
    assert check.status == "fail" and check.found == "2 of 2 GPU(s) without a NIC"


def test_environment_checks(host):
    root, _ = host
    assert status(host, "NVLink multicast off") == "ok"
    check = run(host, environ={"NCCL_NVLS_ENABLE": "1"})["NVLink multicast off"]
    assert check.status == "warn" and "NCCL_NVLS_ENABLE=0" in check.fix
    name = "NVSHMEM_REMOTE_TRANSPORT"
    assert "unset (ibrc" in run(host)[name].found
    assert status(host, name, environ={"NVSHMEM_REMOTE_TRANSPORT": "ucx"}) == "ok"
    check = run(host, environ={"NVSHMEM_REMOTE_TRANSPORT": "none"})[name]
    assert check.status == "fail" and "ibrc" in check.fix
    check = run(host, environ={"NVSHMEM_REMOTE_TRANSPORT": "verbs"})[name]
    assert check.status == "fail" and "choose one of" in check.fix
    fake_port(root, "efa_0", layer="Unspecified", rate="100 Gb/sec")
    check = run(host)[name]
    assert check.status == "warn" and "libfabric" in check.fix
    assert status(host, name, environ={"NVSHMEM_REMOTE_TRANSPORT": "libfabric"}) == "ok"


def test_network_transport_libraries(host, tmp_path):
    """The libraries of the network transport NVSHMEM_REMOTE_TRANSPORT selects (default ibrc)
    are looked for where the dynamic loader looks: LD_LIBRARY_PATH, /etc/ld.so.conf.d's
    folders, the system's; a missing one fails, naming it and how to install it."""
    root, _ = host
    name = "Network transport libraries"
    check = run(host)[name]
    assert check.status == "ok" and "libibverbs.so.1 in" in check.found, check
    os.remove(os.path.join(root, "usr", "lib", "x86_64-linux-gnu", "libibverbs.so.1"))
    check = run(host)[name]
    assert check.status == "fail" and "libibverbs.so.1" in check.found, check
    assert "rdma-core" in check.fix
    ucx = {"NVSHMEM_REMOTE_TRANSPORT": "ucx"}
    check = run(host, environ=ucx)[name]
    assert check.status == "fail" and "libucp.so.0, libucs.so.0" in check.found, check
    assert "libucx-cu13" in check.fix and "LD_LIBRARY_PATH" in check.fix
    wheel = tmp_path / "site" / "libucx" / "lib"  # the libucx-cu13 wheel's folder
    for lib in ("libucp.so.0", "libucs.so.0"):
        write(str(wheel / lib))
    assert status(host, name, environ=dict(ucx, LD_LIBRARY_PATH=f"/nowhere:{wheel}")) == "ok"
    write(os.path.join(root, "opt", "ucx", "lib", "libucp.so.0"))
    write(os.path.join(root, "opt", "ucx", "lib", "libucs.so.0"))
    write(os.path.join(root, "etc", "ld.so.conf.d", "ucx.conf"), "# UCX\n/opt/ucx/lib\n")
    assert status(host, name, environ=ucx) == "ok"
    assert status(host, name, environ={"NVSHMEM_REMOTE_TRANSPORT": "libfabric"}) == "fail"


def test_format_and_json_of_the_preflight(host):
    root, lib = host
    checks = cluster.preflight(root, {}, (), lib)
    text = "\n".join(env_report.format_cluster(checks))
    assert text.startswith("Cross-host preflight (8 ok, 1 warn, 0 fail)")
    assert "JAX_EP_DEVICE_TRANSPORT=nvshmem (else the reference backend)" in text
    assert "  WARN  NVLink multicast off" in text and "fix: export NVSHMEM_DISABLE_NVLS=1" in text
    assert max(len(line) for line in text.splitlines() if "fix:" in line) <= 100
    report = env_report.collect(env.BufferSpec(num_ranks=1), free_memory=False)
    data = env_report.report_to_dict(dataclasses.replace(report, cluster=checks))
    row = json.loads(json.dumps(data))["cluster"][0]
    assert set(row) == {"name", "status", "found", "fix", "details"}
    assert env_report.report_to_dict(report)["cluster"] is None


def test_cluster_flag_prints_the_preflight_and_fails_with_it(capsys, monkeypatch):
    failing = (cluster.PreflightCheck("RDMA devices", "fail", "none", "install a NIC"),)
    monkeypatch.setattr(cluster, "preflight", lambda **kw: failing)
    assert env_report.main(["--cluster", "--no-free-memory", "--num-ranks", "1"]) == 1
    out = capsys.readouterr().out
    assert "Cross-host preflight (0 ok, 0 warn, 1 fail)" in out and "fix: install a NIC" in out
    assert env_report.main(["--no-free-memory", "--num-ranks", "1"]) == 0
    assert "Cross-host preflight" not in capsys.readouterr().out
