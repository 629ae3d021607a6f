"""Stress and lifecycle (issue 9): many random and adversarial routings in one compiled program,
each equal to the oracle; Buffers created and closed without leaking device memory.

The stress test runs on both backends (50 iterations on CPU for CI, 1,000 with `-m gpu`).
"""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import ep_mesh, require_gpus
from harness import run_sharded

import jax_ep
from jax_ep import testing as oracle

E, K, T, H = 32, 4, 16, 256


def test_many_adversarial_routings_match_the_oracle(backend):
    mesh = ep_mesh(backend)
    R = mesh.shape["ep"]
    iterations = 1000 if backend == "cuda" else 50
    buf = jax_ep.Buffer(mesh, "ep", num_experts=E, hidden=H, max_tokens_per_rank=T, num_topk=K,
                        dtype=jnp.bfloat16, backend=backend, report_errors=False)
    rng = np.random.default_rng(99)

    def step(x, idx, w):
        d = jax_ep.dispatch(buf, x, idx, w)
        return d, jax_ep.combine(buf, d.recv_x, d.handle)[0]

    for i in range(iterations):
        kind = oracle.ROUTINGS[i % len(oracle.ROUTINGS)]
        idx, w = oracle.make_routing(kind, rng, R, T, E, K)
        x = rng.standard_normal((R, T, H)).astype(ml_dtypes.bfloat16)
        x[:, i % T, :3] = [np.nan, np.inf, -np.inf]  # special values move bit-exactly
        d, y = run_sharded(mesh, step, x, idx, w)
        for r, exp in enumerate(oracle.dispatch(x, idx, w, E)):
            assert np.array_equal(d.recv_x[r].view(np.uint16), exp["recv_x"].view(np.uint16)), i
            assert np.array_equal(d.handle.recv_src[r], exp["recv_src"]), (i, kind)
            assert np.array_equal(d.recv_topk_idx[r], exp["recv_topk_idx"]), (i, kind)
        finite = np.isfinite(x.astype(np.float32)).all(-1)  # tokens without special values
        want = oracle.combine(d.recv_x.astype(np.float32), d.handle.recv_src, T)
        np.testing.assert_allclose(y.astype(np.float64)[finite], want[finite], rtol=1e-2,
                                   atol=1e-2)
    buf.close()


@pytest.mark.gpu
def test_hundred_buffers_return_device_memory():
    """Creating and closing 100 Buffers (normal + low latency) leaves free device memory where it
    started (within 1 MiB on every GPU)."""
    gpus = require_gpus(1)
    from jax_ep import _cuda_driver

    driver, reason = _cuda_driver.get_driver()
    if driver is None:
        pytest.skip(reason)
    mesh = ep_mesh("cuda")
    ordinals = [d.local_hardware_id for d in gpus[: mesh.devices.size]]

    def free():
        return [driver.free_memory(o) for o in ordinals]

    def make_and_close():
        buf = jax_ep.Buffer(mesh, "ep", num_experts=E, hidden=H, max_tokens_per_rank=T,
                            num_topk=K, low_latency=True, backend="cuda")
        assert buf.workspace_bytes > 0
        buf.close()

    make_and_close()  # first-time allocations of the runtime itself
    before = free()
    for _ in range(100):
        make_and_close()
    after = free()
    for b, a in zip(before, after, strict=True):
        assert abs(a - b) <= 1 << 20, (before, after)
