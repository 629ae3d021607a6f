"""The main job: ``jax-ep-demo`` (or ``python -m jax_ep.tools.demo``).

Builds a Buffer over every device (8 host CPU devices and the reference backend when there is
no GPU; the CUDA kernels on GPUs), dispatches and combines a random MoE batch, checks the result
against the NumPy oracle of docs/api.md's semantics, and prints a table of steady-state times
(per call, and the rows a rank moves per second). Without a GPU those are the reference
backend's times on CPU, which say nothing about GPU speed; the table says so.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

# Read when the first backend starts, so this works although `import jax_ep` imported jax.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_ep  # noqa: E402
from jax_ep import testing as oracle  # noqa: E402


def _time_per_call(make_fn, args, counts, repeats=7):
    """GPU time of one op: the difference between programs with two unrolled counts, so the
    host dispatch of the jitted call cancels out."""
    medians = []
    for count in counts:
        fn = make_fn(count)
        jax.block_until_ready(fn(*args))
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            samples.append(time.perf_counter() - start)
        medians.append(statistics.median(samples))
    return (medians[1] - medians[0]) / (counts[1] - counts[0])


def rate_text(bytes_per_s: float) -> str:
    """A bandwidth with the unit that shows its figure: "412.0 GB/s", "35.2 MB/s", "900.0 kB/s"
    (decimal units, as GB/s figures are quoted elsewhere)."""
    for unit, scale in (("TB/s", 1e12), ("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if bytes_per_s >= scale:
            return f"{bytes_per_s / scale:.1f} {unit}"
    return f"{bytes_per_s:.1f} B/s"


def times_table(backend: str, on_gpu: bool, num_devices: int, seconds: dict[str, float],
                counts: tuple[int, int], rows: int, row_bytes: int) -> list[str]:
    """The lines of the demo's table: per op, the time per call (``seconds``: op -> seconds,
    <= 0 when the timer noise drowned it) and the rate of the ``rows`` rows of ``row_bytes``
    bytes a rank moves per call; a line before it says when the times are the CPU reference
    backend's, and one after it what the columns are."""
    lines = []
    if not on_gpu:
        lines.append(f"Times of the reference backend on {num_devices} CPU devices: they check "
                     "the set-up and say nothing about GPU speed.")
    lines.append(f"{'op':<10}{'backend':<9}{'time per call':>16}{'rate per rank':>16}")
    for op, s in seconds.items():
        if s <= 0:  # a busy host: the difference drowned in timer noise
            lines.append(f"{op:<10}{backend:<9}{'below noise':>16}{'-':>16}")
        else:
            lines.append(f"{op:<10}{backend:<9}{f'{s * 1e6:.1f} us':>16}"
                         f"{rate_text(rows * row_bytes / s):>16}")
    lines.append(f"time per call: the difference of jitted programs of {counts[0]} and "
                 f"{counts[1]} calls, per call; rate per rank: the {rows} rows of {row_bytes} "
                 "bytes that a rank receives (dispatch) or gets back (combine) per call, over "
                 "that time.")
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="auto", choices=("auto", "cuda", "reference"))
    parser.add_argument("--tokens", type=int, help="tokens per rank (default: by platform)")
    args = parser.parse_args(argv)

    on_gpu = jax.default_backend() == "gpu"
    devices = jax.devices()
    R = len(devices)
    T, H, E, K = (4096, 7168, 256, 8) if on_gpu else (128, 1024, 64, 4)
    T = args.tokens or T
    E = max(E // R, 1) * R
    dtype = jnp.bfloat16
    mesh = Mesh(np.array(devices), ("ep",))
    buf = jax_ep.Buffer(mesh, "ep", num_experts=E, hidden=H, max_tokens_per_rank=T,
                        num_topk=K, dtype=dtype, backend=args.backend)
    print(f"{R} x {devices[0].device_kind} ({jax.default_backend()}), backend={buf.backend}"
          + (f" (not cuda: {'; '.join(buf.backend_reasons)})" if buf.backend_reasons else ""))
    print(f"T={T} tokens/rank, H={H}, E={E}, top-{K}, {jnp.dtype(dtype).name}")

    rng = np.random.default_rng(0)
    idx, w = oracle.make_routing("uniform", rng, R, T, E, K)
    x = rng.standard_normal((R, T, H)).astype(np.float32).astype(jnp.dtype(dtype))
    sharding = NamedSharding(mesh, P("ep"))
    gx, gidx, gw = (jax.device_put(a.reshape(R * T, *a.shape[2:]), sharding) for a in (x, idx, w))

    def step(x, idx, w):
        d = jax_ep.dispatch(buf, x, idx, w)
        y, _ = jax_ep.combine(buf, d.recv_x, d.handle)
        return d.recv_x, d.handle.recv_src, d.num_recv_tokens[None], y

    run = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
    recv_x, recv_src, num_recv, y = (np.asarray(a) for a in run(gx, gidx, gw))
    recv_x, recv_src, y = (a.reshape(R, -1, *a.shape[1:]) for a in (recv_x, recv_src, y))
    expected = oracle.dispatch(x, idx, w, E)
    for r in range(R):
        assert np.array_equal(recv_x[r].view(np.uint16), expected[r]["recv_x"].view(np.uint16)), r
        assert np.array_equal(recv_src[r], expected[r]["recv_src"]), r
        assert int(num_recv[r]) == expected[r]["num_recv_tokens"], r
    want = oracle.combine(recv_x.astype(np.float32), recv_src, T)
    np.testing.assert_allclose(y.astype(np.float64), want, rtol=1e-2, atol=1e-2)
    print("dispatch + combine match the NumPy oracle (received rows bit-exact)")

    rows = int(np.mean([e["num_recv_tokens"] for e in expected]))
    row_bytes = H * jnp.dtype(dtype).itemsize

    counts = (2, 10)
    # Distinct inputs for every repetition: identical calls could be merged by XLA.
    xs = [jax.device_put(rng.standard_normal((R * T, H)).astype(np.float32), sharding)
          .astype(dtype) for _ in range(counts[1])]
    ys = [jax.device_put(rng.standard_normal((R * R * T, H)).astype(np.float32), sharding)
          .astype(dtype) for _ in range(counts[1])]

    def repeated(op, count):
        def body(x, idx, w, *inputs):
            # combine needs a handle: one dispatch first (its time cancels in the difference)
            d = jax_ep.dispatch(buf, x, idx, w) if op == "combine" else None
            outs = []
            for v in inputs[:count]:
                if op == "dispatch":
                    outs.append(jax_ep.dispatch(buf, v, idx, w).recv_x[:1])
                else:
                    outs.append(jax_ep.combine(buf, v, d.handle)[0][:1])
            return jnp.concatenate(outs)
        n = 3 + counts[1]
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("ep"),) * n,
                                     out_specs=P("ep")))

    seconds = {op: _time_per_call(lambda n, op=op: repeated(op, n),
                                  (gx, gidx, gw, *(xs if op == "dispatch" else ys)), counts)
               for op in ("dispatch", "combine")}
    print("\n" + "\n".join(times_table(buf.backend, on_gpu, R, seconds, counts, rows, row_bytes)))
    buf.close()


if __name__ == "__main__":
    main()
