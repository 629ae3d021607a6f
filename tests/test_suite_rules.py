"""The suite's own rules: a missing jax_ep._C fails where the build would have made it.

conftest.require_extension: with nvcc found or a GPU seen, a missing _C fails; with neither, it
skips.
"""

import sys

import conftest
import pytest

import jax_ep


# ------------------------------------------------------------------------- a missing _C
@pytest.fixture
def without_extension(monkeypatch, tmp_path):
    """jax_ep._C cannot be imported, no GPU is seen, and nvcc is nowhere; returns a folder that
    holds an executable `nvcc` once the test asks for it (``put_nvcc``)."""
    monkeypatch.delattr(jax_ep, "_C", raising=False)
    monkeypatch.setitem(sys.modules, "jax_ep._C", None)  # the import raises ImportError
    monkeypatch.setattr(conftest, "gpu_devices", lambda: [])
    monkeypatch.setattr(conftest, "NVCC_DIRS", ())
    monkeypatch.delenv("CUDACXX", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    return tmp_path


def outcome(check):
    """``("failed" | "skipped" | "passed", message)`` of a check (a skip raised inside
    ``pytest.raises`` would skip the test that expects a failure, not fail it)."""
    try:
        check()
    except pytest.fail.Exception as e:
        return "failed", str(e)
    except pytest.skip.Exception as e:
        return "skipped", str(e)
    return "passed", ""


def put_nvcc(folder):
    folder.mkdir(parents=True, exist_ok=True)
    nvcc = folder / "nvcc"
    nvcc.write_text("#!/bin/sh\n")
    nvcc.chmod(0o755)
    return nvcc


def test_missing_extension_skips_without_nvcc_or_gpu(without_extension):
    result, message = outcome(conftest.require_extension)
    assert result == "skipped" and "no nvcc and no GPU" in message, (result, message)


@pytest.mark.parametrize("where", ["PATH", "NVCC_DIRS", "CUDACXX"])
def test_missing_extension_fails_where_nvcc_is_found(without_extension, monkeypatch, where):
    nvcc = put_nvcc(without_extension / "cuda" / "bin")
    if where == "PATH":
        monkeypatch.setenv("PATH", str(nvcc.parent))
    elif where == "NVCC_DIRS":
        monkeypatch.setattr(conftest, "NVCC_DIRS", (str(nvcc.parent),))
    else:
        monkeypatch.setenv("CUDACXX", str(nvcc))
    result, message = outcome(conftest.require_extension)
    assert result == "failed" and f"nvcc is at {nvcc} but" in message, (result, message)
    assert "jax_ep._C is not built or cannot load" in message, message


def test_missing_extension_fails_where_a_gpu_is_seen(without_extension, monkeypatch):
    monkeypatch.setattr(conftest, "gpu_devices", lambda: ["gpu 0"])
    for check in (conftest.require_extension, conftest.require_gpus):  # the GPU tests' gate too
        result, message = outcome(check)
        assert result == "failed" and "jax sees 1 GPU(s) but" in message, (result, message)
