"""The suite's own rules: every test runs in one place, and a missing jax_ep._C fails where the
build would have made it.

- The GPU suite's two tiers (pyproject.toml): ``pytest -m gpu`` (stress tests left out unless
  -m names them) and ``pytest -m "gpu and stress"``. Together they are what ``-m "gpu or
  stress"`` runs, neither holds a test of the other, and no test is left out of every
  selection: the default (CPU) run, the tiers and ``-m multihost`` cover the whole suite.
- conftest.require_extension: with nvcc found or a GPU seen, a missing _C fails; with neither,
  it skips.
- conftest.gpu_devices: a launched process handed a GPU that jax cannot start fails.
"""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import conftest
import pytest

import jax_ep

ROOT = Path(__file__).resolve().parents[1]
TIERS = {"fast": "gpu", "stress": "gpu and stress"}
SELECTIONS = {"default": None, "all": "stress or not stress", "every_gpu": "gpu or stress",
              "multihost": "multihost", **TIERS}

# One child collects the suite once per selection (modules are imported once): pytest's own
# -m, addopts and ini file, from outside the source tree (the installed jax_ep, as CI's pytest).
COLLECT = textwrap.dedent("""
    import json, sys
    import pytest

    root, out, selections = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])

    class Collect:
        def pytest_collection_finish(self, session):
            self.ids = [item.nodeid for item in session.items]

    found = {}
    for name, expr in selections.items():
        collect = Collect()
        args = ["--collect-only", "-q", "-p", "no:cacheprovider", "--rootdir", root, "-c",
                root + "/pyproject.toml", root + "/tests"]
        if expr is not None:
            args += ["-m", expr]  # replaces addopts' -m
        code = pytest.main(args, plugins=[collect])
        assert code in (0, 5), (name, code)  # 5: nothing selected
        found[name] = collect.ids
    with open(out, "w") as f:
        json.dump(found, f)
""")


@pytest.fixture(scope="module")
def selections(tmp_path_factory):
    """{selection: [test ids]} of SELECTIONS, as pytest selects them."""
    tmp = tmp_path_factory.mktemp("collect")
    out = tmp / "ids.json"
    proc = subprocess.run(
        [sys.executable, "-c", COLLECT, str(ROOT), str(out), json.dumps(SELECTIONS)],
        cwd=tmp, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {name: set(ids) for name, ids in json.loads(out.read_text()).items()}


def test_every_gpu_test_is_in_exactly_one_tier(selections):
    fast, stress, gpu = selections["fast"], selections["stress"], selections["every_gpu"]
    assert len(gpu) > 100 and fast and stress, {k: len(v) for k, v in selections.items()}
    assert fast & stress == set()  # `-m gpu` leaves out the stress tier
    assert fast | stress == gpu, sorted(gpu ^ (fast | stress))


def test_no_test_is_left_out_of_every_selection(selections):
    """The default run holds no GPU test, and default + tiers + multihost are the suite: a test
    marked stress but not gpu would run nowhere."""
    everything, default = selections["all"], selections["default"]
    assert default and not default & selections["every_gpu"]
    covered = default | selections["fast"] | selections["stress"] | selections["multihost"]
    assert covered == everything, sorted(everything - covered)


def test_the_stress_tier_holds_the_long_runs(selections):
    """What the fast tier leaves to the stress tier (one H200, earlier runs): the pairs on one
    GPU (~90 s each), the device transports' seeds, mutants and fake-host digests (~7 min), and
    the model sizes and big grids; the fast tier keeps one run of each transport op suite."""
    stress = selections["stress"]
    for wanted in ("test_gpu_multiprocess.py::test_the_op_suite_passes_in_both_processes",
                   "test_device_transport.py::test_every_protocol_mutant",
                   "test_device_transport.py::test_every_normal_protocol_mutant",
                   "test_device_transport.py::test_normal_ops_across_fake_hosts",
                   "test_normal.py::test_plan_grid_shapes", "test_gpu.py::test_model_hidden"):
        assert any(wanted in test for test in stress), wanted
    fast = selections["fast"]
    for wanted in ("test_low_latency_ops_over_a_device_transport[emulated]",
                   "test_normal_ops_over_a_device_transport[emulated-7]"):
        assert any(test.endswith(wanted) for test in fast), wanted


# ------------------------------------------------------------------------- a missing _C
@pytest.fixture
def without_extension(monkeypatch, tmp_path):
    """jax_ep._C cannot be imported, no GPU is seen, and nvcc is nowhere; returns a folder that
    holds an executable `nvcc` once the test asks for it (``put_nvcc``)."""
    monkeypatch.delattr(jax_ep, "_C", raising=False)
    monkeypatch.setitem(sys.modules, "jax_ep._C", None)  # the import raises ImportError
    monkeypatch.setattr(conftest, "gpu_devices", lambda: [])
    monkeypatch.setattr(conftest, "NVCC_DIRS", ())
    monkeypatch.delenv("CUDACXX", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    return tmp_path


def outcome(check):
    """``("failed" | "skipped" | "passed", message)`` of a check (a skip raised inside
    ``pytest.raises`` would skip the test that expects a failure, not fail it)."""
    try:
        check()
    except pytest.fail.Exception as e:
        return "failed", str(e)
    except pytest.skip.Exception as e:
        return "skipped", str(e)
    return "passed", ""


def put_nvcc(folder):
    folder.mkdir(parents=True, exist_ok=True)
    nvcc = folder / "nvcc"
    nvcc.write_text("#!/bin/sh\n")
    nvcc.chmod(0o755)
    return nvcc


def test_missing_extension_skips_without_nvcc_or_gpu(without_extension):
    result, message = outcome(conftest.require_extension)
    assert result == "skipped" and "no nvcc and no GPU" in message, (result, message)


@pytest.mark.parametrize("where", ["PATH", "NVCC_DIRS", "CUDACXX"])
def test_missing_extension_fails_where_nvcc_is_found(without_extension, monkeypatch, where):
    nvcc = put_nvcc(without_extension / "cuda" / "bin")
    if where == "PATH":
        monkeypatch.setenv("PATH", str(nvcc.parent))
    elif where == "NVCC_DIRS":
        monkeypatch.setattr(conftest, "NVCC_DIRS", (str(nvcc.parent),))
    else:
        monkeypatch.setenv("CUDACXX", str(nvcc))
    result, message = outcome(conftest.require_extension)
    assert result == "failed" and f"nvcc is at {nvcc} but" in message, (result, message)
    assert "jax_ep._C is not built or cannot load" in message, message


def test_missing_extension_fails_where_a_gpu_is_seen(without_extension, monkeypatch):
    monkeypatch.setattr(conftest, "gpu_devices", lambda: ["gpu 0"])
    for check in (conftest.require_extension, conftest.require_gpus):  # the GPU tests' gate too
        result, message = outcome(check)
        assert result == "failed" and "jax sees 1 GPU(s) but" in message, (result, message)


def test_a_launched_process_that_cannot_start_its_gpu_fails(monkeypatch):
    """Its peers wait for it in the GPU backend's start: a skip would leave them waiting."""
    def no_gpu(*_):
        raise RuntimeError("Unable to initialize backend 'cuda': no supported devices found")

    monkeypatch.setattr(conftest.jax, "devices", no_gpu)
    monkeypatch.delenv("JAX_EP_NUM_PROCESSES", raising=False)
    assert conftest.gpu_devices() == []  # not launched: no GPU here, the tests skip
    monkeypatch.setenv("JAX_EP_NUM_PROCESSES", "16")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(pytest.fail.Exception, match="gave this process GPU 0 but jax could not"):
        conftest.gpu_devices()
