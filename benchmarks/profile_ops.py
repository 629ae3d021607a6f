"""Kernel-level GPU times of jax_ep's ops from a profiler trace (CUPTI), per GPU.

    python benchmarks/profile_ops.py [--tokens 4096] [--ll-tokens 128] [--iters 8] [--out DIR]

Runs each op ``--iters`` times in one jitted program under ``jax.profiler.trace`` and prints,
per op and device, every kernel's median duration and the median span of one op (first kernel
start to last kernel end of each call). Unlike wall-clock differences this is pure GPU time:
it shows what the GPU spends and where the gaps are. The ``*_split`` ops run the low-latency
ops as send + receive halves back to back: the two kernels' medians are the halves' device
times (the receive's includes waiting for the peers' sends), the span is the pair's. Writes
``<machine>-<date>-profile_ops[-<tag>].json`` into ``--out``: the header of
``bench_records.result_header`` and ``results`` (per op: the stats printed, per device).
"""

from __future__ import annotations

import argparse
import glob
import os
import statistics
import sys
import tempfile

import bench_peers  # benchmarks/ is sys.path[0] when run as a script
import bench_records
import jax
import jax.numpy as jnp
import numpy as np
from jax.profiler import ProfileData
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep import testing as oracle

# The send half's kernel names, demangled or not (LowLatencyHalves::kSend == 1).
SEND_HALF = ("LowLatencyHalves)1", "LowLatencyHalvesE1E")


def _gpu_kernel_events(xspace_path):
    """{device plane name: [(name, start_ns, duration_ns)]} for device-side activity."""
    events = {}
    for plane in ProfileData.from_file(xspace_path).planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        rows = []
        for line in plane.lines:
            if "stream" not in line.name.lower():
                continue
            rows += [(e.name, e.start_ns, e.duration_ns) for e in line.events]
        events[plane.name] = sorted(rows, key=lambda r: r[1])
    return events


def _summarise(events, marker, family, iters):
    """Per kernel name: median us; and the median span of one op: a call starts at each kernel
    whose name contains ``marker`` (or one of them, a tuple) and covers the following kernels
    whose names contain one of ``family`` (the op's own kernels and memsets), up to the next
    call."""
    by_name = {}
    for name, _, dur in events:
        by_name.setdefault(name, []).append(dur / 1e3)
    markers = (marker,) if isinstance(marker, str) else marker
    starts = [i for i, (name, _, _) in enumerate(events) if any(m in name for m in markers)]
    spans = []
    for j, i in enumerate(starts):
        end = starts[j + 1] if j + 1 < len(starts) else len(events)
        span_events = [ev for ev in events[i:end] if any(f in ev[0] for f in family)]
        spans.append((max(s + d for _, s, d in span_events) - span_events[0][1]) / 1e3)
    kernels = {name: {"count": len(v), "median_us": statistics.median(v)}
               for name, v in by_name.items() if len(v) >= iters}
    # Everything the GPU did for the program, gaps included, per op call (from the first call's
    # first kernel: a combine program's one dispatch before it is not counted): comparable
    # between jax_ep and the peers. gap_us: what the GPU idles per op beyond the op's span.
    first = events[starts[0]][1] if starts else (events[0][1] if events else None)
    period = (max(s + d for _, s, d in events) - first) / 1e3 / iters if events else None
    span = statistics.median(spans) if spans else None
    gap = period - span if span is not None and period is not None else None
    return {"kernels": kernels, "op_span_us": span, "period_us": period, "gap_us": gap}


def _profile(fn, args, marker, family, iters, label, trace=True):
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    if not trace:  # another profiler (ncu) watches the process: CUPTI has room for one
        jax.block_until_ready(fn(*args))
        return {}
    trace_dir = tempfile.mkdtemp(prefix="jax_ep_trace_")
    with jax.profiler.trace(trace_dir):
        jax.block_until_ready(fn(*args))
    path = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)[0]
    result = {}
    for device, events in sorted(_gpu_kernel_events(path).items()):
        result[device] = _summarise(events, marker, family, iters)
        span, period = result[device]["op_span_us"], result[device]["period_us"]
        gap = result[device]["gap_us"]
        print(f"{label:<28}{device:<18} op span "
              f"{'-' if span is None else round(span, 1)} us, period {period:.1f} us/op, gap "
              f"{'-' if gap is None else round(gap, 1)} us/op")
        kernels = result[device]["kernels"]
        for name, k in sorted(kernels.items(), key=lambda kv: -kv[1]["median_us"]):
            print(f"    {k['median_us']:9.1f} us x{k['count']:<3} {name[:90]}")
    return result


def _program(mesh, buf, mode, op, num_inputs):
    """One jitted program running ``op`` once per input ``x`` (distinct inputs: no CSE)."""
    peer = bench_peers.AllToAllPeer(mesh.shape["ep"], buf.num_experts, buf.num_topk)

    def body(idx, w, *xs):
        outs = []
        if op in ("combine", "all_to_all_combine"):  # the rows to combine: one dispatch first
            first = jax_ep.dispatch(buf, xs[0], idx, w)
        for x in xs:
            if op == "all_to_all_dispatch_bf16":
                outs.append(peer.dispatch([x], idx, w)[0])
            elif op == "all_to_all_combine":
                outs.append(peer.combine(first.recv_x, peer.plan(idx)))
            elif op == "dispatch_bf16":
                outs.append(jax_ep.dispatch(buf, x, idx, w).recv_x)
            elif op == "dispatch_fp8":
                outs.append(jax_ep.dispatch(buf, jax_ep.per_token_cast_to_fp8(x), idx, w).recv_x)
            elif op == "combine":
                outs.append(jax_ep.combine(buf, first.recv_x, first.handle)[0])
            elif op == "ll_dispatch_fp8":
                outs.append(jax_ep.low_latency_dispatch(buf, x, idx).recv_x)
            elif op == "ll_dispatch_bf16":
                outs.append(jax_ep.low_latency_dispatch(buf, x, idx, use_fp8=False).recv_x)
            elif op == "ll_combine":
                ll = jax_ep.low_latency_dispatch(buf, x, idx, use_fp8=False)
                outs.append(jax_ep.low_latency_combine(buf, ll.recv_x, idx, w, ll.handle))
            elif op in ("ll_dispatch_split_fp8", "ll_dispatch_split_bf16"):
                pending = jax_ep.low_latency_dispatch_send(buf, x, idx,
                                                           use_fp8=op.endswith("fp8"))
                outs.append(jax_ep.low_latency_dispatch_recv(buf, pending).recv_x)
            elif op == "ll_combine_split":
                ll = jax_ep.low_latency_dispatch(buf, x, idx, use_fp8=False)
                pending = jax_ep.low_latency_combine_send(buf, ll.recv_x, idx, w, ll.handle)
                outs.append(jax_ep.low_latency_combine_recv(buf, pending))
        return outs

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("ep"),) * (2 + num_inputs),
                                 out_specs=P("ep"), check_vma=False))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096,
                        help="normal-mode tokens per rank (default 4096)")
    parser.add_argument("--ll-tokens", type=int, default=128,
                        help="low-latency tokens per rank (default 128)")
    parser.add_argument("--hidden", type=int, default=7168, help="model width H (default 7168)")
    parser.add_argument("--experts", type=int, default=256,
                        help="experts over all ranks (default 256)")
    parser.add_argument("--topk", type=int, default=8, help="experts per token (default 8)")
    parser.add_argument("--iters", type=int, default=8,
                        help="calls of each op in its program, each on its own input (default 8)")
    bench_records.add_out_argument(parser, "folder of the record")
    parser.add_argument("--tag", help="file name <machine>-<date>-profile_ops-<tag>.json")
    bench_records.add_note_argument(parser)
    parser.add_argument("--ops", type=lambda text: set(text.split(",")),
                        help="comma-separated subset of the ops (default: all)")
    parser.add_argument("--no-trace", action="store_true",
                        help="only run the programs (3 times each), for an outside profiler: "
                             "ncu -k regex:low_latency_dispatch ... profile_ops.py --no-trace")
    args = parser.parse_args(argv)
    devices = jax.devices()
    R, H, E, K = len(devices), args.hidden, args.experts, args.topk
    mesh = Mesh(np.array(devices), ("ep",))
    sharding = NamedSharding(mesh, P("ep"))
    results = {}

    for mode, T in (("normal", args.tokens), ("low_latency", args.ll_tokens)):
        buf = jax_ep.Buffer(mesh, "ep", num_experts=E, hidden=H, max_tokens_per_rank=T,
                            num_topk=K, low_latency=mode == "low_latency", backend="cuda")
        rng = np.random.default_rng(0)
        idx, w = oracle.make_routing("uniform", rng, R, T, E, K)
        xs = [jax.device_put(rng.standard_normal((R * T, H)).astype(np.float32), sharding)
              .astype(jnp.bfloat16) for _ in range(args.iters)]
        gidx = jax.device_put(idx.reshape(R * T, K), sharding)
        gw = jax.device_put(w.reshape(R * T, K), sharding)

        # op -> (kernel that starts a call, substrings of the call's kernels)
        ops = ({"dispatch_bf16": ("dispatch_plan", ("dispatch_", "emset")),
                "dispatch_fp8": ("dispatch_plan", ("dispatch_", "emset")),
                "combine": ("combine_plan", ("combine_", "emset")),
                "all_to_all_dispatch_bf16": ("-", ()), "all_to_all_combine": ("-", ())}
               if mode == "normal" else
               {"ll_dispatch_fp8": ("low_latency_dispatch", ("low_latency_dispatch",)),
                "ll_dispatch_bf16": ("low_latency_dispatch", ("low_latency_dispatch",)),
                "ll_combine": ("low_latency_combine", ("low_latency_combine",)),
                # A split call starts at its send kernel (kernel<..., LowLatencyHalves 1>).
                "ll_dispatch_split_fp8": (SEND_HALF, ("low_latency_dispatch",)),
                "ll_dispatch_split_bf16": (SEND_HALF, ("low_latency_dispatch",)),
                "ll_combine_split": (SEND_HALF, ("low_latency_combine",))})
        ops = {op: v for op, v in ops.items() if args.ops is None or op in args.ops}
        if not ops:
            buf.close()
            continue
        for op, (marker, family) in ops.items():
            program = _program(mesh, buf, mode, op, len(xs))
            results[op] = _profile(program, (gidx, gw, *xs), marker, family, args.iters,
                                   f"{op} T={T}", trace=not args.no_trace)
        buf.close()
    tag = f"-{args.tag}" if args.tag else ""
    path = os.path.join(args.out, f"{bench_records.machine_name()}-{bench_records.today()}"
                                  f"-profile_ops{tag}.json")
    header = bench_records.result_header(sys.argv[1:] if argv is None else argv, args.note,
                                        __file__)
    bench_records.write_json(path, {**header, "results": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
