"""Runs ``python -m jax_ep.launch`` from tests and reads its prefixed output."""

import os
import subprocess
import sys
import time
from pathlib import Path

from jax_ep import launch
from jax_ep.buffer import EMULATED_TRANSPORT_CONNECTIONS

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_PARENT = Path(launch.__file__).resolve().parents[1]  # children import this jax_ep
DIGEST_SCRIPT = ROOT / "tests" / "multiprocess_digest.py"
# The -m expression of a child that runs a file's GPU tests, both tiers (tests/conftest.py).
EVERY_GPU_TEST = "gpu or stress"


def child_env(platform, extra_env=None):
    """The test's environment without launcher or device-selection variables, so the launcher
    chooses; ``platform="cpu"`` pins the children to CPU devices."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("JAX_EP_") and k not in ("XLA_FLAGS", "CUDA_VISIBLE_DEVICES")}
    if platform == "cpu":
        env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(PACKAGE_PARENT), env.get("PYTHONPATH")) if p)
    env.update(extra_env or {})
    return env


def device_transport_env(transport, seed=0, **extra_env):
    """What a child process needs to run the ops over ``JAX_EP_DEVICE_TRANSPORT=transport``
    (``seed``: the emulator's, rank r with seed + r), plus ``extra_env``."""
    return {"JAX_EP_DEVICE_TRANSPORT": transport, "JAX_EP_EMULATOR_SEED": str(seed),
            # The proxy's copies must not queue behind the kernel that waits for them.
            launch.ENV_MAX_CONNECTIONS: str(EMULATED_TRANSPORT_CONNECTIONS),
            # A kernel wait's bound, for runs slowed by the emulator and by a shared GPU.
            "JAX_EP_TIMEOUT_S": "20", **extra_env}


def run_launcher(*args, platform="cpu", timeout=300, extra_env=None, cwd=ROOT):
    """``(CompletedProcess, seconds)`` of one launcher run (``--platform`` is passed through).
    Children of ``python -c`` import from ``cwd`` first: pass another folder than the source
    tree when they need the installed (compiled) jax_ep."""
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "jax_ep.launch", "--platform", platform, *args], cwd=cwd,
        env=child_env(platform, extra_env), capture_output=True, text=True,
        errors="replace", timeout=timeout)
    return proc, time.monotonic() - start


def lines_of(text, rank):
    prefix = f"[{rank}] "
    return [line[len(prefix):] for line in text.splitlines() if line.startswith(prefix)]


def digest_lines(text, rank=0):
    """The ``DIGEST name sha`` lines of tests/multiprocess_digest.py from process ``rank`` of a
    launcher run, or (``rank=None``) from the script run alone, whose lines have no prefix."""
    lines = text.splitlines() if rank is None else lines_of(text, rank)
    return [line for line in lines if line.startswith("DIGEST ")]
