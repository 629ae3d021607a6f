"""The FFI path lowers for CUDA from a CPU machine: jax.export with a symbolic token count."""

import re

import jax
import jax.numpy as jnp
import numpy as np
from harness import shard_spec
from jax.sharding import Mesh

import jax_ep
from jax_ep import _cuda

E, K, H, R = 16, 2, 256, 2


def moe_step(buf):
    def step(x, idx, w):
        d = jax_ep.dispatch(buf, x, idx, w)
        y, _ = jax_ep.combine(buf, d.recv_x, d.handle)
        lay = jax_ep.get_dispatch_layout(buf, idx)
        return y, d.num_recv_tokens[None], lay.num_tokens_per_rank
    return step


def export_for_cuda(buf, mesh, fn, arg_shapes):
    spec = shard_spec(mesh)
    sharded = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(spec,) * len(arg_shapes),
                                    out_specs=spec))
    return jax.export.export(sharded, platforms=("cuda",),
                            disabled_checks=jax_ep.export_safety_checks())(*arg_shapes)


def test_export_normal_mode_with_symbolic_tokens():
    mesh = Mesh(np.array(jax.devices("cpu")[:R]), ("ep",))
    buf = jax_ep.Buffer(mesh, "ep", num_experts=E, hidden=H, max_tokens_per_rank=4096,
                        num_topk=K, backend="cuda", lowering_only=True)
    (t,) = jax.export.symbolic_shape("t")
    args = (jax.ShapeDtypeStruct((R * t, H), jnp.bfloat16),
            jax.ShapeDtypeStruct((R * t, K), jnp.int32),
            jax.ShapeDtypeStruct((R * t, K), jnp.float32))
    exported = export_for_cuda(buf, mesh, moe_step(buf), args)
    restored = jax.export.deserialize(exported.serialize())
    text = restored.mlir_module()
    for op in ("dispatch", "combine", "layout"):
        assert f"@{_cuda.target_name(op)}(" in text, op
    assert "jax_ep_dispatch_v1" in text and "has_side_effect = true" in text
    # recv_x of the dispatch: [R*t, H] per rank, i.e. a dynamic leading dimension.
    dispatch_call = re.search(r"custom_call @jax_ep_dispatch_v1\(.*", text).group(0)
    assert f"tensor<?x{H}xbf16>" in dispatch_call
    assert str(restored.in_avals[0].shape[0]) == "2*t"
    assert str(restored.out_avals[0].shape[0]) == "2*t"
    assert restored.platforms == ("cuda",)


def test_export_low_latency_mode():
    mesh = Mesh(np.array(jax.devices("cpu")[:R]), ("ep",))
    buf = jax_ep.Buffer(mesh, "ep", num_experts=E, hidden=H, max_tokens_per_rank=64,
                        num_topk=K, low_latency=True, backend="cuda", lowering_only=True)

    def step(x, idx, w):
        ll = jax_ep.low_latency_dispatch(buf, x, idx, use_fp8=True)
        y = jax_ep.per_token_cast_from_fp8(ll.recv_x, ll.recv_scales)
        return jax_ep.low_latency_combine(buf, y, idx, w, ll.handle)

    (t,) = jax.export.symbolic_shape("t")
    args = (jax.ShapeDtypeStruct((R * t, H), jnp.bfloat16),
            jax.ShapeDtypeStruct((R * t, K), jnp.int32),
            jax.ShapeDtypeStruct((R * t, K), jnp.float32))
    text = jax.export.deserialize(export_for_cuda(buf, mesh, step, args).serialize()
                                  ).mlir_module()
    call = re.search(r"custom_call @jax_ep_low_latency_dispatch_v1\(.*", text).group(0)
    assert "use_fp8 = true" in call and "round_scale = false" in call
    assert f"tensor<{E // R}x{R * 64}x{H}xf8E4M3FN>" in call
    assert f"@{_cuda.target_name('low_latency_combine')}(" in text
