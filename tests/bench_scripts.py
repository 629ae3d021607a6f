"""Runs the benchmark scripts of benchmarks/ on 8 host CPU devices with small shapes
(``--quick``) and reads the records they write (tests/test_benchmarks.py,
tests/test_bench_scripts.py).

The scripts run from a copy of the tree (``TREE``: benchmarks/ without its records, docs/,
examples/, .gitignore, committed to a git repository of its own), with their default
``--out``; after each run its ``git status`` must still be clean: a script writes into the
tracked tree only when asked (``--out benchmarks/results``).
"""

import atexit
import contextlib
import glob
import importlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
from unittest import mock

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _git(root, *args):
    return subprocess.run(["git", "-c", "user.name=tests", "-c", "user.email=tests@localhost",
                           *args], cwd=root, check=True, capture_output=True, text=True).stdout


def _tree_copy():
    """The copy the scripts run from (one per test process, removed at its exit)."""
    root = tempfile.mkdtemp(prefix="jax_ep-bench-tree-")
    atexit.register(shutil.rmtree, root, True)
    skip = shutil.ignore_patterns("__pycache__", "results", "out")
    for folder in ("benchmarks", "docs", "examples"):  # docs: traffic.py's formula
        shutil.copytree(os.path.join(REPO, folder), os.path.join(root, folder), ignore=skip)
    shutil.copy(os.path.join(REPO, ".gitignore"), root)
    _git(root, "init", "-q")
    _git(root, "add", "-A")
    _git(root, "commit", "-q", "-m", "the benchmarks")
    return root


TREE = _tree_copy()
BENCH_DIR = os.path.join(TREE, "benchmarks")
sys.path.insert(0, BENCH_DIR)

import bench_inputs as bi  # noqa: E402
import bench_mesh as bm  # noqa: E402
import bench_peers as bp  # noqa: E402
import bench_records as br  # noqa: E402
import bench_timing as bt  # noqa: E402
import jax  # noqa: E402

__all__ = ["BENCH_DIR", "TREE", "bi", "bm", "bp", "br", "bt", "bench_module", "load_record",
           "positive", "run_script", "timer_noise"]


def bench_module(name):
    """The copy's ``benchmarks/<name>.py``, imported."""
    module = importlib.import_module(name)
    assert module.__file__.startswith(BENCH_DIR), module.__file__
    return module

SCRIPT_TIMEOUT_S = 600


def jax_ep_importable():
    module, _ = bm.import_jax_ep()
    return module is not None


def run_script(script, out_dir, *extra):
    """Runs ``benchmarks/<script> --quick *extra`` from ``TREE``; returns what it printed.

    The script writes into its default folder (``bench_records.DEFAULT_OUT``, which git
    ignores; an ``--out`` in ``extra`` wins); afterwards ``TREE``'s ``git status`` must be clean,
    and what the script wrote there moves to ``out_dir``.

    In this process (the script's ``main(argv)``) when the test process has the 8 host CPU
    devices the scripts want (conftest): no interpreter, JAX import and backend start per
    script, and XLA:CPU at conftest's -O0, which compiles the scripts' many small programs
    faster than the default level runs them (bench_step --quick: 19 -> 10 s). Elsewhere (the
    CPU suite on a GPU machine) a subprocess pinned to the CPU devices.
    """
    argv = ["--quick", *extra]
    if jax.default_backend() == "cpu" and jax.device_count() == 8:
        stdout = _run_in_process(script, argv)
    else:
        stdout = _run_subprocess(script, argv)
    status = _git(TREE, "status", "--porcelain", "--untracked-files=all")
    assert status == "", f"{script} wrote into the tracked tree:\n{status}"
    if os.path.isdir(br.DEFAULT_OUT):
        for name in os.listdir(br.DEFAULT_OUT):
            shutil.move(os.path.join(br.DEFAULT_OUT, name), os.path.join(str(out_dir), name))
    return stdout


def _run_in_process(script, argv):
    module = bench_module(os.path.splitext(script)[0])
    stdout = io.StringIO()
    # Child processes a script starts (first_call's cases) inherit this process's environment:
    # pinned to the CPU devices as _run_subprocess pins the script itself.
    with mock.patch.dict(os.environ, {"JAX_PLATFORMS": "cpu"}), \
            contextlib.redirect_stdout(stdout):
        try:
            module.main(argv)
        except SystemExit as e:
            if e.code not in (None, 0):
                raise AssertionError(f"{script} exited with {e.code}:\n"
                                     f"{stdout.getvalue()[-3000:]}") from e
    return stdout.getvalue()


def _run_subprocess(script, argv):
    env = dict(os.environ)
    # XLA's default optimization, as the scripts run for real.
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    env["JAX_PLATFORMS"] = "cpu"
    cmd = [sys.executable, os.path.join(BENCH_DIR, script), *argv]
    proc = subprocess.run(cmd, cwd=TREE, env=env, capture_output=True, text=True,
                          timeout=SCRIPT_TIMEOUT_S)
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def load_record(out_dir, pattern):
    files = glob.glob(os.path.join(str(out_dir), pattern))
    assert len(files) == 1, files
    with open(files[0]) as f:
        payload = json.load(f)
    for key in ("machine", "date", "commit", "command", "results"):
        assert key in payload, key
    assert payload["machine"] == "8xcpu"
    assert len(payload["date"]) == 10 and payload["date"][4] == "-"
    assert isinstance(payload["commit"], str) and payload["commit"]
    return payload


def timer_noise(errors):
    """The errors that only say an op measured below the timer noise.

    On a busy 2-core machine (the suite runs in two workers) the difference of two wall times can
    come out non-positive for an op of a few us or ms; the scripts then report the case instead
    of a meaningless time. Every other error is a failure.
    """
    return [e for e in errors if "non-positive time" in e.get("error", "")]


def positive(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
