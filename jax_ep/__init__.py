"""jax_ep: expert-parallel MoE dispatch/combine for JAX on NVIDIA GPUs.

Our CUDA kernels, registered as XLA FFI custom calls, move tokens over NVLink; a pure-JAX
reference backend runs the same ops on any platform. See ``Buffer`` for the sharding model.
"""

from jax_ep import moe
from jax_ep._cuda import export_safety_checks
from jax_ep._types import (
    Dispatched,
    DispatchHandle,
    Layout,
    LowLatencyDispatched,
    LowLatencyHandle,
)
from jax_ep.aot import aot_compile
from jax_ep.buffer import Buffer
from jax_ep.fp8 import per_token_cast_from_fp8, per_token_cast_to_fp8
from jax_ep.ops import (
    combine,
    dispatch,
    get_dispatch_layout,
    low_latency_combine,
    low_latency_dispatch,
)

__version__ = "0.1.0"

__all__ = [
    "Buffer",
    "aot_compile",
    "Dispatched",
    "DispatchHandle",
    "Layout",
    "LowLatencyDispatched",
    "LowLatencyHandle",
    "combine",
    "dispatch",
    "export_safety_checks",
    "get_dispatch_layout",
    "low_latency_combine",
    "low_latency_dispatch",
    "moe",
    "per_token_cast_from_fp8",
    "per_token_cast_to_fp8",
]
