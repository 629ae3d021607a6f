"""Runs the benchmark scripts of benchmarks/ on 8 host CPU devices with small shapes
(``--quick``) and reads the records they write (tests/test_benchmarks.py,
tests/test_bench_scripts.py)."""

import contextlib
import glob
import importlib
import io
import json
import os
import subprocess
import sys
from unittest import mock

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH_DIR = os.path.join(REPO, "benchmarks")
if BENCH_DIR not in sys.path:
    sys.path.insert(0, BENCH_DIR)

import bench_common as bc  # noqa: E402
import jax  # noqa: E402

SCRIPT_TIMEOUT_S = 600


def jax_ep_importable():
    module, _ = bc.import_jax_ep()
    return module is not None


def run_script(script, out_dir, *extra):
    """Runs ``benchmarks/<script> --quick --out <out_dir> *extra``; returns what it printed.

    In this process (the script's ``main(argv)``) when the test process has the 8 host CPU
    devices the scripts want (conftest): no interpreter, JAX import and backend start per
    script, and XLA:CPU at conftest's -O0, which compiles the scripts' many small programs
    faster than the default level runs them (bench_step --quick: 19 -> 10 s). Elsewhere (the
    CPU suite on a GPU machine) a subprocess pinned to the CPU devices.
    """
    argv = ["--quick", "--out", str(out_dir), *extra]
    if jax.default_backend() == "cpu" and jax.device_count() == 8:
        return _run_in_process(script, argv)
    return _run_subprocess(script, argv)


def _run_in_process(script, argv):
    module = importlib.import_module(os.path.splitext(script)[0])
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
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
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
