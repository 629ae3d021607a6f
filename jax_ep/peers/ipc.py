"""Peers in other processes (one process per GPU): CUDA IPC handles through jax.distributed.

When a Buffer's mesh spans processes, every process allocates the workspaces of its own ranks,
publishes their CUDA IPC handles (with its host name and the Buffer's configuration) in the
key-value store of ``jax.distributed``, reads the handles of the other ranks of its EP groups and
maps them into its devices. Keys are ``jax_ep/buffer<id>/...``: Buffer ids count creations in
each process, so every process must create the same Buffers in the same order (as for compiled
programs, which carry the id). Every wait is bounded by ``JAX_EP_JOIN_TIMEOUT_S`` (default 120 s)
and fails with a message naming the rank and process that did not arrive.

Closing is the reverse, in an order that never frees memory a peer still maps: each process
waits for its devices and unmaps the others' workspaces, all processes meet at a barrier, then
each frees its own.
"""

from __future__ import annotations

import json
import socket
import warnings

import jax

from jax_ep import settings

ENV_JOIN_TIMEOUT = "JAX_EP_JOIN_TIMEOUT_S"


def spans_processes(devices) -> bool:
    """Whether any of ``devices`` belongs to another process."""
    return any(d.process_index != jax.process_index() for d in devices)


def join_timeout_s() -> float:
    return settings.value(ENV_JOIN_TIMEOUT)


def kv_client():
    from jax._src import distributed  # noqa: PLC0415 - the key-value store has no public API

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError(
            "the mesh spans several processes but jax.distributed is not initialized in this "
            "one: call jax.distributed.initialize() (or jax_ep.launch.initialize_from_env()) "
            "before creating the Buffer")
    return client


def process_indices(devices) -> list[int]:
    return sorted({d.process_index for d in devices})


def all_gather(buf, name: str, value: str) -> dict[int, str]:
    """Every process of ``buf``'s mesh publishes ``value`` under ``name``; returns the values
    of all of them by process index (bounded wait)."""
    client, timeout_s = kv_client(), join_timeout_s()
    prefix = f"jax_ep/buffer{buf.buffer_id}/{name}"
    client.key_value_set(f"{prefix}/p{jax.process_index()}", value)
    values = {}
    for p in process_indices(buf.mesh.devices.flat):
        try:
            values[p] = client.blocking_key_value_get(f"{prefix}/p{p}", int(timeout_s * 1000))
        except Exception as e:  # noqa: BLE001 - jaxlib raises its own error types
            raise RuntimeError(
                f"jax_ep Buffer {buf.buffer_id}: process {p} did not publish {name!r} within "
                f"{timeout_s:g} s ({ENV_JOIN_TIMEOUT}): every process of the mesh must create "
                f"the same Buffers in the same order") from e
    return values


def sum_over_processes(buf, name: str, counts: dict[str, int]) -> dict[str, int]:
    """``counts`` summed over every process of ``buf``'s mesh (bounded wait; ``name`` must be
    new for this Buffer: the store keeps every key)."""
    values = all_gather(buf, name, json.dumps(counts, sort_keys=True))
    parts = [json.loads(v) for v in values.values()]
    return {key: sum(int(p[key]) for p in parts) for key in counts}


def configuration(buf) -> dict:
    """What every process must agree on for one Buffer."""
    return {"num_ranks": buf.num_ranks, "num_experts": buf.num_experts, "hidden": buf.hidden,
            "max_tokens_per_rank": buf.max_tokens_per_rank, "num_topk": buf.num_topk,
            "capacity": buf.capacity, "dtype": buf.dtype.name, "low_latency": buf.low_latency,
            "timeout_s": buf.timeout_s, "axis_name": str(buf.axis_name),
            "overlap": buf.overlap, "device_transport": buf.device_transport,
            # The normal-mode window sizes the workspace, whose layout every rank shares.
            "normal_window_rows": settings.value("JAX_EP_NORMAL_WINDOW_ROWS") or 0,
            "groups": [[d.id for d in g] for g in buf._ep_group_devices()]}


def check_same_configuration(buf) -> None:
    """Raises naming the first field in which another process's Buffer differs from ours."""
    mine = configuration(buf)
    for p, raw in sorted(all_gather(buf, "config", json.dumps(mine, sort_keys=True)).items()):
        theirs = json.loads(raw)
        for key in mine:
            if theirs.get(key) != mine[key]:
                raise RuntimeError(
                    f"jax_ep Buffer {buf.buffer_id}: process {p} created it with {key}="
                    f"{theirs.get(key)!r}, process {jax.process_index()} with {mine[key]!r}; "
                    f"every process must create the same Buffers in the same order")


def host_name() -> str:
    """The name by which this process's host is told apart from others: ``JAX_EP_HOST`` (the
    launcher's ``--fake-hosts``) or the machine's."""
    return settings.value("JAX_EP_HOST") or socket.gethostname()


def hosts(buf) -> dict[int, str]:
    """Host name of every process of the mesh."""
    return all_gather(buf, "host", host_name())


def exchange_workspaces(buf, module) -> None:
    """Publishes this process's workspace handles, maps those of the other processes' ranks of
    our EP groups, then waits until every process has done the same."""
    client, timeout_s = kv_client(), join_timeout_s()
    me = jax.process_index()
    prefix = f"jax_ep/buffer{buf.buffer_id}/workspace"
    for group, rank, handle in module.export_workspace_handles(buf.buffer_id):
        client.key_value_set(f"{prefix}/g{group}/r{rank}", handle.hex())
    remote = []
    for g, group in enumerate(buf._ep_group_devices()):
        if all(d.process_index != me for d in group):
            continue
        for r, device in enumerate(group):
            if device.process_index == me:
                continue
            try:
                raw = client.blocking_key_value_get(f"{prefix}/g{g}/r{r}", int(timeout_s * 1000))
            except Exception as e:  # noqa: BLE001
                raise RuntimeError(
                    f"jax_ep Buffer {buf.buffer_id}: rank {r} of EP group {g} (device "
                    f"{device.id}, process {device.process_index}) did not publish its workspace "
                    f"within {timeout_s:g} s ({ENV_JOIN_TIMEOUT})") from e
            remote.append((g, r, bytes.fromhex(raw)))
    module.import_workspace_handles(buf.buffer_id, remote)
    barrier(buf, "mapped")


def barrier(buf, name: str) -> None:
    """All processes of ``buf``'s mesh meet (bounded by the join timeout)."""
    timeout_s = join_timeout_s()
    processes = process_indices(buf.mesh.devices.flat)
    everyone = processes == list(range(jax.process_count()))
    try:
        kv_client().wait_at_barrier(f"jax_ep/buffer{buf.buffer_id}/{name}", int(timeout_s * 1000),
                                  None if everyone else processes)
    except Exception as e:  # noqa: BLE001
        raise RuntimeError(
            f"jax_ep Buffer {buf.buffer_id}: not every process of {processes} reached {name!r} "
            f"within {timeout_s:g} s ({ENV_JOIN_TIMEOUT})") from e


def release_workspaces(buf, module) -> None:
    """Unmaps the other processes' workspaces, waits for every process to do the same, then
    frees ours. If the barrier fails (a process died), frees anyway with a warning."""
    module.release_peer_workspaces(buf.buffer_id)
    try:
        barrier(buf, "released")
    except RuntimeError as e:
        warnings.warn(f"{e}; freeing this process's workspaces anyway", RuntimeWarning,
                      stacklevel=3)
    module.destroy_buffer(buf.buffer_id)
