"""The FFI path lowers for CUDA from a CPU machine: jax.export with a symbolic token count."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import shard_spec
from jax.extend import mlir as jex_mlir
from jax.interpreters import mlir
from jax.sharding import Mesh, NamedSharding

import jax_ep
from jax_ep.backends import cuda as _cuda

E, K, H, R = 16, 2, 256, 2


def cpu_mesh():
    return Mesh(np.array(jax.devices("cpu")[:R]), ("ep",))


def normal_buffer(mesh):
    return jax_ep.Buffer(mesh, "ep", num_experts=E, hidden=H, max_tokens_per_rank=4096,
                         num_topk=K, backend="cuda", lowering_only=True)


def low_latency_buffer(mesh):
    return jax_ep.Buffer(mesh, "ep", num_experts=E, hidden=H, max_tokens_per_rank=64,
                         num_topk=K, low_latency=True, backend="cuda", lowering_only=True)


def moe_step(buf):
    def step(x, idx, w):
        d = jax_ep.dispatch(buf, x, idx, w)
        y, _ = jax_ep.combine(buf, d.recv_x, d.handle)
        lay = jax_ep.get_dispatch_layout(buf, idx)
        return y, d.num_recv_tokens[None], lay.num_tokens_per_rank
    return step


def low_latency_step(buf):
    def step(x, idx, w):
        ll = jax_ep.low_latency_dispatch(buf, x, idx, use_fp8=True)
        y = jax_ep.per_token_cast_from_fp8(ll.recv_x, ll.recv_scales)
        return jax_ep.low_latency_combine(buf, y, idx, w, ll.handle)
    return step


def step_args(t, sharding=None):
    """x, topk_idx, topk_weights of ``t`` tokens per rank (an int or a symbolic dimension)."""
    return (jax.ShapeDtypeStruct((R * t, H), jnp.bfloat16, sharding=sharding),
            jax.ShapeDtypeStruct((R * t, K), jnp.int32, sharding=sharding),
            jax.ShapeDtypeStruct((R * t, K), jnp.float32, sharding=sharding))


def export_for_cuda(mesh, fn, arg_shapes):
    """``fn`` under shard_map exported for cuda, as a deserialising process gets it."""
    spec = shard_spec(mesh)
    sharded = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(spec,) * len(arg_shapes),
                                    out_specs=spec))
    return jax.export.deserialize(jax_ep.export_step(sharded, *arg_shapes).serialize())


def refined_call_module(exported, mesh, tokens):
    """Text of ``exported.call`` lowered for cuda at ``tokens`` per rank and shape-refined: the
    first thing compiling it on a GPU does (jax's ``mlir.refine_polymorphic_shapes``)."""
    args = step_args(tokens, NamedSharding(mesh, shard_spec(mesh)))
    module = jax.jit(exported.call).trace(*args).lower(lowering_platforms=("cuda",))
    refined = jex_mlir.refine_polymorphic_shapes(
        mlir.module_to_bytecode(module.compiler_ir("stablehlo")), enable_shape_assertions=True,
        validate_static_shapes=True, enable_shardy=jax.config.jax_use_shardy_partitioner)
    with mlir.make_ir_context():
        return str(mlir.ir.Module.parse(refined))


def test_export_normal_mode_with_symbolic_tokens():
    mesh = cpu_mesh()
    (t,) = jax.export.symbolic_shape("t")
    restored = export_for_cuda(mesh, moe_step(normal_buffer(mesh)), step_args(t))
    text = restored.mlir_module()
    for op in ("dispatch", "combine", "layout"):
        assert f"@{_cuda.target_name(op)}(" in text, op
    assert "jax_ep_dispatch_v2" in text and "has_side_effect = true" in text
    # recv_x of the dispatch: [R*t, H] per rank, i.e. a dynamic leading dimension.
    dispatch_call = re.search(r"custom_call @jax_ep_dispatch_v2\(.*", text).group(0)
    assert f"tensor<?x{H}xbf16>" in dispatch_call
    assert str(restored.in_avals[0].shape[0]) == "2*t"
    assert str(restored.out_avals[0].shape[0]) == "2*t"
    assert restored.platforms == ("cuda",)


def test_export_low_latency_mode():
    mesh = cpu_mesh()
    (t,) = jax.export.symbolic_shape("t")
    text = export_for_cuda(mesh, low_latency_step(low_latency_buffer(mesh)),
                           step_args(t)).mlir_module()
    call = re.search(r"custom_call @jax_ep_low_latency_dispatch_v2\(.*", text).group(0)
    assert "use_fp8 = true" in call and "round_scale = false" in call
    assert f"tensor<{E // R}x{R * 64}x{H}xf8E4M3FN>" in call
    assert f"@{_cuda.target_name('low_latency_combine')}(" in text


@pytest.mark.parametrize("make_buffer,make_step,op,result", [
    (normal_buffer, moe_step, "dispatch", f"tensor<{R * 64}x{H}xbf16>"),
    (low_latency_buffer, low_latency_step, "low_latency_combine", f"tensor<64x{H}xbf16>"),
])
def test_symbolic_export_refines_to_static_shapes(make_buffer, make_step, op, result):
    """Called for a concrete T, the symbolic export refines to static shapes everywhere (with a
    Shardy export our custom calls stayed dynamic and the GPU compile failed)."""
    mesh = cpu_mesh()
    (t,) = jax.export.symbolic_shape("t")
    exported = export_for_cuda(mesh, make_step(make_buffer(mesh)), step_args(t))
    text = refined_call_module(exported, mesh, 64)
    assert not re.findall(r"tensor<[^>]*\?", text)
    call = re.search(rf"custom_call @{_cuda.target_name(op)}\(.*", text).group(0)
    assert result in call


@pytest.mark.parametrize("make_buffer,make_step", [(normal_buffer, moe_step),
                                                   (low_latency_buffer, low_latency_step)])
def test_ops_are_side_effecting_for_xla_and_effect_free_for_jit(make_buffer, make_step):
    """XLA must neither remove nor merge our calls (has_side_effect in the HLO), and the jaxpr
    must carry no JAX effect: jit dispatches an effectful program through Python on every call
    (no C++ fast path): 620-920 us per call of a 2-layer program on an H200, 160-430 without."""
    mesh = cpu_mesh()
    spec = shard_spec(mesh)
    step = jax.jit(jax.shard_map(make_step(make_buffer(mesh)), mesh=mesh,
                                 in_specs=(spec,) * 3, out_specs=spec))
    args = step_args(64, NamedSharding(mesh, spec))
    assert not step.trace(*args).jaxpr.effects
    text = step.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    calls = re.findall(r"custom_call @jax_ep_\w+\(.*", text)
    assert calls and all("has_side_effect = true" in c for c in calls), calls


def test_warmup_program_calls_every_op_of_its_mode():
    """Buffer.warmup() must run every kernel of its mode; jit drops a call whose results are
    unused, so each call's result must leave the warm-up program (lowered for cuda here)."""
    from jax_ep import warmup  # noqa: PLC0415

    mesh = cpu_mesh()
    fn, args = warmup.program(low_latency_buffer(mesh))
    text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    calls = {op: text.count(f"@{_cuda.target_name(op)}(") for op in (
        "layout", "dispatch", "combine", "low_latency_dispatch", "low_latency_combine")}
    assert calls == {"layout": 1, "dispatch": 1, "combine": 1, "low_latency_dispatch": 2,
                     "low_latency_combine": 1}, calls
