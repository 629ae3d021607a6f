"""The GPU timeline of a program from a profiler trace: kernels per stream, and overlap.

    events = timeline.kernels(fn, *args, calls=5)       # [Kernel(name, stream, start, end)]
    timeline.hidden_fraction(events, selected)         # share of their time under other kernels

A trace through ``jax.profiler`` (CUPTI) records every kernel the GPU ran with its stream (the
device plane's "Stream #N" lines). The hidden fraction of a set of kernels ("ours") is the part
of their summed duration during which some other kernel ran on another stream: the time the
step did not pay for them. Sharding model: one process; each device plane is one GPU.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import tempfile
from collections.abc import Callable, Iterable

import jax


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One kernel on the GPU timeline: ``start``/``end`` in ns of the trace's clock."""

    name: str
    device: str
    stream: str
    start: int
    end: int

    @property
    def duration_ns(self) -> int:
        return self.end - self.start


def read_trace(trace_dir: str) -> list[Kernel]:
    """Every kernel (and memset / memcpy) of the GPU planes of the trace in ``trace_dir``."""
    from jax.profiler import ProfileData  # noqa: PLC0415

    paths = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    if not paths:
        raise RuntimeError(f"no profiler trace under {trace_dir}")
    events = []
    for plane in ProfileData.from_file(max(paths, key=os.path.getmtime)).planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if "stream" not in line.name.lower():
                continue
            events += [Kernel(e.name, plane.name, line.name, int(e.start_ns),
                              int(e.start_ns + e.duration_ns)) for e in line.events]
    return sorted(events, key=lambda k: k.start)


def kernels(fn: Callable, *args, calls: int = 5) -> list[Kernel]:
    """The kernels of ``calls`` calls of ``fn(*args)`` (already compiled and warm), traced."""
    with tempfile.TemporaryDirectory() as trace_dir:
        jax.block_until_ready(fn(*args))
        with jax.profiler.trace(trace_dir):
            for _ in range(calls):
                out = fn(*args)
            jax.block_until_ready(out)
        return read_trace(trace_dir)


def _merged(intervals: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _covered_ns(start: int, end: int, merged: list[tuple[int, int]]) -> int:
    return sum(max(0, min(end, e) - max(start, s)) for s, e in merged)


def hidden_fraction(events: list[Kernel], selected: Callable[[str], bool]) -> dict:
    """How much of the kernels ``selected`` picks (by name) ran while another kernel ran on
    another stream of the same device.

    Returns ``{"kernels_us", "hidden_us", "hidden_fraction", "streams"}``: summed durations of
    the selected kernels and of the parts of them covered by other kernels, their ratio (None
    without selected kernels), and the streams the selected kernels ran on.
    """
    picked = [k for k in events if selected(k.name)]
    total = hidden = 0
    for kernel in picked:
        others = _merged((k.start, k.end) for k in events if not selected(k.name)
                         and k.device == kernel.device and k.stream != kernel.stream)
        total += kernel.duration_ns
        hidden += _covered_ns(kernel.start, kernel.end, others)
    return {"kernels_us": total / 1e3, "hidden_us": hidden / 1e3,
            "hidden_fraction": hidden / total if total else None,
            "streams": sorted({k.stream for k in picked})}


def largest_us(events: list[Kernel], top: int = 8) -> dict[str, float]:
    """The ``top`` kernel names by summed duration, in us, largest first (where time went)."""
    totals: dict[str, int] = {}
    for k in events:
        totals[k.name] = totals.get(k.name, 0) + k.duration_ns
    return {name: ns / 1e3 for name, ns in sorted(totals.items(), key=lambda kv: -kv[1])[:top]}


def busy_us(events: list[Kernel]) -> float:
    """Time during which some kernel ran (any stream), in us: the device span minus its idle."""
    return sum(e - s for s, e in _merged((k.start, k.end) for k in events)) / 1e3


def span_us(events: list[Kernel]) -> float:
    """First kernel start to last kernel end, in us."""
    return (max(k.end for k in events) - min(k.start for k in events)) / 1e3 if events else 0.0
