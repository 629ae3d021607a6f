"""Test set-up: 8 host CPU devices (before jax is imported) and the backend fixture.

Under ``python -m jax_ep.launch`` (``JAX_EP_NUM_PROCESSES`` set) the launcher chose the devices
per process and this joins ``jax.distributed`` before anything touches a device.
"""

import os
import shutil
import tempfile
import zlib

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
# XLA takes its memory as it needs it rather than 75% of the GPU at the first GPU test: tests
# that start other processes on the same GPU (launcher --processes-per-gpu) need the rest.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# Never use NVLink multicast on shared machines.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

if os.environ.get("JAX_EP_NUM_PROCESSES"):
    from jax_ep import launch  # noqa: E402

    launch.initialize_from_env()


def pytest_configure(config):
    _register_emulated_transport()
    # The CPU suite compiles a few hundred small programs, and XLA:CPU's LLVM passes are most of
    # that time: at -O0 the suite takes ~20% less (the results are the same; nothing here times
    # XLA's code). Runs that select GPU tests keep XLA's defaults.
    selects_gpu = "gpu" in config.option.markexpr.replace("not gpu", "")
    if not selects_gpu and "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
        os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
    if not selects_gpu:
        _use_compilation_cache(config)


def _register_emulated_transport():
    """JAX_EP_DEVICE_TRANSPORT=emulated runs the test module's emulated transport (jax_ep never
    imports jax_ep._C_testing, and jax_ep._C carries none): hand it to jax_ep._C in every test
    process, child processes' pytest runs included, where both modules are built."""
    from jax_ep.backends import cuda  # noqa: PLC0415

    module, _ = cuda.load_extension()
    if module is None:
        return
    try:
        from jax_ep import _C_testing  # noqa: PLC0415
    except ImportError:  # built without the test module: test_build.py reports it
        return
    _C_testing.register_emulated_transport()


def pytest_collection_modifyitems(config, items):
    """`-m gpu` is the fast GPU tier: tests marked stress run only where the -m expression
    names them (`-m "gpu and stress"`: the stress tier; `-m "gpu or stress"`: both tiers)."""
    if "stress" in config.option.markexpr:
        return
    stress = [item for item in items if item.get_closest_marker("stress")]
    if stress:
        config.hook.pytest_deselected(items=stress)
        items[:] = [item for item in items if not item.get_closest_marker("stress")]


def _use_compilation_cache(config):
    """A persistent compilation cache of this process alone, new and removed at the end.

    Many of the suite's programs equal an earlier one but for their Python function (tests
    build the same ops for each case, the benchmark scripts each their own programs), and a hit
    skips XLA: ~10% of the CPU suite's time. Not shared between
    processes (jax writes its entries without a lock); child processes start without it
    (first_call times a cold start).
    """
    path = tempfile.mkdtemp(prefix="jax_ep-test-compile-cache-")
    config.add_cleanup(lambda: shutil.rmtree(path, ignore_errors=True))
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def gpu_devices():
    """jax's GPUs, or none. A process that the launcher handed a GPU and that cannot start it
    fails instead: its peers wait for it in the GPU backend's start, and a skip would leave them
    waiting."""
    try:
        return jax.devices("gpu")
    except RuntimeError as e:
        if os.environ.get("JAX_EP_NUM_PROCESSES") and os.environ.get("CUDA_VISIBLE_DEVICES"):
            pytest.fail(f"the launcher gave this process GPU {os.environ['CUDA_VISIBLE_DEVICES']}"
                        f" but jax could not start it: {e}")
        return []


# Where CMake's check_language(CUDA) finds nvcc besides PATH and CUDACXX (CI adds it to PATH).
NVCC_DIRS = ("/usr/local/cuda/bin",)


def find_nvcc():
    """The nvcc a build here would use (CUDACXX, PATH, then NVCC_DIRS), or None."""
    candidates = [os.environ.get("CUDACXX"), shutil.which("nvcc")]
    candidates += [os.path.join(d, "nvcc") for d in NVCC_DIRS]
    return next((c for c in candidates if c and os.path.isfile(c) and os.access(c, os.X_OK)),
                None)


def require_extension():
    """jax_ep._C, by the suite's one rule for a missing extension. Where nvcc is found (the
    build compiles _C wherever it finds nvcc) or jax sees a GPU, a missing or unloadable _C
    FAILS the test: a broken build must not pass as skipped tests. Elsewhere it skips, saying
    why."""
    from jax_ep.backends import cuda as _cuda

    module, reason = _cuda.load_extension()
    if module is not None:
        return module
    nvcc, gpus = find_nvcc(), gpu_devices()
    if nvcc is None and not gpus:
        pytest.skip(f"{reason}; no nvcc and no GPU here to build or run it")
    seen = f"nvcc is at {nvcc}" if nvcc else f"jax sees {len(gpus)} GPU(s)"
    import jax_ep

    pytest.fail(f"{seen} but {reason} (jax_ep imported from "
                f"{os.path.dirname(jax_ep.__file__)}): build it with `pip install -e .`; run "
                "`pytest`, not `python -m pytest`, which puts the uncompiled source tree first")


@pytest.fixture
def extension():
    """jax_ep._C for tests that need it (``require_extension``'s rule)."""
    return require_extension()


def require_gpus(count=1):
    """Skips (saying why) unless jax sees `count` GPUs. Fails when it sees a GPU but jax_ep._C
    is missing or cannot load (``require_extension``): on a GPU machine the GPU suite must not
    pass by skipping."""
    gpus = gpu_devices()
    if len(gpus) < count:
        pytest.skip(f"needs {count} CUDA GPU(s), jax sees {len(gpus)}")
    require_extension()
    return gpus


@pytest.fixture(params=["reference", pytest.param("cuda", marks=pytest.mark.gpu)])
def backend(request):
    """Every op test runs once per backend; the cuda one only with `-m gpu` on a GPU machine."""
    if request.param == "cuda":
        require_gpus(1)
    return request.param


def per_backend(gpu_cases, cpu_cases):
    """Parameters ``(backend, *case)`` for ``parametrize(..., indirect=["backend"])``: every case
    of `gpu_cases` on the CUDA kernels (marked gpu), `cpu_cases` on the reference backend."""
    return ([pytest.param("cuda", *case, marks=pytest.mark.gpu) for case in gpu_cases]
            + [("reference", *case) for case in cpu_cases])


def covering(*axes):
    """The fewest cases that take every value of every axis: case i takes value i of each axis
    (wrapping). For the reference backend, whose code paths for the axes are independent (the
    GPU suite runs the whole product)."""
    return [tuple(axis[i % len(axis)] for axis in axes) for i in range(max(map(len, axes)))]


def ep_mesh(backend, num_ranks=None, data=1):
    """A mesh ('data', 'ep') or ('ep',) over the devices of `backend`."""
    devices = gpu_devices() if backend == "cuda" else jax.devices("cpu")
    num_ranks = num_ranks or len(devices) // data
    if num_ranks * data > len(devices):
        pytest.skip(f"needs {num_ranks * data} devices, have {len(devices)}")
    grid = np.array(devices[: num_ranks * data])
    if data == 1:
        return Mesh(grid, ("ep",))
    return Mesh(grid.reshape(data, num_ranks), ("data", "ep"))


@pytest.fixture
def rng(request):
    """Deterministic per test."""
    seed = zlib.crc32(request.node.nodeid.encode())
    return np.random.default_rng(seed)
