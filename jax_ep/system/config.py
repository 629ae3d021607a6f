"""The rules of a Buffer configuration, checked in one place.

`jax_ep.Buffer` and `BufferSpec` (the configuration `jax-ep-env` sizes) both call
`check_config`; the limits are the kernels' (tests/test_facts.py checks them against
`jax_ep._C`). The kernels keep their own guard (csrc/runtime/validation.cc, run when a Buffer is
created on GPUs); Python never computes what they compute (the workspace size comes from
`jax_ep._C.workspace_bytes`).
"""

from __future__ import annotations

import numpy as np

from jax_ep.fp8 import CHANNELS_PER_SCALE

MAX_TOPK = 32  # static limit of the kernels (per-token id lists live in registers)
MAX_LOW_LATENCY_HIDDEN = 32768  # low-latency mode: the dispatch stages a token in shared memory
DTYPE_BYTES = {2: "bfloat16", 4: "float32"}  # the data dtypes, by size


def positive_int(name, value) -> int:
    """``value`` as an int; ValueError naming ``name`` unless it is a positive integer."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def check_config(*, num_ranks, num_experts, hidden, max_tokens_per_rank, num_topk,
                 capacity=None, low_latency=False, dtype_bytes=2) -> dict:
    """Raises ValueError naming the argument, what it got and what it needs, unless the
    configuration is one the kernels take; returns the values as ints (``capacity``: None for
    the default ``num_ranks * max_tokens_per_rank``)."""
    out = {name: positive_int(name, value) for name, value in (
        ("num_ranks", num_ranks), ("num_experts", num_experts), ("hidden", hidden),
        ("max_tokens_per_rank", max_tokens_per_rank), ("num_topk", num_topk))}
    ranks, experts = out["num_ranks"], out["num_experts"]
    if experts % ranks:
        raise ValueError(f"num_experts ({experts}) must be a multiple of the number of ranks "
                         f"({ranks}): choose num_experts = k * {ranks}")
    if out["hidden"] % CHANNELS_PER_SCALE:
        raise ValueError(f"hidden must be a multiple of {CHANNELS_PER_SCALE}, got {hidden}")
    if out["num_topk"] > min(MAX_TOPK, experts):
        raise ValueError(f"num_topk must be at most min({MAX_TOPK}, num_experts={experts}), "
                         f"got {num_topk}")
    if low_latency and out["hidden"] > MAX_LOW_LATENCY_HIDDEN:
        raise ValueError(f"hidden must be at most {MAX_LOW_LATENCY_HIDDEN} with "
                         f"low_latency=True, got {hidden}")
    max_capacity = ranks * out["max_tokens_per_rank"]
    if capacity is not None:
        capacity = positive_int("capacity", capacity)
        if capacity > max_capacity:
            raise ValueError(f"capacity must be at most num_ranks * max_tokens_per_rank = "
                             f"{max_capacity}, got {capacity}")
    if dtype_bytes not in DTYPE_BYTES:
        raise ValueError(f"dtype_bytes must be 2 (bfloat16) or 4 (float32), got {dtype_bytes!r}")
    return dict(out, capacity=capacity)
