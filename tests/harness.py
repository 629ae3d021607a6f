"""Runs per-rank functions under jit + shard_map on global arrays with a leading rank axis."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P


def shard_spec(mesh, axis="ep"):
    others = tuple(a for a in mesh.axis_names if a != axis)
    return P((*others, axis))


def run_sharded(mesh, fn, *arrays, axis="ep"):
    """``arrays`` are ``[S, ...]`` (S = number of devices in the mesh, EP axis fastest);
    ``fn`` gets the per-rank ``[...]`` slices and returns a pytree of per-rank arrays
    (scalars allowed). Returns the pytree with a leading ``[S]`` axis, as NumPy arrays."""
    spec = shard_spec(mesh, axis)
    num_shards = mesh.devices.size

    def per_rank(*xs):
        out = fn(*(x[0] for x in xs))
        return jax.tree.map(lambda a: a[None], out)

    flat = [jnp.asarray(a) for a in arrays]
    wrapped = jax.jit(jax.shard_map(per_rank, mesh=mesh, in_specs=(spec,) * len(flat),
                                    out_specs=spec))
    assert all(a.shape[0] == num_shards for a in flat), [a.shape for a in flat]
    return jax.tree.map(np.asarray, wrapped(*flat))
