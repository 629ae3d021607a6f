"""jax_ep.aot_compile: the compiled step equals the jitted one, from arrays or abstract shapes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ep_mesh
from harness import shard_spec
from jax.sharding import NamedSharding

import jax_ep
from jax_ep import testing as oracle

E, K, T, H = 16, 2, 8, 128


@pytest.mark.parametrize("abstract", [False, True])
def test_aot_compiled_step_matches_jit(backend, rng, abstract):
    mesh = ep_mesh(backend)
    R = mesh.shape["ep"]
    buf = jax_ep.Buffer(mesh, "ep", num_experts=E, hidden=H, max_tokens_per_rank=T, num_topk=K,
                        backend=backend, report_errors=False)
    spec = shard_spec(mesh)

    def step(x, idx, w):
        d = jax_ep.dispatch(buf, x, idx, w)
        return jax_ep.combine(buf, d.recv_x, d.handle)[0]

    jitted = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec))
    idx, w = oracle.make_routing("with_minus_one", rng, R, T, E, K)
    x = rng.standard_normal((R * T, H)).astype(np.float32)
    sharding = NamedSharding(mesh, spec)
    args = [jax.device_put(jnp.asarray(a).reshape(R * T, -1).astype(dt), sharding)
            for a, dt in ((x, jnp.bfloat16), (idx, jnp.int32), (w, jnp.float32))]
    example = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in args]
    compiled = jax_ep.aot_compile(jitted, *(example if abstract else args))
    np.testing.assert_array_equal(np.asarray(compiled(*args)), np.asarray(jitted(*args)))
    with pytest.raises(TypeError):  # compiled for exactly these shapes: no retrace
        compiled(args[0][: R * (T // 2)], args[1][: R * (T // 2)], args[2][: R * (T // 2)])
    buf.close()
