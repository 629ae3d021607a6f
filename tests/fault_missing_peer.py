"""A peer that never arrives: rank 0 runs a dispatch whose partner rank 1 never runs.

    python tests/fault_missing_peer.py MODE

MODE: normal, low_latency, low_latency_split or low_latency_combine_split.

The split modes run the send/receive halves: the send returns, the receive's bounded wait
fires (``low_latency_combine_split`` runs a combine with an empty handle, so only the flag
words are waited for).

Expected: within the timeout the kernel records (rank 0, peer 1, phase) and traps; the call
raises, and Buffer.errors() names the phase and the missing peer. Prints "reported: ...".
Run in its own process: the trap leaves device 0's CUDA context unusable.
"""

import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax_ep

T, H, E, K = 16, 256, 16, 2


def main(mode):
    gpus = jax.devices()[:2]
    mesh = Mesh(np.array(gpus), ("ep",))
    buf = jax_ep.Buffer(mesh, "ep", num_experts=E, hidden=H, max_tokens_per_rank=T, num_topk=K,
                        low_latency=mode.startswith("low_latency"), backend="cuda", timeout_s=2.0)
    lonely = Mesh(np.array(gpus[:1]), ("ep",))  # only rank 0's program runs

    def step(x, idx, w):
        if mode == "normal":
            return jax_ep.dispatch(buf, x, idx, w).recv_x
        if mode == "low_latency_split":
            pending = jax_ep.low_latency_dispatch_send(buf, x, idx)
            return jax_ep.low_latency_dispatch_recv(buf, pending).recv_x
        if mode == "low_latency_combine_split":
            rows = 2 * T
            empty = jax_ep.LowLatencyHandle(recv_src=jnp.full((E // 2, rows), -1, jnp.int32),
                                            recv_k=jnp.full((E // 2, rows), -1, jnp.int32),
                                            recv_count=jnp.zeros((E // 2,), jnp.int32))
            y = jnp.zeros((E // 2, rows, H), jnp.bfloat16)
            pending = jax_ep.low_latency_combine_send(buf, y, idx, w, empty)
            return jax_ep.low_latency_combine_recv(buf, pending)
        return jax_ep.low_latency_dispatch(buf, x, idx).recv_x

    run = jax.jit(jax.shard_map(step, mesh=lonely, in_specs=P("ep"), out_specs=P("ep")))
    x = jnp.ones((T, H), jnp.bfloat16)
    idx = jnp.tile(jnp.arange(K, dtype=jnp.int32)[None] * (E // 2), (T, 1))  # both ranks
    w = jnp.ones((T, K), jnp.float32)
    start = time.perf_counter()
    try:
        jax.block_until_ready(run(x, idx, w))
    except Exception as e:  # noqa: BLE001 - XLA reports the trapped kernel
        print("call raised after", round(time.perf_counter() - start, 1), "s:",
              str(e).splitlines()[0][:200])
    else:
        raise SystemExit("the call returned although rank 1 never ran")
    errors = buf.errors()
    print("reported:", errors["timeouts"], flush=True)
    assert errors["timeouts"], errors
    # Device 0's CUDA context is gone: skip the interpreter's teardown of JAX and the Buffer.
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
