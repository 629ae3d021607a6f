"""Runs per-rank functions under jit + shard_map on global arrays with a leading rank axis."""

import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_ep.peers import ipc as _ipc


def shard_spec(mesh, axis="ep"):
    others = tuple(a for a in mesh.axis_names if a != axis)
    return P((*others, axis))


def spans_processes(mesh):
    """True when some device of ``mesh`` belongs to another process (``jax.distributed``)."""
    return any(d.process_index != jax.process_index() for d in mesh.devices.flat)


def run_sharded(mesh, fn, *arrays, axis="ep", compiler_options=None):
    """``arrays`` are ``[S, ...]`` (S = number of devices in the mesh, EP axis fastest);
    ``fn`` gets the per-rank ``[...]`` slices and returns a pytree of per-rank arrays
    (scalars allowed). Returns the pytree with a leading ``[S]`` axis, as NumPy arrays.

    When the mesh spans processes every process passes the same full ``arrays`` (deterministic
    seeds), places its own shards of them, and gets the full gathered result back.
    ``compiler_options``: XLA options of this compile (e.g. ``xla_gpu_enable_command_buffer``).
    Traces and compiles ``fn`` on every call: see ``sharded_program`` to reuse one program."""
    return sharded_program(mesh, fn, axis=axis, compiler_options=compiler_options)(*arrays)


def sharded_program(mesh, fn, *, axis="ep", compiler_options=None):
    """``run_sharded`` of ``fn`` as a callable ``(*arrays) -> pytree of NumPy arrays`` that
    traces and compiles once per argument shape (one ``jax.jit``), then reuses the program."""
    spec = shard_spec(mesh, axis)
    num_shards = mesh.devices.size
    jitted, compiled = {}, {}

    def per_rank(*xs):
        out = fn(*(x[0] for x in xs))
        return jax.tree.map(lambda a: a[None], out)

    def call(*arrays):
        if len(arrays) not in jitted:  # jax.jit traces once per argument shape
            jitted[len(arrays)] = jax.jit(jax.shard_map(
                per_rank, mesh=mesh, in_specs=(spec,) * len(arrays), out_specs=spec))
        wrapped = jitted[len(arrays)]
        if not spans_processes(mesh):
            flat = [jnp.asarray(a) for a in arrays]
            assert all(a.shape[0] == num_shards for a in flat), [a.shape for a in flat]
        else:
            sharding = NamedSharding(mesh, spec)
            full = [np.asarray(a) for a in arrays]
            assert all(a.shape[0] == num_shards for a in full), [a.shape for a in full]
            flat = [jax.make_array_from_callback(a.shape, sharding, lambda index, a=a: a[index])
                    for a in full]
        if compiler_options:
            key = tuple((a.shape, a.dtype) for a in flat)
            if key not in compiled:
                compiled[key] = wrapped.lower(*flat).compile(compiler_options=compiler_options)
            wrapped = compiled[key]
        return jax.tree.map(fetch, wrapped(*flat))

    return call


def sharded_loss(mesh, per_rank_loss, axis="ep"):
    """A scalar loss over global ``[S, ...]`` arguments: the sum over ranks of
    ``per_rank_loss`` of each rank's slices (for ``jax.grad`` through the ops)."""
    spec = shard_spec(mesh, axis)

    def loss(*args):
        per_rank = jax.shard_map(lambda *xs: per_rank_loss(*(v[0] for v in xs))[None],
                                 mesh=mesh, in_specs=(spec,) * len(args), out_specs=spec)
        return jnp.sum(per_rank(*args))
    return loss


_fetches = itertools.count()


def fetch(a):
    """``a`` as one NumPy array, gathered from every process when it is sharded across them (a
    collective: every process runs the same tests in the same order).

    Through jax.distributed's key-value store rather than an XLA all-gather: NCCL refuses
    processes that share a GPU (``jax_ep.launch --processes-per-gpu``), and the store needs no
    communicator."""
    if getattr(a, "is_fully_addressable", True) or a.is_fully_replicated:
        return np.asarray(a)
    client, key = _ipc.kv_client(), f"harness/fetch{next(_fetches)}"  # the store's one accessor
    bounds, data = [], []
    for shard in a.addressable_shards:
        bounds.append([(s.start or 0, n if s.stop is None else s.stop)
                       for s, n in zip(shard.index, a.shape, strict=True)])
        data.append(np.ascontiguousarray(np.asarray(shard.data)).tobytes())
    header = json.dumps(bounds).encode()
    client.key_value_set_bytes(f"{key}/p{jax.process_index()}",
                               len(header).to_bytes(8, "little") + header + b"".join(data))
    out = np.empty(a.shape, a.dtype)
    for p in range(jax.process_count()):
        raw = client.blocking_key_value_get_bytes(f"{key}/p{p}", 120_000)
        size = int.from_bytes(raw[:8], "little")
        offset = 8 + size
        for box in json.loads(raw[8:offset]):
            where = tuple(slice(lo, hi) for lo, hi in box)
            count = int(np.prod([hi - lo for lo, hi in box]))
            out[where] = np.frombuffer(raw, a.dtype, count, offset).reshape(out[where].shape)
            offset += count * a.dtype.itemsize
    return out


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                               recv_sizes, *, axis_name, axis_index_groups=None):
    """``lax.ragged_all_to_all``'s documented semantics built from all_gather (XLA:CPU has no
    ragged_all_to_all): source s's rows ``[input_offsets_s[me], + send_sizes_s[me])`` land at
    ``output[output_offsets_s[me] + i]``."""
    del recv_sizes, axis_index_groups
    me = jax.lax.axis_index(axis_name)
    operands = jax.lax.all_gather(operand, axis_name)
    starts = jax.lax.all_gather(input_offsets, axis_name)
    sizes = jax.lax.all_gather(send_sizes, axis_name)
    dests = jax.lax.all_gather(output_offsets, axis_name)
    rows = jnp.arange(operand.shape[0])
    for src in range(operands.shape[0]):
        block = jnp.take(operands[src], starts[src, me] + rows, axis=0, mode="clip")
        where = jnp.where(rows < sizes[src, me], dests[src, me] + rows, output.shape[0])
        output = output.at[where].set(block, mode="drop")
    return output
