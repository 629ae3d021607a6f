"""What a JAX program pays per MoE step: jax_ep against its peers inside one jitted program.

    python benchmarks/bench_step.py [--ops decode_step,normal_step] [--impls jax_ep,all_to_all,...]
                                    [--tokens 4096] [--ll-tokens 128] [--out DIR]

A step is what a model layer does with the communication, its results consumed in the program:
- ``decode_step``: low-latency dispatch (bf16 or fp8 rows) -> a stand-in expert (each local
  expert scales its rows) -> low-latency combine, at ``--ll-tokens`` per rank;
- ``normal_step``: dispatch -> the stand-in expert -> combine (forward), at ``--tokens`` per
  rank; ``normal_train_step``: the same forward and backward (the gradients of a loss w.r.t.
  the tokens and the routing weights: a cached dispatch and a combine more per layer).
The peers run the same step with ``jax.lax.all_to_all`` (capacity-padded) and
``jax.lax.ragged_all_to_all`` (benchmarks/bench_peers.py).

Each program chains ``N`` steps like the layers of a model (step i+1 takes step i's output as
its tokens, each layer its own routing), and only the last output leaves the program. The
measures per step are each the slope of a least-squares line through the programs of N = 4, 8,
12 and 16 layers (``--layers``; 1 and 2 with ``--quick``), so the fixed cost of a call cancels
and no single program's noise decides. Every one of these programs has at least 5 custom calls,
so XLA runs each as one command buffer (CUDA graph), as it runs a model's many layers; a
2-layer program of 4 calls would run thunk by thunk (``xla_gpu_graph_min_graph_size``):
- ``time_us``: wall time, from the call to its results being ready (what the program pays;
  ``time_us_stderr``: the slope's standard error, from how far the programs stray from a line);
  each call is waited for before the next. (Calls made back to back do not work with the
  difference: the host's fixed cost per call, larger than a short program's GPU work, bounds
  both programs and cancels out.)
- ``kernel_us``: the device's busy time (the sum of every kernel's and copy's duration, from a
  CUPTI trace through ``jax.profiler``): what the GPU works; ``ep_kernel_us``: of that, jax_ep's
  own kernels; ``device_span_us``: from a call's first kernel start to its last kernel end in
  the same trace, so ``device_span_us - kernel_us`` is the device's idle time inside the
  program and ``time_us - device_span_us`` what the host adds around it (traced calls: the
  profiler may change both);
- ``enqueue_us``: the host time until the call returns (XLA enqueues the work): when it is
  larger than ``kernel_us`` the GPU waits for the host.
Writes ``<out>/<machine>-<date>-step[-tag].json`` (one record per op, impl, dtype) and prints
its row as each case ends, under one header. Runs at EP=1 on one GPU and on any number of GPUs
(one process, or every process under ``python -m jax_ep.launch``). At EP=1 the peers are not run
(XLA turns them into a local copy: no comparison); ``skipped`` says so. On CPU (8 host devices
unless ``XLA_FLAGS`` sets a count) only ``all_to_all`` and the reference backend run, with
``--quick`` shapes for testing: their times say nothing about GPU speed.
"""

from __future__ import annotations

import argparse
import glob
import os
import statistics
import sys
import tempfile
import time
import traceback

import bench_inputs as bi
import bench_mesh as bm
import bench_peers as bp
import bench_records as br
import bench_timing as bt
import jax
import jax.numpy as jnp

IMPLS = ("jax_ep", "all_to_all", "ragged_all_to_all")
OPS = ("decode_step", "normal_step", "normal_train_step")
LAYERS = (4, 8, 12, 16)  # the programs' layer counts; each step is their line's slope
# --quick: CPU tests; 1 and 2 layers exercise the same code (a layer that takes the previous
# one's output included) at a fraction of the compile time.
QUICK = {"tokens": 64, "ll_tokens": 8, "hidden": 256, "experts": 16, "repeats": 3,
         "layers": (1, 2)}


def _layer_counts(text):
    counts = tuple(int(v) for v in text.split(","))
    if len(counts) < 2 or counts[0] < 1 or list(counts) != sorted(set(counts)):
        raise argparse.ArgumentTypeError(
            f"--layers needs two or more ascending layer counts >= 1, got {text!r}")
    return counts


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", type=lambda s: tuple(s.split(",")), default=OPS,
                   help=f"comma-separated subset of {','.join(OPS)}")
    p.add_argument("--impls", type=lambda s: tuple(s.split(",")), default=IMPLS,
                   help="jax_ep (CUDA kernels; the reference backend on CPU), all_to_all, "
                        "ragged_all_to_all")
    p.add_argument("--dtypes", type=lambda s: tuple(s.split(",")), default=("bf16", "fp8"),
                   help="decode_step's dispatch rows (normal_step is bf16)")
    p.add_argument("--tokens", type=int, default=4096,
                   help="tokens per rank of the normal steps (default 4096)")
    p.add_argument("--ll-tokens", type=int, default=128,
                   help="tokens per rank of the decode step (default 128)")
    p.add_argument("--hidden", type=int, default=7168, help="model width H (default 7168)")
    p.add_argument("--experts", type=int, default=256, help="experts over all ranks (default 256)")
    p.add_argument("--topk", type=int, default=8, help="experts per token (default 8)")
    p.add_argument("--bare", action="store_true",
                   help="each layer is dispatch -> combine alone, no stand-in expert and no "
                        "residual add: the op pair's own in-program cost (the fp8 decode step's "
                        "combine reads the carried bf16 buffer as it is)")
    p.add_argument("--carry", choices=("donated", "input"), default="donated",
                   help="the carried expert buffer: donated to each call (a serving loop's "
                        "state) or an input XLA may not write (it copies it)")
    p.add_argument("--repeats", type=int, default=30, help="timed calls of each program")
    p.add_argument("--no-kernel-trace", action="store_true", help="skip the CUPTI trace")
    p.add_argument("--host-trace", action="store_true",
                   help="print where jax_ep's host time goes (host events of a profiler trace)")
    p.add_argument("--layers", type=_layer_counts, default=LAYERS,
                   help="the programs' layer counts, ascending, e.g. 4,8,12,16 (each step is "
                        "the slope of their wall times' least-squares line)")
    p.add_argument("--quick", action="store_true", help="small shapes, for CPU tests")
    br.add_out_argument(p)
    p.add_argument("--ranks", type=int, help="number of devices to use (default all)")
    p.add_argument("--tag", help="appended to the file name: <machine>-<date>-step-<tag>.json")
    br.add_note_argument(p)
    args = p.parse_args(argv)
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    return args


# ------------------------------------------------------------------------------- steps


def stand_in_expert(rows, scale):
    """Each local expert scales its rows (a cheap, fused XLA op in place of the expert MLP)."""
    return (rows.astype(jnp.float32) * scale).astype(jnp.bfloat16)


def local_expert_scales(num_local_experts):
    return 1.0 + jnp.arange(num_local_experts, dtype=jnp.float32) / num_local_experts


def valid_slots(recv_count, rows_per_expert, max_rows):
    """``(expert, row)`` of every valid slot of the low-latency layout (row < recv_count[e]), in
    expert order, padded to ``max_rows`` entries with expert = E_loc (out of range: dropped)."""
    ends = jnp.cumsum(recv_count)
    flat = jnp.arange(max_rows, dtype=jnp.int32)
    # compare_all: one fused comparison (the default method is a loop, which XLA:GPU runs as a
    # while loop whose predicate the host reads every iteration)
    expert = jnp.searchsorted(ends, flat, side="right", method="compare_all").astype(jnp.int32)
    row = flat - (ends - recv_count)[jnp.minimum(expert, recv_count.shape[0] - 1)]
    valid = flat < ends[-1]
    return jnp.where(valid, expert, recv_count.shape[0]), jnp.where(valid, row, 0)


def jax_ep_decode(jax_ep, buf, use_fp8, bare=False):
    """Decode step with jax_ep's low-latency ops. The stand-in expert touches only the valid rows
    of the ``[E_loc, R*T_max, H]`` layout, as a masked grouped GEMM does: bf16 rows are its
    output in place (``y = recv_x``: no traffic of its own); fp8 rows are dequantized, scaled
    and written into a bf16 output buffer carried from layer to layer (rows past recv_count are
    unspecified, and combine reads only valid rows). ``bare``: no expert for fp8 rows either:
    combine reads the carried buffer as it is (the op pair's own cost)."""
    E_loc, T_max = buf.num_local_experts, buf.max_tokens_per_rank
    scale = local_expert_scales(E_loc)

    def step(x, idx, w, carry):
        d = jax_ep.low_latency_dispatch(buf, x, idx, use_fp8=use_fp8)
        if not use_fp8 or bare:
            y = carry if use_fp8 else d.recv_x
            return jax_ep.low_latency_combine(buf, y, idx, w, d.handle), carry
        rows_bound = buf.num_ranks * T_max * buf.num_topk  # every selection of every source
        rows_per_expert = buf.num_ranks * T_max
        expert, row = valid_slots(d.recv_count, rows_per_expert, rows_bound)
        safe = jnp.minimum(expert, E_loc - 1)
        # Whole rows by one flat index: XLA:GPU scatters [E*R*T, H] rows by a 1-D index with a
        # row copy per index; the (expert, row) pair made it a slow element-wise scatter.
        flat = expert * rows_per_expert + row  # past the end for padding: dropped
        H = d.recv_x.shape[-1]
        rows = d.recv_x.reshape(-1, H)[jnp.minimum(flat, E_loc * rows_per_expert - 1)]
        scales = d.recv_scales.reshape(E_loc * rows_per_expert, -1)[
            jnp.minimum(flat, E_loc * rows_per_expert - 1)]
        rows = rows.astype(jnp.float32) * jnp.repeat(scales, bi.FP8_BLOCK, axis=1)
        y = carry.reshape(-1, H).at[flat].set(
            (rows * scale[safe][:, None]).astype(jnp.bfloat16), mode="drop").reshape(carry.shape)
        return jax_ep.low_latency_combine(buf, y, idx, w, d.handle), y

    return step


def peer_decode(peer, use_fp8, bare=False):
    """The peer's decode step: dispatch, the expert on every received row (weighted at the
    expert, as jax_ep's low-latency combine weights at the owner), combine; ``bare``: the
    received rows (dequantized) go back as they are."""
    E_loc = peer.experts_per_rank
    scales = local_expert_scales(E_loc)

    def step(x, idx, w, carry):
        payload = [*bi.cast_fp8(x)] if use_fp8 else [x]
        got = peer.dispatch(payload, idx, w)
        rows = (got[0].astype(jnp.float32) * jnp.repeat(got[1], bi.FP8_BLOCK, axis=1)
                if use_fp8 else got[0])
        if bare:
            return peer.combine(rows.astype(jnp.bfloat16), peer.plan(idx)), carry
        local_idx, local_w = got[-2], got[-1]
        factor = jnp.sum(jnp.where(local_idx >= 0, local_w * scales[local_idx], 0.0), axis=1)
        y = (rows.astype(jnp.float32) * factor[:, None]).astype(jnp.bfloat16)
        return peer.combine(y, peer.plan(idx)), carry

    return step


def jax_ep_normal(jax_ep, buf, bare=False):
    scale = local_expert_scales(buf.num_local_experts)

    def step(x, idx, w, carry):
        d = jax_ep.dispatch(buf, x, idx, w)
        if bare:
            return jax_ep.combine(buf, d.recv_x, d.handle)[0], carry
        local = d.recv_topk_idx
        factor = jnp.sum(jnp.where(local >= 0, d.recv_topk_weights * scale[local], 0.0), axis=1)
        y = (d.recv_x.astype(jnp.float32) * factor[:, None]).astype(x.dtype)
        return jax_ep.combine(buf, y, d.handle)[0], carry

    return step


def peer_normal(peer, bare=False):
    scale = local_expert_scales(peer.experts_per_rank)

    def step(x, idx, w, carry):
        got_x, local_idx, local_w = peer.dispatch([x], idx, w)
        if bare:
            return peer.combine(got_x, peer.plan(idx)), carry
        factor = jnp.sum(jnp.where(local_idx >= 0, local_w * scale[local_idx], 0.0), axis=1)
        y = (got_x.astype(jnp.float32) * factor[:, None]).astype(x.dtype)
        return peer.combine(y, peer.plan(idx)), carry

    return step


def chained(step, num_steps, backward, residual=True):
    """Per-rank program of ``num_steps`` layers: layer i's output, added to its input as a
    model's residual connection does (one small XLA kernel, as a layer has XLA work between its
    MoE blocks), is layer i+1's input; only the last output (forward) or the gradients w.r.t.
    the input and every layer's weights (backward) leave the program, with ``carry``: an expert
    output buffer some steps reuse (else a placeholder), donated by the caller and returned, as
    a serving loop keeps its state buffers from step to step. Without ``residual`` layer i's
    output is layer i+1's input as it is."""

    def forward(x, idx, w, carry):  # idx, w: one [T, K] array per layer, layer i the i-th
        for i in range(num_steps):
            out, carry = step(x, idx[i], w[i], carry)
            x = ((x.astype(jnp.float32) * 0.5 + out.astype(jnp.float32) * 0.5).astype(x.dtype)
                 if residual else out.astype(x.dtype))
        return x, carry

    if not backward:
        return forward

    def loss(x, w, idx, carry):
        return jnp.sum(forward(x, idx, w, carry)[0].astype(jnp.float32) ** 2)

    def grads(x, idx, w, carry):
        return jax.grad(loss, argnums=(0, 1))(x, w, idx, carry), carry

    return grads


class CarriedProgram:
    """``program(x, idx, w)``: calls ``fn(x, idx, w, carry) -> (out, carry)`` with the carry
    of the previous call (donated: XLA updates it in place instead of copying it)."""

    def __init__(self, fn, carry):
        self.fn, self.carry = fn, carry

    def __call__(self, x, idx, w):
        out, self.carry = self.fn(x, idx, w, self.carry)
        return out


# ------------------------------------------------------------------------------- measuring


def host_clocks(fn, args, repeats):
    """Medians of (enqueue, ready) microseconds over ``repeats`` calls after 3 warm ones, each
    call waited for before the next."""
    rows = []
    for i in range(3 + repeats):
        t0 = time.perf_counter()
        out = fn(*args)
        t1 = time.perf_counter()
        jax.block_until_ready(out)
        t2 = time.perf_counter()
        del out
        if i >= 3:
            rows.append((t1 - t0, t2 - t0))
    return [statistics.median(r[j] for r in rows) * 1e6 for j in range(2)]


def device_busy_us(fn, args, calls=3, by_kernel=None, gaps=None):
    """``(all, ours, span)``: the sum of the durations of every GPU kernel and copy of one call,
    of jax_ep's own kernels alone (means of ``calls`` traced calls), and the device span of a
    call (its first kernel's start to its last kernel's end: idle time inside the program
    included; median); the maximum over this process's devices. ``by_kernel`` (a dict), when
    given, gets the time per kernel name; ``gaps`` the device's idle time inside a call per pair
    of consecutive kernels."""
    from jax.profiler import ProfileData  # noqa: PLC0415

    trace_dir = tempfile.mkdtemp(prefix="jax_ep_step_trace_")
    with jax.profiler.trace(trace_dir):
        for _ in range(calls):
            jax.block_until_ready(fn(*args))
    path = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)[0]
    busy, ours, spans = [], [], []
    for plane in ProfileData.from_file(path).planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        events = sorted((e for line in plane.lines if "stream" in line.name.lower()
                         for e in line.events), key=lambda e: e.start_ns)
        if not events:
            continue
        busy.append(sum(e.duration_ns for e in events) / 1e3 / calls)
        ours.append(sum(e.duration_ns for e in events if "jax_ep" in e.name) / 1e3 / calls)
        if by_kernel is not None:
            for e in events:
                name = e.name[:100]
                by_kernel[name] = by_kernel.get(name, 0.0) + e.duration_ns / 1e3 / calls
        # The calls are separated by the host's round trip, longer than any idle time inside a
        # call: the calls - 1 longest idle times are the boundaries.
        idle = [(b.start_ns - (a.start_ns + a.duration_ns), i + 1)
                for i, (a, b) in enumerate(zip(events, events[1:], strict=False))]
        cuts = sorted(i for _, i in sorted(idle, reverse=True)[:calls - 1])
        per_call = [events[a:b] for a, b in zip([0, *cuts], [*cuts, len(events)], strict=True)]
        spans.append(statistics.median(
            (max(e.start_ns + e.duration_ns for e in c) - c[0].start_ns) / 1e3 for c in per_call))
        if gaps is not None:
            for call in per_call:
                for a, b in zip(call, call[1:], strict=False):
                    gap = (b.start_ns - (a.start_ns + a.duration_ns)) / 1e3
                    if gap > 0:
                        key = f"{a.name[:45]} -> {b.name[:45]}"
                        gaps[key] = gaps.get(key, 0.0) + gap / calls
    return (max(busy), max(ours), max(spans)) if busy else (None, None, None)


def host_events(fn, args, calls=10, top=30):
    """Where the host's time goes in one call: the host-side events of a ``jax.profiler`` trace
    (XLA's thunks and command buffers, PjRt, our handlers' CUDA calls), summed by name per call,
    the largest first: ``[(name, us per call, count per call)]``."""
    from jax.profiler import ProfileData  # noqa: PLC0415

    jax.block_until_ready(fn(*args))
    trace_dir = tempfile.mkdtemp(prefix="jax_ep_host_trace_")
    with jax.profiler.trace(trace_dir):
        for _ in range(calls):
            jax.block_until_ready(fn(*args))
    path = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)[0]
    totals = {}
    for plane in ProfileData.from_file(path).planes:
        if plane.name.startswith("/device:"):
            continue
        for line in plane.lines:
            for e in line.events:
                if e.name.startswith("$"):  # Python frames: they nest the events below
                    continue
                key = f"{line.name[:18]}|{e.name[:90]}"
                t, c = totals.get(key, (0.0, 0))
                totals[key] = (t + e.duration_ns / 1e3, c + 1)
    rows = sorted(((k, t / calls, c / calls) for k, (t, c) in totals.items()),
                  key=lambda r: -r[1])
    return rows[:top]


def slope(xs, ys):
    """The least-squares slope of ``ys`` over ``xs``."""
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    return (sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True))
            / sum((x - mean_x) ** 2 for x in xs))


def slope_stderr(xs, ys):
    """The standard error of that slope (None with fewer than 3 points): how far the programs'
    wall times stray from one line, in the slope's units."""
    if len(xs) < 3:
        return None
    b = slope(xs, ys)
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    residuals = [y - mean_y - b * (x - mean_x) for x, y in zip(xs, ys, strict=True)]
    sxx = sum((x - mean_x) ** 2 for x in xs)
    return (sum(r * r for r in residuals) / (len(xs) - 2) / sxx) ** 0.5


def measure(programs, args, repeats, trace):
    """Per step: (time_us, kernel_us, ep_kernel_us, device_span_us, enqueue_us, walls), each
    the slope over the programs' layer counts (``programs`` by their layer counts); walls: the
    median wall time of each program."""
    counts = sorted(programs)
    clocks = {}
    for _ in range(2):  # interleave: drift hits every program
        for n in counts:
            clocks.setdefault(n, []).append(host_clocks(programs[n], args, repeats // 2 or 1))
    enq = [statistics.median(c[0] for c in clocks[n]) for n in counts]
    wall = [statistics.median(c[1] for c in clocks[n]) for n in counts]
    per_layer = [None, None, None]  # kernel_us, ep_kernel_us, device_span_us
    if trace:
        busy = [device_busy_us(programs[n], args) for n in counts]
        if busy[0][0] is not None:
            per_layer = [slope(counts, [b[j] for b in busy]) for j in range(3)]
    return slope(counts, wall), *per_layer, slope(counts, enq), wall


def build_programs(mesh, step, backward, make_carry, donate, residual, layers):
    return {n: CarriedProgram(bt.shard_mapped(mesh, chained(step, n, backward, residual), 4,
                                              donate=(3,) if donate else ()), make_carry())
            for n in layers}


def step_inputs(mesh, tokens, args, seed):
    """Tokens ``[R*T, H]`` and, per layer of the longest program, a routing ``([R*T, K], [R*T,
    K])``, each its own argument (sharded along the tokens like everything else): a routing
    is then a buffer of its own, as a model's router makes it, where slicing one stacked array
    cost two copy kernels per layer (~2 us each at T=4096 on an H200) that no model runs."""
    R = mesh.shape[bm.AXIS]
    x = bi.random_rows(mesh, seed, (R * tokens, args.hidden))
    routings = [bi.random_routing(mesh, seed + 1 + i, tokens, args.experts, args.topk)
                for i in range(args.layers[-1])]
    idx = tuple(r[0] for r in routings)
    w = tuple(r[1] for r in routings)
    return x, idx, w


def run_case(jax_ep, mesh, args, op, impl, dtype):
    R = mesh.shape[bm.AXIS]
    decode = op == "decode_step"
    backward = op == "normal_train_step"
    tokens = args.ll_tokens if decode else args.tokens
    buf = None
    if impl == "jax_ep":
        backend = "cuda" if bm.on_gpu() else "reference"
        buf = jax_ep.Buffer(mesh, bm.AXIS, num_experts=args.experts, hidden=args.hidden,
                            max_tokens_per_rank=tokens, num_topk=args.topk,
                            low_latency=decode, backend=backend)
        step = (jax_ep_decode(jax_ep, buf, dtype == "fp8", args.bare) if decode
                else jax_ep_normal(jax_ep, buf, args.bare))
    else:
        peer = bp.PEER_CLASSES[impl](R, args.experts, args.topk)
        step = (peer_decode(peer, dtype == "fp8", args.bare) if decode
                else peer_normal(peer, args.bare))

    # The fp8 decode expert's output buffer [E_loc, R*T, H] per rank, else a placeholder.
    carry_shape = ((args.experts, R * tokens, args.hidden) if decode and dtype == "fp8"
                   and impl == "jax_ep" else (R, 1))
    make_carry = jax.jit(lambda: jnp.zeros(carry_shape, jnp.bfloat16),
                         out_shardings=bm.sharded(mesh))
    # Called as a user calls a jitted step (its C++ fast path), compiled by the warm-up calls.
    programs = build_programs(mesh, step, backward, make_carry, args.carry == "donated",
                              residual=not args.bare, layers=args.layers)
    longest = args.layers[-1]
    call_args = step_inputs(mesh, tokens, args, seed=7)
    counts_before = _handler_counts(jax_ep) if impl == "jax_ep" and bm.on_gpu() else None
    time_us, kernel_us, ep_kernel_us, span_us, enqueue_us, wall = measure(
        programs, call_args, args.repeats, bm.on_gpu() and not args.no_kernel_trace)
    if args.host_trace and impl == "jax_ep" and bm.on_gpu():
        kernels, gaps = {}, {}
        device_busy_us(programs[longest], call_args, by_kernel=kernels, gaps=gaps)
        print(f"kernels of one {op} ({dtype}) program of {longest} steps, us per call:")
        for name, us in sorted(kernels.items(), key=lambda kv: -kv[1])[:12]:
            print(f"  {us:9.1f} us  {name}")
        print(f"device idle between kernels, one program of {longest} steps, us per call:")
        for name, us in sorted(gaps.items(), key=lambda kv: -kv[1])[:10]:
            print(f"  {us:9.1f} us  {name}")
        record_host = host_events(programs[longest], call_args)
        print(f"host events of one {op} ({dtype}) program of {longest} steps, "
              "us and count per call:")
        for name, us, count in record_host:
            print(f"  {us:9.1f} us  x{count:6.1f}  {name}")
    record = {"op": op, "impl": impl, "dtype": dtype if decode else "bf16", "ranks": R,
              "tokens": tokens, "hidden": args.hidden, "experts": args.experts,
              "topk": args.topk, "carry": args.carry, "bare": args.bare,
              "time_us": time_us, "kernel_us": kernel_us,
              "ep_kernel_us": ep_kernel_us if impl == "jax_ep" else None,
              "device_span_us": span_us,
              "enqueue_us": enqueue_us, "layers": list(args.layers), "wall_us": wall,
              "time_us_stderr": slope_stderr(args.layers, wall)}
    if counts_before is not None:
        calls, captured = (a - b for a, b in zip(_handler_counts(jax_ep), counts_before,
                                                 strict=True))
        record["handler_calls"], record["handler_calls_captured"] = calls, captured
    if buf is not None:
        buf.close()
    return record


def _handler_counts(jax_ep):
    from jax_ep.backends import cuda as _cuda  # noqa: PLC0415

    module, _ = _cuda.load_extension()
    counts = module.handler_call_counts()
    return counts["calls"], counts["captured"]


def main(argv=None):
    bm.default_host_devices()  # before anything starts a backend: 8 ranks on CPU, as bench_ep
    args = parse_args(sys.argv[1:] if argv is None else argv)
    bm.join_processes()
    jax_ep, reason = bm.import_jax_ep()
    mesh = bm.make_mesh(args.ranks)
    records, skipped = [], {}
    if bm.is_reporter():
        if bm.cpu_note():
            print(bm.cpu_note())
        print(HEADER, flush=True)
    for op in args.ops:
        dtypes = args.dtypes if op == "decode_step" else ("bf16",)
        for dtype in dtypes:
            for impl in args.impls:
                if impl == "jax_ep" and jax_ep is None:
                    print(f"skip jax_ep: {reason}")
                    continue
                if impl == "ragged_all_to_all" and not bm.on_gpu():
                    skipped[impl] = "not run: XLA:CPU has no ragged_all_to_all"
                    continue
                if impl in bp.PEER_CLASSES and mesh.shape[bm.AXIS] == 1:
                    skipped[impl] = ("not run: at EP=1 it moves nothing (XLA turns it into a "
                                     "local copy)")
                    continue
                try:
                    rec = run_case(jax_ep, mesh, args, op, impl, dtype)
                except Exception as e:  # noqa: BLE001 - one failing case must not end the run
                    traceback.print_exc()
                    rec = {"op": op, "impl": impl, "dtype": dtype, "error": repr(e)[:500]}
                records.append(rec)
                if bm.is_reporter():
                    print(format_row(rec), flush=True)
    if bm.is_reporter():
        name = f"{br.machine_name()}-{br.today()}-step" + (f"-{args.tag}" if args.tag else "")
        path = os.path.join(args.out, name + ".json")
        br.write_json(path, {**br.result_header(sys.argv[1:] if argv is None else argv,
                                                      args.note, __file__),
                             "method": __doc__.split("\n\n")[2].strip(), "records": records,
                             "skipped": skipped})
        for impl, why in skipped.items():
            print(f"{impl}: {why}")
        print("us per step (the slope over the programs' layers); noise: a slope at or below "
              "zero, drowned in timer noise; -: not measured here (no device trace)")
        print(f"\nwrote {path}")


HEADER = (f"{'op':<17} {'impl':<18} {'dtype':<5} {'R':>2} {'T':>5} {'time_us':>9} "
          f"{'kernel_us':>9} {'ep_kern_us':>10} {'enqueue_us':>10}")


def format_row(rec):
    if "error" in rec:
        return f"{rec['op']:<17} {rec['impl']:<18} {rec['dtype']:<5} error: {rec['error'][:80]}"

    def f(v):
        return "-" if v is None else "noise" if v <= 0 else f"{v:.1f}"

    return (f"{rec['op']:<17} {rec['impl']:<18} {rec['dtype']:<5} {rec['ranks']:>2} "
            f"{rec['tokens']:>5} {f(rec['time_us']):>9} {f(rec['kernel_us']):>9} "
            f"{f(rec['ep_kernel_us']):>10} {f(rec['enqueue_us']):>10}")


if __name__ == "__main__":
    main()
