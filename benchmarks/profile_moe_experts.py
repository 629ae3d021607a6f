"""Where the time of the expert GEMMs goes: `swiglu_experts` forward + backward on one device.

    python benchmarks/profile_moe_experts.py [--matmul mosaic] [--variants split,fused]

For each variant, one jitted step `value_and_grad(sum(y * ct))` w.r.t. the rows and the weights
at bench_moe_layer's shape (T=4096 tokens x top-8 = 32768 rows, H=2048, F=1024, 64 experts,
bf16, EP=1), measured three ways:
- `wall_ms`: the median wall time of a synchronous call (what a loop of blocking steps pays);
- `span_ms` / `idle_ms`: from a profiler trace of 3 calls in a row, the device timeline's span
  per step and the time in it where no kernel ran;
- `kernels`: device time per step of each kernel name (`busy_ms` their sum).
TFLOP/s count the useful work, 18 * rows * H * F per step, like bench_moe_layer.

Variants: `split` is `jax_ep.moe.swiglu_experts` with gate and up as two weights; `fused` with
gate and up side by side in one `[E, H, 2F]` weight (`w_up=None`): forward, dx and dw of both
are one product each (three instead of six, and no sum of two dx).
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

import bench_common as bc
import jax
import jax.numpy as jnp
import numpy as np

DEFAULTS = dict(tokens=4096, topk=8, hidden=2048, ffn=1024, experts=64)
QUICK = dict(tokens=64, topk=2, hidden=256, ffn=128, experts=4)
VARIANTS = ("split", "fused")
TRACED_STEPS = 3


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small shapes (CPU smoke test)")
    p.add_argument("--out", default=os.path.join(bc.REPO_ROOT, "benchmarks", "results"))
    p.add_argument("--matmul", default="auto", help="jax_ep.moe matmul (default auto)")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--tag", help="file name <machine>-<date>-moe_experts_profile-<tag>.json")
    args = p.parse_args(argv)
    args.variants = tuple(v for v in args.variants.split(",") if v)
    bad = [v for v in args.variants if v not in VARIANTS]
    if bad:
        p.error(f"unknown variants {bad}: expected some of {','.join(VARIANTS)}")
    for name, value in (QUICK if args.quick else DEFAULTS).items():
        setattr(args, name, value)
    return args


def make_inputs(args):
    rows = args.tokens * args.topk
    rng = np.random.default_rng(0)
    experts = np.argsort(rng.random((args.tokens, args.experts)), axis=1)[:, :args.topk]
    sizes = jnp.asarray(np.bincount(experts.ravel(), minlength=args.experts), jnp.int32)
    keys = jax.random.split(jax.random.key(0), 5)

    def weight(key, shape):
        return (jax.random.normal(key, shape, jnp.float32) * 0.02).astype(jnp.bfloat16)

    x = jax.random.normal(keys[0], (rows, args.hidden), jnp.bfloat16)
    ct = jax.random.normal(keys[1], (rows, args.hidden), jnp.bfloat16)
    w_gate = weight(keys[2], (args.experts, args.hidden, args.ffn))
    w_up = weight(keys[3], (args.experts, args.hidden, args.ffn))
    w_down = weight(keys[4], (args.experts, args.ffn, args.hidden))
    return x, ct, sizes, (w_gate, w_up, w_down)


def make_step(variant, matmul, x, ct, sizes, weights):
    """`(jitted step, its arguments)`: value and gradients w.r.t. the rows and the weights."""
    from jax_ep import moe

    def loss_of(y):
        return jnp.sum(y.astype(jnp.float32) * ct.astype(jnp.float32))

    if variant == "split":
        def loss(x, w_gate, w_up, w_down):
            return loss_of(moe.swiglu_experts(x, sizes, w_gate, w_up, w_down, matmul=matmul))
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3))), (x, *weights)
    w_gate, w_up, w_down = weights

    def loss(x, w_gate_up, w_down):
        return loss_of(moe.swiglu_experts(x, sizes, w_gate_up, None, w_down, matmul=matmul))
    w_gate_up = jnp.concatenate([w_gate, w_up], axis=2)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))), (x, w_gate_up, w_down)


def device_profile(fn, fn_args):
    """Per step: `{kernel: us}`, the timeline's span and idle (None without a device plane)."""
    from jax.profiler import ProfileData

    trace_dir = tempfile.mkdtemp(prefix="jax_ep_moe_trace_")
    with jax.profiler.trace(trace_dir):
        for _ in range(TRACED_STEPS):
            out = fn(*fn_args)
        jax.block_until_ready(out)
    path = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)[0]
    kernels, events = {}, []
    for plane in ProfileData.from_file(path).planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if "stream" not in line.name.lower():
                continue
            for e in line.events:
                kernels[e.name] = kernels.get(e.name, 0.0) + e.duration_ns / 1e3 / TRACED_STEPS
                events.append((e.start_ns, e.start_ns + e.duration_ns))
    if not events:
        return {}, None, None
    events.sort()
    idle_ns, end = 0, events[0][1]
    for start, stop in events[1:]:
        idle_ns += max(0, start - end)
        end = max(end, stop)
    span_ms = (end - events[0][0]) / 1e6 / TRACED_STEPS
    return kernels, span_ms, idle_ns / 1e6 / TRACED_STEPS


def run_variant(args, variant, inputs, flops):
    x, ct, sizes, weights = inputs
    start = time.perf_counter()
    fn, fn_args = make_step(variant, args.matmul, x, ct, sizes, weights)
    loss = float(jax.block_until_ready(fn(*fn_args))[0])
    compile_s = time.perf_counter() - start
    jax.block_until_ready(fn(*fn_args))
    walls = [bc.wall_us(fn, *fn_args) / 1e3 for _ in range(args.repeats)]
    wall_ms = statistics.median(walls)
    kernels, span_ms, idle_ms = device_profile(fn, fn_args)
    busy_ms = sum(kernels.values()) / 1e3 if kernels else None
    tflops = lambda ms: None if ms is None else round(flops / (ms * 1e-3) / 1e12, 1)  # noqa: E731
    top = dict(sorted(kernels.items(), key=lambda kv: -kv[1])[:12])
    return {"variant": variant, "matmul": args.matmul, "loss": loss, "wall_ms": round(wall_ms, 4),
            "tflops_wall": tflops(wall_ms), "span_ms": span_ms and round(span_ms, 4),
            "tflops_span": tflops(span_ms), "idle_ms": idle_ms and round(idle_ms, 4),
            "busy_ms": busy_ms and round(busy_ms, 4), "compile_s": round(compile_s, 1),
            "kernels_us": {k: round(v, 1) for k, v in top.items()}}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    jax_ep, why = bc.import_jax_ep()
    if jax_ep is None:
        raise SystemExit(f"jax_ep does not import: {why}")
    from jax_ep.moe import grouped_gemm

    resolved = grouped_gemm.resolve_matmul(args.matmul, jnp.bfloat16)
    inputs = make_inputs(args)
    flops = 18.0 * args.tokens * args.topk * args.hidden * args.ffn
    payload = dict(bc.result_header(argv), shape={k: getattr(args, k) for k in DEFAULTS},
                   resolved=resolved, flops_per_step=flops, results=[], errors=[])
    for variant in args.variants:
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
              f"TFLOP/s); {span}; loss {r['loss']:.6g}")
        for name, us in r["kernels_us"].items():
            print(f"    {us:9.1f} us  {name[:100]}")
    tag = f"-{args.tag}" if args.tag else ""
    name = f"{bc.machine_name()}-{bc.today()}-moe_experts_profile{tag}.json"
    bc.write_json(os.path.join(args.out, name), payload)
    print(f"wrote {os.path.join(args.out, name)}")


if __name__ == "__main__":
    main()
