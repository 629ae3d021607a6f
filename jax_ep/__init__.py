"""jax_ep: expert-parallel MoE dispatch/combine for JAX on NVIDIA GPUs.

Our CUDA kernels, registered as XLA FFI custom calls, move tokens over NVLink; a pure-JAX
reference backend runs the same ops on any platform. See ``Buffer`` for the sharding model.
"""

from jax_ep import moe
from jax_ep._types import (
    Dispatched,
    DispatchHandle,
    Layout,
    LowLatencyDispatched,
    LowLatencyHandle,
    LowLatencyPendingCombine,
    LowLatencyPendingDispatch,
)
from jax_ep.aot import aot_compile, export_step
from jax_ep.backends.cuda import export_safety_checks
from jax_ep.buffer import Buffer
from jax_ep.fp8 import per_token_cast_from_fp8, per_token_cast_to_fp8
from jax_ep.ops import (
    combine,
    dispatch,
    get_dispatch_layout,
    low_latency_combine,
    low_latency_combine_recv,
    low_latency_combine_send,
    low_latency_dispatch,
    low_latency_dispatch_recv,
    low_latency_dispatch_send,
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
    "LowLatencyPendingCombine",
    "LowLatencyPendingDispatch",
    "combine",
    "dispatch",
    "export_safety_checks",
    "export_step",
    "get_dispatch_layout",
    "low_latency_combine",
    "low_latency_combine_recv",
    "low_latency_combine_send",
    "low_latency_dispatch",
    "low_latency_dispatch_recv",
    "low_latency_dispatch_send",
    "moe",
    "per_token_cast_from_fp8",
    "per_token_cast_to_fp8",
]
