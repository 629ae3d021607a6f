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


def test_a_rank_s_workspace_stays_within_its_bounds_at_any_group_size(tmp_path, monkeypatch):
    """The built library's workspace at 64 and 256 ranks (normal, T_max 4096, the default
    capacity R * T_max) and 256 ranks (low latency, T_max 128) is within twice DeepEP's size
    hints: the normal mode streams a call through a bounded window instead of sizing its region
    for R * T_max rows."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    script = _load(BENCHMARKS / "workspace_bytes.py")
    from jax_ep import _C  # noqa: PLC0415 - the extension fixture checked it imports

    records = script.workspace_records(_C)
    checked = [(r["mode"], r["ranks"], r["bytes"], script.BOUNDS[(r["mode"], r["ranks"])])
               for r in records if (r["mode"], r["ranks"]) in script.BOUNDS]
    assert len(checked) == 3
    assert all(nbytes <= bound for _, _, nbytes, bound in checked), checked
