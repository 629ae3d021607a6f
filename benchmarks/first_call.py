"""First call against steady state, for normal and low-latency dispatch + combine.

    python benchmarks/first_call.py [--quick] [--out DIR] [--tokens 4096]

Each case runs in a fresh process (so nothing is warm from an earlier case):

- ``cold``: the first call of ``jax.jit(step)`` (tracing and compilation included), wall time;
- ``aot``: ``jax.jit(step).lower(...).compile()`` first (not timed), then the first call,
  without ``buf.warmup()``;
- ``warm``: ``buf.warmup()``, the step compiled by ``jax_ep.aot_compile`` (which also runs it
  ``WARMUP_EXECUTIONS`` times on the example arrays), then the first call;
  then ``--steady-calls`` more calls, whose median is the steady state; then calls alternating
  two input sets, and calls each after a 0.1 s pause (``paused_us``).

The step is, per rank, ``dispatch`` (bf16) then ``combine`` of the received rows (normal mode,
``--tokens``), or ``low_latency_dispatch`` (fp8) then ``low_latency_combine`` of a given expert
output (low-latency mode, ``--ll-tokens``). Every time is the wall time of one call up to
``block_until_ready``, host dispatch included (steady state included too, so the ratio compares
like with like). The peer ``jax.lax.all_to_all`` (capacity padding, same routing) is measured
the same way (cold, aot; it has no warm-up). Writes ``<out>/<machine>-<date>-first_call.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import bench_inputs as bi
import bench_mesh as bm
import bench_peers as bp
import bench_records as br
import bench_timing as bt

MODES = ("normal", "low_latency")
CASES = ("cold", "aot", "warm")
PEER_CASES = ("cold", "aot")
QUICK = {"tokens": 64, "ll_tokens": 4, "hidden": 256, "experts": 32, "steady_calls": 3}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small shapes (CPU testing)")
    br.add_out_argument(p)
    p.add_argument("--tokens", type=int, help="normal-mode tokens per rank (default 4096)")
    p.add_argument("--ll-tokens", type=int, help="low-latency tokens per rank (default 128)")
    p.add_argument("--hidden", type=int, help="default 7168")
    p.add_argument("--experts", type=int, help="default 256")
    p.add_argument("--topk", type=int, default=8, help="experts per token (default 8)")
    p.add_argument("--ranks", type=int, help="number of devices to use (default all)")
    p.add_argument("--backend", default="auto", choices=("auto", "cuda", "reference"),
                   help="jax_ep's Buffer backend (default auto: the CUDA kernels on GPUs)")
    p.add_argument("--modes", type=lambda s: tuple(s.split(",")), default=MODES,
                   help=f"comma-separated subset of {','.join(MODES)}")
    p.add_argument("--no-peer", action="store_true", help="skip the all_to_all peer")
    p.add_argument("--steady-calls", type=int, help="calls for the steady state (default 20)")
    p.add_argument("--case-timeout", type=float, default=900.0, help="seconds per child process")
    p.add_argument("--max-minutes", type=float,
                   help="start no new process after this many minutes (results so far are kept)")
    p.add_argument("--tag", help="appended to the file name: <machine>-<date>-first_call-<tag>")
    br.add_note_argument(p)
    p.add_argument("--child", help=argparse.SUPPRESS)  # "mode,case,impl" in a child process
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    defaults = {"tokens": 4096, "ll_tokens": 128, "hidden": 7168, "experts": 256,
                "steady_calls": 20}
    bi.fill_defaults(args, defaults, QUICK)
    bad = [m for m in args.modes if m not in MODES]
    if bad:
        p.error(f"unknown mode {bad}; choose from {MODES}")
    return args


# ----------------------------------------------------------------------------- child


def wall_us(fn, *args):
    import jax

    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return (time.perf_counter() - start) * 1e6


def build_step(args, mode, impl, mesh, jax_ep, buf, seed=0):
    """``(jitted step, args)`` of one mode; the step returns every output it makes. ``seed``
    picks the inputs (another seed: same shapes, new values in new buffers)."""
    import jax.numpy as jnp

    num_ranks = mesh.shape[bm.AXIS]
    tokens = args.tokens if mode == "normal" else args.ll_tokens
    topk_idx, topk_weights = bi.random_routing(mesh, seed + 1, tokens, args.experts, args.topk)
    x = bi.random_rows(mesh, seed + 2, (num_ranks * tokens, args.hidden))
    if impl == "all_to_all":
        peer = bp.AllToAllPeer(num_ranks, args.experts, args.topk)

        if mode == "normal":
            def step(x, idx, w):
                recv_x, recv_idx, recv_w = peer.dispatch([x], idx, w)
                return peer.combine(recv_x, peer.plan(idx)), recv_idx, recv_w

            return bt.shard_mapped(mesh, step, 3), (x, topk_idx, topk_weights)
        y = bi.random_rows(mesh, seed + 3, (num_ranks * num_ranks * tokens, args.hidden))

        def step(x, idx, w, y):
            recv_x, recv_scales, recv_idx, _ = peer.dispatch(list(bi.cast_fp8(x)), idx)
            return peer.combine(y, peer.plan(idx)), recv_x, recv_scales, recv_idx

        return bt.shard_mapped(mesh, step, 4), (x, topk_idx, topk_weights, y)

    if mode == "normal":
        def step(x, idx, w):
            d = jax_ep.dispatch(buf, x, idx, w)
            y, _ = jax_ep.combine(buf, d.recv_x, d.handle)
            return y, d.recv_topk_idx, d.recv_topk_weights, d.num_recv_tokens_per_expert

        return bt.shard_mapped(mesh, step, 3), (x, topk_idx, topk_weights)
    y = bi.random_rows(mesh, seed + 3, (args.experts, num_ranks * tokens, args.hidden),
                       jnp.bfloat16)

    def step(x, idx, w, y):
        d = jax_ep.low_latency_dispatch(buf, x, idx, use_fp8=True)
        z = jax_ep.low_latency_combine(buf, y, idx, w, d.handle)
        return z, d.recv_x, d.recv_scales, d.recv_count

    return bt.shard_mapped(mesh, step, 4), (x, topk_idx, topk_weights, y)


def run_child(args):
    mode, case, impl = args.child.split(",")
    import jax

    mesh = bm.make_mesh(args.ranks)
    out = {"mode": mode, "case": case, "impl": impl, "machine": br.machine_name(),
           "ranks": mesh.shape[bm.AXIS], "platform": jax.default_backend()}
    jax_ep, buf = None, None
    if impl != "all_to_all":
        jax_ep, why = bm.import_jax_ep()
        if jax_ep is None:
            raise SystemExit(f"import jax_ep failed: {why}")
        start = time.perf_counter()
        buf = jax_ep.Buffer(
            mesh, bm.AXIS, num_experts=args.experts, hidden=args.hidden,
            max_tokens_per_rank=args.tokens if mode == "normal" else args.ll_tokens,
            num_topk=args.topk, low_latency=mode == "low_latency", backend=args.backend)
        out["buffer_create_s"] = time.perf_counter() - start
        out["impl"] = "jax_ep" if buf.backend == "cuda" else "reference"
    step, step_args = build_step(args, mode, impl, mesh, jax_ep, buf)
    if case == "cold":
        out["first_us"] = wall_us(step, *step_args)
        fn = step
    else:
        start = time.perf_counter()
        if case == "warm":
            # buf.warmup() (every op once), then jax_ep.aot_compile: compile, then warm-up
            # executions of the step on the example arrays.
            buf.warmup()
            out["warmup_s"] = time.perf_counter() - start
            start = time.perf_counter()
            fn = jax_ep.aot_compile(step, *step_args)
            out["compile_s"] = time.perf_counter() - start
        else:
            fn = step.lower(*step_args).compile()
            out["compile_s"] = time.perf_counter() - start
        out["first_us"] = wall_us(fn, *step_args)
    calls = [wall_us(fn, *step_args) for _ in range(args.steady_calls)]
    out["steady_us"] = statistics.median(calls)
    out["second_us"] = calls[0]
    # A job's steps get new input buffers: alternate two input sets, so every call sees other
    # addresses than the one before (what XLA's command buffers must update for).
    other_args = build_step(args, mode, impl, mesh, jax_ep, buf, seed=10)[1]
    alternating = [wall_us(fn, *(other_args if i % 2 == 0 else step_args))
                   for i in range(args.steady_calls)]
    out["fresh_args_us"] = alternating[0]
    out["steady_alternating_us"] = statistics.median(alternating)
    # A serving loop idles between requests: calls after a pause pay for the idle host thread
    # and GPU (wake-up, clocks) whatever was warmed up before.
    paused = []
    for _ in range(5):
        time.sleep(0.1)
        paused.append(wall_us(fn, *step_args))
    out["paused_us"] = statistics.median(paused)
    if buf is not None:
        buf.close()
    br.write_json(args.child_out, out)


# ----------------------------------------------------------------------------- parent


def spawn(argv, args, mode, case, impl):
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "case.json")
        cmd = [sys.executable, os.path.abspath(__file__), *argv,
               "--child", f"{mode},{case},{impl}", "--child-out", path]
        start = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.case_timeout)
        except subprocess.TimeoutExpired:
            return None, f"timed out after {args.case_timeout:.0f} s"
        if proc.returncode != 0 or not os.path.exists(path):
            return None, f"exit {proc.returncode}: {proc.stderr.strip()[-600:]}"
        with open(path) as f:
            result = json.load(f)
        result["process_s"] = time.perf_counter() - start
        return result, None


def sig(value, digits=6):
    return None if value is None else float(f"{value:.{digits}g}")


def make_record(args, mode, got):
    """One ``first_call`` record from the child results of one (mode, impl)."""
    any_result = next(iter(got.values()))
    steady_from = "warm" if "warm" in got else ("aot" if "aot" in got else "cold")
    steady = got[steady_from]["steady_us"]
    first = {c: got[c]["first_us"] if c in got else None for c in CASES}
    rec = {
        "op": "first_call", "mode": mode, "impl": any_result["impl"],
        "dtype": "bf16" if mode == "normal" else "fp8", "ranks": any_result["ranks"],
        "tokens": args.tokens if mode == "normal" else args.ll_tokens,
        "hidden": args.hidden, "topk": args.topk, "experts": args.experts,
        "cold_us": sig(first["cold"]), "aot_first_us": sig(first["aot"]),
        "warm_first_us": sig(first["warm"]), "steady_us": sig(steady),
        "ratio": sig(first["warm"] / steady) if first["warm"] else None,
        "aot_ratio": sig(first["aot"] / steady) if first["aot"] else None,
        "steady_calls": args.steady_calls,
    }
    for key in ("second_us", "fresh_args_us", "steady_alternating_us", "paused_us"):
        if key in got[steady_from]:
            rec[key] = sig(got[steady_from][key])
    if first["warm"] and "steady_alternating_us" in rec:
        rec["ratio_alternating"] = sig(first["warm"] / rec["steady_alternating_us"])
    for key in ("buffer_create_s", "compile_s", "warmup_s"):
        values = [r[key] for r in got.values() if key in r]
        if values:
            rec[key] = sig(max(values), 4)
    return rec


def print_table(records, errors):
    head = (f"{'mode':12s} {'impl':10s} {'tokens':>6s} {'cold_us':>12s} {'aot_first_us':>12s} "
            f"{'warm_first_us':>13s} {'steady_us':>10s} {'ratio':>7s} {'aot_ratio':>9s}")
    print(head)
    print("-" * len(head))
    widths = [12, 12, 13, 10, 7, 9]
    for r in records:
        cells = [r["cold_us"], r["aot_first_us"], r["warm_first_us"], r["steady_us"],
                 r["ratio"], r["aot_ratio"]]
        text = " ".join(
            (f"{v:{w}.1f}" if i < 4 else f"{v:{w}.2f}") if v is not None else "-".rjust(w)
            for i, (v, w) in enumerate(zip(cells, widths, strict=True)))
        print(f"{r['mode']:12s} {r['impl']:10s} {r['tokens']:>6d} {text}")
    for e in errors:
        print(f"{e['mode']:12s} {e['impl']:10s} {e['case']:5s} ERROR {e['error'][:160]}")
    print("ratio = warm_first_us / steady_us (goal <= 1.2); aot_ratio = aot_first_us / steady_us;"
          " all wall times of one call, host dispatch included.", flush=True)


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.child:
        run_child(args)
        return
    deadline = (time.perf_counter() + 60 * args.max_minutes) if args.max_minutes else None

    records, errors, header = [], [], None
    path = None
    impls = [("jax_ep", CASES)] + ([] if args.no_peer else [("all_to_all", PEER_CASES)])
    for mode in args.modes:
        for impl, cases in impls:
            got = {}
            for case in cases:
                if deadline is not None and time.perf_counter() > deadline:
                    errors.append({"op": "first_call", "mode": mode, "impl": impl,
                                   "case": case, "error": "not run: --max-minutes reached"})
                    continue
                result, error = spawn(argv, args, mode, case, impl)
                if error:
                    errors.append({"op": "first_call", "mode": mode, "impl": impl,
                                   "case": case, "error": error})
                    print(f"[first_call] {mode:11s} {impl:10s} {case:5s} ERROR {error}",
                          flush=True)
                    continue
                got[case] = result
                print(f"[first_call] {mode:11s} {result['impl']:10s} {case:5s} first "
                      f"{result['first_us']:12.1f} us  steady {result['steady_us']:10.1f} us  "
                      f"(process {result['process_s']:.1f} s)", flush=True)
            if got:
                records.append(make_record(args, mode, got))
                if header is None:  # the machine is known once a child has run
                    machine = next(iter(got.values()))["machine"]
                    header = {"machine": machine, "date": br.today(),
                              **br.tree_header(argv, args.note, __file__),
                              "platform": next(iter(got.values()))["platform"]}
                    name = f"{machine}-{header['date']}-first_call" + (
                        f"-{args.tag}" if args.tag else "")
                    path = os.path.join(args.out, name + ".json")
            if header is not None:  # written after every (mode, impl): survives a kill
                br.write_json(path, dict(header, results=records, errors=errors))

    if header is None:
        print("[first_call] every case failed; nothing to write", flush=True)
        for e in errors:
            print(f"  {e}")
        raise SystemExit(1)
    print(f"\n[first_call] wrote {path}\n")
    print_table(records, errors)


if __name__ == "__main__":
    main()
