"""`jax_ep.grouped_gemm`, the documented path of `jax_ep.moe.grouped_gemm` (its public names and
the kernel configurations in use)."""

from jax_ep.moe.grouped_gemm import *  # noqa: F403
from jax_ep.moe.grouped_gemm import MOSAIC_CONFIGS, TOKAMAX_CONFIGS  # noqa: F401
