"""Export a MoE step with a symbolic token count in one process, run it in another.

    python tests/export_roundtrip.py export FILE   # serialise the exported step to FILE
    python tests/export_roundtrip.py run FILE      # deserialise, run for T=64 and T=4096, check
    (a third argument T exports and runs one fixed token count instead of a symbolic one)

Run by test_gpu.py on a GPU machine; each command in its own fresh process.
"""

import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep import testing as oracle

H, E, K, T_MAX = 1024, 32, 4, 4096


def make_buffer(mesh):
    # The first Buffer of the process: id 1 in both processes (ids are baked into programs).
    return jax_ep.Buffer(mesh, "ep", num_experts=E, hidden=H, max_tokens_per_rank=T_MAX,
                         num_topk=K, dtype=jnp.bfloat16, backend="cuda")


def main(command, path, tokens=None):
    mesh = Mesh(np.array(jax.devices()), ("ep",))
    R = mesh.shape["ep"]
    buf = make_buffer(mesh)
    if command == "export":
        def step(x, idx, w):
            d = jax_ep.dispatch(buf, x, idx, w)
            y, _ = jax_ep.combine(buf, d.recv_x, d.handle)
            return d.recv_x, d.handle.recv_src, y

        sharded = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
        # A symbolic token count, or (tokens given) one fixed bucket.
        (t,) = jax.export.symbolic_shape("t") if tokens is None else (tokens,)
        args = (jax.ShapeDtypeStruct((R * t, H), jnp.bfloat16),
                jax.ShapeDtypeStruct((R * t, K), jnp.int32),
                jax.ShapeDtypeStruct((R * t, K), jnp.float32))
        exported = jax_ep.export_step(sharded, *args)
        with open(path, "wb") as f:
            f.write(exported.serialize())
        print("exported", len(exported.mlir_module()), "chars")
        return
    with open(path, "rb") as f:
        exported = jax.export.deserialize(bytearray(f.read()))
    rng = np.random.default_rng(3)
    sharding = NamedSharding(mesh, P("ep"))
    for T in (64, 4096) if tokens is None else (tokens,):
        idx, w = oracle.make_routing("uniform", rng, R, T, E, K)
        x = rng.standard_normal((R, T, H)).astype(ml_dtypes.bfloat16)
        args = [jax.device_put(a.reshape(R * T, *a.shape[2:]), sharding) for a in (x, idx, w)]
        recv_x, recv_src, y = (np.asarray(a) for a in exported.call(*args))
        recv_x = recv_x.reshape(R, R * T, H)
        recv_src = recv_src.reshape(R, R * T)
        for r, exp in enumerate(oracle.dispatch(x, idx, w, E)):
            assert np.array_equal(recv_x[r].view(np.uint16), exp["recv_x"].view(np.uint16)), T
            assert np.array_equal(recv_src[r], exp["recv_src"]), T
        oracle.assert_combine_close(y.reshape(R, T, H), recv_x, recv_src, T, what=f"T={T}")
        print("ran T =", T)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else None)
