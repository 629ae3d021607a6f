"""Every JAX_EP_* environment variable is in one table (jax_ep/settings.py) and in the README,
and a bad value is an error naming the variable."""

import re
from pathlib import Path

import pytest

from jax_ep import settings

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("jax_ep", "csrc", "xla_ffi", "benchmarks", "tests", "scripts", "examples", ".ci")
# Names that are CMake variables or C/C++ macros of the build, not environment variables.
BUILD_INTERNAL = {"JAX_EP_CMAKE_CUDA_ARCHS", "JAX_EP_CUDA_ARCHS_BUILT", "JAX_EP_CUDA_ARCH_ENTRIES",
                  "JAX_EP_CUDA_PTX", "JAX_EP_CUDA_SASS", "JAX_EP_FFI_SOURCES", "JAX_EP_HAVE_CUDA",
                  "JAX_EP_NVIDIA_SMI", "JAX_EP_GPU_CAPS",
                  "JAX_EP_DIVISOR_HOST_DEVICE", "JAX_EP_HAVE_NVSHMEM", "JAX_EP_HOST_DEVICE",
                  "JAX_EP_KERNEL_SOURCES", "JAX_EP_NVCC_VERSION_TEXT", "JAX_EP_RUNTIME_SOURCES",
                  "JAX_EP_EMULATOR_SOURCES", "JAX_EP_TESTING_KERNEL_SOURCES",
                  "JAX_EP_TESTING_SOURCES"}


def names_in_code():
    files = [ROOT / "CMakeLists.txt", ROOT / "pyproject.toml"]
    for folder in SCANNED:
        files += [p for p in (ROOT / folder).rglob("*") if p.is_file()
                  and p.suffix in (".py", ".cc", ".cu", ".cuh", ".h", ".in", ".sh", "")]
    found = set()
    for path in files:
        found |= set(re.findall(r"JAX_EP_[A-Z0-9_]+", path.read_text(errors="replace")))
    return found - {"JAX_EP_"}


def test_every_variable_of_the_code_is_in_the_table_and_the_readme():
    table = set(settings.SETTINGS)
    # A renamed variable's old name is named only to refuse it (settings.RENAMED).
    known = table | BUILD_INTERNAL | set(settings.RENAMED)
    assert names_in_code() <= known, names_in_code() - known
    assert not set(settings.RENAMED) & table
    readme = (ROOT / "README.md").read_text()
    missing = [name for name in table if f"`{name}`" not in readme]
    assert not missing, f"not in the README's Settings table: {missing}"


@pytest.mark.parametrize("name,raw,message", [
    ("JAX_EP_TIMEOUT_S", "ten", "JAX_EP_TIMEOUT_S must be a number of seconds"),
    ("JAX_EP_TIMEOUT_S", "-1", "JAX_EP_TIMEOUT_S must be positive"),
    ("JAX_EP_JOIN_TIMEOUT_S", "0", "JAX_EP_JOIN_TIMEOUT_S must be positive"),
    ("JAX_EP_NORMAL_BLOCKS", "0", "JAX_EP_NORMAL_BLOCKS must be a positive integer"),
    ("JAX_EP_LOW_LATENCY_BLOCKS", "many", "JAX_EP_LOW_LATENCY_BLOCKS must be a positive integer"),
    ("JAX_EP_PEER_MAPPING", "rdma", "JAX_EP_PEER_MAPPING='rdma': choose one of ipc, nvshmem"),
])
def test_a_bad_value_names_the_variable(name, raw, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        settings.value(name, {name: raw})


def test_values_and_defaults():
    assert settings.value("JAX_EP_TIMEOUT_S", {}) == 10.0
    assert settings.value("JAX_EP_TIMEOUT_S", {"JAX_EP_TIMEOUT_S": "2.5"}) == 2.5
    assert settings.value("JAX_EP_NORMAL_PUSH_BLOCKS", {"JAX_EP_NORMAL_PUSH_BLOCKS": ""}) is None
    assert settings.value("JAX_EP_NORMAL_PUSH_BLOCKS", {"JAX_EP_NORMAL_PUSH_BLOCKS": "12"}) == 12
    assert settings.value("JAX_EP_PEER_MAPPING", {"JAX_EP_PEER_MAPPING": " NVSHMEM "}) == "nvshmem"


@pytest.mark.parametrize("environ", [{"JAX_EP_TRANSPORT": "nvshmem"},
                                     {"JAX_EP_TRANSPORT": "ipc", "JAX_EP_PEER_MAPPING": "ipc"}])
def test_the_old_name_of_the_peer_mapping_is_refused_naming_the_new_one(environ):
    """JAX_EP_TRANSPORT (how peers' memory is mapped) was renamed JAX_EP_PEER_MAPPING, so that
    "transport" means only JAX_EP_DEVICE_TRANSPORT (how the ops send rows): the old name, set,
    is an error that names the new one, whether or not the new one is set too."""
    with pytest.raises(ValueError, match=r"JAX_EP_TRANSPORT was renamed JAX_EP_PEER_MAPPING .*"
                                         r"set JAX_EP_PEER_MAPPING="):
        settings.value("JAX_EP_PEER_MAPPING", environ)
    assert settings.value("JAX_EP_DEVICE_TRANSPORT", environ) == "stores"
