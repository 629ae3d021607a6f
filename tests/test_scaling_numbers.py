"""docs/scaling_numbers.py prints docs/scaling.md's tables without JAX, from a transcription of
the kernels' workspace formulas (csrc/kernels/normal/workspace.h, low_latency/layout.cuh). For
every R of the tables the transcription must give jax_ep._C's figure: a change of the kernels'
layout fails here until the transcription and docs/scaling.md follow.

Needs jax_ep._C (conftest's rule: fails where nvcc is found or jax sees a GPU, skips elsewhere).
"""

import importlib.util
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
pytestmark = pytest.mark.usefixtures("extension")


def test_the_transcription_equals_the_library():
    spec = importlib.util.spec_from_file_location("scaling_numbers", DOCS / "scaling_numbers.py")
    numbers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(numbers)
    # Asserts equality config by config (R from 1 to 256, normal and low-latency, both dtypes,
    # two capacities) and says how many it compared.
    assert numbers.check_against_extension() == (
        "transcription == jax_ep._C.workspace_bytes for 84 configurations, R up to 256")
