"""Digests of every op's outputs on fixed inputs, to compare process layouts bit for bit.

    python tests/multiprocess_digest.py [reference|cuda] [normal|low_latency]  # one process
    python -m jax_ep.launch -n 2 -- python tests/multiprocess_digest.py cuda   # one per GPU

Process 0 prints one line ``DIGEST <name> <sha256>`` per output (normal dispatch bf16/fp8,
cached dispatch, combine, layout, low-latency dispatch fp8/bf16 and combine, gradients of a
dispatch+combine loss); the lines of the two layouts must be equal (tests/test_gpu_multiprocess.py).
With ``normal`` only the normal-mode ops (6 lines), with ``low_latency`` only the low-latency
ops (3 lines): what a device transport carries, one Buffer at a time
(tests/test_device_transport.py). A process that fails leaves at once, without waiting for its
peers at exit; ``DIGEST_FAIL_PROCESS=<index>`` makes that process fail first thing (a test of
that). ``JAX_EP_TRANSPORT_MUTANT=<mutant>`` makes the put-protocol kernels of every Buffer's ops
break one rule (set through the test module jax_ep._C_testing), so that a test shows the
emulated transport catches it; a process that fails then prints, before it leaves, one
``CAUGHT`` line per timed-out wait (rank, peer, phase) and per fault the emulated transport's
proxies found, from its own ranks. ``DIGEST_SAVE_DIR=<folder>`` makes process 0 also save the
sums (combine, low-latency combine, the gradient) as ``<name>.npy``, with ``<name>.magnitude.npy``
(the same sum of the terms' absolute values, by the NumPy oracle), so that a test compares them
per element (``jax_ep.testing.assert_sums_close``) with another layout's.
``DIGEST_TOKENS=<T>`` sets the tokens per rank (default 64), so that a test can make a call
larger than a small normal-mode window (``JAX_EP_NORMAL_WINDOW_ROWS``).
"""

import dataclasses
import hashlib
import os
import sys
import traceback

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
if os.environ.get("JAX_EP_NUM_PROCESSES"):
    from jax_ep import launch

    launch.initialize_from_env()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
from harness import run_sharded  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

import jax_ep  # noqa: E402
from jax_ep import settings  # noqa: E402
from jax_ep import testing as oracle  # noqa: E402

E, K, H = 32, 4, 512
T = int(os.environ.get("DIGEST_TOKENS", "64"))


def specified(out):
    """``out`` with the low-latency rows past ``recv_count`` zeroed: the contract leaves them
    unspecified (they hold whatever the memory held). Normal-mode padding rows are zero by
    contract and stay in the digest."""
    if not isinstance(out, jax_ep.LowLatencyDispatched):
        return out
    rows = np.arange(out.recv_x.shape[2])
    mask = (rows[None, None, :] < np.asarray(out.recv_count)[..., None])[..., None]
    scales = None if out.recv_scales is None else np.where(mask, out.recv_scales, 0)
    return dataclasses.replace(out, recv_x=np.where(mask, out.recv_x, 0), recv_scales=scales)


def digest(name, tree):
    tree = specified(tree)
    sha = hashlib.sha256()
    for leaf in jax.tree.leaves(tree):
        leaf = np.ascontiguousarray(np.asarray(leaf))
        sha.update(str((leaf.shape, leaf.dtype)).encode())
        sha.update(leaf.tobytes())
    if jax.process_index() == 0:
        print(f"DIGEST {name} {sha.hexdigest()}", flush=True)


def save_sum(name, value, magnitude):
    """Process 0 saves a sum and its magnitude under DIGEST_SAVE_DIR, when that is set."""
    folder = os.environ.get("DIGEST_SAVE_DIR")
    if folder and jax.process_index() == 0:
        np.save(os.path.join(folder, f"{name}.npy"), np.asarray(value).astype(np.float32))
        np.save(os.path.join(folder, f"{name}.magnitude.npy"),
                np.asarray(magnitude).astype(np.float32))


BUFFERS = []  # every Buffer made, for print_evidence


def register_emulated_transport():
    """Over JAX_EP_DEVICE_TRANSPORT=emulated: hand the test module's emulated transport to
    jax_ep._C (which carries none) before the first Buffer."""
    if settings.value("JAX_EP_DEVICE_TRANSPORT") == "emulated":
        from jax_ep import _C_testing  # noqa: PLC0415

        _C_testing.register_emulated_transport()


def with_mutant(buf):
    """``buf``, its put-protocol kernels made to break the rule JAX_EP_TRANSPORT_MUTANT names
    (from its first op on), when that is set."""
    BUFFERS.append(buf)
    mutant = settings.value("JAX_EP_TRANSPORT_MUTANT")
    if mutant != "none" and buf.backend == "cuda":  # the reference backend has no kernels
        from jax_ep import _C_testing  # noqa: PLC0415

        _C_testing.set_transport_mutant(buf.buffer_id, mutant)
    return buf


def print_evidence():
    """After a failure, what names the rule a caught mutant broke, from this process's ranks
    alone (no collective: a peer may be gone): every wait that timed out (the rank, the peer it
    waited for, the phase) and every fault the emulated transport's proxies found. Host memory
    only: a device whose kernel trapped has lost its context."""
    from jax_ep.backends import cuda  # noqa: PLC0415

    module, _ = cuda.load_extension()
    for buf in BUFFERS:
        if module is None or buf.backend != "cuda":
            continue
        try:
            records = [r for r in module.read_timeouts(buf.buffer_id) if r["timed_out"]]
            faults = list(module.take_transport_errors(buf.buffer_id))
        except RuntimeError:  # closed
            continue
        for r in records:
            phase = cuda.wait_phase_names().get(r["timeout_phase"], r["timeout_phase"])
            print(f"CAUGHT timeout: rank {r['rank']} waited for rank {r['timeout_peer']} in "
                  f"{phase} (call {r['seq']})", flush=True)
        for fault in faults:
            print(f"CAUGHT transport: {fault}", flush=True)


def main(backend, parts="all", devices=None):
    """Prints the digests of ``parts`` on ``backend`` over ``devices`` (default: every device of
    the backend's platform)."""
    if os.environ.get("DIGEST_FAIL_PROCESS") == str(jax.process_index()):
        raise RuntimeError("this process fails on purpose (DIGEST_FAIL_PROCESS)")
    if backend == "cuda":
        register_emulated_transport()
    if devices is None:
        devices = jax.devices("gpu") if backend == "cuda" else jax.devices("cpu")
    mesh = Mesh(np.array(devices), ("ep",))
    R = mesh.shape["ep"]
    rng = np.random.default_rng(2026)
    idx, w = oracle.make_routing("with_minus_one", rng, R, T, E, K)
    x = rng.standard_normal((R, T, H)).astype(ml_dtypes.bfloat16)
    x8, s8 = (np.asarray(a) for a in jax.vmap(jax_ep.per_token_cast_to_fp8)(jnp.asarray(x)))

    if parts in ("all", "normal"):
        normal_mode(mesh, backend, x, x8, s8, idx, w)
    if parts in ("all", "low_latency"):
        low_latency_mode(mesh, backend, x, idx, w)


def normal_mode(mesh, backend, x, x8, s8, idx, w):
    buf = with_mutant(jax_ep.Buffer(mesh, "ep", num_experts=E, hidden=H, max_tokens_per_rank=T,
                                    num_topk=K, backend=backend, report_errors=False))

    def normal(x, idx, w):
        d = jax_ep.dispatch(buf, x, idx, w)
        y, y_w = jax_ep.combine(buf, d.recv_x, d.handle, d.recv_topk_weights)
        again = jax_ep.dispatch(buf, x, handle=d.handle)
        layout = jax_ep.get_dispatch_layout(buf, idx)
        return d, y, y_w, again, layout

    d, y, y_w, again, layout = run_sharded(mesh, normal, x, idx, w)
    digest("dispatch_bf16", d)
    digest("combine", (y, y_w))
    recv_src = np.asarray(d.handle.recv_src)
    save_sum("combine", y, oracle.combine(np.abs(np.asarray(d.recv_x, np.float64)), recv_src, T))
    save_sum("combine_weights", y_w, oracle.combine(
        np.abs(np.asarray(d.recv_topk_weights, np.float64)), recv_src, T))
    digest("cached_dispatch", again)
    digest("layout", layout)
    digest("dispatch_fp8", run_sharded(
        mesh, lambda a, s, i, w: jax_ep.dispatch(buf, (a, s), i, w), x8, s8, idx, w))

    def loss_grad(x, idx, w):
        def loss(x):
            d = jax_ep.dispatch(buf, x, idx, w)
            y, _ = jax_ep.combine(buf, d.recv_x * 2, d.handle)
            return jnp.sum(y.astype(jnp.float32) ** 2)
        return jax.grad(loss)(x)

    grad = run_sharded(mesh, loss_grad, x, idx, w)
    digest("gradient", grad)
    # The loss's combined rows are 2 * y, so d loss / d x[t] sums, over the ranks that received
    # t, the term 2 * 2 * (2 * y[t]): the terms' absolute sum is 8 * |y[t]| * (those ranks).
    ranks_of_token = np.asarray(layout.is_token_in_rank).sum(axis=-1, keepdims=True)
    save_sum("gradient", grad, 8 * np.abs(np.asarray(y, np.float64)) * ranks_of_token)
    buf.check()  # over the emulated transport: what its proxies found, if anything
    buf.close()


def low_latency_mode(mesh, backend, x, idx, w):
    ll = with_mutant(jax_ep.Buffer(mesh, "ep", num_experts=E, hidden=H, max_tokens_per_rank=T,
                                   num_topk=K, low_latency=True, backend=backend,
                                   report_errors=False))

    def low_latency(x, idx, w):
        d8 = jax_ep.low_latency_dispatch(ll, x, idx, use_fp8=True)
        d16 = jax_ep.low_latency_dispatch(ll, x, idx, use_fp8=False)
        out = jax_ep.low_latency_combine(ll, d16.recv_x, idx, w, d16.handle)
        return d8, d16, out

    d8, d16, out = run_sharded(mesh, low_latency, x, idx, w)
    digest("low_latency_dispatch_fp8", d8)
    digest("low_latency_dispatch_bf16", d16)
    digest("low_latency_combine", out)
    rows = np.abs(np.asarray(d16.recv_x, np.float64))
    save_sum("low_latency_combine", out, oracle.low_latency_combine(
        rows, idx, np.abs(w), oracle.low_latency_dispatch(x, idx, E, T)))
    ll.check()  # over the emulated transport: what its proxies found, if anything
    ll.close()


if __name__ == "__main__":
    try:
        main(sys.argv[1] if len(sys.argv) > 1 else "cuda", *sys.argv[2:3])
    except Exception:
        # A failed rank (a kernel that trapped: a caught protocol mutant) leaves at once.
        # jax.distributed's shutdown at exit would wait for the peer, which may itself wait for
        # this rank's data; the launcher ends the others only once one process has exited.
        traceback.print_exc()
        print_evidence()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
