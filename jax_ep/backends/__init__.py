"""The backends of a Buffer: what `jax_ep.ops` calls, per rank, inside `jax.shard_map`.

  - `reference.ReferenceBackend` (`backend="reference"`): plain `jax.lax`, any platform;
  - `cuda.CudaBackend` (`backend="cuda"`): FFI calls of our kernels in `jax_ep._C`;
  - `gate`: whether the cuda backend runs on a Buffer's devices (what `backend="auto"` picks).

Both implement `Backend`; `create(name, buf)` makes the one a Buffer resolved to. The ops
validate their arguments, add gradients and wrap results; a backend only moves rows.
"""

from __future__ import annotations

from typing import Any, Protocol

import jax

from jax_ep._types import DispatchHandle, Layout

Array = jax.Array


class Backend(Protocol):
    """The per-rank calls of one Buffer's configuration (shapes in docs/api.md, "per rank").

    `T` tokens, `H` channels, `K` experts per token, `C` receive rows (`buf.capacity_for(T)`),
    `E_loc` local experts, `T_max` = `buf.max_tokens_per_rank`. Scales are per 128 channels
    (`[.., H/128]` float32; an empty `[T, 0]` for unscaled data). Tickets (`after`, `ticket`)
    order a split send before its receive (`jax_ep/_ordering.py`).
    """

    name: str  # "reference" or "cuda", Buffer.backend

    def layout(self, topk_idx: Array) -> Layout:
        """`get_dispatch_layout` of `topk_idx [T, K]`."""

    def dispatch(self, x: Array, x_scales: Array, topk_idx: Array,
                 topk_weights: Array) -> dict[str, Any]:
        """Normal dispatch: the fields of `Dispatched` (`recv_x [C, H]`, `recv_scales`,
        `recv_topk_idx`, `recv_topk_weights`, `num_recv_tokens`, `num_recv_tokens_per_expert`,
        `handle: DispatchHandle`)."""

    def cached_dispatch(self, x: Array, x_scales: Array, w: Array,
                        handle: DispatchHandle) -> tuple[Array, Array, Array]:
        """Dispatch along an earlier handle: `(recv_x, recv_scales, recv_w)`."""

    def combine(self, y: Array, y_w: Array, handle: DispatchHandle) -> tuple[Array, Array]:
        """Normal combine of `y [C, H]` (and per-row values `y_w`) back to `[T, ...]`."""

    def low_latency_dispatch(self, x: Array, topk_idx: Array, use_fp8: bool,
                             round_scale: bool) -> dict[str, Any]:
        """`recv_x [E_loc, R*T_max, H]`, `recv_scales`, `recv_count [E_loc]`, `recv_src`,
        `recv_k` (the raw fields `jax_ep.ops` turns into `LowLatencyDispatched`)."""

    def low_latency_combine(self, y: Array, topk_idx: Array, topk_weights: Array,
                            handle: Any) -> Array:
        """`[T, H]` bfloat16: the weighted sum of each token's experts' rows of `y`."""

    def low_latency_dispatch_send(self, x: Array, topk_idx: Array, after: Array | None,
                                  use_fp8: bool, round_scale: bool) -> Array:
        """The send half of `low_latency_dispatch`; returns its ticket."""

    def low_latency_dispatch_recv(self, x: Array, topk_idx: Array, ticket: Array,
                                  use_fp8: bool, round_scale: bool) -> dict[str, Any]:
        """The receive half: what `low_latency_dispatch` returns."""

    def low_latency_combine_send(self, y: Array, topk_idx: Array, topk_weights: Array,
                                 handle: Any, after: Array | None) -> Array:
        """The send half of `low_latency_combine`; returns its ticket."""

    def low_latency_combine_recv(self, y: Array, topk_idx: Array, topk_weights: Array,
                                 handle: Any, ticket: Array) -> Array:
        """The receive half: what `low_latency_combine` returns."""


def create(name: str, buf) -> Backend:
    """The backend `name` ("reference" or "cuda") of `buf`."""
    from jax_ep.backends import cuda, reference  # noqa: PLC0415 - gate users need neither

    implementations = {"reference": reference.ReferenceBackend, "cuda": cuda.CudaBackend}
    if name not in implementations:
        raise ValueError(f"unknown backend {name!r}; one of {sorted(implementations)}")
    return implementations[name](buf)
