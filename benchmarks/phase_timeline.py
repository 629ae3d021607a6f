"""When every block of a low-latency kernel passes each phase (one GPU process, any mesh).

    JAX_EP_PHASE_TIMELINE=ON pip install --no-build-isolation --no-deps .
    python benchmarks/phase_timeline.py [--ops ll_dispatch_bf16,ll_dispatch_fp8,ll_combine]
                                        [--ll-tokens 128] [--launches 8] [--split]

Needs a build with the phase timeline (the CMake option above; a release build prints
nothing and this script says so): every block of a launch prints its marks
(csrc/common/phase_timeline.cuh). The script runs each op ``--launches`` times in a
child process, one launch per program call, and prints per mark how many blocks reached it and
the earliest, median and latest time after the launch's first block started (microseconds,
medians over the launches), then the marks of the block that finished last. Marks: dispatch
1 phase 1 done, 2 slots and staged rows, 3 remote rows released, 4 own rows stored, 5 receive
plan built, 6 receive done, 7 end; combine 1 send done, 2 first pass resolved, 3 own rows
summed, 4 peers' flags seen, 5 owner passes done, 6 receive done, 7 end. A diagnostic build
only: printf costs time, so the absolute times run longer than a release kernel's.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys

OPS = ("ll_dispatch_bf16", "ll_dispatch_fp8", "ll_combine")
MARKS = 8
PREFIX = "jax_ep-timeline"
LAUNCH_GAP_NS = 100_000  # more between two block starts: another launch


def child(args):
    import bench_mesh  # benchmarks/ is sys.path[0]
    import bench_timing
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_ep
    from jax_ep import testing as oracle

    mesh = bench_mesh.make_mesh()
    R, T, H, E, K = mesh.shape["ep"], args.ll_tokens, args.hidden, args.experts, args.topk
    buf = jax_ep.Buffer(mesh, "ep", num_experts=E, hidden=H, max_tokens_per_rank=T, num_topk=K,
                        low_latency=True, backend="cuda")
    rng = np.random.default_rng(0)
    idx, w = oracle.make_routing("uniform", rng, R, T, E, K)
    sharding = NamedSharding(mesh, P("ep"))
    x = jax.device_put(rng.standard_normal((R * T, H)).astype(jax.numpy.bfloat16), sharding)
    idx = jax.device_put(idx.reshape(R * T, K), sharding)
    w = jax.device_put(w.reshape(R * T, K), sharding)
    run = bench_timing.shard_mapped

    def dispatch(x, idx, use_fp8):
        if args.split:
            return jax_ep.low_latency_dispatch_recv(
                buf, jax_ep.low_latency_dispatch_send(buf, x, idx, use_fp8=use_fp8))
        return jax_ep.low_latency_dispatch(buf, x, idx, use_fp8=use_fp8)

    def combine(y, idx, w, handle):
        if args.split:
            return jax_ep.low_latency_combine_recv(
                buf, jax_ep.low_latency_combine_send(buf, y, idx, w, handle))
        return jax_ep.low_latency_combine(buf, y, idx, w, handle)

    def program_and_inputs(op):
        if op == "ll_combine":
            d = run(mesh, lambda x, idx: dispatch(x, idx, False), 2)(x, idx)
            return run(mesh, combine, 4), (d.recv_x, idx, w, d.handle)
        use_fp8 = op == "ll_dispatch_fp8"
        return run(mesh, lambda x, idx: dispatch(x, idx, use_fp8).recv_x, 2), (x, idx)

    for op in args.ops:
        program, inputs = program_and_inputs(op)
        for _ in range(1 + args.launches):  # the first one warms up (dropped by parse)
            jax.block_until_ready(program(*inputs))


def parse(text):
    """{(op, halves): [launch: {block: [marks ns]}]}. A launch's blocks start within
    microseconds and launches milliseconds apart, so lines are grouped into launches by their
    start marks (device printf reaches stdout at a later synchronisation, not in order); the
    first launch of each kernel (the warm-up) is dropped."""
    lines = {}
    for line in text.splitlines():
        if line.startswith(PREFIX):
            words = line.split()
            marks = [int(v) for v in words[4:4 + MARKS]]
            lines.setdefault((words[1], int(words[2])), []).append((int(words[3]), marks))
    launches = {}
    for key, rows in lines.items():
        rows.sort(key=lambda row: row[1][0])
        groups, last_start = [], None
        for block, marks in rows:
            if last_start is None or marks[0] - last_start > LAUNCH_GAP_NS:
                groups.append({})
            groups[-1][block] = marks
            last_start = marks[0]
        if len(groups) > 1:
            launches[key] = groups[1:]
    return launches


def summarise(launches):
    """Per mark: (blocks reached, earliest, median, latest) in us after the launch's first
    start, medians over launches; and the last-finishing block's marks."""
    rows = []
    for m in range(MARKS):
        per_launch = []
        for blocks in launches:
            start = min(marks[0] for marks in blocks.values())
            times = sorted((marks[m] - start) / 1e3 for marks in blocks.values() if marks[m])
            if times:
                per_launch.append((len(times), times[0], statistics.median(times), times[-1]))
        if per_launch:
            rows.append((m, *[statistics.median(v[i] for v in per_launch) for i in range(4)]))
    last = []
    for blocks in launches:
        start = min(marks[0] for marks in blocks.values())
        block, marks = max(blocks.items(), key=lambda item: item[1][MARKS - 1])
        last.append((block, [(v - start) / 1e3 if v else None for v in marks]))
    return rows, last


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", type=lambda s: tuple(s.split(",")), default=OPS,
                   help=f"comma-separated subset of {','.join(OPS)}")
    p.add_argument("--ll-tokens", type=int, default=128, help="tokens per rank (default 128)")
    p.add_argument("--hidden", type=int, default=7168, help="model width H (default 7168)")
    p.add_argument("--experts", type=int, default=256, help="experts over all ranks (default 256)")
    p.add_argument("--topk", type=int, default=8, help="experts per token (default 8)")
    p.add_argument("--launches", type=int, default=8,
                   help="launches of each op timed, after one that warms up (default 8)")
    p.add_argument("--split", action="store_true", help="the send/receive halves, not the fused op")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    for op in args.ops:
        if op not in OPS:
            p.error(f"--ops: unknown op {op!r}; choose from {', '.join(OPS)}")
    if args.child:
        return child(args)
    result = subprocess.run([sys.executable, __file__, "--child", *sys.argv[1:]],
                            capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        sys.exit(f"the child failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    launches = parse(result.stdout)
    if not launches:
        sys.exit("no timeline lines: build with JAX_EP_PHASE_TIMELINE=ON (see the docstring)")
    for (op, halves), runs in sorted(launches.items()):
        rows, last = summarise(runs)
        kind = {1: "send", 2: "receive", 3: "fused"}.get(halves, str(halves))
        print(f"{op} ({kind}), T={args.ll_tokens}, {len(runs)} launches, us after the first start")
        print(f"  {'mark':>4} {'blocks':>6} {'first':>8} {'median':>8} {'last':>8}")
        for m, n, first, median, latest in rows:
            print(f"  {m:>4} {n:>6.0f} {first:>8.2f} {median:>8.2f} {latest:>8.2f}")
        block, marks = last[len(last) // 2]
        shown = " ".join("-" if v is None else f"{v:.2f}" for v in marks)
        print(f"  last block to finish (median launch): block {block}: {shown}")


if __name__ == "__main__":
    main()
