"""Where the time of the expert GEMMs goes: `swiglu_experts` forward + backward on one device.

    python benchmarks/profile_moe_experts.py [--matmul mosaic] [--variants split,fused,gemms]
        [--unrolled 6]

For each variant, one step of bench_moe_layer's experts section (`value_and_grad(sum(y * ct))`
w.r.t. the rows and the weights, its inputs: T=4096 tokens x top-8 = 32768 rows split
multinomially over 64 experts, H=2048, F=1024, bf16, EP=1), measured four ways:
- `wall_ms`: the median wall time of a synchronous call (what a loop of blocking steps pays);
- `loop_ms`: per step, the wall time of 20 calls dispatched back to back and awaited once (what
  a training loop pays: the host prepares the next call while the GPU runs this one);
- `span_ms` / `idle_ms`: from a profiler trace of 3 calls in a row, the GPU timeline's span
  per step and the time in it where no kernel ran;
- `kernels`: GPU time per step of each kernel name (`busy_ms` their sum).
TFLOP/s count the useful work, 18 * rows * H * F per step, like bench_moe_layer.

Variants: `split` is `jax_ep.moe.swiglu_experts` with gate and up as two weights; `fused` with
gate and up side by side in one `[E, H, 2F]` weight (`w_up=None`): forward, dx and dw of both
are one product each (three instead of six, and no sum of two dx); `gemms` is bench_moe_layer's
gemms section: the six grouped GEMMs of a `fused` step alone, on operands prepared outside it.
On machines without a GPU the trace has no device plane: only the wall time is reported.
"""

from __future__ import annotations

import argparse
import glob
import os
import statistics
import sys
import tempfile
import time

import bench_mesh as bm
import bench_moe_layer as bml
import bench_records as br
import bench_timing as bt
import jax
import jax.numpy as jnp
import profile_ops

DEFAULTS = dict(tokens=4096, topk=8, hidden=2048, ffn=1024, experts=64)
QUICK = dict(tokens=64, topk=2, hidden=256, ffn=128, experts=4)
VARIANTS = ("split", "fused", "gemms")
TRACED_STEPS = 3
LOOP_STEPS = 20  # calls of the loop wall (loop_wall_ms)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small shapes (CPU smoke test)")
    br.add_out_argument(p)
    p.add_argument("--matmul", default="auto", help="jax_ep.moe matmul (default auto)")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated subset of {','.join(VARIANTS)} (the docstring says "
                        "what each is)")
    p.add_argument("--repeats", type=int, default=10,
                   help="synchronous calls timed for wall_ms (default 10)")
    p.add_argument("--unrolled", type=int, default=0,
                   help="also trace bench_moe_layer's program of this many unrolled steps "
                        "(distinct inputs, every output kept): per step wall, span and kernels")
    p.add_argument("--tag", help="file name <machine>-<date>-moe_experts_profile-<tag>.json")
    br.add_note_argument(p)
    p.add_argument("--seed", type=int, default=0, help="seed of the routing and inputs")
    args = p.parse_args(argv)
    args.variants = tuple(v for v in args.variants.split(",") if v)
    bad = [v for v in args.variants if v not in VARIANTS]
    if bad:
        p.error(f"unknown variants {bad}: expected some of {','.join(VARIANTS)}")
    for name, value in (QUICK if args.quick else DEFAULTS).items():
        setattr(args, name, value)
    args.gate_up = "split"  # bench_moe_layer.ExpertInputs' weights: each variant holds its own
    return args


def device_profile(fn, fn_args):
    """Per step: `{kernel: us}`, the timeline's span and idle (None without a device plane)."""
    trace_dir = tempfile.mkdtemp(prefix="jax_ep_moe_trace_")
    with jax.profiler.trace(trace_dir):
        for _ in range(TRACED_STEPS):
            out = fn(*fn_args)
        jax.block_until_ready(out)
    path = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)[0]
    events = sorted(e for plane in profile_ops._gpu_kernel_events(path).values() for e in plane)
    if not events:
        return {}, None, None
    kernels = {}
    for name, _, duration_ns in events:
        kernels[name] = kernels.get(name, 0.0) + duration_ns / 1e3 / TRACED_STEPS
    intervals = sorted((start, start + duration) for _, start, duration in events)
    idle_ns, end = 0, intervals[0][1]
    for start, stop in intervals[1:]:
        idle_ns += max(0, start - end)
        end = max(end, stop)
    span_ms = (end - intervals[0][0]) / 1e6 / TRACED_STEPS
    return kernels, span_ms, idle_ns / 1e6 / TRACED_STEPS


def variant_step(args, variant, inputs):
    """`(step, weights, sets)`: the variant's step `step(weights, *sets[i])`, one set per step of
    `inputs`."""
    if variant == "gemms":
        from jax_ep.moe import grouped_gemm

        step = bml.gemms_step(grouped_gemm.resolve_matmul(args.matmul, jnp.bfloat16))
        sets = [(x, sizes, ct, bml.width(x, args.ffn), bml.width(ct, 2 * args.ffn))
                for x, sizes, ct in inputs.sets]
        return step, bml.held_as("fused", inputs.weights), sets
    return (bml.experts_step(args.matmul, inputs.used), bml.held_as(variant, inputs.weights),
            inputs.sets)


def unrolled_profile(args, step, weights, sets, tflops):
    """bench_moe_layer's measured program, `--unrolled` steps: per step, the wall of one call
    and the GPU timeline's span and idle time."""
    n = args.unrolled
    program = bt.repeated_program(bm.make_mesh(1), step, n, lambda *fixed: fixed)
    call_args = (tuple(weights), tuple(tuple(s) for s in sets[:n]))
    compiled = program.lower(*call_args).compile()
    jax.block_until_ready(compiled(*call_args))
    wall_ms = statistics.median(bt.wall_us(compiled, *call_args) for _ in range(5)) / 1e3 / n
    kernels, span_ms, idle_ms = device_profile(compiled, call_args)
    return {"steps": n, "wall_ms": round(wall_ms, 4), "tflops_wall": tflops(wall_ms),
            "span_ms": span_ms and round(span_ms / n, 4),
            "tflops_span": tflops(span_ms and span_ms / n),
            "idle_ms": idle_ms and round(idle_ms / n, 4),
            "kernels_us": {k: round(v / n, 1) for k, v in
                           sorted(kernels.items(), key=lambda kv: -kv[1])[:12]}}


def loop_wall_ms(fn, fn_args, steps):
    """Wall time per step of `steps` calls dispatched back to back and awaited once at the end:
    what a training loop pays, the host preparing call i + 1 while the GPU runs call i."""
    start = time.perf_counter()
    outs = [fn(*fn_args) for _ in range(steps)]
    jax.block_until_ready(outs)
    return (time.perf_counter() - start) * 1e3 / steps


def run_variant(args, variant, inputs, flops):
    """One step of bench_moe_layer's experts section (its inputs, its step), gate and up held as
    `variant` says; or of its gemms section (`gemms`)."""
    start = time.perf_counter()
    step, weights, sets = variant_step(args, variant, inputs)
    fn = jax.jit(step)
    fn_args = (weights, *sets[0])
    first = jax.block_until_ready(fn(*fn_args))[0]
    loss = float(first) if first.ndim == 0 else None  # the gemms variant has no loss
    compile_s = time.perf_counter() - start
    jax.block_until_ready(fn(*fn_args))
    walls = [bt.wall_us(fn, *fn_args) / 1e3 for _ in range(args.repeats)]
    wall_ms = statistics.median(walls)
    loop_ms = statistics.median(loop_wall_ms(fn, fn_args, LOOP_STEPS) for _ in range(3))
    kernels, span_ms, idle_ms = device_profile(fn, fn_args)
    busy_ms = sum(kernels.values()) / 1e3 if kernels else None
    tflops = lambda ms: None if ms is None else round(flops / (ms * 1e-3) / 1e12, 1)  # noqa: E731
    top = dict(sorted(kernels.items(), key=lambda kv: -kv[1])[:12])
    unrolled = unrolled_profile(args, step, weights, sets, tflops) if args.unrolled else None
    return {"variant": variant, "matmul": args.matmul, "loss": loss, "wall_ms": round(wall_ms, 4),
            "tflops_wall": tflops(wall_ms), "loop_ms": round(loop_ms, 4),
            "tflops_loop": tflops(loop_ms), "span_ms": span_ms and round(span_ms, 4),
            "tflops_span": tflops(span_ms), "idle_ms": idle_ms and round(idle_ms, 4),
            "busy_ms": busy_ms and round(busy_ms, 4), "compile_s": round(compile_s, 1),
            "kernels_us": {k: round(v, 1) for k, v in top.items()}, "unrolled": unrolled}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    jax_ep, why = bm.import_jax_ep()
    if jax_ep is None:
        raise SystemExit(f"jax_ep does not import: {why}")
    from jax_ep.moe import grouped_gemm

    resolved = grouped_gemm.resolve_matmul(args.matmul, jnp.bfloat16)
    # One rank's block: T * K rows over E experts; a set per unrolled step.
    inputs = bml.ExpertInputs(args, 1, max(1, args.unrolled))
    flops = 18.0 * inputs.used * args.hidden * args.ffn
    payload = dict(br.result_header(argv, args.note, __file__),
                   shape={k: getattr(args, k) for k in DEFAULTS}, resolved=resolved,
                   flops_per_step=flops, results=[], errors=[])
    for variant in args.variants:
        if variant == "gemms" and resolved not in grouped_gemm.LIBRARY_MATMULS:
            print(f"gemms: skipped ({resolved} is not a library matmul)")
            continue
        try:
            r = run_variant(args, variant, inputs, flops)
        except Exception as e:  # noqa: BLE001 - reported, the other variants still run
            error = f"{type(e).__name__}: {e}"[:500]
            payload["errors"].append({"variant": variant, "error": error})
            print(f"{variant}: ERROR {payload['errors'][-1]['error']}")
            continue
        payload["results"].append(r)
        span = ("no device trace" if r["span_ms"] is None else
                f"{r['span_ms']:.3f} ms span ({r['tflops_span']} TFLOP/s), idle "
                f"{r['idle_ms']:.3f} ms")
        print(f"{variant:6s} {resolved}: wall {r['wall_ms']:.3f} ms ({r['tflops_wall']} "
              f"TFLOP/s); loop {r['loop_ms']:.3f} ms ({r['tflops_loop']} TFLOP/s); {span}; "
              f"loss {r['loss']}")
        for name, us in r["kernels_us"].items():
            print(f"    {us:9.1f} us  {name[:100]}")
        u = r["unrolled"]
        if u:
            print(f"  unrolled x{u['steps']}, per step: wall {u['wall_ms']:.3f} ms "
                  f"({u['tflops_wall']} TFLOP/s); span {u['span_ms']} ms ({u['tflops_span']} "
                  f"TFLOP/s), idle {u['idle_ms']} ms")
            for name, us in u["kernels_us"].items():
                print(f"    {us:9.1f} us  {name[:100]}")
    tag = f"-{args.tag}" if args.tag else ""
    name = f"{br.machine_name()}-{br.today()}-moe_experts_profile{tag}.json"
    br.write_json(os.path.join(args.out, name), payload)
    print(f"wrote {os.path.join(args.out, name)}")


if __name__ == "__main__":
    main()
