"""`jax_ep.moe`: Mixture-of-Experts building blocks around `jax_ep.dispatch` / `jax_ep.combine`.

  - `layer`: `router`, `permute` / `unpermute`, `swiglu_experts` (`expert_matmul`: the matmul
    it runs), `moe_ffn` (re-exported here; the module docstring describes the layer and its
    sharding model);
  - `tiled_matmul`: `grouped_matmul`, the portable tiled grouped matmul;
  - `grouped_gemm`: library grouped GEMMs on Hopper GPUs and the `matmul="auto"` choice.

The MoE helpers sit on top of the public ops; nothing below them imports this package.
"""

from jax_ep.moe.layer import (
    DEFAULT_MATMUL,
    MATMULS,
    Permuted,
    PermuteState,
    Routing,
    expert_matmul,
    grouped_matmul,
    moe_ffn,
    permute,
    router,
    swiglu_experts,
    unpermute,
)

__all__ = [
    "DEFAULT_MATMUL",
    "MATMULS",
    "PermuteState",
    "Permuted",
    "Routing",
    "expert_matmul",
    "grouped_matmul",
    "moe_ffn",
    "permute",
    "router",
    "swiglu_experts",
    "unpermute",
]
