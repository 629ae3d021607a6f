"""Bad configuration and bad input: a ValueError naming the argument (docs/api.md, "Bad input")."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ep_mesh
from harness import run_sharded
from jax.sharding import Mesh

import jax_ep
from jax_ep import env

E, K, H, T = 32, 4, 128, 8


def buffer(mesh=None, **overrides):
    args = dict(num_experts=E, hidden=H, max_tokens_per_rank=T, num_topk=K,
                dtype=jnp.float32, backend="reference")
    args.update(overrides)
    return jax_ep.Buffer(mesh or ep_mesh("reference"), overrides.pop("axis", "ep"), **args)


@pytest.mark.parametrize("overrides,message", [
    (dict(num_experts=30), "num_experts .* multiple of the number of ranks"),
    (dict(num_experts=0), "num_experts must be a positive integer"),
    (dict(hidden=100), "hidden must be a multiple of 128"),
    (dict(hidden=32768 + 128, low_latency=True), "hidden must be at most 32768 with low_latency"),
    (dict(max_tokens_per_rank=0), "max_tokens_per_rank must be a positive integer"),
    (dict(num_topk=33), "num_topk must be at most"),
    (dict(dtype=jnp.float16), "dtype must be bfloat16 or float32"),
    (dict(capacity=8 * T + 1), "capacity must be at most"),
    (dict(backend="tpu"), "backend must be one of"),
    (dict(timeout_s=0), "timeout_s must be positive"),
])
def test_buffer_rejects_bad_configuration(overrides, message):
    with pytest.raises(ValueError, match=message):
        buffer(**overrides)


@pytest.mark.parametrize("overrides", [
    dict(num_experts=30), dict(hidden=100), dict(num_topk=33), dict(max_tokens_per_rank=0),
    dict(hidden=32768 + 128, low_latency=True), dict(capacity=8 * T + 1),
])
def test_buffer_and_the_reports_spec_share_one_check(overrides):
    """jax_ep.Buffer and env.BufferSpec (what jax-ep-env sizes) run the same rules
    (jax_ep.system.config.check_config): the same configuration, the same error."""
    with pytest.raises(ValueError) as from_buffer:
        buffer(**overrides)
    spec = dict(num_ranks=8, num_experts=E, hidden=H, max_tokens_per_rank=T, num_topk=K,
                dtype_bytes=4)
    with pytest.raises(ValueError) as from_spec:
        env.BufferSpec(**{**spec, **overrides})
    assert str(from_buffer.value) == str(from_spec.value)


def test_buffer_rejects_missing_axis_and_non_mesh():
    mesh = ep_mesh("reference")
    with pytest.raises(ValueError, match="axis_name 'experts' is not an axis"):
        jax_ep.Buffer(mesh, "experts", num_experts=E, hidden=H, max_tokens_per_rank=T,
                      num_topk=K, backend="reference")
    with pytest.raises(ValueError, match="mesh must be a jax.sharding.Mesh"):
        jax_ep.Buffer("ep", "ep", num_experts=E, hidden=H, max_tokens_per_rank=T,
                      num_topk=K, backend="reference")


def test_the_reference_backend_has_one_name():
    """"reference" is the pure-JAX backend's one name (Buffer.backend, the demo's --backend,
    bench_ep's label); "xla", its earlier name, still selects it and reads back as "reference"."""
    assert jax_ep.buffer.BACKENDS == ("auto", "cuda", "reference")
    assert buffer(backend="reference").backend == "reference"
    assert buffer(backend="auto").backend == "reference"  # CPU devices
    old = buffer(backend="xla")
    assert old.backend == "reference" and "backend='reference'" in repr(old)
    with pytest.raises(ValueError, match=r"backend must be one of \('auto', 'cuda', "
                                         r"'reference'\), got 'ref'"):
        buffer(backend="ref")


def test_a_buffer_whose_constructor_failed_has_a_repr():
    """What a traceback's locals or a debugger show of a Buffer whose constructor raised."""
    with pytest.raises(ValueError, match="backend must be one of") as info:
        buffer(backend="tpu")
    tb = info.tb
    while tb.tb_next is not None and "self" not in tb.tb_frame.f_locals:
        tb = tb.tb_next
    half_built = tb.tb_frame.f_locals["self"]
    assert isinstance(half_built, jax_ep.Buffer)
    assert repr(half_built) == "Buffer(<constructor failed>)"


def test_ops_outside_shard_map_say_where_to_call_them():
    """The global batch passed outside shard_map: each op says to call it inside shard_map (not
    that the 64 tokens are more than max_tokens_per_rank=8), jitted or not; a shard_map over
    another number of ranks says so."""
    mesh = ep_mesh("reference")
    buf = buffer(mesh)
    ll_buf = buffer(mesh, dtype=jnp.bfloat16, low_latency=True)
    x, idx, w = (a.reshape(-1, *a.shape[2:]) for a in _inputs())
    where = "runs per rank: call it inside jax.shard_map manual over the Buffer's axis 'ep'"
    calls = {
        "dispatch": lambda: jax_ep.dispatch(buf, x, idx, w),
        "get_dispatch_layout": lambda: jax_ep.get_dispatch_layout(buf, idx),
        "low_latency_dispatch": lambda: jax_ep.low_latency_dispatch(
            ll_buf, x.astype(jnp.bfloat16), idx),
    }
    for op, call in calls.items():
        with pytest.raises(ValueError, match=f"{op} {where}"):
            call()
        with pytest.raises(ValueError, match=f"{op} {where}"):
            jax.jit(call)()
    half = Mesh(np.array(jax.devices("cpu")[:4]), ("ep",))
    with pytest.raises(ValueError, match="dispatch: the shard_map's axis 'ep' has 4 ranks, the "
                                         "Buffer's mesh 8"):
        run_sharded(half, lambda x, i, w: jax_ep.dispatch(buf, x, i, w).recv_x,
                    *(a[:4] for a in _inputs()))


def test_cuda_backend_on_cpu_names_the_fix():
    cpu_mesh = Mesh(np.array(jax.devices("cpu")), ("ep",))
    with pytest.raises(ValueError, match="backend='cuda' needs every mesh device to be a CUDA"):
        jax_ep.Buffer(cpu_mesh, "ep", num_experts=E, hidden=H, max_tokens_per_rank=T,
                      num_topk=K, backend="cuda")


def _inputs(tokens=T, hidden=H, dtype=np.float32, idx_dtype=np.int32, topk=K):
    x = np.zeros((8, tokens, hidden), dtype)
    idx = np.zeros((8, tokens, topk), idx_dtype)
    w = np.zeros((8, tokens, topk), np.float32)
    return x, idx, w


@pytest.mark.parametrize("inputs,message", [
    (_inputs(dtype=jnp.bfloat16), "x must have dtype float32, got bfloat16"),
    (_inputs(hidden=256), r"x must have shape \[\*, 128\], got \[8, 256\]"),
    (_inputs(tokens=T + 1), "more than the Buffer's max_tokens_per_rank=8"),
    (_inputs(idx_dtype=np.float32), "topk_idx must have dtype int32"),
    (_inputs(topk=K + 1), r"topk_idx must have shape \[8, 4\]"),
])
def test_dispatch_rejects_bad_input(inputs, message):
    mesh = ep_mesh("reference")
    buf = buffer(mesh)
    with pytest.raises(ValueError, match=message):
        run_sharded(mesh, lambda x, i, w: jax_ep.dispatch(buf, x, i, w).recv_x, *inputs)


def test_combine_and_handle_errors():
    mesh = ep_mesh("reference")
    buf = buffer(mesh)
    x, idx, w = _inputs()

    def wrong_rows(x, idx, w):
        d = jax_ep.dispatch(buf, x, idx, w)
        return jax_ep.combine(buf, d.recv_x[:-1], d.handle)[0]

    with pytest.raises(ValueError, match=r"y must have shape \[64, 128\], got \[63, 128\]"):
        run_sharded(mesh, wrong_rows, x, idx, w)
    with pytest.raises(ValueError, match="handle must be the DispatchHandle"):
        run_sharded(mesh, lambda x: jax_ep.combine(buf, x, handle=(1, 2))[0], x)
    with pytest.raises(ValueError, match="either handle"):
        run_sharded(mesh, lambda x, i, w: jax_ep.dispatch(
            buf, x, i, w, handle=jax_ep.dispatch(buf, x, i, w).handle).recv_x, x, idx, w)


def test_fp8_pair_is_checked():
    mesh = ep_mesh("reference")
    buf = buffer(mesh, dtype=jnp.bfloat16)
    x, idx, w = _inputs()
    scales = np.zeros((8, T, H // 128 + 1), np.float32)
    x8 = x.astype(jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"x\[1\] \(scales\) must have shape \[8, 1\]"):
        run_sharded(mesh, lambda a, s, i, w: jax_ep.dispatch(buf, (a, s), i, w).recv_x,
                    x8, scales, idx, w)


def test_closed_buffer_raises():
    mesh = ep_mesh("reference")
    buf = buffer(mesh)
    buf.close()
    x, idx, w = _inputs()
    with pytest.raises(ValueError, match="is closed"):
        run_sharded(mesh, lambda x, i, w: jax_ep.dispatch(buf, x, i, w).recv_x, x, idx, w)


def test_fp8_cast_exactly_as_specified():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 512)).astype(np.float32)
    x[0, :128] = 0.0          # amax floor 1e-4
    x[1, 128:256] *= 1000.0   # large block
    for round_scale in (False, True):
        x8, scales = jax.jit(jax_ep.per_token_cast_to_fp8, static_argnums=1)(x, round_scale)
        blocks = x.reshape(4, 4, 128)
        want = np.maximum(np.abs(blocks).max(-1), np.float32(1e-4)) / np.float32(448.0)
        if round_scale:
            want = np.exp2(np.ceil(np.log2(want.astype(np.float64)))).astype(np.float32)
            assert np.all(np.log2(np.asarray(scales)) == np.round(np.log2(np.asarray(scales))))
        # XLA turns the division by the constant 448 into a multiplication by its reciprocal:
        # at most one float32 ulp apart.
        np.testing.assert_allclose(np.asarray(scales), want, rtol=2.4e-7, atol=0)
        back = np.asarray(x8).astype(np.float32).reshape(4, 4, 128) * want[..., None]
        np.testing.assert_allclose(back.reshape(4, 512), x, rtol=0.07, atol=1e-6)
