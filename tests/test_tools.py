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
