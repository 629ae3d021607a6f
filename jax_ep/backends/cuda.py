"""The CUDA backend (``backend="cuda"``): FFI custom calls of our kernels.

Each method builds the custom call of one op for the *per-rank* shapes inside ``jax.shard_map``.
Result shapes are functions of the operand shapes only (capacity ``C`` is ``R*T`` or the
Buffer's static capacity), so a symbolic token count exports. Operand/result order, attributes
and semantics: docs/internals.md. Every call is side-effecting for XLA (it neither removes nor
merges them) and free of JAX effects (jit keeps its fast dispatch path): ``custom_call.py``.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_ep import _vma, fp8
from jax_ep._types import DispatchHandle, Layout
from jax_ep.backends import deferred
from jax_ep.backends.custom_call import custom_call


def load_extension():
    """The compiled module ``jax_ep._C``, or None with the reason when it is not available."""
    try:
        from jax_ep import _C  # noqa: PLC0415
    except ImportError as e:
        return None, f"the CUDA extension jax_ep._C is not built or cannot load ({e})"
    return _C, ""


def _extension():
    module, reason = load_extension()
    if module is None:
        raise RuntimeError(reason)
    return module


# The facts below belong to the kernels: jax_ep._C is their one source (read on first use, so
# that jax_ep imports without it).
@functools.cache
def target_names() -> dict[str, str]:
    """Op (``"layout"``, ``"low_latency_dispatch_send"``, ...) -> its FFI target name, whose
    version suffix changes with any change of operands, results, attributes or semantics."""
    return dict(_extension().target_names())


def target_name(op: str) -> str:
    return target_names()[op]


@functools.cache
def wait_phase_names() -> dict[int, str]:
    """A timeout record's ``timeout_phase`` -> the wait it names."""
    return dict(_extension().wait_phase_names())


@functools.cache
def max_ranks() -> int:
    """Most ranks in one EP group of the cuda backend (one NVLink domain)."""
    return int(_extension().max_ranks())


def export_safety_checks():
    """``disabled_checks`` for ``jax.export.export`` of programs that call jax_ep's kernels.

    jax.export refuses custom calls without a compatibility guarantee; ours carry a version in
    their name instead, so a program exported against another version fails to find its target
    rather than running a different kernel. Without jax_ep._C nothing lowers to our targets:
    no checks to disable.
    """
    if load_extension()[0] is None:
        return []
    return [jax.export.DisabledSafetyCheck.custom_call(name) for name in target_names().values()]


@contextlib.contextmanager
def gspmd_partitioner():
    """Lowers with the GSPMD partitioner instead of Shardy: wrap ``jax.export.export`` of a
    shard_map step with symbolic shapes in it. The exported program is called under Shardy.

    jaxlib 0.10-0.11 cannot refine the shapes of a Shardy shard_map body when such a program is
    compiled: the dimension variables enter ``sdy.manual_computation`` as block arguments that
    refinement never replaces by their values, so our custom calls' results (and any
    ``jnp.zeros((T, 0))``) stay dynamic ("Module has dynamic shapes"), and a shape computation it
    does fold inside the region crashes it. GSPMD lowers the body to a function whose dimension
    arguments refinement specialises.
    """
    shardy = jax.config.jax_use_shardy_partitioner
    jax.config.update("jax_use_shardy_partitioner", False)
    try:
        yield
    finally:
        jax.config.update("jax_use_shardy_partitioner", shardy)


@functools.cache
def buffer_config(module, **fields):
    """``module.BufferConfig`` (the C++ struct) with ``fields`` set by name: a name that is not
    one of its fields raises AttributeError."""
    config = module.BufferConfig()
    for name, value in fields.items():
        setattr(config, name, value)
    return config


def register_targets() -> None:
    """Registers every FFI target of ``jax_ep._C`` with XLA for platform CUDA (once)."""
    module, reason = load_extension()
    if module is None:
        raise RuntimeError(reason)
    for name, capsule in module.registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform="CUDA")


def _order(after):
    """The send halves' ordering operand: the previous receive's result, or for the first send
    of a trace a one-element constant (nothing to wait for)."""
    return jnp.zeros((1,), jnp.int32) if after is None else after


class CudaBackend:
    """FFI calls of one Buffer. Operands vary over the same axes (so the custom call type-checks
    under shard_map's varying-axes check) and results are typed like them."""

    name = "cuda"

    def __init__(self, buf):
        self.buf = buf
        self.num_ranks = buf.num_ranks
        self.num_local_experts = buf.num_local_experts

    def _call(self, op, operands, results, **attrs):
        operands = _vma.align(self.buf.axis_name, list(operands))
        template = jax.typeof(operands[0])
        # Results are typed like the operands (same varying axes) with their own shape/dtype.
        result_types = [template.update(shape=tuple(shape), dtype=jnp.dtype(dtype))
                        for shape, dtype in results]
        # XLA:GPU's dynamic-slice fusion moves a custom call whose operand is a slice (or whose
        # result feeds a dynamic-update-slice) into a fusion around a clone of it; for a call
        # with several results it leaves the side-effecting original in place as well, so the
        # kernel runs twice (jaxlib 0.11.2: a second low-latency receive then waits for a call
        # that never comes). Optimization barriers hide the slices from that pass; they vanish
        # after scheduling (a sliced operand is then copied once, a plain one not at all).
        operands = tuple(jax.lax.optimization_barrier(operands))
        buffer_id = np.int64(self.buf.buffer_id)
        if not self.buf.overlap:
            results = custom_call(target_name(op), result_types, *operands, buffer_id=buffer_id,
                                  **attrs)
            return jax.lax.optimization_barrier(results)
        # An overlap Buffer: the op starts on the Buffer's side stream; its wait follows at once,
        # or after the compute of an enclosing deferred.overlap.
        raw = custom_call(target_name(f"{op}_async"), result_types, *operands,
                          buffer_id=buffer_id, **attrs)
        started = deferred.collector()
        if started is not None:
            started.ops.append((self, raw, operands))
            return raw
        return jax.lax.optimization_barrier(self.wait(raw, operands))

    def wait(self, raw, operands, after=(), unaliased=()):
        """The results ``raw`` of an op's async start, once XLA's stream has waited for its
        kernels (the same buffers: aliased, but for the indices in ``unaliased``, which the
        wait copies after joining). ``operands`` (the start's) stay alive until then; the wait
        comes after every value of ``after`` (never read)."""
        every = _vma.align(self.buf.axis_name, [*raw, *operands, *after])
        return custom_call(target_name("wait"), [jax.typeof(r) for r in every[:len(raw)]],
                           *every, buffer_id=np.int64(self.buf.buffer_id),
                           aliases=tuple((i, i) for i in range(len(raw)) if i not in unaliased))

    def layout(self, topk_idx):
        T = topk_idx.shape[0]
        R, E = self.num_ranks, self.buf.num_experts
        per_rank, per_expert, is_in = self._call(
            "layout", [topk_idx], [((R,), jnp.int32), ((E,), jnp.int32), ((T, R), jnp.bool_)])
        return Layout(num_tokens_per_rank=per_rank, num_tokens_per_expert=per_expert,
                      is_token_in_rank=is_in)

    def dispatch(self, x, x_scales, topk_idx, topk_weights):
        T, H = x.shape
        K, R = topk_idx.shape[1], self.num_ranks
        C = self.buf.capacity_for(T)
        outs = self._call("dispatch", [x, x_scales, topk_idx, topk_weights], [
            ((C, H), x.dtype), ((C, x_scales.shape[1]), jnp.float32), ((C, K), jnp.int32),
            ((C, K), jnp.float32), ((), jnp.int32), ((self.num_local_experts,), jnp.int32),
            ((T, R), jnp.int32), ((C,), jnp.int32)])
        recv_x, recv_scales, recv_idx, recv_w, num_recv, per_expert, send_pos, recv_src = outs
        return dict(recv_x=recv_x, recv_scales=recv_scales, recv_topk_idx=recv_idx,
                    recv_topk_weights=recv_w, num_recv_tokens=num_recv,
                    num_recv_tokens_per_expert=per_expert,
                    handle=DispatchHandle(send_pos=send_pos, recv_src=recv_src,
                                          num_recv_tokens=num_recv))

    def cached_dispatch(self, x, x_scales, w, handle):
        C = handle.recv_src.shape[0]
        return tuple(self._call(
            "cached_dispatch",
            [x, x_scales, w, handle.send_pos, handle.recv_src, handle.num_recv_tokens],
            [((C, x.shape[1]), x.dtype), ((C, x_scales.shape[1]), jnp.float32),
             ((C, w.shape[1]), jnp.float32)]))

    def combine(self, y, y_w, handle):
        T = handle.send_pos.shape[0]
        return tuple(self._call(
            "combine", [y, y_w, handle.send_pos, handle.recv_src, handle.num_recv_tokens],
            [((T, y.shape[1]), y.dtype), ((T, y_w.shape[1]), jnp.float32)]))

    def _low_latency_dispatch_call(self, target, operands, use_fp8, round_scale):
        """The fused dispatch or its receive half: same results, different operands."""
        H = operands[0].shape[1]
        E_loc, rows = self.num_local_experts, self.num_ranks * self.buf.max_tokens_per_rank
        x_dtype = jnp.float8_e4m3fn if use_fp8 else jnp.bfloat16
        num_scales = H // fp8.CHANNELS_PER_SCALE if use_fp8 else 0
        recv_x, recv_scales, recv_count, recv_src, recv_k = self._call(
            target, operands,
            [((E_loc, rows, H), x_dtype), ((E_loc, rows, num_scales), jnp.float32),
             ((E_loc,), jnp.int32), ((E_loc, rows), jnp.int32), ((E_loc, rows), jnp.int32)],
            use_fp8=bool(use_fp8), round_scale=bool(round_scale))
        return dict(recv_x=recv_x, recv_scales=recv_scales, recv_count=recv_count,
                    recv_src=recv_src, recv_k=recv_k)

    def low_latency_dispatch(self, x, topk_idx, use_fp8, round_scale):
        return self._low_latency_dispatch_call("low_latency_dispatch", [x, topk_idx], use_fp8,
                                               round_scale)

    def low_latency_combine(self, y, topk_idx, topk_weights, handle):
        T, H = topk_idx.shape[0], y.shape[-1]
        (out,) = self._call(
            "low_latency_combine",
            [y, topk_idx, topk_weights, handle.recv_src, handle.recv_k, handle.recv_count],
            [((T, H), jnp.bfloat16)])
        return out

    # Send/receive halves of the two ops above. The send's only result is the ticket [1] int32
    # that the receive takes as an operand (so XLA keeps send -> receive); the receive takes the
    # fused op's operands again where its half reads them (x, y: own rows; the routing). The
    # send's last operand `after`, never read, keeps it after the previous receive of its op.
    def low_latency_dispatch_send(self, x, topk_idx, after, use_fp8, round_scale):
        (ticket,) = self._call("low_latency_dispatch_send", [x, topk_idx, _order(after)],
                               [((1,), jnp.int32)], use_fp8=bool(use_fp8),
                               round_scale=bool(round_scale))
        return ticket

    def low_latency_dispatch_recv(self, x, topk_idx, ticket, use_fp8, round_scale):
        del topk_idx  # the send half consumed it; the receive reads the region and x
        return self._low_latency_dispatch_call("low_latency_dispatch_recv", [x, ticket], use_fp8,
                                               round_scale)

    def low_latency_combine_send(self, y, topk_idx, topk_weights, handle, after):
        del topk_idx, topk_weights  # read by the receive half only
        (ticket,) = self._call(
            "low_latency_combine_send",
            [y, handle.recv_src, handle.recv_k, handle.recv_count, _order(after)],
            [((1,), jnp.int32)])
        return ticket

    def low_latency_combine_recv(self, y, topk_idx, topk_weights, handle, ticket):
        T, H = topk_idx.shape[0], y.shape[-1]
        (out,) = self._call(
            "low_latency_combine_recv",
            [y, topk_idx, topk_weights, handle.recv_src, handle.recv_k, handle.recv_count,
             ticket],
            [((T, H), jnp.bfloat16)])
        return out

