"""Every ``JAX_EP_*`` environment variable, in one table: what it sets, its default, and how it
is parsed. The runtime reads them only through :func:`value`, which validates once per read and
names the variable in its error. The README's "Settings" table lists the same names (a test
keeps the two and the code in step).

Kinds: ``runtime`` (read by jax_ep when a Buffer is made or an op runs), ``launcher`` (written
by ``python -m jax_ep.launch`` for its children, read by ``launch.initialize_from_env``),
``build`` (read by CMake / pip when jax_ep is built), ``tooling`` (benchmarks and tests).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any


def _seconds(name: str, raw: str) -> float:
    try:
        seconds = float(raw)
    except ValueError:
        raise ValueError(f"{name} must be a number of seconds, got {raw!r}") from None
    if not seconds > 0:
        raise ValueError(f"{name} must be positive, got {raw!r}")
    return seconds


def _int_at_least(minimum: int, what: str) -> Callable[[str, str], int]:
    def parse(name: str, raw: str) -> int:
        try:
            number = int(raw)
        except ValueError:
            raise ValueError(f"{name} must be a {what} integer, got {raw!r}") from None
        if number < minimum:
            raise ValueError(f"{name} must be a {what} integer, got {raw!r}")
        return number
    return parse


_positive_int = _int_at_least(1, "positive")
_nonnegative_int = _int_at_least(0, "non-negative")


def _choice(*options: str) -> Callable[[str, str], str]:
    def parse(name: str, raw: str) -> str:
        text = raw.strip().lower()
        if text not in options:
            raise ValueError(f"{name}={raw!r}: choose one of {', '.join(options)}")
        return text
    return parse


def _text(name: str, raw: str) -> str:
    del name
    return raw


@dataclasses.dataclass(frozen=True)
class Setting:
    name: str
    kind: str  # runtime | launcher | build | tooling
    default: Any  # None: unset means "not given" (the code picks, e.g. from the device)
    parse: Callable[[str, str], Any]
    doc: str


SETTINGS = {s.name: s for s in (
    Setting("JAX_EP_TIMEOUT_S", "runtime", 10.0, _seconds,
            "bound on every wait of a kernel for a peer (Buffer(timeout_s=...) overrides)"),
    Setting("JAX_EP_JOIN_TIMEOUT_S", "runtime", 120.0, _seconds,
            "bound on every wait of the multi-process Buffer exchange"),
    Setting("JAX_EP_PEER_MAPPING", "runtime", "ipc", _choice("ipc", "nvshmem"),
            "how processes map their peers' workspaces (a Buffer's peer_mapping): CUDA IPC or "
            "NVSHMEM's symmetric heap"),
    Setting("JAX_EP_NVSHMEM_LIB", "runtime", None, _text,
            "path of NVSHMEM's host library (default: the nvidia-nvshmem wheel's)"),
    Setting("JAX_EP_NORMAL_BLOCKS", "runtime", None, _positive_int,
            "blocks of a normal-mode transfer kernel (default: one per SM)"),
    Setting("JAX_EP_NORMAL_PUSH_BLOCKS", "runtime", None, _positive_int,
            "of those, the blocks that push rows to peers (default: a quarter)"),
    Setting("JAX_EP_NORMAL_SEND_SLOTS", "runtime", None, _positive_int,
            "over a device transport: send slots per push warp of a normal transfer kernel "
            "(default: as many as the send region holds; fewer makes warps restage slots "
            "within a call, as tests want)"),
    Setting("JAX_EP_NORMAL_WINDOW_ROWS", "runtime", None, _positive_int,
            "rows of the normal-mode data region, the window a call streams its rows through "
            "in rounds when they do not fit (default 65536: 0.96 GB at bf16 H=7168, any number "
            "of ranks; every process of a group must use the same)"),
    Setting("JAX_EP_LOW_LATENCY_BLOCKS", "runtime", None, _positive_int,
            "blocks of a low-latency launch, at most one per SM (default: all SMs but 8)"),
    Setting("JAX_EP_DEVICE_TRANSPORT", "runtime", "stores",
            _choice("stores", "mapped", "emulated", "nvshmem"),
            "how the ops of a Buffer reach peers: stores through peer mappings, or the "
            "put-protocol kernels for peers without one, performed as stores (mapped), by an "
            "adversarial host proxy (emulated: the test module's, for tests) or by NVSHMEM's "
            "device API (nvshmem, with JAX_EP_PEER_MAPPING=nvshmem; docs/transport.md)"),
    Setting("JAX_EP_EMULATOR_SEED", "runtime", 0, _nonnegative_int,
            "the emulated transport's seed (reordering, tearing, delays); rank r uses seed + r"),
    Setting("JAX_EP_MOE_MATMUL", "runtime", None,
            _choice("tiled", "ragged_dot", "tokamax", "tokamax+mosaic", "mosaic"),
            "the expert matmul that jax_ep.moe's matmul=\"auto\" uses (default: by machine)"),
    Setting("JAX_EP_COORDINATOR", "launcher", None, _text,
            "host:port of jax.distributed's coordinator"),
    Setting("JAX_EP_NUM_PROCESSES", "launcher", None, _positive_int, "processes of the job"),
    Setting("JAX_EP_PROCESS_ID", "launcher", None, _text, "this process's index"),
    Setting("JAX_EP_LOCAL_DEVICE_IDS", "launcher", None, _text,
            "GPUs this process drives among those it sees (launcher --share-gpus)"),
    Setting("JAX_EP_HOST", "launcher", None, _text,
            "the host name by which jax_ep tells hosts apart (default: the machine's; the "
            "launcher's --fake-hosts sets it)"),
    Setting("JAX_EP_CUDA_ARCHS", "build", None, _text,
            "CUDA architectures to build, a CMake list (default: see Supported platforms)"),
    Setting("JAX_EP_ENABLE_CUDA", "build", "AUTO", _text,
            "build the CUDA extension: ON, OFF or AUTO (when nvcc is found)"),
    Setting("JAX_EP_NVSHMEM_HOME", "build", None, _text,
            "NVSHMEM root with include/host/nvshmemx_api.h (default: the installed wheel)"),
    Setting("JAX_EP_PHASE_TIMELINE", "build", "OFF", _text,
            "ON: a diagnostic build whose low-latency kernels print when each block passes "
            "each phase (benchmarks/phase_timeline.py); slower kernels"),
    Setting("JAX_EP_COMMIT", "tooling", None, _text,
            "commit recorded in benchmark results (a copied tree may carry a stale .git; "
            "benchmarks/tree_state.py prints it)"),
    Setting("JAX_EP_DIFF_SHA256", "tooling", None, _text,
            "with JAX_EP_COMMIT: 'clean', or the SHA-256 of the tree's `git diff HEAD --binary`, "
            "recorded in benchmark results (benchmarks/tree_state.py prints it)"),
    Setting("JAX_EP_TRANSPORT_MUTANT", "tooling", "none", _text,
            "tests only: tests/multiprocess_digest.py makes the put-protocol kernels under its "
            "Buffers' ops break one rule of the protocol (no_fence, signal_before_data, "
            "reuse_before_quiet, unregistered_source, no_final_quiet; docs/transport.md) through "
            "the test module jax_ep._C_testing, so that a test shows the emulated transport "
            "catches it"),
    Setting("JAX_EP_TRANSPORT_SEEDS", "tooling", 3, _positive_int,
            "emulator seeds of tests/test_device_transport.py's fake-hosts digests"),
    Setting("JAX_EP_TEST_SEED", "tooling", None, _text,
            "pins the seed of the adversarial routing tests"),
)}


# Names no longer read, by the setting that replaced them: reading the new one while the old is
# set is an error naming both (a renamed setting must not be ignored without a word).
RENAMED = {
    "JAX_EP_TRANSPORT": ("JAX_EP_PEER_MAPPING", "how processes map peers' memory; "
                         "JAX_EP_DEVICE_TRANSPORT is how the ops send rows"),
}


def value(name: str, environ=None):
    """The parsed value of setting ``name`` (its default when unset or empty); ValueError naming
    the variable when the text does not parse, or when a name it replaced (RENAMED) is set."""
    setting = SETTINGS[name]
    environ = os.environ if environ is None else environ
    for old, (new, meaning) in RENAMED.items():
        if new == name and old in environ:
            raise ValueError(f"{old} was renamed {new} ({meaning}): set "
                             f"{new}={environ[old].strip() or '...'} instead, and unset {old}")
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        return setting.default
    return setting.parse(name, raw)
