"""`python -m jax_ep.env` and the backend choice (jax_ep/env.py, jax_ep/backends/gate.py,
jax_ep/system/).

CPU tests run the real probes on this machine (no GPU expected) and the decision logic on fake
device descriptions; the `gpu` test checks a machine with at least two peer-connected GPUs.
"""

import dataclasses
import importlib.machinery
import json
import os
import subprocess
import sys
from types import ModuleType

import jax
import pytest

from jax_ep import env
from jax_ep.backends import cuda
from jax_ep.system import compat, probes
from jax_ep.system import cuda_driver as _cuda_driver
from jax_ep.tools import env_report

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TOP_LEVEL_KEYS = {
    "schema_version": int,
    "versions": dict,
    "driver": dict,
    "jax": dict,
    "gpus": list,
    "peers": list,
    "extension": dict,
    "nvshmem": dict,
    "xla_memory": dict,
    "workspace": dict,
    "backend": dict,
    "cluster": (list, type(None)),
}
NONE = type(None)
SECTION_KEYS = {
    "versions": {"jax_ep": (str, NONE), "jax": str, "jaxlib": (str, NONE), "python": str,
                 "cuda_driver": (str, NONE), "cuda_runtime": str,
                 "cuda_runtime_source": (str, NONE), "jax_cuda_plugin": (str, NONE)},
    "driver": {"available": bool, "reason": (str, NONE), "device_count": int, "nvml": bool,
               "nvml_reason": (str, NONE)},
    "jax": {"default_backend": (str, NONE), "process_index": int, "process_count": int,
            "device_count": int, "local_devices": list, "error": (str, NONE)},
    "extension": {"importable": bool, "cuda_architectures": (str, NONE), "path": (str, NONE),
                  "error": (str, NONE), "nvshmem_built": (bool, NONE),
                  "cuda_runtime_version": (int, NONE), "max_ranks": (int, NONE),
                  "source_tree": (str, NONE), "shadowed_build": (str, NONE)},
    "nvshmem": {"package": (str, NONE), "version": (str, NONE), "host_library": (str, NONE),
                "reason": (str, NONE)},
    "xla_memory": {"preallocate": bool, "mem_fraction": float, "allocator": str,
                   "preallocate_env": (str, NONE), "mem_fraction_env": (str, NONE),
                   "allocator_env": (str, NONE), "notes": list},
    "workspace": {"spec": dict, "bytes": (int, NONE), "source": str},
    "backend": {"backend": str, "reasons": list},
}
GPU_KEYS = {"ordinal": int, "name": str, "compute_capability": str,
            "total_memory_bytes": (int, NONE), "free_memory_bytes": (int, NONE),
            "pci_bus_id": (str, NONE), "nvlinks_active": (int, NONE),
            "cooperative_launch": (bool, NONE)}
DEVICE_KEYS = {"id": int, "platform": str, "kind": str, "process_index": int,
               "addressable": bool, "local_ordinal": (int, NONE),
               "compute_capability": (str, NONE), "is_cuda": bool}
PREFLIGHT_KEYS = {"name": str, "status": str, "found": str, "fix": str, "details": list}
SPEC_KEYS = {"num_ranks": int, "num_experts": int, "hidden": int, "max_tokens_per_rank": int,
             "num_topk": int, "capacity": int, "dtype_bytes": int, "low_latency": bool}

H200 = 141 * (1 << 30)
# a build that reports CMake's list (and the kernels' rank limit, kMaxRanks)
EXT_90 = env.ExtensionInfo(True, "90", "/fake/_C.so", None, max_ranks=8)
# What the default build reports (CMakeLists.txt: 80-real;89-real;90-real;100-real;120).
DEFAULT_ARCHS = "sm_80 sm_89 sm_90 sm_100 sm_120 compute_120"
EXT_DEFAULT = env.ExtensionInfo(True, DEFAULT_ARCHS, "/fake/_C.so", None, False, 13000, 8)
EXT_MISSING = env.ExtensionInfo(False, None, None,
                                "ModuleNotFoundError: No module named 'jax_ep._C'")


def jax_sees_gpu() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


def fake_gpu(ordinal, cc="9.0", kind="NVIDIA H200", process_index=0, addressable=True):
    return env.DeviceInfo(id=ordinal, platform="gpu", kind=kind, process_index=process_index,
                          addressable=addressable, local_ordinal=ordinal, compute_capability=cc,
                          is_cuda=True)


def fake_cpu(i):
    return env.DeviceInfo(id=i, platform="cpu", kind="cpu", process_index=0, addressable=True,
                          local_ordinal=None, compute_capability=None, is_cuda=False)


def full_peers(n, link="nvlink", missing=()):
    """PeerLinks between n GPUs; pairs in `missing` have no access."""
    peers = []
    for src in range(n):
        for dst in range(n):
            if src != dst:
                ok = (src, dst) not in missing
                peers.append(env.PeerLink(src, dst, ok, ok, 0 if ok else None,
                                          link if ok else "none", "nvml" if ok else None))
    return tuple(peers)


def fake_gpu_infos(n, free=100 * (1 << 30), name="NVIDIA H200", cc="9.0", cooperative=True):
    return tuple(env.GpuInfo(i, name, cc, H200, free, f"0000:{0x18 + i:02x}:00.0", 18, cooperative)
                 for i in range(n))


def decide(devices, **kw):
    kw.setdefault("default_backend", "gpu")
    kw.setdefault("extension", EXT_90)
    kw.setdefault("gpus", ())
    kw.setdefault("peers", full_peers(len(devices)))
    kw.setdefault("driver_cuda_version", 13000)  # not this machine's driver, if it has one
    return env.auto_backend(devices, **kw)


# ------------------------------------------------------------------------- this machine (CPU)


@pytest.fixture(scope="module")
def report():
    if jax_sees_gpu():
        pytest.skip("this test describes a machine without GPUs; jax sees a GPU here")
    return env.collect()


def test_report_on_cpu_machine_says_no_gpu_and_xla(report):
    assert report.backend.backend == "reference"
    assert report.backend.reasons, "backend reference must come with a reason"
    assert any(r.startswith("no GPU") for r in report.backend.reasons), report.backend.reasons
    assert report.jax.default_backend == "cpu"
    assert report.gpus == () and report.peers == ()
    assert report.versions.jax == jax.__version__
    if report.extension.importable:  # the kernels' own size, or none
        assert report.workspace.bytes > 0, report.workspace
        assert report.workspace.source == "jax_ep._C.workspace_bytes"
    else:
        assert report.workspace.bytes is None, report.workspace
        assert "jax_ep._C is not built here" in report.workspace.source
    text = env.format_report(report)
    assert "no GPU" in text
    assert 'Buffer(backend="auto") -> reference' in text


def test_driver_absent_degrades_gracefully():
    driver, reason = _cuda_driver.get_driver()
    if driver is not None and driver.initialized and driver.device_count() > 0:
        pytest.skip("a CUDA driver with GPUs is present")
    if driver is None:
        assert "libcuda" in reason
    nvml, nvml_reason = _cuda_driver.get_nvml()
    assert (nvml is None) == (nvml_reason is not None)
    info = env.collect(free_memory=False).driver
    assert not info.available and info.reason and info.device_count == 0


def check_keys(obj, keys, where):
    assert set(obj) == set(keys), f"{where}: keys {sorted(obj)} != {sorted(keys)}"
    for key, types in keys.items():
        assert isinstance(obj[key], types), f"{where}.{key} = {obj[key]!r} is not {types}"


def check_json_report(data):
    check_keys(data, TOP_LEVEL_KEYS, "report")
    assert data["schema_version"] == env.SCHEMA_VERSION
    for section, keys in SECTION_KEYS.items():
        check_keys(data[section], keys, section)
    for i, device in enumerate(data["jax"]["local_devices"]):
        check_keys(device, DEVICE_KEYS, f"jax.local_devices[{i}]")
    for i, gpu in enumerate(data["gpus"]):
        check_keys(gpu, GPU_KEYS, f"gpus[{i}]")
    check_keys(data["workspace"]["spec"], SPEC_KEYS, "workspace.spec")
    assert data["backend"]["backend"] in ("cuda", "reference")
    for link in data["peers"]:
        assert link["link"] in ("nvlink", "pcie", "none", "unknown")
    for i, check in enumerate(data["cluster"] or ()):
        check_keys(check, PREFLIGHT_KEYS, f"cluster[{i}]")
        assert check["status"] in ("ok", "warn", "fail")


def test_json_output_has_documented_keys_and_types(capsys):
    assert env.main(["--json", "--num-ranks", "2", "--max-tokens-per-rank", "128"]) == 0
    data = json.loads(capsys.readouterr().out)
    check_json_report(data)
    assert data["workspace"]["spec"]["num_ranks"] == 2
    assert data["workspace"]["spec"]["max_tokens_per_rank"] == 128
    for key in TOP_LEVEL_KEYS:  # the schema in the module docstring names every key
        assert f'"{key}"' in env_report.__doc__


def test_json_of_fake_report_matches_schema():
    check_json_report(json.loads(json.dumps(env.report_to_dict(fake_report()))))


def test_python_dash_m_runs():
    environ = dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-m", "jax_ep.env", "--json", "--low-latency",
                          "--max-tokens-per-rank", "128"],
                         capture_output=True, text=True, env=environ, cwd=REPO_ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["backend"]["backend"] == "reference"
    assert data["workspace"]["spec"]["low_latency"] is True


def test_bad_flags_exit_with_the_fix(capsys):
    with pytest.raises(SystemExit):
        env.main(["--num-experts", "10", "--num-ranks", "4"])
    assert "multiple of the number of ranks (4)" in capsys.readouterr().err


# ------------------------------------------------------------------------- format_report


def fake_report(num_gpus=2, cuda_driver="13.0", extension=EXT_DEFAULT):
    gpus = fake_gpu_infos(num_gpus, free=30 * (1 << 30))
    devices = tuple(fake_gpu(i) for i in range(num_gpus))
    spec = env.BufferSpec(num_ranks=num_gpus, num_experts=32 * num_gpus)
    return env.EnvReport(
        versions=env.Versions("0.1.0", "0.11.2", "0.11.2", "3.11.7", cuda_driver, "13.0.96",
                              "nvidia-cuda-runtime package", "jax-cuda13-plugin 0.11.2"),
        driver=env.DriverInfo(True, None, num_gpus, True, None),
        jax=env.JaxInfo("gpu", 0, 1, num_gpus, devices, None),
        gpus=gpus,
        peers=full_peers(num_gpus),
        extension=extension,
        nvshmem=env.NvshmemInfo("nvidia-nvshmem-cu12", "3.3.9", "/x/libnvshmem_host.so.3", None),
        xla_memory=env.xla_memory_settings({}),
        workspace=env.WorkspaceEstimate(spec, 3 << 30, "jax_ep._C.workspace_bytes"),
        backend=env.BackendDecision("cuda", ()),
        cluster=(env.PreflightCheck("RDMA devices", "fail", "none", "install a NIC", ("x",)),),
    )


def test_format_report_names_the_build_for_a_gpu_running_ptx():
    """A build without a GPU carries PTX compute_80 alone: the report says the driver compiles
    it and which JAX_EP_CUDA_ARCHS builds the GPU's own code."""
    ptx = env.ExtensionInfo(True, "compute_80", "/fake/_C.so", None, False, 13000, 8)
    text = env.format_report(fake_report(extension=ptx))
    assert ("[0] NVIDIA H200 (compute capability 9.0): runs PTX compute_80, JIT-compiled by the "
            'driver at first use (a build with JAX_EP_CUDA_ARCHS="90-real" carries its own '
            "code)") in text, text


def test_format_report_two_gpus_nvlink_matrix():
    text = env.format_report(fake_report(2))
    lines = text.splitlines()
    assert "  [0] NVIDIA H200  compute capability 9.0  memory 141.0 GiB total, 30.0 GiB free, " \
           "18 NVLinks up" in lines
    assert any(line.startswith("  [1] NVIDIA H200") for line in lines)
    header = lines.index("Peer access (row GPU reads/writes column GPU's memory)")
    columns, row0, row1 = lines[header + 1: header + 4]
    assert columns.split() == ["GPU0", "GPU1"]
    assert row0.split() == ["GPU0", "X", "NV"]
    assert row1.split() == ["GPU1", "NV", "X"]
    assert "NV = NVLink" in lines[header + 4]
    assert ("  built with CUDA 13.0 for sm_80, sm_89, sm_90, sm_100, sm_120 + PTX compute_120"
            in lines)
    assert "  driver check: the driver (CUDA 13.0) runs a CUDA 13.0 build" in lines
    assert "  [1] NVIDIA H200 (compute capability 9.0): runs SASS sm_90" in lines
    assert "13.0.96" in text and "nvidia-nvshmem-cu12 3.3.9" in text
    assert 'Buffer(backend="auto") -> cuda' in text


def test_format_report_driver_older_than_the_build():
    text = env.format_report(fake_report(1, cuda_driver="12.8"))
    assert ("  driver check: the CUDA driver supports CUDA 12.8, but jax_ep._C was built with "
            "CUDA 13.0 (its CUDA runtime is linked in), which needs a driver of CUDA 13.0 or "
            "newer (r580+)") in text
    ptx_only = env.ExtensionInfo(True, "compute_80", "/fake/_C.so", None, False, 12040)
    text = env.format_report(fake_report(1, cuda_driver="12.8", extension=ptx_only))
    assert "  built with CUDA 12.4 for PTX compute_80" in text
    assert "driver check: the driver (CUDA 12.8) runs a CUDA 12.4 build" in text
    assert ("  [0] NVIDIA H200 (compute capability 9.0): runs PTX compute_80, JIT-compiled by "
            "the driver at first use") in text


def test_format_report_marks_pcie_missing_and_inferred_links():
    report = fake_report(3)
    peers = []
    for p in report.peers:
        if (p.src, p.dst) in ((0, 2), (2, 0)):
            p = env.PeerLink(p.src, p.dst, False, False, None, "none", None)
        elif (p.src, p.dst) in ((1, 2), (2, 1)):
            p = env.PeerLink(p.src, p.dst, True, False, 1, "pcie", "cuda")
        else:
            p = env.PeerLink(p.src, p.dst, True, True, 0, "nvlink", "cuda")
        peers.append(p)
    text = env.format_report(env.EnvReport(**{**vars(report), "peers": tuple(peers)}))
    rows = [line.split() for line in text.splitlines() if line.startswith("  GPU")]
    assert rows == [["GPU0", "X", "NV*", "--"], ["GPU1", "NV*", "X", "PCIe"],
                    ["GPU2", "--", "PCIe", "X"]]
    assert "* = inferred from native peer atomics" in text


# ------------------------------------------------------------------------- auto_backend


def test_auto_backend_no_gpu():
    backend, reasons = env.auto_backend([fake_cpu(i) for i in range(4)], default_backend="cpu",
                                        extension=EXT_MISSING, gpus=(), peers=())
    assert backend == "reference"
    assert reasons[0].startswith("no GPU: jax's default backend is cpu")
    assert any("jax_ep._C does not import" in r for r in reasons)


def test_auto_backend_real_cpu_devices():
    backend, reasons = env.auto_backend(jax.devices("cpu"))
    assert backend == "reference" and reasons[0].startswith("no GPU")


def test_auto_backend_all_good_is_cuda():
    devices = [fake_gpu(i) for i in range(8)]
    assert decide(devices) == ("cuda", [])
    # With enough free memory for the workspace.
    assert decide(devices, gpus=fake_gpu_infos(8), workspace_bytes_needed=1 << 30) == ("cuda", [])


def a100s(n=2):
    return [fake_gpu(i, cc="8.0", kind="NVIDIA A100-SXM4-80GB") for i in range(n)]


def test_auto_backend_accepts_a100_with_the_default_build():
    gpus = fake_gpu_infos(2, name="NVIDIA A100-SXM4-80GB", cc="8.0")
    assert decide(a100s(), extension=EXT_DEFAULT, gpus=gpus) == ("cuda", [])
    # A PTX-only build of compute_80 runs on the A100 and, JIT-compiled, on newer GPUs.
    ptx_80 = env.ExtensionInfo(True, "compute_80", "/fake/_C.so", None, False, 13000)
    assert decide(a100s(), extension=ptx_80) == ("cuda", [])
    assert decide([fake_gpu(0), fake_gpu(1)], extension=ptx_80) == ("cuda", [])


def test_auto_backend_refuses_a100_without_code_for_it():
    backend, reasons = decide(a100s())  # EXT_90: CMake's "90", SASS sm_90 + PTX compute_90
    assert backend == "reference"
    assert reasons == [
        "GPUs 0, 1 (NVIDIA A100-SXM4-80GB): compute capability 8.0, but jax_ep._C carries no "
        "code that runs on it (built for sm_90 + PTX compute_90; SASS sm_N runs on compute "
        "capability N/10.x, PTX compute_N on N/10 and newer): rebuild with "
        'JAX_EP_CUDA_ARCHS="90;80"'
    ]
    ptx_90 = env.ExtensionInfo(True, "compute_90", "/fake/_C.so", None, False, 13000)
    backend, reasons = decide(a100s(), extension=ptx_90)
    assert backend == "reference" and "(built for PTX compute_90;" in reasons[0]
    assert reasons[0].endswith('rebuild with JAX_EP_CUDA_ARCHS="90-virtual;80"')


def test_auto_backend_minimum_compute_capability():
    volta = [fake_gpu(i, cc="7.0", kind="Tesla V100-SXM2-32GB") for i in range(2)]
    ext_70 = env.ExtensionInfo(True, "sm_70 compute_70", "/fake/_C.so", None, False, 12040)
    assert decide(volta, extension=ext_70, driver_cuda_version=12040) == ("cuda", [])
    pascal = [fake_gpu(i, cc="6.0", kind="Tesla P100-SXM2-16GB") for i in range(2)]
    backend, reasons = decide(pascal, extension=ext_70, driver_cuda_version=12040)
    assert backend == "reference"
    assert reasons == [
        "GPUs 0, 1 (Tesla P100-SXM2-16GB): compute capability 6.0, but the cuda kernels need "
        "compute capability 7.0 or newer (loads and stores with acquire/release semantics at "
        "system scope): use the reference backend (backend='reference') on these GPUs"
    ]


def test_auto_backend_needs_cooperative_launch():
    devices = [fake_gpu(0), fake_gpu(1)]
    gpus = fake_gpu_infos(2)
    gpus = (gpus[0], env.GpuInfo(**{**vars(gpus[1]), "cooperative_launch": False}))
    backend, reasons = decide(devices, extension=EXT_DEFAULT, gpus=gpus)
    assert backend == "reference"
    assert reasons == [
        "GPU 1 (NVIDIA H200): no cooperative launch (cudaDevAttrCooperativeLaunch is 0), which "
        "the low-latency kernels need (all blocks of a launch resident at once): use the "
        "reference backend (backend='reference')"
    ]
    unknown = tuple(env.GpuInfo(**{**vars(g), "cooperative_launch": None}) for g in gpus)
    assert decide(devices, extension=EXT_DEFAULT, gpus=unknown) == ("cuda", [])


def test_auto_backend_driver_older_than_the_build():
    devices = [fake_gpu(0), fake_gpu(1)]
    # Another major version: nothing of the module runs.
    backend, reasons = decide(devices, extension=EXT_DEFAULT, driver_cuda_version=12080)
    assert backend == "reference" and len(reasons) == 1
    assert reasons[0].startswith(
        "the CUDA driver supports CUDA 12.8, but jax_ep._C was built with CUDA 13.0 (its CUDA "
        "runtime is linked in), which needs a driver of CUDA 13.0 or newer (r580+): update the "
        "driver, or build jax_ep with a CUDA 12 toolkit")
    # Same major, older minor: SASS runs (minor-version compatibility), PTX does not JIT.
    ext_132 = env.ExtensionInfo(True, DEFAULT_ARCHS, "/fake/_C.so", None, False, 13020)
    assert decide(devices, extension=ext_132, driver_cuda_version=13000) == ("cuda", [])
    ptx_80 = env.ExtensionInfo(True, "compute_80", "/fake/_C.so", None, False, 13020)
    backend, reasons = decide(devices, extension=ptx_80, driver_cuda_version=13000)
    assert backend == "reference"
    assert reasons == [
        "GPUs 0, 1 (NVIDIA H200): compute capability 9.0 runs jax_ep._C through its PTX "
        "compute_80, which the driver JIT-compiles, but the driver (CUDA 13.0) is older than "
        "the toolkit that built that PTX (CUDA 13.2) and cannot read it: update the driver, or "
        'rebuild with JAX_EP_CUDA_ARCHS="80-virtual;90" to carry SASS for these GPUs'
    ]
    assert decide(devices, extension=ptx_80, driver_cuda_version=13020) == ("cuda", [])
    # A driver of an older major: one reason, not one more per GPU running PTX.
    _, reasons = decide(devices, extension=ptx_80, driver_cuda_version=12080)
    assert len(reasons) == 1 and reasons[0].startswith("the CUDA driver supports CUDA 12.8")


def test_auto_backend_newer_gpu_vs_arch_specific_build():
    ext = env.ExtensionInfo(True, "90a", "/fake/_C.so", None)
    backend, reasons = decide([fake_gpu(0, cc="10.0", kind="NVIDIA B200"), fake_gpu(1, cc="10.0",
                               kind="NVIDIA B200")], extension=ext)
    assert backend == "reference"
    assert reasons == ["GPUs 0, 1 (NVIDIA B200): compute capability 10.0, but jax_ep._C carries "
                       "no code that runs on it (built for sm_90a + PTX compute_90a; SASS sm_N "
                       "runs on compute capability N/10.x, PTX compute_N on N/10 and newer): "
                       'rebuild with JAX_EP_CUDA_ARCHS="90a;100"']
    # A plain "90" build carries PTX, which the driver compiles for 10.0.
    assert decide([fake_gpu(0, cc="10.0"), fake_gpu(1, cc="10.0")]) == ("cuda", [])


def test_auto_backend_missing_peer_access():
    devices = [fake_gpu(i) for i in range(4)]
    backend, reasons = decide(devices, peers=full_peers(4, missing={(1, 0), (1, 3)}))
    assert backend == "reference" and len(reasons) == 1
    assert reasons[0].startswith("GPU 1 has no peer access to GPUs 0, 3:")
    # Peer access is needed within an EP group only.
    groups = [[devices[0], devices[2]], [devices[1], devices[3]]]
    backend, reasons = decide(devices, ep_groups=groups, peers=full_peers(4, missing={(1, 0)}))
    assert (backend, reasons) == ("cuda", [])


def test_auto_backend_extension_missing():
    backend, reasons = decide([fake_gpu(0), fake_gpu(1)], extension=EXT_MISSING)
    assert backend == "reference" and len(reasons) == 1
    assert "the CUDA extension jax_ep._C does not import (ModuleNotFoundError" in reasons[0]
    assert "JAX_EP_ENABLE_CUDA=ON pip install ." in reasons[0]


def _checkout_and_install(tmp_path):
    """A source checkout without a build (``checkout/jax_ep``) and an installed jax_ep with one
    (``site/jax_ep/_C<suffix>``), as after ``pip install .`` in a checkout."""
    checkout = tmp_path / "checkout"
    (checkout / "jax_ep").mkdir(parents=True)
    for name in ("pyproject.toml", "CMakeLists.txt"):
        (checkout / name).write_text("")
    (checkout / "jax_ep" / "__init__.py").write_text("")
    site = tmp_path / "site"
    (site / "jax_ep").mkdir(parents=True)
    built = site / "jax_ep" / ("_C" + importlib.machinery.EXTENSION_SUFFIXES[0])
    built.write_bytes(b"")
    return checkout, site, built


def test_extension_hidden_by_the_source_tree_says_so(tmp_path, monkeypatch):
    """Python run from inside a checkout imports the checkout's jax_ep, which has no _C, while
    the installed build is fine: the report names both and the fix (another directory or the
    console script), not a rebuild with nvcc."""
    checkout, site, built = _checkout_and_install(tmp_path)
    package = ModuleType("jax_ep")
    package.__file__ = str(checkout / "jax_ep" / "__init__.py")
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "jax_ep", package)
        m.setitem(sys.modules, "jax_ep._C", None)  # import jax_ep._C -> ModuleNotFoundError
        m.setattr(sys, "path", ["", str(site)])
        m.chdir(checkout)  # "" on sys.path is the current directory, as under python -m
        ext = probes.probe_extension()
    assert not ext.importable and ext.error.startswith("ModuleNotFoundError")
    assert ext.source_tree == str(checkout) and ext.shadowed_build == str(built)
    backend, reasons = decide([fake_gpu(0), fake_gpu(1)], extension=ext)
    assert backend == "reference" and len(reasons) == 1, reasons
    assert f"source tree {checkout}" in reasons[0] and str(built) in reasons[0], reasons
    assert "run from another directory" in reasons[0] and "nvcc" not in reasons[0], reasons
    text = env.format_report(fake_report(extension=ext))
    assert f"hides the installed build {built}" in text, text
    assert "jax-ep-env console script" in text, text

    # No installed build anywhere: the checkout is still named, and the fix is to install it.
    assert probes.shadowed_build(str(checkout / "jax_ep"), [str(checkout)]) is None
    alone = dataclasses.replace(ext, shadowed_build=None)
    reason = decide([fake_gpu(0)], extension=alone)[1][0]
    assert f"source tree {checkout}" in reason and "pip install ." in reason, reason
    # An installed package (no pyproject.toml beside it) is no source tree; a package folder
    # with its own build hides nothing.
    assert probes.source_tree(str(site / "jax_ep")) is None
    assert probes.shadowed_build(str(site / "jax_ep"), [str(checkout)]) is None


def test_auto_backend_other_reasons(monkeypatch):
    # The memory advice depends on XLA's preallocation, which the suite turns off (conftest).
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "true")
    gpus = [fake_gpu(i) for i in range(2)]
    # Mixed platforms.
    _, reasons = decide([*gpus, fake_cpu(7)])
    assert reasons == ["devices 7 are cpu, not CUDA GPUs: build the mesh from jax.devices('gpu')"]
    # Not enough memory beside XLA's pool.
    _, reasons = decide(gpus, gpus=fake_gpu_infos(2, free=2 << 30),
                        workspace_bytes_needed=5 << 30)
    assert len(reasons) == 1
    assert reasons[0].startswith("not enough free device memory on GPUs 0, 1: need 5.0 GiB, "
                                 "have 2.0 GiB; lower XLA_PYTHON_CLIENT_MEM_FRACTION")
    # Too many ranks; GPUs of another process are fine (CUDA IPC, checked at Buffer creation).
    _, reasons = decide([fake_gpu(i) for i in range(16)])
    assert reasons == [r for r in reasons if "16 ranks" in r] and len(reasons) == 1
    backend, reasons = decide([*gpus, fake_gpu(0, process_index=1, addressable=False)])
    assert (backend, reasons) == ("cuda", [])


def test_check_cuda_backend_raises_with_every_reason():
    devices = [fake_gpu(0, cc="6.0"), fake_gpu(1, cc="6.0")]
    with pytest.raises(RuntimeError) as info:
        env.check_cuda_backend(devices, 1 << 30, default_backend="gpu", extension=EXT_MISSING,
                               gpus=(), peers=full_peers(2, missing={(0, 1)}))
    message = str(info.value)
    assert message.startswith("Buffer(backend='cuda') cannot run on these devices:")
    for part in ("jax_ep._C does not import", "compute capability 6.0",
                 "GPU 0 has no peer access to GPU 1", "backend='reference'"):
        assert part in message
    env.check_cuda_backend([fake_gpu(0), fake_gpu(1)], 1 << 30, default_backend="gpu",
                           extension=EXT_90, gpus=fake_gpu_infos(2), peers=full_peers(2))


def test_groups_across_hosts_name_the_layout_to_use():
    """One EP group over two hosts: the cuda backend runs it over NVSHMEM's device API (or the
    emulated network of fake hosts) with one process per GPU; otherwise the reason names the
    settings, and when processes drive several GPUs each, one process per GPU and how to start
    it, whatever the transport."""
    hosts = {0: "node-a", 1: "node-b", 2: "node-a", 3: "node-b"}
    per_gpu = [[fake_gpu(0, process_index=0), fake_gpu(0, process_index=1)]]
    reason = env.cross_host_problem(per_gpu, hosts)
    assert reason.startswith("EP group 0 spans hosts ['node-a', 'node-b']: ")
    assert "JAX_EP_PEER_MAPPING=nvshmem and JAX_EP_DEVICE_TRANSPORT=nvshmem" in reason
    assert "one process per GPU" not in reason
    assert env.cross_host_problem(per_gpu, hosts, "mapped") == reason
    assert env.cross_host_problem(per_gpu, hosts, "nvshmem") == ""
    assert env.cross_host_problem(per_gpu, hosts, "emulated") == ""
    # Two processes (one a host) of two GPUs each, EP across the hosts, data within them.
    several = [[fake_gpu(0, process_index=0), fake_gpu(0, process_index=1)],
               [fake_gpu(1, process_index=0), fake_gpu(1, process_index=1)]]
    reason = env.cross_host_problem(several, hosts)
    assert env.cross_host_problem(several, hosts, "nvshmem") == reason
    assert "while processes [0, 1] drive up to 2 GPUs each" in reason
    for part in ("cannot cross hosts", "one process per GPU", "srun --ntasks-per-node=<GPUs>",
                 "mpirun --map-by ppr:<GPUs>:node", "python -m jax_ep.launch",
                 "A job across hosts"):
        assert part in reason
    # Within each host (the EP axis on a host's GPUs), several GPUs per process are fine.
    assert env.cross_host_problem([[fake_gpu(0, process_index=0), fake_gpu(1, process_index=0)],
                                   [fake_gpu(0, process_index=1), fake_gpu(1, process_index=1)]],
                                  hosts) == ""


@pytest.mark.parametrize("archs,cc,expected", [
    ("90", (9, 0), True), ("90", (8, 0), False), ("90", (10, 0), True), ("90-real", (10, 0), False),
    ("90a", (9, 0), True), ("90a", (10, 0), False), ("80;90", (8, 6), True),
    ("90-virtual", (12, 0), True), ("100f", (10, 3), True), ("native", (9, 0), None),
    ("native;80", (8, 0), True), ("sm_80", (9, 0), False), ("compute_80", (9, 0), True),
    ("compute_90", (8, 9), False), ("sm_100f", (10, 3), True), ("sm_90a", (9, 0), True),
    (DEFAULT_ARCHS, (11, 0), False), (DEFAULT_ARCHS, (12, 1), True), (DEFAULT_ARCHS, (7, 5), False),
])
def test_arch_supports(archs, cc, expected):
    assert env.arch_supports(archs, cc) is expected


@pytest.mark.parametrize("archs,cc,code", [
    (DEFAULT_ARCHS, (8, 0), "sm_80"), (DEFAULT_ARCHS, (8, 6), "sm_80"),
    (DEFAULT_ARCHS, (8, 9), "sm_89"), (DEFAULT_ARCHS, (9, 0), "sm_90"),
    (DEFAULT_ARCHS, (10, 3), "sm_100"), (DEFAULT_ARCHS, (12, 0), "sm_120"),
    (DEFAULT_ARCHS, (13, 0), "compute_120"), (DEFAULT_ARCHS, (11, 0), None),
    ("compute_80", (9, 0), "compute_80"), ("80;90", (10, 0), "compute_90"),
    ("80-real;90-virtual", (8, 9), "sm_80"), ("sm_90a compute_90", (9, 0), "sm_90a"),
])
def test_code_for(archs, cc, code):
    assert env.code_for(archs, cc) == code


def test_describe_and_cmake_architectures():
    assert env.describe_architectures(DEFAULT_ARCHS) == (
        "sm_80, sm_89, sm_90, sm_100, sm_120 + PTX compute_120")
    assert env.describe_architectures("compute_80") == "PTX compute_80"
    assert env.describe_architectures("90") == "sm_90 + PTX compute_90"
    assert compat.cmake_architectures(DEFAULT_ARCHS) == "80-real;89-real;90-real;100-real;120"
    assert compat.cmake_architectures("compute_80") == "80-virtual"
    code = env.parse_architectures("80-real;90;native")
    assert (code.sass, code.ptx, code.unknown) == (("80", "90"), ("90",), ("native",))


# ------------------------------------------------------------------------- memory


def test_workspace_size_is_the_kernels_own():
    """The report's workspace is jax_ep._C.workspace_bytes (what a CUDA Buffer of the spec
    allocates), never a Python copy of the formula: without the extension it is unknown."""
    spec = env.BufferSpec(num_ranks=2, num_experts=8, hidden=256, max_tokens_per_rank=16,
                          num_topk=2, low_latency=True)
    missing = env.workspace_estimate(spec, EXT_MISSING)
    assert missing.bytes is None and missing.source.startswith("unknown: jax_ep._C is not built")
    assert "normal+low_latency: unknown: jax_ep._C is not built here" in env.format_report(
        dataclasses.replace(fake_report(), workspace=missing))
    module, reason = cuda.load_extension()
    if module is None:
        pytest.skip(reason)
    estimate = env.workspace_estimate(spec, env.probe_extension())
    config = cuda.buffer_config(module, num_ranks=2, num_experts=8, hidden=256,
                                max_tokens_per_rank=16, num_topk=2, capacity=32, dtype_bytes=2,
                                low_latency=True)
    assert estimate == env.WorkspaceEstimate(spec, module.workspace_bytes(config),
                                             "jax_ep._C.workspace_bytes")


@pytest.mark.parametrize("kwargs,match", [
    ({"num_ranks": 3}, "num_experts \\(256\\) must be a multiple of the number of ranks \\(3\\)"),
    ({"num_ranks": 2, "hidden": 100}, "hidden must be a multiple of 128"),
    ({"num_ranks": 0}, "num_ranks must be a positive integer"),
    ({"num_ranks": 2, "num_topk": 33}, "num_topk must be at most min\\(32, num_experts=256\\)"),
    ({"num_ranks": 2, "hidden": 32768 + 128, "low_latency": True},
     "hidden must be at most 32768 with low_latency=True"),
    ({"num_ranks": 2, "dtype_bytes": 1}, "dtype_bytes must be 2"),
])
def test_buffer_spec_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        env.BufferSpec(**kwargs)


def test_xla_memory_settings():
    default = env.xla_memory_settings({})
    assert (default.preallocate, default.mem_fraction, default.allocator) == (True, 0.75, "default")
    off = env.xla_memory_settings({"XLA_PYTHON_CLIENT_PREALLOCATE": "false",
                                   "XLA_PYTHON_CLIENT_MEM_FRACTION": ".5"})
    assert (off.preallocate, off.mem_fraction, off.notes) == (False, 0.5, ())
    bad = env.xla_memory_settings({"XLA_PYTHON_CLIENT_MEM_FRACTION": "lots"})
    assert bad.mem_fraction == 0.75 and "XLA_PYTHON_CLIENT_MEM_FRACTION" in bad.notes[0]
    assert not env.xla_memory_settings({"XLA_PYTHON_CLIENT_ALLOCATOR": "platform"}).preallocate


# ------------------------------------------------------------------------- GPU machine


@pytest.mark.gpu
def test_gpu_machine_reports_peers_and_cuda():
    if not jax_sees_gpu():
        pytest.skip("jax sees no GPU")
    num_gpus = len(jax.devices("gpu"))
    if num_gpus < 2:
        pytest.skip(f"needs 2 GPUs, jax sees {num_gpus}")
    report = env.collect(env.BufferSpec(num_ranks=num_gpus, max_tokens_per_rank=128))
    assert len(report.gpus) >= 2
    assert report.driver.available and report.versions.cuda_driver
    for g in report.gpus:
        assert g.total_memory_bytes and g.free_memory_bytes is not None
    ordinals = [g.ordinal for g in report.gpus]
    links = {(p.src, p.dst): p for p in report.peers}
    for src in ordinals:
        for dst in ordinals:
            if src != dst:
                assert links[(src, dst)].access, f"GPU {src} -> GPU {dst}: {links[(src, dst)]}"
    assert report.backend.backend == "cuda", report.backend.reasons
    assert env.auto_backend(jax.devices("gpu")) == ("cuda", [])
    text = env.format_report(report)
    assert "Peer access" in text and 'Buffer(backend="auto") -> cuda' in text
