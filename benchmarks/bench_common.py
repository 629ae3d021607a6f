"""Shared pieces of the jax_ep benchmarks: mesh, routing, inputs, peers, timing, result files.

Sharding model: one mesh axis ``"ep"`` over all (or the first ``ranks``) devices; every global
array here is ``[R * rows_per_rank, ...]`` sharded along axis 0, so inside ``jax.shard_map`` each
rank sees its own ``[rows_per_rank, ...]`` block. The peers (``jax.lax.all_to_all`` with capacity
padding and ``jax.lax.ragged_all_to_all``) are written here as per-rank functions with the same
routing semantics as ``jax_ep.dispatch`` / ``jax_ep.combine`` (docs/api.md, "Normal mode"): a
token goes once to every rank that holds at least one of its top-k experts, and combine sums
what comes back.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import tree_state  # benchmarks/ is on sys.path wherever bench_common imports
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

AXIS = "ep"
# The each-way NVLink rate that nvlink_share assumes (2x H200, both directions busy); bench_ep's
# records carry it as method.nvlink_bytes_per_s.
NVLINK_BYTES_PER_S = 283e9
FP8_BLOCK = 128  # channels per fp8 scale (docs/api.md, "FP8 scales")
FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_MIN_AMAX = 1e-4  # floor of the per-block amax before dividing (docs/api.md, "FP8 scales")
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ----------------------------------------------------------------------------- jax_ep import


def import_jax_ep():
    """Returns ``(module, None)`` or ``(None, reason)``.

    Prefers an installed ``jax_ep`` (which carries the built CUDA extension); falls back to the
    source tree next to this folder, so the scripts also run from a plain checkout.
    """
    try:
        import jax_ep

        return jax_ep, None
    except ImportError:
        pass
    if REPO_ROOT not in sys.path:
        sys.path.insert(0, REPO_ROOT)
    try:
        import jax_ep

        return jax_ep, None
    except Exception as e:  # noqa: BLE001 - any import failure means "not available"
        return None, f"{type(e).__name__}: {e}"


# ----------------------------------------------------------------------------- environment


HOST_DEVICES_FLAG = "--xla_force_host_platform_device_count"
HOST_DEVICES = 8  # CPU devices when there is no GPU, as jax-ep-demo and the tests use


def default_host_devices(count: int = HOST_DEVICES) -> None:
    """Gives XLA:CPU ``count`` devices unless ``XLA_FLAGS`` already sets a count, so that a CPU
    run has ranks to exchange between. XLA reads the flag when its first backend starts: call
    this before anything touches a device. Only the CPU platform sees it (GPUs stay GPUs)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if HOST_DEVICES_FLAG not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {HOST_DEVICES_FLAG}={count}".strip()


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def make_mesh(num_ranks: int | None = None) -> Mesh:
    devices = jax.devices()
    if num_ranks is not None:
        if num_ranks > len(devices):
            raise ValueError(f"--ranks {num_ranks} > {len(devices)} devices")
        devices = devices[:num_ranks]
    return Mesh(np.array(devices), (AXIS,))


def machine_name() -> str:
    """``"<count>x<GPU>"`` from nvidia-smi (e.g. ``"2xH200"``), else ``"<count>x<platform>"``."""
    count = jax.device_count()
    if on_gpu() and shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=30, check=True,
            ).stdout
            names = [line.strip() for line in out.splitlines() if line.strip()]
            if names:
                words = [w for w in names[0].split() if w.upper() != "NVIDIA"]
                return f"{count}x{words[0] if words else names[0]}"
        except (OSError, subprocess.SubprocessError):
            pass
    if on_gpu():
        kind = jax.devices()[0].device_kind.replace("NVIDIA", "").split()
        return f"{count}x{kind[0] if kind else 'gpu'}"
    return f"{count}x{jax.default_backend()}"


def git_commit() -> str:
    """The commit the records name (``tree_state.tree_state``: ``$JAX_EP_COMMIT`` when set, for a
    tree that travelled to a GPU machine whose copy may carry a stale ``.git``; else the
    checkout's; ``"unknown"`` without either)."""
    return tree_state.tree_state(REPO_ROOT)[0]


def today() -> str:
    return datetime.date.today().isoformat()


def add_note_argument(parser) -> None:
    """``--note TEXT``: free text stored in the record (what the run is for, what was special)."""
    parser.add_argument("--note", help="free text stored in the result file's 'note'")


def tree_header(argv: Sequence[str], note: str | None = None,
                script: str | None = None) -> dict[str, Any]:
    """The part of a record's header that says what ran: ``commit``, ``dirty_diff_sha256``
    (``benchmarks/tree_state.py``: None for a clean tree), ``note`` and ``command`` (``script``,
    the running script's ``__file__``, else ``sys.argv[0]``, then ``argv``)."""
    commit, diff = tree_state.tree_state(REPO_ROOT)
    program = os.path.relpath(script or sys.argv[0], REPO_ROOT)
    return {"commit": commit, "dirty_diff_sha256": diff, "note": note,
            "command": shlex.join([program, *argv])}


def result_header(argv: Sequence[str], note: str | None = None,
                  script: str | None = None) -> dict[str, Any]:
    """A record's header: machine, date, the tree state and command (``tree_header``), JAX."""
    return {
        "machine": machine_name(),
        "date": today(),
        **tree_header(argv, note, script),
        "jax_version": jax.__version__,
        "platform": jax.default_backend(),
        "processes": jax.process_count(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }


def result_path(out: str, header: dict[str, Any], *parts: str | None) -> str:
    """The JSON file a script writes: ``out`` itself when it ends in ``.json``, else
    ``<out>/<machine>-<date>[-<part>...].json`` (parts that are None left out); its folder is
    created."""
    if out.endswith(".json"):
        path = out
    else:
        name = "-".join([header["machine"], header["date"], *(p for p in parts if p)])
        path = os.path.join(out, name + ".json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    return path


def add_shape_arguments(p, defaults: dict[str, Any]) -> None:
    """The MoE shape options (``--tokens --hidden --ffn --experts --topk --ranks``; default
    None: ``fill_defaults`` sets them), their help naming ``defaults``."""
    helps = {"tokens": "tokens per rank", "hidden": "model width H", "ffn": "expert FFN width F",
             "experts": "experts over all ranks", "topk": "experts per token"}
    for name, text in helps.items():
        p.add_argument(f"--{name}", type=int, help=f"{text} (default {defaults[name]})")
    p.add_argument("--ranks", type=int, help="number of devices to use (default all)")


def fill_defaults(args, defaults: dict[str, Any], quick: dict[str, Any]) -> None:
    """Every option of ``defaults`` left None set from ``quick`` (with ``--quick``) or it."""
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick[name] if args.quick else value)


def join_processes() -> bool:
    """Joins ``jax.distributed`` when started by ``python -m jax_ep.launch`` (before any device
    is touched). Every process then runs the same cases; process 0 writes and prints results."""
    try:
        from jax_ep import launch  # noqa: PLC0415 - pure Python, no extension needed
    except ImportError:
        return False
    return launch.initialize_from_env()


def is_reporter() -> bool:
    return jax.process_index() == 0


def to_host(a) -> np.ndarray:
    """A global array as one NumPy array, gathered from every process (collective)."""
    if getattr(a, "is_fully_addressable", True):
        return np.asarray(a)
    from jax.experimental import multihost_utils  # noqa: PLC0415

    return np.asarray(multihost_utils.process_allgather(a, tiled=True))


def write_json(path: str, payload: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- inputs


def sharded(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P(AXIS))


def random_routing(mesh: Mesh, seed: int, tokens: int, experts: int, topk: int):
    """Top-k of uniform random scores, per token, seeded.

    Returns global ``topk_idx [R*T, K] int32`` and ``topk_weights [R*T, K] float32`` (softmax of
    the selected scores), both sharded along "ep".
    """
    return jax.block_until_ready(_routing_maker(mesh, tokens, experts, topk)(jax.random.key(seed)))


def random_rows(mesh: Mesh, seed: int, shape: tuple[int, ...], dtype=jnp.bfloat16):
    """Standard-normal array of global ``shape`` (axis 0 = R * per-rank rows), sharded."""
    return jax.block_until_ready(_rows_maker(mesh, tuple(shape), dtype)(jax.random.key(seed)))


# One jitted maker per shape: a new closure per call compiled again every time (21 compiles in
# bench_ep --quick alone).
@functools.cache
def _routing_maker(mesh: Mesh, tokens: int, experts: int, topk: int):
    num_ranks = mesh.shape[AXIS]

    def make(key):
        scores = jax.random.uniform(key, (num_ranks * tokens, experts), jnp.float32)
        vals, idx = lax.top_k(scores, topk)
        return idx.astype(jnp.int32), jax.nn.softmax(vals, axis=-1)

    return jax.jit(make, out_shardings=(sharded(mesh), sharded(mesh)))


@functools.cache
def _rows_maker(mesh: Mesh, shape: tuple[int, ...], dtype):
    def make(key):
        return jax.random.normal(key, shape, jnp.float32).astype(dtype)

    return jax.jit(make, out_shardings=sharded(mesh))


def cast_fp8(x):
    """Per-token, per-128-channel e4m3fn cast (docs/api.md, "FP8 scales").

    Args:
      x: ``[T, H]`` bfloat16/float32, ``H % 128 == 0``.
    Returns:
      ``(x_fp8 [T, H] float8_e4m3fn, scales [T, H // 128] float32)``.
    """
    num_tokens, hidden = x.shape
    blocks = x.astype(jnp.float32).reshape(num_tokens, hidden // FP8_BLOCK, FP8_BLOCK)
    amax = jnp.max(jnp.abs(blocks), axis=-1)
    scales = jnp.maximum(amax, FP8_MIN_AMAX) / FP8_MAX
    x_fp8 = (blocks * (1.0 / scales)[..., None]).astype(jnp.float8_e4m3fn)
    return x_fp8.reshape(num_tokens, hidden), scales


# ----------------------------------------------------------------------------- byte counting


def routing_stats(topk_idx: np.ndarray, num_ranks: int, experts: int) -> dict[str, float]:
    """Counts used for bytes, DeepEP style, as means over ranks (each rank's own view).

    Args:
      topk_idx: ``[R*T, K]`` int32 host array (global expert ids, -1 = none).
    Returns:
      ``recv_rows`` (rows a rank receives in normal dispatch, itself included),
      ``remote_recv_rows`` (of those, rows from other ranks), ``selections`` (a rank's
      (token, k) pairs with an expert, as sent by low-latency dispatch) and
      ``remote_selections`` (of those, pairs whose expert is on another rank).
    """
    idx = topk_idx.reshape(num_ranks, -1, topk_idx.shape[-1])
    experts_per_rank = experts // num_ranks
    dst = np.where(idx >= 0, idx // experts_per_rank, -1)  # [R_src, T, K]
    in_rank = np.stack([(dst == r).any(-1) for r in range(num_ranks)], -1)  # [R_src, T, R_dst]
    recv = in_rank.sum(axis=(0, 1))  # [R_dst]
    self_recv = np.array([in_rank[r, :, r].sum() for r in range(num_ranks)])
    selections = (dst >= 0).sum(axis=(1, 2))  # [R_src]
    own = np.stack([(dst[r] == r).sum() for r in range(num_ranks)])
    return {
        "recv_rows": float(recv.mean()),
        "remote_recv_rows": float((recv - self_recv).mean()),
        "selections": float(selections.mean()),
        "remote_selections": float((selections - own).mean()),
    }


def bytes_per_rank(op: str, dtype: str, hidden: int, stats: dict[str, float],
                   peer: bool = False):
    """``(bytes, remote_bytes)`` one rank moves for one call (docs/api.md, "Measuring"), counted
    by what it moves: jax_ep's low-latency ops (either backend) move one row per (token, expert)
    selection, a ``peer`` moves each token once per destination rank in both modes. None for
    layout."""
    per_row = hidden * (1 + 4 / FP8_BLOCK) if dtype == "fp8" else 2 * hidden
    if op in ("dispatch", "combine") or (op.startswith("low_latency") and peer):
        return per_row * stats["recv_rows"], per_row * stats["remote_recv_rows"]
    if op == "low_latency_dispatch":
        per_sel = hidden + hidden / 32 + 16 if dtype == "fp8" else 2 * hidden
        return per_sel * stats["selections"], per_sel * stats["remote_selections"]
    if op == "low_latency_combine":
        per_sel = 2 * hidden
        return per_sel * stats["selections"], per_sel * stats["remote_selections"]
    return None, None


# ----------------------------------------------------------------------------- peers (per rank)


def token_in_rank(topk_idx, num_ranks: int, experts_per_rank: int):
    """``[T, R]`` bool: token t has at least one expert on rank r."""
    dst = jnp.where(topk_idx >= 0, topk_idx // experts_per_rank, -1)
    return (dst[:, :, None] == jnp.arange(num_ranks, dtype=dst.dtype)).any(axis=1)


def to_local_ids(recv_idx, experts_per_rank: int):
    """Global expert ids -> this rank's local ids, -1 for experts elsewhere."""
    first = lax.axis_index(AXIS) * experts_per_rank
    local = recv_idx - first
    return jnp.where((recv_idx >= 0) & (local >= 0) & (local < experts_per_rank), local, -1)


def _as_bytes(a):
    """fp8 -> uint8 bit pattern (collectives move bytes; NCCL has no fp8 type)."""
    return lax.bitcast_convert_type(a, jnp.uint8) if a.dtype == jnp.float8_e4m3fn else a


def _from_bytes(a, dtype):
    return lax.bitcast_convert_type(a, dtype) if dtype == jnp.float8_e4m3fn else a


def pack_meta(topk_idx, topk_weights):
    """``[T, 2K]`` int32: ids then the weights' bits (one collective for the routing metadata)."""
    if topk_weights is None:
        return topk_idx
    return jnp.concatenate([topk_idx, lax.bitcast_convert_type(topk_weights, jnp.int32)], -1)


def unpack_meta(meta, topk: int, experts_per_rank: int):
    idx = to_local_ids(meta[:, :topk], experts_per_rank)
    if meta.shape[1] == topk:
        return idx, None
    w = lax.bitcast_convert_type(meta[:, topk:], jnp.float32)
    return idx, jnp.where(idx >= 0, w, 0.0)


class AllToAllPeer:
    """``jax.lax.all_to_all`` with capacity padding.

    Dispatch: each rank builds ``[R, T, ...]`` (row ``[r, t]`` = token t if it goes to rank r,
    else zeros) for the data and for the packed (ids, weights) metadata, and exchanges them with
    tiled all_to_alls; rank r receives ``[R*T, ...]`` grouped by source rank (rows of tokens not
    sent to r: zeros, ids -1). Combine: the expert
    output ``y [R*T, H]`` (rows in the received order) goes back with the reverse all_to_all and
    the owner sums, in float32, the rows of the ranks its token went to.
    """

    name = "all_to_all"

    def __init__(self, num_ranks: int, experts: int, topk: int):
        self.num_ranks, self.topk = num_ranks, topk
        self.experts_per_rank = experts // num_ranks

    def _exchange(self, a, mask, fill=0):
        num_tokens = a.shape[0]
        keep = mask.T.reshape(self.num_ranks, num_tokens, *([1] * (a.ndim - 1)))
        a = _as_bytes(a)
        send = jnp.where(keep, a[None], jnp.full((), fill, a.dtype))
        recv = lax.all_to_all(send, AXIS, 0, 0, tiled=True)
        return recv.reshape(self.num_ranks * num_tokens, *a.shape[1:])

    def dispatch(self, payload: Sequence[Any], topk_idx, topk_weights=None):
        """``payload``: arrays ``[T, ...]`` (x, or x_fp8 and scales). Returns received arrays
        ``[R*T, ...]``, local ids ``[R*T, K]`` (-1 = not here) and weights (or None)."""
        mask = token_in_rank(topk_idx, self.num_ranks, self.experts_per_rank)
        recv = [_from_bytes(self._exchange(a, mask), a.dtype) for a in payload]
        # Rows not sent to a rank carry ids -1 (no expert), so they never look local there.
        meta = self._exchange(pack_meta(topk_idx, topk_weights), mask, fill=-1)
        return (*recv, *unpack_meta(meta, self.topk, self.experts_per_rank))

    def plan(self, topk_idx):
        """The combine 'handle': which ranks each local token went to."""
        return token_in_rank(topk_idx, self.num_ranks, self.experts_per_rank)

    def combine(self, y, plan):
        num_tokens = plan.shape[0]
        back = lax.all_to_all(
            y.reshape(self.num_ranks, num_tokens, -1), AXIS, 0, 0, tiled=True
        )  # [R (expert rank), T, H]
        keep = plan.T[:, :, None]
        return jnp.sum(jnp.where(keep, back.astype(jnp.float32), 0.0), axis=0).astype(y.dtype)


class RaggedAllToAllPeer:
    """``jax.lax.ragged_all_to_all``, MaxText pattern.

    Dispatch: each rank sorts the (token, destination rank) pairs by destination (a gather into
    ``[R*T, ...]``), exchanges the per-destination sizes with one small ``all_gather`` (every rank
    then knows the whole ``[R_src, R_dst]`` size matrix, hence input/output offsets), and moves the
    rows with ``ragged_all_to_all`` into an ``[R*T, ...]`` output (grouped by source rank, rows
    past the received count zero, their ids -1); the packed (ids, weights) metadata goes the same
    way. Combine: the reverse ``ragged_all_to_all`` of the expert output, then each owner
    gathers, for each token, the rows of the ranks it went to and sums them in float32.
    """

    name = "ragged_all_to_all"

    def __init__(self, num_ranks: int, experts: int, topk: int):
        self.num_ranks, self.topk = num_ranks, topk
        self.experts_per_rank = experts // num_ranks

    def plan(self, topk_idx):
        num_ranks, num_tokens = self.num_ranks, topk_idx.shape[0]
        mask = token_in_rank(topk_idx, num_ranks, self.experts_per_rank)  # [T, R]
        flat = mask.T.reshape(-1)  # [R*T], destination-major
        pos = (jnp.cumsum(flat.astype(jnp.int32)) - 1).reshape(num_ranks, num_tokens).T  # [T, R]
        # Sorted order: row p of the send buffer holds token send_token[p].
        send_token = jnp.zeros(num_ranks * num_tokens, jnp.int32).at[
            jnp.where(mask, pos, num_ranks * num_tokens)
        ].set(jnp.broadcast_to(jnp.arange(num_tokens, dtype=jnp.int32)[:, None], mask.shape),
              mode="drop")
        send_sizes = mask.sum(0).astype(jnp.int32)  # [R]
        sizes = lax.all_gather(send_sizes, AXIS)  # [R_src, R_dst]
        me = lax.axis_index(AXIS)
        before_src = jnp.cumsum(sizes, 0) - sizes  # rows from earlier sources, per destination
        before_dst = jnp.cumsum(sizes, 1) - sizes  # rows to earlier destinations, per source
        return {
            "mask": mask, "pos": pos, "send_token": send_token,
            "send_sizes": send_sizes,
            "input_offsets": before_dst[me],
            "output_offsets": before_src[me],  # where my rows start in each receiver's output
            "recv_sizes": sizes[:, me],
            "recv_offsets": before_src[:, me],
            "back_output_offsets": before_dst[:, me],  # where my rows sat in each source's send
        }

    def _exchange(self, a, plan, fill=0):
        a = _as_bytes(a)
        send = jnp.take(a, plan["send_token"], axis=0, mode="clip")
        out = jnp.full((self.num_ranks * a.shape[0], *a.shape[1:]), fill, a.dtype)
        return lax.ragged_all_to_all(
            send, out, plan["input_offsets"], plan["send_sizes"], plan["output_offsets"],
            plan["recv_sizes"], axis_name=AXIS,
        )

    def dispatch(self, payload: Sequence[Any], topk_idx, topk_weights=None):
        plan = self.plan(topk_idx)
        recv = [_from_bytes(self._exchange(a, plan), a.dtype) for a in payload]
        meta = self._exchange(pack_meta(topk_idx, topk_weights), plan, fill=-1)
        return (*recv, *unpack_meta(meta, self.topk, self.experts_per_rank))

    def combine(self, y, plan):
        back = lax.ragged_all_to_all(
            y, jnp.zeros_like(y), plan["recv_offsets"], plan["recv_sizes"],
            plan["back_output_offsets"], plan["send_sizes"], axis_name=AXIS,
        )  # [R*T, H] in this rank's destination-sorted send order
        rows = jnp.take(back, plan["pos"], axis=0, mode="clip")  # [T, R, H]
        keep = plan["mask"][:, :, None]
        return jnp.sum(jnp.where(keep, rows.astype(jnp.float32), 0.0), axis=1).astype(y.dtype)


PEER_CLASSES = {"all_to_all": AllToAllPeer, "ragged_all_to_all": RaggedAllToAllPeer}


# ----------------------------------------------------------------------------- timing


def shard_mapped(mesh: Mesh, fn: Callable, num_args: int, donate: tuple[int, ...] = ()):
    """``jax.jit(shard_map(fn))``: every argument (a pytree) sharded along "ep" on axis 0, and
    every output leaf concatenated along axis 0 over the ranks; ``donate``: the arguments the
    caller gives up (XLA may reuse their buffers for outputs)."""
    return jax.jit(
        jax.shard_map(
            fn, mesh=mesh, in_specs=(P(AXIS),) * num_args, out_specs=P(AXIS), check_vma=False
        ),
        donate_argnums=donate,
    )


def _per_rank_leaves(tree):
    """Every array leaf with a leading axis of 1 (a free reshape), so scalars can leave the
    shard_map as ``[R]`` arrays."""
    return [leaf[None] for leaf in jax.tree.leaves(tree)]


def repeated_program(mesh: Mesh, op: Callable, iterations: int, prologue: Callable | None = None,
                     epilogue: Callable | None = None, outputs: str = "all"):
    """One jitted program that runs ``op`` ``iterations`` times, unrolled.

    ``program(fixed, sets)``: ``fixed`` is a tuple of global arrays given to ``prologue`` once
    (its result, e.g. a dispatch handle, is ``ctx``); ``sets`` is a tuple of argument tuples, at
    least ``iterations`` of them: iteration i runs ``op(ctx, *sets[i])``. ``epilogue(ctx, args,
    out)`` runs once after the last iteration (its arguments and outputs), e.g. to complete a
    call that the iterations leave open; like the prologue it cancels in a short/long difference.

    - Distinct inputs per iteration: no two calls are the same expression, so XLA cannot CSE
      them (an ``optimization_barrier`` alone does not stop that: XLA:CPU removes it first).
    - ``outputs="all"``: every output of every call is an output of the program (no reduction
      that XLA could slice through), so no work is dead. ``"last"``: only the last call's (and
      the epilogue's); the barriers below keep every earlier call alive, and the program hands
      back far fewer buffers (a check of how much the per-output host work weighs).
    - Iteration i+1's arguments pass through an ``optimization_barrier`` together with
      iteration i's outputs, asking XLA to run the calls one after the other. With
      ``outputs="all"`` those outputs leave the program through the barrier, which keeps it;
      with ``"last"`` XLA prunes the barrier's unused values and the calls are not ordered by
      it (custom calls with side effects still all run).
    """

    if outputs not in ("all", "last"):
        raise ValueError(f"outputs must be 'all' or 'last', got {outputs!r}")

    def body(fixed, sets):
        if len(sets) < iterations:
            raise ValueError(f"{iterations} iterations need as many input sets, got {len(sets)}")
        ctx = prologue(*fixed) if prologue is not None else None
        carry = None
        kept = []
        for i in range(iterations):
            args = sets[i]
            if carry is not None:
                args, carry = lax.optimization_barrier((args, carry))
                # XLA prunes a barrier's unused values (and with them the tie): the previous
                # call's outputs leave the program through the barrier.
                kept[-1] = carry
            carry = op(ctx, *args)
            kept.append(carry)
        if outputs == "last":
            kept = kept[-1:]
        if epilogue is not None:
            kept.append(epilogue(ctx, args, carry))
        return _per_rank_leaves(kept)

    return shard_mapped(mesh, body, 2)


def wall_us(fn: Callable, *args) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return (time.perf_counter() - start) * 1e6


def time_per_op_us(
    compiled_short, compiled_long, args, n_short: int, n_long: int, repeats: int, warmup: int
) -> tuple[float, dict[str, float]]:
    """GPU time of one op: ``(median t(n_long) - median t(n_short)) / (n_long - n_short)``.

    Each program is one host dispatch, so the fixed host cost (~200 us for a 2-GPU call) and the
    prologue cancel in the difference. Short and long runs are interleaved so drift hits both.
    The extras hold both medians and the per-op timer noise (``noise_us``, see ``noise_us``).
    """
    for _ in range(warmup):
        wall_us(compiled_short, *args)
        wall_us(compiled_long, *args)
    short, long = [], []
    for _ in range(repeats):
        short.append(wall_us(compiled_short, *args))
        long.append(wall_us(compiled_long, *args))
    med_short, med_long = statistics.median(short), statistics.median(long)
    per_op = (med_long - med_short) / (n_long - n_short)
    return per_op, {"t_short_us": med_short, "t_long_us": med_long,
                    "noise_us": noise_us(short, long, n_long - n_short)}


# Standard deviation of normal samples = 1.4826 x their median absolute deviation (robust to the
# odd slow call); the standard error of a median of n samples = 1.2533 sigma / sqrt(n).
_MAD_TO_SIGMA = 1.4826
_MEDIAN_STDERR = 1.2533
# A per-op time within this many standard errors of zero is reported as below the noise.
NOISE_STDERRS = 2.0


def noise_us(short: Sequence[float], long: Sequence[float], calls: int) -> float:
    """Timer noise of a per-op time ``(median(long) - median(short)) / calls``: ``NOISE_STDERRS``
    standard errors of that difference, each median's from its samples' median absolute
    deviation. A time at or below it cannot be told from zero."""

    def stderr(samples):
        center = statistics.median(samples)
        mad = statistics.median(abs(s - center) for s in samples)
        return _MEDIAN_STDERR * _MAD_TO_SIGMA * mad / len(samples) ** 0.5

    return NOISE_STDERRS * (stderr(short) ** 2 + stderr(long) ** 2) ** 0.5 / calls


def below_noise(time_us: float, extra: dict[str, float]) -> bool:
    """Whether a per-op time from ``time_per_op_us`` is too small to tell from its noise."""
    return time_us <= extra.get("noise_us", 0.0)


def noise_text(extra: dict[str, float]) -> str:
    """``"below noise (±x us)"``, the words a table prints for such a time."""
    noise = extra.get("noise_us", 0.0)
    return f"below noise (±{noise / 1e3:.3g} ms)" if noise >= 1e3 else \
        f"below noise (±{noise:.3g} us)"
