"""benchmarks/bench_overlap.py runs on CPU (--quick) and writes records with the fields the
overlap figures need."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_quick_run_writes_the_overlap_records(tmp_path):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
               JAX_PLATFORMS="cpu")
    run = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "bench_overlap.py"), "--quick",
         "--cases", "train:bench,decode:bench", "--steps", "1", "--repeats", "1",
         "--unpinned", "--out", str(tmp_path), "--note", "test"],
        capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    for mode in ("train", "decode"):
        (path,) = tmp_path.glob(f"*-overlap-{mode}-bench.json")
        record = json.loads(path.read_text())
        for key in ("op", "mode", "ranks", "tokens", "hidden", "serial_us", "overlapped_us",
                    "compute_us", "comm_us", "hidden_fraction", "commit", "command", "note"):
            assert key in record, key
        assert record["op"] == "overlap_step" and record["mode"] == mode
        assert record["ranks"] == 2 and record["note"] == "test"
        assert all(record[k] > 0 for k in ("serial_us", "overlapped_us", "compute_us",
                                           "comm_us"))
        unpinned = record["programs"]["unpinned"]
        assert unpinned["wall_us"] > 0 and "largest_us" in unpinned, unpinned
    assert "saved/comm" in run.stdout
