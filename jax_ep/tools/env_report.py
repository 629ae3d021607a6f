"""What jax_ep will use on this machine, and why: `python -m jax_ep.env [--json]`.

The report lists the versions (jax_ep, jax, jaxlib, CUDA driver and runtime), every local GPU
(name, compute capability, total and free memory), the peer access between local GPUs and whether
it goes over NVLink, whether the CUDA extension `jax_ep._C` imports, the CUDA version and the
architectures it was built for (SASS and PTX), whether the driver runs that CUDA version and the
code each GPU would run, NVSHMEM, XLA's memory settings, the device memory one Buffer of a given
configuration needs, and the backend `Buffer(backend="auto")` would pick, with the reason and the
fix for every "no".

Library use: `collect(spec)` -> `EnvReport` (a tree of frozen dataclasses,
`jax_ep.system.records`), `format_report(report)` -> text. The backend choice itself is
`jax_ep.backends.gate` (`auto_backend`, `check_cuda_backend`), which the runtime uses; this report
is a tool on top of it that the runtime never imports. `jax_ep.env` re-exports both.

Sharding model: a Buffer's mesh is cut into EP groups (the slices along the EP axis); the cuda
backend needs peer access between every two GPUs of one group (they write into each other's
memory), not across groups. GPUs of other processes (one process per GPU) are reached through
CUDA IPC; the Buffer checks that they share this host when it exchanges its workspaces.

None of this initialises JAX's GPU backend except where the backend choice needs `jax.devices()`
(`collect`, and `auto_backend` without an explicit `default_backend`). Free device memory is
measured after that, so it is what a Buffer can still allocate beside XLA's preallocated pool.

JSON schema (`--json`; `schema_version` 2; keys are stable, `null` where unknown):

  {
    "schema_version": 2,
    "versions": {"jax_ep": str|null, "jax": str, "jaxlib": str|null, "python": str,
                 "cuda_driver": str|null (e.g. "12.8"), "cuda_runtime": str ("unknown" if so),
                 "cuda_runtime_source": str|null, "jax_cuda_plugin": str|null},
    "driver": {"available": bool, "reason": str|null, "device_count": int,
               "nvml": bool, "nvml_reason": str|null},
    "jax": {"default_backend": str|null, "process_index": int, "process_count": int,
            "device_count": int, "error": str|null,
            "local_devices": [{"id": int, "platform": str, "kind": str, "process_index": int,
                               "addressable": bool, "local_ordinal": int|null,
                               "compute_capability": str|null, "is_cuda": bool}]},
    "gpus": [{"ordinal": int, "name": str, "compute_capability": str (e.g. "9.0"),
              "total_memory_bytes": int|null, "free_memory_bytes": int|null,
              "pci_bus_id": str|null, "nvlinks_active": int|null,
              "cooperative_launch": bool|null}],
    "peers": [{"src": int, "dst": int, "access": bool|null, "native_atomics": bool|null,
               "performance_rank": int|null, "link": "nvlink"|"pcie"|"none"|"unknown",
               "link_source": "nvml"|"cuda"|null}],
    "extension": {"importable": bool,
                  "cuda_architectures": str|null (e.g. "sm_80 sm_90 compute_90"),
                  "path": str|null, "error": str|null, "nvshmem_built": bool|null,
                  "cuda_runtime_version": int|null (CUDART_VERSION of the build, e.g. 13000),
                  "max_ranks": int|null (most ranks in one EP group, _C.max_ranks()),
                  "source_tree": str|null (not importable because jax_ep came from this
                                 source checkout, which has no build),
                  "shadowed_build": str|null (then: an installed build the checkout hides)},
    "nvshmem": {"package": str|null, "version": str|null, "host_library": str|null,
                "reason": str|null},
    "xla_memory": {"preallocate": bool, "mem_fraction": float, "allocator": str,
                   "preallocate_env": str|null, "mem_fraction_env": str|null,
                   "allocator_env": str|null, "notes": [str]},
    "workspace": {"spec": {"num_ranks": int, "num_experts": int, "hidden": int,
                           "max_tokens_per_rank": int, "num_topk": int, "capacity": int,
                           "dtype_bytes": int, "low_latency": bool},
                  "bytes": int|null (null without jax_ep._C), "source": str},
    "backend": {"backend": "cuda"|"reference", "reasons": [str]},
    "cluster": null (without --cluster) | [{"name": str, "status": "ok"|"warn"|"fail",
                                           "found": str, "fix": str, "details": [str]}]
  }

`--cluster` adds the cross-host preflight (`jax_ep.system.cluster`): whether this host has what
an EP group across hosts needs (NVSHMEM and its network plugins, RDMA devices and their ports,
GPUDirect RDMA, IBGDA, the NIC of each GPU, NVSHMEM's environment), each with the fix; the
command then exits 1 when a check fails.

`peers` has one entry per ordered pair of distinct local GPUs; `link` is "nvlink" when NVML says
so (`link_source` "nvml") or, without NVML, when the pair supports native peer atomics, which
PCIe peer links do not (`link_source` "cuda"); "pcie" for other peer access, "none" without.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import math
import platform
import re
import sys
import textwrap
from collections.abc import Sequence
from typing import Any

import jax

from jax_ep import settings
from jax_ep.backends import cuda
from jax_ep.backends.gate import ACROSS_HOSTS_SETTINGS, decide_backend
from jax_ep.system import cluster as cluster_checks
from jax_ep.system import config
from jax_ep.system.compat import (
    code_for,
    cuda_version_text,
    describe_architectures,
    driver_problem,
    parse_cc,
)
from jax_ep.system.probes import (
    cuda_runtime_version,
    describe_device,
    driver_cuda_version,
    driver_version_text,
    jax_ep_version,
    jaxlib_version,
    probe_driver,
    probe_extension,
    probe_gpus,
    probe_jax,
    probe_nvshmem,
    probe_peers,
    xla_memory_settings,
)
from jax_ep.system.records import (
    BackendDecision,
    BufferSpec,
    EnvReport,
    ExtensionInfo,
    GpuInfo,
    PeerLink,
    PreflightCheck,
    Versions,
    WorkspaceEstimate,
)

SCHEMA_VERSION = 2

_GIB = 1 << 30
_MIB = 1 << 20
_DTYPE_BYTES = {name: size for size, name in config.DTYPE_BYTES.items()}  # the Buffer's dtypes

def workspace_estimate(
    spec: BufferSpec, extension: ExtensionInfo | None = None
) -> WorkspaceEstimate:
    """Per-device workspace of `spec`: the kernels' own size, `jax_ep._C.workspace_bytes`.

    Without jax_ep._C the size is unknown (None, and `source` says why): Python does not copy
    the kernels' formula, and without the extension there is no CUDA backend here to allocate
    it. docs/scaling.md tabulates sizes for larger configurations.
    """
    extension = probe_extension() if extension is None else extension
    if not extension.importable:
        return WorkspaceEstimate(spec, None, "unknown: jax_ep._C is not built here (the size is "
                                             "the kernels' own, jax_ep._C.workspace_bytes)")
    try:
        module = importlib.import_module("jax_ep._C")
        capacity = spec.capacity or spec.num_ranks * spec.max_tokens_per_rank
        size = module.workspace_bytes(cuda.buffer_config(
            module, num_ranks=spec.num_ranks, num_experts=spec.num_experts,
            hidden=spec.hidden, max_tokens_per_rank=spec.max_tokens_per_rank,
            num_topk=spec.num_topk, capacity=capacity, dtype_bytes=spec.dtype_bytes,
            low_latency=spec.low_latency,
            normal_window_rows=settings.value("JAX_EP_NORMAL_WINDOW_ROWS") or 0))
    except Exception as e:  # noqa: BLE001 - a build whose config the spec does not fit
        return WorkspaceEstimate(spec, None, f"unknown: jax_ep._C.workspace_bytes failed: {e}")
    return WorkspaceEstimate(spec, int(size), "jax_ep._C.workspace_bytes")


# --------------------------------------------------------------------------------------------
# The backend decision.


# --------------------------------------------------------------------------------------------
# The report.


def _default_spec(num_devices: int) -> BufferSpec:
    """DeepEP's normal test shape on all devices (experts rounded up to a multiple of R)."""
    ranks = max(1, num_devices)
    return BufferSpec(num_ranks=ranks, num_experts=math.ceil(256 / ranks) * ranks)


def collect(spec: BufferSpec | None = None, *, free_memory: bool = True,
            cluster: bool = False) -> EnvReport:
    """Gathers the report (calls jax.devices(), which starts jax's default backend).

    Args:
      spec: the Buffer configuration to size and to check memory for; default DeepEP's normal
        shape (E=256, H=7168, T_max=4096, K=8, bfloat16) with R = every jax device.
      free_memory: measure free memory per GPU (retains each GPU's primary context for the query).
      cluster: also run the cross-host preflight (`jax_ep.system.cluster.preflight`).

    Returns:
      The EnvReport. Never raises for a missing GPU, driver, extension or package.
    """
    jax_info, devices = probe_jax()
    driver = probe_driver()
    gpus = probe_gpus(free_memory=free_memory)
    peers = probe_peers([g.ordinal for g in gpus], {g.ordinal: g.pci_bus_id for g in gpus})
    extension = probe_extension()
    runtime, runtime_source, plugin = cuda_runtime_version(devices)
    versions = Versions(
        jax_ep=jax_ep_version(), jax=jax.__version__, jaxlib=jaxlib_version(),
        python=platform.python_version(), cuda_driver=driver_version_text(), cuda_runtime=runtime,
        cuda_runtime_source=runtime_source, jax_cuda_plugin=plugin,
    )
    if spec is None:
        spec = _default_spec(len(devices))
    workspace = workspace_estimate(spec, extension)
    xla_memory = xla_memory_settings()
    infos = [describe_device(d) for d in devices]
    if jax_info.error is not None:
        backend = BackendDecision("reference", (f"jax failed to start: {jax_info.error}",))
    else:
        group = infos[: spec.num_ranks]
        backend = decide_backend(
            infos, default_backend=jax_info.default_backend, extension=extension, gpus=gpus,
            peers=peers, ep_groups=[group], workspace_bytes_needed=workspace.bytes,
            xla_memory=xla_memory, driver_gpu_count=driver.device_count,
            driver_cuda_version=driver_cuda_version(),
        )
        if spec.num_ranks > len(infos):
            backend = BackendDecision("reference", backend.reasons + (
                f"an EP group of {spec.num_ranks} ranks needs {spec.num_ranks} devices, jax has "
                f"{len(infos)}: lower --num-ranks (the workspace above is sized for "
                f"{spec.num_ranks})",
            ))
    checks = cluster_checks.preflight(gpus=gpus) if cluster else None
    return EnvReport(versions, driver, jax_info, gpus, peers, extension, probe_nvshmem(),
                     xla_memory, workspace, backend, checks)


def report_to_dict(report: EnvReport) -> dict[str, Any]:
    """The JSON-ready form of the report (schema in the module docstring)."""
    return {"schema_version": SCHEMA_VERSION, **dataclasses.asdict(report)}


def _bytes_text(n: int | None) -> str:
    if n is None:
        return "unknown"
    return f"{n / _GIB:.1f} GiB" if n >= _GIB else f"{n / _MIB:.1f} MiB"


_LINK_CELLS = {"nvlink": "NV", "pcie": "PCIe", "none": "--", "unknown": "?"}


def _peer_matrix(gpus: Sequence[GpuInfo], peers: Sequence[PeerLink]) -> list[str]:
    ordinals = [g.ordinal for g in gpus]
    links = {(p.src, p.dst): p for p in peers}
    width = max(6, *(len(f"GPU{o}") + 2 for o in ordinals))
    lines = [" " * 8 + "".join(f"GPU{o}".rjust(width) for o in ordinals)]
    for src in ordinals:
        cells = []
        for dst in ordinals:
            link = links.get((src, dst))
            if src == dst:
                cell = "X"
            elif link is None:
                cell = "?"
            else:
                cell = _LINK_CELLS.get(link.link, link.link)
                if link.link == "nvlink" and link.link_source == "cuda":
                    cell += "*"
            cells.append(cell.rjust(width))
        lines.append(f"  {'GPU' + str(src):<6}" + "".join(cells))
    legend = "  NV = NVLink, PCIe = peer access over PCIe, -- = no peer access, X = self"
    if any(p.link == "nvlink" and p.link_source == "cuda" for p in peers):
        legend += ", * = inferred from native peer atomics (NVML unavailable)"
    lines.append(legend)
    return lines


def _parse_cuda_version(text: str | None) -> int | None:
    """ "12.8" -> 12080."""
    match = re.fullmatch(r"(\d+)\.(\d+)", text or "")
    return int(match.group(1)) * 1000 + int(match.group(2)) * 10 if match else None


def _driver_and_code_lines(report: EnvReport) -> list[str]:
    """The driver against the extension's CUDA runtime, and the code each GPU would run."""
    ext = report.extension
    driver = _parse_cuda_version(report.versions.cuda_driver)
    lines = []
    if driver is not None and ext.cuda_runtime_version is not None:
        problem = driver_problem(driver, ext.cuda_runtime_version)
        lines.append(f"driver check: {problem}" if problem else (
            f"driver check: the driver (CUDA {cuda_version_text(driver)}) runs a CUDA "
            f"{cuda_version_text(ext.cuda_runtime_version)} build"))
    if not ext.cuda_architectures:
        return lines
    for g in report.gpus:
        cc = parse_cc(g.compute_capability)
        if cc is None:
            continue
        code = code_for(ext.cuda_architectures, cc)
        if code is None:
            runs = "no code for it"
        elif code.startswith("sm_"):
            runs = f"runs SASS {code}"
        else:
            runs = (f"runs PTX {code}, JIT-compiled by the driver at first use (a build with "
                    f"JAX_EP_CUDA_ARCHS=\"{cc[0]}{cc[1]}-real\" carries its own code)")
        lines.append(f"[{g.ordinal}] {g.name} (compute capability {g.compute_capability}): "
                     f"{runs}")
    return lines


_STATUS_CELLS = {"ok": "ok", "warn": "WARN", "fail": "FAIL"}
_WIDTH = 100  # columns the fixes wrap at


def format_cluster(checks: Sequence[PreflightCheck]) -> list[str]:
    """The cross-host preflight as a table: status, check, what was found; the fix below each
    check that is not ok, then the detail lines."""
    counts = {s: sum(c.status == s for c in checks) for s in ("ok", "warn", "fail")}
    out = [f"Cross-host preflight ({counts['ok']} ok, {counts['warn']} warn, {counts['fail']} "
           f"fail)",
           f"  An EP group across hosts runs the CUDA kernels over NVSHMEM's device API with "
           f"{ACROSS_HOSTS_SETTINGS} (else the reference backend); these are what that path "
           f"(NVSHMEM over RDMA) needs."]
    width = max((len(c.name) for c in checks), default=0)
    indent = " " * (width + 8)
    for c in checks:
        out.append(f"  {_STATUS_CELLS.get(c.status, c.status):<4}  {c.name:<{width}}  {c.found}")
        if c.fix:
            out.extend(textwrap.wrap(f"fix: {c.fix}", _WIDTH, initial_indent=indent,
                                     subsequent_indent=indent + "     ",
                                     break_on_hyphens=False))
        out.extend(f"{indent}  {d}" for d in c.details)
    return out


def format_report(report: EnvReport) -> str:
    """Human-readable text of the report (what `python -m jax_ep.env` prints)."""
    v, drv, jx = report.versions, report.driver, report.jax
    out = ["jax_ep environment", ""]

    out.append("Versions")
    out.append(f"  jax_ep          {v.jax_ep or 'not installed (source tree)'}")
    out.append(f"  jax / jaxlib    {v.jax} / {v.jaxlib or 'unknown'}")
    out.append(f"  python          {v.python}")
    out.append(f"  jax CUDA plugin {v.jax_cuda_plugin or 'none'}")
    out.append(f"  CUDA driver     {v.cuda_driver or 'none'}"
               + (f" ({drv.reason})" if drv.reason else ""))
    runtime = v.cuda_runtime + (f" ({v.cuda_runtime_source})" if v.cuda_runtime_source else "")
    out.append(f"  CUDA runtime    {runtime}")
    out.append("")

    out.append("JAX")
    if jx.error:
        out.append(f"  error: {jx.error}")
    else:
        kinds = sorted({d.kind for d in jx.local_devices})
        out.append(f"  default backend {jx.default_backend}")
        out.append(f"  devices         {len(jx.local_devices)} local ({', '.join(kinds)}), "
                   f"{jx.device_count} in all; process {jx.process_index} of {jx.process_count}")
    out.append("")

    out.append(f"GPUs (CUDA driver: {drv.device_count} visible)")
    if not report.gpus:
        out.append(f"  none: {drv.reason or 'the driver sees no GPU'}")
    for g in report.gpus:
        nvlinks = "" if g.nvlinks_active is None else f", {g.nvlinks_active} NVLinks up"
        out.append(
            f"  [{g.ordinal}] {g.name}  compute capability {g.compute_capability}  memory "
            f"{_bytes_text(g.total_memory_bytes)} total, {_bytes_text(g.free_memory_bytes)} free"
            f"{nvlinks}"
        )
    if len(report.gpus) > 1:
        out.append("")
        out.append("Peer access (row GPU reads/writes column GPU's memory)")
        out.extend(_peer_matrix(report.gpus, report.peers))
        if not drv.nvml:
            out.append(f"  NVML: {drv.nvml_reason}")
    out.append("")

    ext = report.extension
    out.append("CUDA extension jax_ep._C")
    if ext.importable:
        archs = (describe_architectures(ext.cuda_architectures) if ext.cuda_architectures
                 else "unknown architectures")
        cuda = (f"CUDA {cuda_version_text(ext.cuda_runtime_version)}"
                if ext.cuda_runtime_version else "an unknown CUDA")
        out.append(f"  imports ({ext.path})")
        out.append(f"  built with {cuda} for {archs}")
        out.extend(f"  {line}" for line in _driver_and_code_lines(report))
    else:
        out.append(f"  does not import: {ext.error}")
        if ext.shadowed_build:
            out.append(f"  jax_ep was imported from the source tree {ext.source_tree}, which has "
                       f"no build; it hides the installed build {ext.shadowed_build}: run from "
                       f"another directory, or use the jax-ep-env console script")
        elif ext.source_tree:
            out.append(f"  jax_ep was imported from the source tree {ext.source_tree}, which has "
                       f"no build, and no installed jax_ep has one")
    out.append("")

    nv = report.nvshmem
    out.append("NVSHMEM")
    if nv.package:
        library = nv.host_library or "not found"
        out.append(f"  {nv.package} {nv.version}; libnvshmem_host: {library}")
    if nv.reason:
        out.append(f"  {nv.reason}")
    if ext.nvshmem_built is not None:
        built = "yes" if ext.nvshmem_built else "no"
        out.append(f"  jax_ep._C built with NVSHMEM's headers: {built}")
    out.append("")

    mem = report.xla_memory
    out.append("XLA memory (decides what is left for a Buffer)")
    out.append(f"  XLA_PYTHON_CLIENT_PREALLOCATE  {mem.preallocate_env or 'unset'} -> "
               f"{'preallocate' if mem.preallocate else 'no preallocation'}")
    out.append(f"  XLA_PYTHON_CLIENT_MEM_FRACTION {mem.mem_fraction_env or 'unset'} -> "
               f"{mem.mem_fraction:g}")
    out.append(f"  XLA_PYTHON_CLIENT_ALLOCATOR    {mem.allocator_env or 'unset'} -> "
               f"{mem.allocator}")
    out.extend(f"  note: {n}" for n in mem.notes)
    out.append("")

    ws = report.workspace
    s = ws.spec
    capacity = s.capacity or s.num_ranks * s.max_tokens_per_rank
    out.append("Buffer workspace per device")
    out.append(
        f"  R={s.num_ranks} E={s.num_experts} H={s.hidden} T_max={s.max_tokens_per_rank} "
        f"K={s.num_topk} C={capacity} dtype_bytes={s.dtype_bytes} "
        f"{'normal+low_latency' if s.low_latency else 'normal'}: "
        + (f"{_bytes_text(ws.bytes)} ({ws.bytes} bytes, {ws.source})" if ws.bytes is not None
           else ws.source)
    )
    out.append("")

    out.append(f"Buffer(backend=\"auto\") -> {report.backend.backend}")
    out.extend(f"  - {r}" for r in report.backend.reasons)
    from jax_ep.moe import grouped_gemm  # the MoE layer's expert matmul choice (jax_ep.moe)

    out.append(f"MoE expert matmul (matmul=\"auto\") -> {grouped_gemm.selection_report()}")
    if report.cluster is not None:
        out.append("")
        out.extend(format_cluster(report.cluster))
    return "\n".join(out) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m jax_ep.env [--json] [--cluster] [Buffer flags]`: prints the report; returns
    0 (with --cluster: 1 when a preflight check fails)."""
    parser = argparse.ArgumentParser(
        prog="python -m jax_ep.env",
        description="What jax_ep will use on this machine, and why.",
    )
    parser.add_argument("--json", action="store_true", help="print JSON (schema: module docstring)")
    parser.add_argument("--cluster", action="store_true",
                        help="add the cross-host preflight: NVSHMEM, RDMA devices, GPUDirect "
                             "RDMA, IBGDA, the NIC of each GPU (exit 1 when a check fails)")
    parser.add_argument("--num-experts", type=int, default=None,
                        help="global experts (default 256, rounded up to a multiple of R)")
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--max-tokens-per-rank", type=int, default=4096)
    parser.add_argument("--num-topk", type=int, default=8)
    parser.add_argument("--num-ranks", type=int, default=None,
                        help="ranks per EP group (default: every jax device)")
    parser.add_argument("--capacity", type=int, default=0,
                        help="normal-mode receive rows (default num_ranks * max_tokens_per_rank)")
    parser.add_argument("--dtype", choices=sorted(_DTYPE_BYTES), default="bfloat16")
    parser.add_argument("--low-latency", action="store_true",
                        help="size the low-latency regions too")
    parser.add_argument("--no-free-memory", action="store_true",
                        help="do not create CUDA contexts to measure free memory")
    args = parser.parse_args(argv)

    num_ranks = args.num_ranks
    if num_ranks is None:
        try:
            num_ranks = len(jax.devices())
        except Exception:  # collect() reports the failure
            num_ranks = 1
    num_experts = args.num_experts
    if num_experts is None:
        num_experts = _default_spec(num_ranks).num_experts
    try:
        spec = BufferSpec(
            num_ranks=num_ranks, num_experts=num_experts, hidden=args.hidden,
            max_tokens_per_rank=args.max_tokens_per_rank, num_topk=args.num_topk,
            capacity=args.capacity, dtype_bytes=_DTYPE_BYTES[args.dtype],
            low_latency=args.low_latency,
        )
    except ValueError as e:
        parser.error(f"{e} (flags use dashes: --num-experts, --num-ranks, ...)")
    report = collect(spec, free_memory=not args.no_free_memory, cluster=args.cluster)
    if args.json:
        print(json.dumps(report_to_dict(report), indent=2))
    else:
        print(format_report(report), end="")
    return int(any(c.status == "fail" for c in report.cluster or ()))


if __name__ == "__main__":
    sys.exit(main())
