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


def positive(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
