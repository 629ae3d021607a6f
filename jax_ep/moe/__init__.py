"""`jax_ep.moe`: Mixture-of-Experts building blocks around `jax_ep.dispatch` / `jax_ep.combine`.

  - `layer`: `router`, `swiglu_experts` (`expert_matmul`: the matmul it runs), `moe_ffn`
    (re-exported here; the module docstring describes the layer and its sharding model);
  - `permute`: `permute` / `unpermute`, a rank's received rows grouped by local expert and back
    (what `layer` and `stages` both build on);
  - `tiled_matmul`: `grouped_matmul`, the portable tiled grouped matmul;
  - `grouped_gemm`: library grouped GEMMs on Hopper GPUs and the `matmul="auto"` choice;
  - `two_batch`: two micro-batches whose communication runs under each other's compute;
  - `stages`: the MoE layer's stages for it (normal and low-latency), and the decode layer
    `low_latency_moe_ffn`.

The MoE helpers sit on top of the public ops; nothing below them imports this package.
"""

from jax_ep.moe.layer import (
    DEFAULT_MATMUL,
    MATMULS,
    Routing,
    expert_matmul,
    grouped_matmul,
    moe_ffn,
    router,
    swiglu_experts,
)
from jax_ep.moe.permute import Permuted, PermuteState, permute, unpermute
from jax_ep.moe.stages import (
    combine_stage,
    dispatch_stage,
    expert_stage,
    low_latency_combine_stage,
    low_latency_dispatch_stage,
    low_latency_expert_stage,
    low_latency_moe_ffn,
)
from jax_ep.moe.two_batch import Comm, Compute, two_batch

__all__ = [
    "Comm",
    "Compute",
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
    "combine_stage",
    "dispatch_stage",
    "expert_stage",
    "low_latency_combine_stage",
    "low_latency_dispatch_stage",
    "low_latency_expert_stage",
    "low_latency_moe_ffn",
    "two_batch",
    "unpermute",
]
