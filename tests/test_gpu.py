"""CUDA-backend checks beyond the shared suite: many routings, model-sized hidden dims, and
CUDA-graph (XLA command buffer) replay. Run with `pytest -m gpu` on a machine with GPUs."""

import os
import re
import subprocess
import sys
import time

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import ep_mesh, require_gpus
from harness import run_sharded
from test_low_latency import E as LL_E
from test_low_latency import K as LL_K
from test_low_latency import check_low_latency_dispatch, weighted_copies
from test_low_latency import make_buffer as ll_buffer
from test_low_latency_split import assert_dispatch_equal

import jax_ep
from jax_ep import testing as oracle

pytestmark = pytest.mark.gpu


def _check_against_oracle(d, y, x, idx, w, experts, tokens):
    expected = oracle.dispatch(x, idx, w, experts)
    for r, exp in enumerate(expected):
        assert np.array_equal(d.recv_x[r].view(np.uint16), exp["recv_x"].view(np.uint16))
        assert np.array_equal(d.recv_topk_idx[r], exp["recv_topk_idx"])
        assert np.array_equal(d.recv_topk_weights[r], exp["recv_topk_weights"])
        assert np.array_equal(d.handle.recv_src[r], exp["recv_src"])
        assert np.array_equal(d.num_recv_tokens_per_expert[r], exp["num_recv_tokens_per_expert"])
    oracle.assert_combine_close(y, d.recv_x, d.handle.recv_src, tokens)


@pytest.mark.stress  # test_normal.py runs every routing and dtype once
def test_two_hundred_random_routings():
    require_gpus(1)
    mesh = ep_mesh("cuda")
    R, T, H, E, K = mesh.shape["ep"], 64, 256, 64, 8
    buf = jax_ep.Buffer(mesh, "ep", num_experts=E, hidden=H, max_tokens_per_rank=T,
                        num_topk=K, dtype=jnp.bfloat16, backend="cuda")
    rng = np.random.default_rng(1234)

    def step(x, idx, w):
        d = jax_ep.dispatch(buf, x, idx, w)
        return d, jax_ep.combine(buf, d.recv_x, d.handle)[0]

    for i in range(200):
        kind = oracle.ROUTINGS[i % len(oracle.ROUTINGS)]
        idx, w = oracle.make_routing(kind, rng, R, T, E, K)
        x = rng.standard_normal((R, T, H)).astype(ml_dtypes.bfloat16)
        d, y = run_sharded(mesh, step, x, idx, w)
        _check_against_oracle(d, y, x, idx, w, E, T)
    buf.check()


@pytest.mark.stress
@pytest.mark.parametrize("hidden", [2048, 4096, 7168])
def test_model_hidden_sizes(hidden):
    require_gpus(1)
    mesh = ep_mesh("cuda")
    R, T, E, K = mesh.shape["ep"], 128, 256, 8
    buf = jax_ep.Buffer(mesh, "ep", num_experts=E, hidden=hidden, max_tokens_per_rank=T,
                        num_topk=K, dtype=jnp.bfloat16, low_latency=True, backend="cuda")
    rng = np.random.default_rng(hidden)
    idx, w = oracle.make_routing("uniform", rng, R, T, E, K)
    x = rng.standard_normal((R, T, hidden)).astype(ml_dtypes.bfloat16)

    def step(x, idx, w):
        d = jax_ep.dispatch(buf, x, idx, w)
        ll = jax_ep.low_latency_dispatch(buf, x, idx, use_fp8=False)
        return d, jax_ep.combine(buf, d.recv_x, d.handle)[0], ll

    d, y, ll = run_sharded(mesh, step, x, idx, w)
    _check_against_oracle(d, y, x, idx, w, E, T)
    for r, exp in enumerate(oracle.low_latency_dispatch(x, idx, E, T)):
        assert np.array_equal(ll.recv_count[r], exp["recv_count"])
        assert np.array_equal(ll.recv_src[r], exp["recv_src"])
        for e, n in enumerate(exp["recv_count"]):
            if n:
                assert np.array_equal(ll.recv_x[r][e][:n].view(np.uint16),
                                      exp["recv_x"][e].view(np.uint16))
    buf.close()




@pytest.mark.parametrize("use_fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize(("tokens", "hidden"), [
    (1, 7168), pytest.param(128, 7168, marks=pytest.mark.stress),
    pytest.param(1024, 16384, marks=pytest.mark.stress)])
def test_low_latency_ops_at_model_sizes(tokens, hidden, use_fp8):
    """The low-latency ops, fused and split, against the oracle at the shapes that pick each
    split of the kernels' work: T=1 (a pair per block, the owner's rows over several blocks),
    T=128 (pairs spanning tokens, the receive plan), T=1024 at H=16384 (x staged in shared
    memory in several passes, owner passes over several tokens)."""
    require_gpus(1)
    mesh = ep_mesh("cuda")
    R = mesh.shape["ep"]
    buf = ll_buffer("cuda", mesh, hidden, tokens)
    rng = np.random.default_rng(tokens)
    idx, w = oracle.make_routing("with_minus_one", rng, R, tokens, LL_E, LL_K)
    x = rng.standard_normal((R, tokens, hidden)).astype(ml_dtypes.bfloat16)
    x[..., :128] *= 100.0

    def step(x, idx, w):
        d = jax_ep.low_latency_dispatch(buf, x, idx, use_fp8=use_fp8)
        split = jax_ep.low_latency_dispatch_recv(
            buf, jax_ep.low_latency_dispatch_send(buf, x, idx, use_fp8=use_fp8))
        rows = d if not use_fp8 else jax_ep.low_latency_dispatch(buf, x, idx, use_fp8=False)
        out = jax_ep.low_latency_combine(buf, rows.recv_x, idx, w, rows.handle)
        out_split = jax_ep.low_latency_combine_recv(
            buf, jax_ep.low_latency_combine_send(buf, rows.recv_x, idx, w, rows.handle))
        return d, split, out, out_split

    d, split, out, out_split = run_sharded(mesh, step, x, idx, w)
    check_low_latency_dispatch(d, x, idx, tokens, use_fp8, False, "cuda")
    assert_dispatch_equal(split, d, use_fp8)
    oracle.assert_sums_close(out, *weighted_copies(x, idx, w), term_rtol=oracle.BF16_OUT_RTOL)
    assert np.array_equal(out_split.view(np.uint16), out.view(np.uint16))
    buf.check()
    buf.close()


@pytest.mark.parametrize("ops", ["fused", "split", "normal"])
def test_ops_replay_in_command_buffers(ops):
    """100 steps with changing inputs under XLA command buffers that include custom calls, each
    checked against the oracle; the handlers report that XLA captured them into CUDA graphs.
    ``fused``: the low-latency ops; ``split``: their send/receive halves; ``normal``: layout,
    dispatch and combine."""
    require_gpus(1)
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false",
               XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL "
                         "--xla_gpu_graph_min_graph_size=1")
    script = os.path.join(os.path.dirname(__file__), "command_buffer_replay.py")
    extra = [] if ops == "fused" else [ops]
    result = subprocess.run([sys.executable, script, "100", *extra], env=env,
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "steps ok 100" in result.stdout
    match = re.search(r"handler calls (\d+) captured (\d+)", result.stdout)
    assert match and int(match.group(2)) > 0, f"not captured into CUDA graphs: {result.stdout}"


def _run_script(args, env_extra=None, timeout=300):
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", **(env_extra or {}))
    result = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, (result.stdout[-2000:] + result.stderr[:3000] + "\n...\n"
                                    + result.stderr[-3000:])
    return result.stdout


def test_exported_step_runs_in_a_fresh_process(tmp_path):
    """jax.export with a symbolic token count: serialised in one process, deserialised and run
    for T=64 and T=4096 in another, equal to the oracle."""
    require_gpus(1)
    script = os.path.join(os.path.dirname(__file__), "export_roundtrip.py")
    path = str(tmp_path / "step.jax_exported")
    assert "exported" in _run_script([script, "export", path])
    out = _run_script([script, "run", path])
    assert "ran T = 64" in out and "ran T = 4096" in out


def test_persistent_compilation_cache_second_process(tmp_path):
    """A second process that loads the step from the persistent compilation cache is correct."""
    require_gpus(1)
    script = os.path.join(os.path.dirname(__file__), "command_buffer_replay.py")
    cache = {"JAX_COMPILATION_CACHE_DIR": str(tmp_path / "cache"),
             "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
             "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
    assert "steps ok 3" in _run_script([script, "3"], cache)
    assert any((tmp_path / "cache").iterdir()), "nothing was written to the cache"
    assert "steps ok 3" in _run_script([script, "3"], cache)


@pytest.mark.parametrize("mode,phase", [("normal", "dispatch count exchange"),
                                        ("low_latency", "low-latency dispatch receive"),
                                        ("low_latency_split", "low-latency dispatch receive"),
                                        ("low_latency_combine_split",
                                         "low-latency combine receive")])
def test_missing_peer_times_out_with_a_named_phase(mode, phase):
    """Rank 1 never runs its program: rank 0's wait ends after the timeout (2 s) with an error
    naming the phase and the missing peer, instead of hanging."""
    require_gpus(2)
    script = os.path.join(os.path.dirname(__file__), "fault_missing_peer.py")
    start = time.perf_counter()
    out = _run_script([script, mode], timeout=120)
    assert time.perf_counter() - start < 90
    assert "waited for rank 1" in out and phase in out, out
