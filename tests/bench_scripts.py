"""Runs the benchmark scripts of benchmarks/ as subprocesses on 8 host CPU devices with small
shapes (``--quick``) and reads the records they write (tests/test_benchmarks.py,
tests/test_bench_scripts.py)."""

import glob
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH_DIR = os.path.join(REPO, "benchmarks")
if BENCH_DIR not in sys.path:
    sys.path.insert(0, BENCH_DIR)

import bench_common as bc  # noqa: E402

SCRIPT_TIMEOUT_S = 600


def jax_ep_importable():
    module, _ = bc.import_jax_ep()
    return module is not None


def run_script(script, out_dir, *extra):
    env = dict(os.environ)
    # XLA's default optimization (not conftest's -O0): the timed programs run long enough that
    # -O0 code costs more than it saves in compiling.
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    env["JAX_PLATFORMS"] = "cpu"
    cmd = [sys.executable, os.path.join(BENCH_DIR, script), "--quick", "--out", str(out_dir),
           *extra]
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
