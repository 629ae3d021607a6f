"""What the build put into jax_ep._C, against what it says it carries (no GPU needed).

Where nvcc is found or jax sees a GPU, a missing jax_ep._C fails these tests; elsewhere they skip
(conftest.require_extension). CI, on a machine without a GPU, builds the default there (PTX
compute_80 only); a GPU machine's default build (five architectures) meets the same tests, and
the oldest-architecture test below runs ptxas on every kernel source wherever nvcc is found.
"""

import collections
import concurrent.futures
import glob
import os
import re
import subprocess

import fatbin
import pytest
from conftest import find_nvcc

from jax_ep import env
from jax_ep.backends import cuda
from jax_ep.system import compat, probes

# None where the extension is missing: the `extension` fixture (conftest's rule) then fails each
# test where nvcc or a GPU is found, and skips it elsewhere, before the test touches _C.
_C, _ = cuda.load_extension()
pytestmark = pytest.mark.usefixtures("extension")


# What only tests use: the test extension jax_ep._C_testing's, never the user's module's.
TEST_BINDINGS = ("EmulatedQueueForTests", "LowLatencyTransportForTests", "transport_probe",
                 "transport_ring_stress", "low_latency_transport_layout", "low_latency_layout",
                 "fast_divide", "print_native_stack_on_crash", "set_transport_mutant",
                 "check_transport_mutant", "mutant_names", "register_emulated_transport")
# Names that only test code has: the emulator's (its transport, host proxy, proxy thread,
# executors, emulated ranks), the protocol mutants, and the capsule by which the test module
# once reached into _C's registry. The user's module may carry none of them, in its bindings or
# in its machine code (class names survive stripping: kernels' mangled names, type names).
TEST_ONLY_NAMES = ("EmulatedTransport", "EmulatedQueue", "HostProxy", "ProxyThread", "RankProxy",
                   "CudaCopyExecutor", "HostMemcpyExecutor", "Mutant", "mutant", "_runtime_api")


def test_test_bindings_live_in_the_test_extension_beside_the_module():
    """The tests' bindings (the device transports' proxy and probe, protocol mutants, the
    kernels' host arithmetic) are jax_ep._C_testing's, built and installed beside jax_ep._C:
    the user's module exports none of them, and its configuration has no mutant."""
    testing = pytest.importorskip("jax_ep._C_testing", reason="the test extension is not built")
    assert os.path.dirname(testing.__file__) == os.path.dirname(_C.__file__)
    assert all(hasattr(testing, name) for name in TEST_BINDINGS)
    assert [name for name in TEST_BINDINGS if hasattr(_C, name)] == []
    assert [name for name in dir(_C) if re.search(r"mutant|ForTests|probe", name)] == []
    assert [name for name in dir(_C.BufferConfig) if "mutant" in name] == []


def test_the_module_exports_nothing_that_only_tests_use():
    """jax_ep._C ships no emulator, no protocol mutant and no test-only binding or capsule: its
    attributes, its BufferConfig's fields, its FFI targets and the bytes of its shared object
    name none of TEST_ONLY_NAMES, while the test module's shared object names them (so the scan
    can see them where they are)."""
    testing = pytest.importorskip("jax_ep._C_testing", reason="the test extension is not built")
    names = (set(dir(_C)) | set(dir(_C.BufferConfig)) | set(_C.registrations())
             | set(_C.target_names().values()))
    pattern = re.compile(r"mutant|emulat(ed|or)_?(transport|queue|ranks?)|proxy|ForTests|probe|"
                         r"runtime_api", re.IGNORECASE)
    assert sorted(n for n in names if pattern.search(n)) == []
    with open(_C.__file__, "rb") as f:
        image = f.read()
    assert [n for n in TEST_ONLY_NAMES if n.encode() in image] == []
    with open(testing.__file__, "rb") as f:
        testing_image = f.read()
    assert [n for n in ("EmulatedTransport", "HostProxy", "Mutant")
            if n.encode() not in testing_image] == []


def test_cuda_architectures_name_the_code_in_the_module():
    reported = _C.cuda_architectures()
    assert re.fullmatch(r"((sm|compute)_\d+[af]? ?)+", reported), reported
    listed = collections.Counter(fatbin.device_code(_C.__file__))
    # Every kernel file carries the same code; the "a"/"f" suffixes are flag bits in the fat
    # binary, compared here by number.
    assert set(listed) == {re.sub(r"[af]$", "", t) for t in reported.split()}, (reported, listed)
    assert len(set(listed.values())) == 1, listed


def test_reported_architectures_match_the_cmake_list():
    cmake = _C.cmake_cuda_architectures()
    code = env.parse_architectures(cmake)
    if code.unknown:
        pytest.skip(f"built for {cmake!r}: CMake expanded it")
    built = env.parse_architectures(_C.cuda_architectures())
    assert (set(built.sass), set(built.ptx)) == (set(code.sass), set(code.ptx))


def test_cuda_runtime_version_and_extension_probe():
    version = _C.cuda_runtime_version()
    assert isinstance(version, int) and version >= 12000, version
    info = env.probe_extension()
    assert info.importable and info.cuda_runtime_version == version
    assert info.cuda_architectures == _C.cuda_architectures()


@pytest.mark.gpu
def test_the_driver_runs_the_code_the_report_names():
    """On every local GPU the driver loads the code `env.code_for` names: the SASS it names, or
    code JIT-compiled through the PTX it names (a build of only compute_80 on a 9.0 GPU runs
    binary version 90 compiled through PTX version 80: the sm_80 code path, software fp8 casts)."""
    gpus = probes.probe_gpus(free_memory=False, nvlinks=False)
    if not gpus:
        pytest.skip("the CUDA driver sees no GPU")
    archs = _C.cuda_architectures()
    for gpu in gpus:
        cc = compat.parse_cc(gpu.compute_capability)
        code = env.code_for(archs, cc)
        assert code is not None, f"GPU {gpu.ordinal} ({gpu.name}, {cc}): no code in {archs!r}"
        image = _C.kernel_image(gpu.ordinal)
        arch = int(re.sub(r"\D", "", code))
        if code.startswith("sm_"):
            assert image["binary_version"] == arch, (gpu, code, image)
        else:
            assert image == {"binary_version": cc[0] * 10 + cc[1], "ptx_version": arch}, (
                gpu, code, image)


def test_kernels_compile_for_the_oldest_architecture_we_promise():
    """Every kernel source compiles for the oldest GPU the README supports with this toolkit
    (sm_70 with CUDA 12, sm_75 with CUDA 13, which dropped sm_70): the default build starts at
    sm_80, so an instruction newer than the oldest target (cp.async needs sm_80) would pass
    CI's build and fail a user's JAX_EP_CUDA_ARCHS=75 build.

    Device code only (``-cubin``: the front end and ptxas for the target, which is where an
    architecture fails; the host side is the CI build's), two sources at a time: ~20 CPU-s,
    where compiling whole objects took ~45."""
    nvcc = find_nvcc()
    if nvcc is None:
        pytest.skip("no nvcc here")
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    major = int(re.search(r"release (\d+)\.", version).group(1))
    arch = "sm_70" if major <= 12 else "sm_75"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sources = sorted(glob.glob(os.path.join(root, "csrc", "kernels", "*.cu")))
    sources += sorted(glob.glob(os.path.join(root, "csrc", "kernels", "*", "*.cu")))
    sources += sorted(glob.glob(os.path.join(root, "xla_ffi", "testing", "*.cu")))
    assert len(sources) > 5, sources

    def compile_for_arch(source):
        return source, subprocess.run(
            [nvcc, "-std=c++17", "--expt-relaxed-constexpr", f"-arch={arch}", "-cubin",
             "-I", os.path.join(root, "csrc"), source, "-o", os.devnull],
            capture_output=True, text=True, timeout=600)

    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(compile_for_arch, sources))
    failed = [f"{os.path.relpath(source, root)}:\n{result.stderr[-1500:]}"
              for source, result in results if result.returncode != 0]
    assert not failed, f"not compilable for {arch}:\n" + "\n".join(failed)
