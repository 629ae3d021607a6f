"""``Buffer.warmup()``: run every op once so the first real step pays no one-time cost.

One-time costs and where they go: kernel loading -> preloaded at Buffer creation (C++);
first touch of the communication memory, peer mappings and the ranks' first rendezvous -> the
calls below; compilation of the user's step -> ``jax.jit(step).lower(...).compile()`` ahead of
time (the warm-up cannot compile the user's program for them).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_ep import ops


def _spec(buf):
    """Shard the leading axis over every mesh axis (EP axis last, so ranks are contiguous)."""
    others = tuple(a for a in buf.mesh.axis_names if a != buf.axis_name)
    return P((*others, buf.axis_name))


def run(buf) -> None:
    fn, args = program(buf)
    for _ in range(2):  # the second run sees every region already touched once
        jax.block_until_ready(fn(*args))


def program(buf):
    """``(fn, args)``: the jitted warm-up program of ``buf`` (every op of its mode at
    ``max_tokens_per_rank`` tokens per rank) and its inputs."""
    mesh, T, K, H = buf.mesh, buf.max_tokens_per_rank, buf.num_topk, buf.hidden
    num_shards = mesh.devices.size
    spec = _spec(buf)
    rng = np.random.default_rng(0)
    scores = rng.random((num_shards * T, buf.num_experts))
    topk_idx = np.argsort(-scores, axis=1)[:, :K].astype(np.int32)
    topk_weights = rng.random((num_shards * T, K)).astype(np.float32)
    x = rng.standard_normal((num_shards * T, H)).astype(np.float32)

    def step(x, topk_idx, topk_weights):
        # Every call's result leaves the program: jit drops a call whose results are unused.
        layout = ops.get_dispatch_layout(buf, topk_idx)
        d = ops.dispatch(buf, x.astype(buf.dtype), topk_idx, topk_weights)
        y, _ = ops.combine(buf, d.recv_x, d.handle)
        results = [y, layout.num_tokens_per_rank]
        if buf.low_latency:
            xb = x.astype(jnp.bfloat16)
            for use_fp8 in (True, False):
                ll = ops.low_latency_dispatch(buf, xb, topk_idx, use_fp8=use_fp8)
                results.append(ll.recv_count)
            y_ll = jnp.zeros((buf.num_local_experts, buf.num_ranks * T, H), jnp.bfloat16)
            results.append(ops.low_latency_combine(buf, y_ll, topk_idx, topk_weights, ll.handle))
        return results

    sharding = NamedSharding(mesh, spec)
    args = [jax.device_put(a, sharding) for a in (x, topk_idx, topk_weights)]
    out_specs = [spec] * (5 if buf.low_latency else 2)
    fn = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(spec, spec, spec),
                               out_specs=out_specs))
    return fn, args
