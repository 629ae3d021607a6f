"""The devices the benchmarks run on: jax_ep's import, XLA:CPU's host devices, the ``"ep"`` mesh
and the processes of a multi-process run.

Sharding model: one mesh axis ``"ep"`` over all (or the first ``ranks``) devices; every global
array of the benchmarks is ``[R * rows_per_rank, ...]`` sharded along axis 0, so inside
``jax.shard_map`` each rank sees its own ``[rows_per_rank, ...]`` block.
"""

from __future__ import annotations

import os
import sys

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
AXIS = "ep"


def import_jax_ep():
    """Returns ``(module, None)`` or ``(None, reason)``.

    Prefers an installed ``jax_ep`` (which carries the built CUDA extension); falls back to the
    source tree next to this folder, so the scripts also run from a plain checkout.
    """
    try:
        import jax_ep

        return jax_ep, None
    except ImportError:
        pass
    if REPO_ROOT not in sys.path:
        sys.path.insert(0, REPO_ROOT)
    try:
        import jax_ep

        return jax_ep, None
    except Exception as e:  # noqa: BLE001 - any import failure means "not available"
        return None, f"{type(e).__name__}: {e}"


HOST_DEVICES_FLAG = "--xla_force_host_platform_device_count"
HOST_DEVICES = 8  # CPU devices when there is no GPU, as jax-ep-demo and the tests use


def default_host_devices(count: int = HOST_DEVICES) -> None:
    """Gives XLA:CPU ``count`` devices unless ``XLA_FLAGS`` already sets a count, so that a CPU
    run has ranks to exchange between. XLA reads the flag when its first backend starts: call
    this before anything touches a device. Only the CPU platform sees it (GPUs stay GPUs)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if HOST_DEVICES_FLAG not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {HOST_DEVICES_FLAG}={count}".strip()


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def cpu_note() -> str | None:
    """The line a script prints before its times when it runs without a GPU (None on GPUs)."""
    if on_gpu():
        return None
    return (f"{jax.device_count()} {jax.default_backend()} devices: jax_ep's reference backend "
            "and XLA:CPU's collectives. These times check the script; they say nothing about "
            "GPU speed.")


def make_mesh(num_ranks: int | None = None) -> Mesh:
    devices = jax.devices()
    if num_ranks is not None:
        if num_ranks > len(devices):
            raise ValueError(f"--ranks {num_ranks} > {len(devices)} devices")
        devices = devices[:num_ranks]
    return Mesh(np.array(devices), (AXIS,))


def join_processes() -> bool:
    """Joins ``jax.distributed`` when started by ``python -m jax_ep.launch`` (before any device
    is touched). Every process then runs the same cases; process 0 writes and prints results."""
    try:
        from jax_ep import launch  # noqa: PLC0415 - pure Python, no extension needed
    except ImportError:
        return False
    return launch.initialize_from_env()


def is_reporter() -> bool:
    return jax.process_index() == 0


def to_host(a) -> np.ndarray:
    """A global array as one NumPy array, gathered from every process (collective)."""
    if getattr(a, "is_fully_addressable", True):
        return np.asarray(a)
    from jax.experimental import multihost_utils  # noqa: PLC0415

    return np.asarray(multihost_utils.process_allgather(a, tiled=True))


def sharded(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P(AXIS))
