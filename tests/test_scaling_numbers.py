"""docs/scaling_numbers.py prints docs/scaling.md's tables without JAX, from a transcription of
the kernels' workspace formulas (csrc/kernels/normal/workspace.h, low_latency/layout.cuh). For
every R of the tables the transcription must give jax_ep._C's figure: a change of the kernels'
layout fails here until the transcription and docs/scaling.md follow.

Needs jax_ep._C (conftest's rule: fails where nvcc is found or jax sees a GPU, skips elsewhere).
"""

import importlib.util
import json
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
BENCHMARKS = DOCS.parent / "benchmarks"
pytestmark = pytest.mark.usefixtures("extension")


def _load(path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_transcription_equals_the_library():
    numbers = _load(DOCS / "scaling_numbers.py")
    # Asserts equality config by config (R from 1 to 256, normal and low-latency, both dtypes,
    # two capacities) and says how many it compared.
    assert numbers.check_against_extension() == (
        "transcription == jax_ep._C.workspace_bytes for 84 configurations, R up to 256")


def test_the_workspace_record_script_writes_the_librarys_sizes(tmp_path, monkeypatch):
    """benchmarks/workspace_bytes.py records, for each mode and group size, the bytes the
    library sizes: equal to the transcription's (an independent reading of the layout)."""
    numbers = _load(DOCS / "scaling_numbers.py")
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    script = _load(BENCHMARKS / "workspace_bytes.py")
    assert script.main(["--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("*-workspace_bytes.json")
    records = json.loads(path.read_text())["records"]
    assert [(r["mode"], r["ranks"]) for r in records] == [
        (mode, ranks) for mode in ("normal", "low_latency") for ranks in (2, 8, 16, 64, 256)]
    for r in records:
        assert set(r) == {"op", "mode", "ranks", "tokens", "hidden", "dtype", "bytes"}
        capacity = r["ranks"] * r["tokens"]
        assert r["bytes"] == numbers.workspace_bytes(
            r["ranks"], r["tokens"], capacity, 2, r["mode"] == "low_latency"), r
