"""`jax_ep.env`, the documented path of the environment report and the backend gate.

`python -m jax_ep.env [--json]` (or the `jax-ep-env` console script) prints what jax_ep will use
on this machine, and why. The code lives in its layers; this module only re-exports it:

  - `jax_ep.system.records`: the facts, as frozen dataclasses;
  - `jax_ep.system.probes`, `jax_ep.system.compat`: the probes and what code runs where;
  - `jax_ep.system.cluster`: the cross-host preflight (`--cluster`);
  - `jax_ep.backends.gate`: `auto_backend`, `check_cuda_backend`, `decide_backend`,
    `cross_host_problem`;
  - `jax_ep.tools.env_report`: `collect`, `format_report`, `report_to_dict`, `main` (its
    docstring holds the JSON schema of `--json`).
"""

import sys

from jax_ep.backends.gate import (
    MIN_COMPUTE_CAPABILITY,
    auto_backend,
    check_cuda_backend,
    cross_host_problem,
    decide_backend,
)
from jax_ep.system.compat import (
    arch_supports,
    code_for,
    describe_architectures,
    driver_problem,
    parse_architectures,
)
from jax_ep.system.probes import (
    DEFAULT_MEM_FRACTION,
    probe_extension,
    probe_nvshmem,
    xla_memory_settings,
)
from jax_ep.system.records import (
    BackendDecision,
    BufferSpec,
    BuiltCode,
    DeviceInfo,
    DriverInfo,
    EnvReport,
    ExtensionInfo,
    GpuInfo,
    JaxInfo,
    NvshmemInfo,
    PeerLink,
    PreflightCheck,
    Versions,
    WorkspaceEstimate,
    XlaMemorySettings,
)
from jax_ep.tools.env_report import (
    SCHEMA_VERSION,
    collect,
    format_report,
    main,
    report_to_dict,
    workspace_estimate,
)

__all__ = [
    "DEFAULT_MEM_FRACTION", "MIN_COMPUTE_CAPABILITY", "SCHEMA_VERSION",
    "BackendDecision", "BufferSpec", "BuiltCode", "DeviceInfo", "DriverInfo", "EnvReport",
    "ExtensionInfo", "GpuInfo", "JaxInfo", "NvshmemInfo", "PeerLink", "PreflightCheck", "Versions",
    "WorkspaceEstimate", "XlaMemorySettings",
    "arch_supports", "auto_backend", "check_cuda_backend",
    "code_for", "collect", "cross_host_problem", "decide_backend", "describe_architectures",
    "driver_problem", "format_report", "main", "parse_architectures", "probe_extension",
    "probe_nvshmem", "report_to_dict", "workspace_estimate", "xla_memory_settings",
]

if __name__ == "__main__":
    sys.exit(main())
