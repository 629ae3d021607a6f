"""The tools as a newcomer meets them: install files, the demo's table (jax_ep/tools/demo.py)."""

import os
import re

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _requirement_names(lines):
    return sorted(line.strip() for line in lines if line.strip() and not line.startswith("#"))


def test_requirements_test_txt_is_the_test_extra():
    """requirements-test.txt (the tests' dependencies for an environment that already has
    jax_ep, so that they install without a second build) lists what the `test` extra lists."""
    tomllib = pytest.importorskip("tomllib")
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        extra = tomllib.load(f)["project"]["optional-dependencies"]["test"]
    with open(os.path.join(REPO, "requirements-test.txt")) as f:
        listed = _requirement_names(f)
    assert listed == sorted(extra)
    assert not any(re.match(r"jax[_-]ep\b", r) for r in listed)  # never jax_ep itself


def test_demo_rates_show_their_figure():
    """The demo's table gives each bandwidth in the unit that shows it: a CPU's combine is not
    "0.0 GB/s"."""
    from jax_ep.tools.demo import rate_text

    assert rate_text(412.04e9) == "412.0 GB/s"
    assert rate_text(35.2e6) == "35.2 MB/s"
    assert rate_text(9.5e5) == "950.0 kB/s"
    assert rate_text(1.5e12) == "1.5 TB/s"
    assert rate_text(12.0) == "12.0 B/s"


def test_demo_table_names_its_units_and_its_platform():
    """On CPU the table says that its times are the reference backend's and say nothing about
    GPU speed; every time carries its unit, every rate its unit, and the columns are defined."""
    from jax_ep.tools.demo import times_table

    cpu = times_table("xla", False, 8, {"dispatch": 0.032333, "combine": -1.0}, (2, 10), 400,
                      2048)
    assert "say nothing about GPU speed" in cpu[0] and "8 CPU devices" in cpu[0]
    assert cpu[2].split()[2:] == ["32333.0", "us", "25.3", "MB/s"], cpu[2]
    assert "below noise" in cpu[3]
    assert cpu[-1].startswith("time per call:") and "400 rows of 2048 bytes" in cpu[-1]
    gpu = times_table("cuda", True, 8, {"dispatch": 100e-6}, (2, 10), 400, 2048)
    assert not any("GPU speed" in line for line in gpu)
    assert gpu[1].split()[2:] == ["100.0", "us", "8.2", "GB/s"], gpu[1]
