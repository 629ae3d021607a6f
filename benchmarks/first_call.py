"""First call against steady state, and where a call with new arguments goes, for normal and
low-latency dispatch + combine.

    python benchmarks/first_call.py [--quick] [--out DIR] [--processes 5] [--modes low_latency]

Each case runs in ``--processes`` fresh processes (default 5, 2 with ``--quick``; one round of
every case, then the next round), so nothing is warm from an earlier case and the record says
how much a figure moves from one process to the next: for each case and measure, the median
over the processes, the min, the max, the relative spread ``(max - min) / median`` and each
process's value. The record's top-level times are those medians. The cases:

- ``cold``: the first call of ``jax.jit(step)`` (tracing and compilation included);
- ``aot``: ``jax.jit(step).lower(...).compile()`` first (not timed), then the first call,
  without ``buf.warmup()``;
- ``warm``: ``buf.warmup()``, the step compiled by ``jax_ep.aot_compile`` (which also runs it
  ``WARMUP_EXECUTIONS`` times on the example arrays), then the first call;
- ``warm_no_cmdbuf`` (jax_ep) and ``aot_no_cmdbuf`` (the peer): ``warm`` and ``aot`` in a
  process whose ``XLA_FLAGS`` end in ``--xla_gpu_enable_command_buffer=``: XLA runs the program
  thunk by thunk, without command buffers (CUDA graphs);
- ``warm_fusion_cmdbuf`` (jax_ep): ``warm`` with ``--xla_gpu_enable_command_buffer=FUSION``:
  XLA's own kernels in command buffers, jax_ep's custom calls outside them. Against ``warm``, it
  tells what re-tracing the custom calls costs a call with new arguments (XLA calls a custom
  call's handler again under stream capture when its buffers move) from what updating the
  graph's kernel nodes costs.

After the first call every process makes, in this order: ``--steady-calls`` calls on the same
arguments (their median is ``steady_us``, the first of them ``second_us``); single calls that
each change one thing against the call before (``NEW_ARGUMENT_CALLS``): the steady arguments
right after a new argument set was made on device by programs compiled earlier
(``same_args_us``, the control), the first call with that set (``fresh_args_us``), the first call
with a second new set (``fresh_args_second_us``), the first call with a set transferred from
the host (``host_args_us``), the steady arguments again right after a second executable of the
step was compiled and not run (``recompiled_us``: XLA drops every other executable's command
buffers when it creates one); then calls alternating two argument sets
(``steady_alternating_us``) and calls each after a 0.1 s pause (``paused_us``). Beside each
time: ``*_captured``, how many of jax_ep's FFI handlers ran under CUDA-graph stream capture
during the call (XLA recording or updating a command buffer that holds them; CUDA backend only,
else null), and ``*_new_outputs``, whether the call's outputs got other device addresses than
those of the call before (XLA updates a command buffer for new output addresses too; for a
series, how many of its calls).

The step is, per rank, ``dispatch`` (bf16) then ``combine`` of the received rows (normal mode,
``--tokens``), or ``low_latency_dispatch`` (fp8) then ``low_latency_combine`` of a given expert
output (low-latency mode, ``--ll-tokens``). Every time is the wall time of one call up to
``block_until_ready``, host dispatch included (steady state included too, so the ratio compares
like with like). The peer ``jax.lax.all_to_all`` (capacity padding, same routing) is measured
the same way (cold, aot, aot_no_cmdbuf; it has no warm-up). Writes
``<out>/<machine>-<date>-first_call.json`` (rewritten after every round, ``"partial": true``
until the last).
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
# case -> (how the process warms up before its first call, the command types XLA may put in
# command buffers: None for XLA's default, "" for none)
CASE_SETUP = {
    "cold": ("cold", None),
    "aot": ("aot", None),
    "warm": ("warm", None),
    "warm_no_cmdbuf": ("warm", ""),
    "warm_fusion_cmdbuf": ("warm", "FUSION"),
    "aot_no_cmdbuf": ("aot", ""),
}
CASES = ("cold", "aot", "warm", "warm_no_cmdbuf", "warm_fusion_cmdbuf")
PEER_CASES = ("cold", "aot", "aot_no_cmdbuf")  # the peer has nothing to warm up
# Appended, with the case's command types, to the XLA_FLAGS of a case that sets them; an empty
# list turns XLA's command buffers (CUDA graphs) off.
COMMAND_BUFFER_FLAG = "--xla_gpu_enable_command_buffer="
# The single calls with new arguments (or after a new executable), in the order a process makes
# them; each gives <name>_us, <name>_captured and <name>_new_outputs.
NEW_ARGUMENT_CALLS = ("same_args", "fresh_args", "fresh_args_second", "host_args", "recompiled")
# The record's top-level medians of the steady case besides the first calls and steady_us.
TOP_LEVEL_TIMES = ("second_us", "same_args_us", "fresh_args_us", "fresh_args_second_us",
                   "host_args_us", "recompiled_us", "steady_alternating_us", "paused_us")
PAUSE_S = 0.1
PAUSED_CALLS = 5
QUICK = {"tokens": 64, "ll_tokens": 4, "hidden": 256, "experts": 32, "steady_calls": 3,
         "processes": 2}


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
    p.add_argument("--cases", type=lambda s: tuple(s.split(",")), default=tuple(CASE_SETUP),
                   help=f"comma-separated subset of {','.join(CASE_SETUP)} (default all; the "
                        "peer runs those of its own cases named here)")
    p.add_argument("--processes", type=int,
                   help="fresh processes per case, the medians' sample (default 5, --quick 2)")
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
                "steady_calls": 20, "processes": 5}
    bi.fill_defaults(args, defaults, QUICK)
    bad = [m for m in args.modes if m not in MODES]
    if bad:
        p.error(f"unknown mode {bad}; choose from {MODES}")
    bad = [c for c in args.cases if c not in CASE_SETUP]
    if bad:
        p.error(f"unknown case {bad}; choose from {tuple(CASE_SETUP)}")
    if args.processes < 1:
        p.error(f"--processes must be at least 1, got {args.processes}")
    return args


# ----------------------------------------------------------------------------- child


def make_args(args, mode, impl, mesh, seed=0):
    """The step's arguments for ``mode`` and ``impl``, made on device by jitted makers (one per
    shape, compiled on first use); another ``seed``: same shapes, new values in new buffers."""
    import jax.numpy as jnp

    num_ranks = mesh.shape[bm.AXIS]
    tokens = args.tokens if mode == "normal" else args.ll_tokens
    topk_idx, topk_weights = bi.random_routing(mesh, seed + 1, tokens, args.experts, args.topk)
    x = bi.random_rows(mesh, seed + 2, (num_ranks * tokens, args.hidden))
    if mode == "normal":
        return x, topk_idx, topk_weights
    if impl == "all_to_all":
        y = bi.random_rows(mesh, seed + 3, (num_ranks * num_ranks * tokens, args.hidden))
    else:
        y = bi.random_rows(mesh, seed + 3, (args.experts, num_ranks * tokens, args.hidden),
                           jnp.bfloat16)
    return x, topk_idx, topk_weights, y


def build_step(args, mode, impl, mesh, jax_ep, buf, seed=0):
    """``(jitted step, args)`` of one mode; the step returns every output it makes. ``seed``
    picks the inputs (``make_args``)."""
    num_ranks = mesh.shape[bm.AXIS]
    step_args = make_args(args, mode, impl, mesh, seed)
    if impl == "all_to_all":
        peer = bp.AllToAllPeer(num_ranks, args.experts, args.topk)

        if mode == "normal":
            def step(x, idx, w):
                recv_x, recv_idx, recv_w = peer.dispatch([x], idx, w)
                return peer.combine(recv_x, peer.plan(idx)), recv_idx, recv_w

            return bt.shard_mapped(mesh, step, 3), step_args

        def step(x, idx, w, y):
            recv_x, recv_scales, recv_idx, _ = peer.dispatch(list(bi.cast_fp8(x)), idx)
            return peer.combine(y, peer.plan(idx)), recv_x, recv_scales, recv_idx

        return bt.shard_mapped(mesh, step, 4), step_args

    if mode == "normal":
        def step(x, idx, w):
            d = jax_ep.dispatch(buf, x, idx, w)
            y, _ = jax_ep.combine(buf, d.recv_x, d.handle)
            return y, d.recv_topk_idx, d.recv_topk_weights, d.num_recv_tokens_per_expert

        return bt.shard_mapped(mesh, step, 3), step_args

    def step(x, idx, w, y):
        d = jax_ep.low_latency_dispatch(buf, x, idx, use_fp8=True)
        z = jax_ep.low_latency_combine(buf, y, idx, w, d.handle)
        return z, d.recv_x, d.recv_scales, d.recv_count

    return bt.shard_mapped(mesh, step, 4), step_args


def captured_handler_calls(buf):
    """A function returning the process's count of jax_ep handler executions under CUDA-graph
    capture (``jax_ep._C.handler_call_counts``), or None when the Buffer runs no FFI handler
    (no Buffer, or the reference backend)."""
    if buf is None or buf.backend != "cuda":
        return None
    from jax_ep.backends import cuda  # noqa: PLC0415

    module, _ = cuda.load_extension()
    return lambda: module.handler_call_counts()["captured"]


def output_addresses(out):
    """The device address of every shard of every output array, in order."""
    import jax

    return tuple(shard.data.unsafe_buffer_pointer()
                 for leaf in jax.tree.leaves(out) for shard in leaf.addressable_shards)


class TimedCalls:
    """Calls one function, each call timed up to ``block_until_ready``; notes how many handlers
    ran under graph capture during the call and whether its outputs got new addresses."""

    def __init__(self, fn, captured):
        self.fn = fn
        self.captured = captured
        self.last_outputs = None

    def __call__(self, call_args):
        import jax

        captured_before = self.captured() if self.captured else None
        start = time.perf_counter()
        out = jax.block_until_ready(self.fn(*call_args))
        elapsed_us = (time.perf_counter() - start) * 1e6
        addresses = output_addresses(out)
        new_outputs = None if self.last_outputs is None else int(addresses != self.last_outputs)
        self.last_outputs = addresses
        captured = self.captured() - captured_before if self.captured else None
        return {"us": elapsed_us, "captured": captured, "new_outputs": new_outputs}


def summarize(name, calls):
    """``<name>_us`` (median time), ``<name>_captured`` (sum) and ``<name>_new_outputs`` (calls
    whose outputs moved) of a series of calls."""
    captured = [c["captured"] for c in calls]
    moved = [c["new_outputs"] for c in calls]
    return {f"{name}_us": statistics.median(c["us"] for c in calls),
            f"{name}_captured": None if None in captured else sum(captured),
            f"{name}_new_outputs": None if None in moved else sum(moved)}


def single(name, call):
    return {f"{name}_us": call["us"], f"{name}_captured": call["captured"],
            f"{name}_new_outputs": call["new_outputs"]}


def on_host_then_device(arrays):
    """New device arrays with the values of ``arrays``, transferred from host copies."""
    import jax
    import numpy as np

    return jax.block_until_ready(
        tuple(jax.device_put(np.asarray(a), a.sharding) for a in arrays))


def run_child(args):
    mode, case, impl = args.child.split(",")
    warm_up, _ = CASE_SETUP[case]
    import jax

    mesh = bm.make_mesh(args.ranks)
    out = {"mode": mode, "case": case, "impl": impl, "machine": br.machine_name(),
           "ranks": mesh.shape[bm.AXIS], "platform": jax.default_backend(),
           "xla_flags": os.environ.get("XLA_FLAGS", "")}
    measures = {}
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
        measures["buffer_create_s"] = time.perf_counter() - start
        out["impl"] = "jax_ep" if buf.backend == "cuda" else "reference"
    step, step_args = build_step(args, mode, impl, mesh, jax_ep, buf)
    fn = step
    if warm_up == "warm":
        # buf.warmup() (every op once), then jax_ep.aot_compile: compile, then warm-up
        # executions of the step on the example arrays.
        start = time.perf_counter()
        buf.warmup()
        measures["warmup_s"] = time.perf_counter() - start
        start = time.perf_counter()
        fn = jax_ep.aot_compile(step, *step_args)
        measures["compile_s"] = time.perf_counter() - start
    elif warm_up == "aot":
        start = time.perf_counter()
        fn = step.lower(*step_args).compile()
        measures["compile_s"] = time.perf_counter() - start
    calls = TimedCalls(fn, captured_handler_calls(buf))
    first = calls(step_args)
    measures["first_us"], measures["first_captured"] = first["us"], first["captured"]
    steady = [calls(step_args) for _ in range(args.steady_calls)]
    measures.update(summarize("steady", steady))
    measures["second_us"] = steady[0]["us"]
    measures["first_over_steady"] = first["us"] / measures["steady_us"]

    # New arguments. A job's steps get new input buffers; XLA then updates the command buffers
    # (CUDA graphs) that use them. Each call below changes one thing against the call before.
    fresh = make_args(args, mode, impl, mesh, seed=10)
    measures.update(single("same_args", calls(step_args)))
    measures.update(single("fresh_args", calls(fresh)))
    fresh_second = make_args(args, mode, impl, mesh, seed=20)
    measures.update(single("fresh_args_second", calls(fresh_second)))
    from_host = on_host_then_device(fresh)
    measures.update(single("host_args", calls(from_host)))
    calls(step_args)  # the steady arguments again: what the next call's command buffers hold
    jax.jit(lambda *a: step(*a)).lower(*step_args).compile()  # a new executable, never run
    measures.update(single("recompiled", calls(step_args)))
    alternating = [calls(fresh if i % 2 == 0 else step_args) for i in range(args.steady_calls)]
    measures.update(summarize("steady_alternating", alternating))
    # A serving loop idles between requests: calls after a pause pay for the idle host thread
    # and GPU (wake-up, clocks) whatever was warmed up before.
    paused = []
    for _ in range(PAUSED_CALLS):
        time.sleep(PAUSE_S)
        paused.append(calls(step_args))
    measures.update(summarize("paused", paused))
    if buf is not None:
        buf.close()
    out["measures"] = measures
    br.write_json(args.child_out, out)


# ----------------------------------------------------------------------------- parent


def child_env(case):
    """The environment of a ``case``'s process: this one's, with the case's command types (none
    for the *_no_cmdbuf cases) appended to ``XLA_FLAGS``."""
    env = dict(os.environ)
    types = CASE_SETUP[case][1]
    if types is not None:
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {COMMAND_BUFFER_FLAG}{types}".strip()
    return env


def spawn(argv, args, mode, case, impl):
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "case.json")
        cmd = [sys.executable, os.path.abspath(__file__), *argv,
               "--child", f"{mode},{case},{impl}", "--child-out", path]
        start = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.case_timeout,
                                  env=child_env(case))
        except subprocess.TimeoutExpired:
            return None, f"timed out after {args.case_timeout:.0f} s"
        if proc.returncode != 0 or not os.path.exists(path):
            return None, f"exit {proc.returncode}: {proc.stderr.strip()[-600:]}"
        with open(path) as f:
            result = json.load(f)
        result["measures"]["process_s"] = time.perf_counter() - start
        return result, None


def sig(value, digits=6):
    return None if value is None else float(f"{value:.{digits}g}")


def spread(values):
    """Median, min, max, relative spread ``(max - min) / median`` and the values themselves (in
    process order) of one measure over the processes of a case; None without any value."""
    values = [v for v in values if v is not None]
    if not values:
        return None
    median = statistics.median(values)
    low, high = min(values), max(values)
    return {"median": sig(median), "min": sig(low), "max": sig(high),
            "rel_spread": sig((high - low) / median, 3) if median else None,
            "values": [sig(v) for v in values]}


def case_summary(results):
    """What the record keeps of one case: its processes' XLA flags, and every measure's
    ``spread`` over them."""
    names = sorted({name for r in results for name in r["measures"]})
    return {"num_runs": len(results),
            "command_buffers": CASE_SETUP[results[0]["case"]][1] != "",
            "xla_flags": sorted({r["xla_flags"] for r in results}),
            "measures": {name: spread([r["measures"].get(name) for r in results])
                         for name in names}}


def case_stats(cases, case, name):
    """The ``spread`` of measure ``name`` in ``case`` of a record's ``cases``, or None."""
    return cases.get(case, {}).get("measures", {}).get(name)


def median_of(cases, case, name):
    stats = case_stats(cases, case, name)
    return None if stats is None else stats["median"]


def make_record(args, mode, got):
    """One ``first_call`` record from the child results of one (mode, impl): ``got`` maps each
    case that ran to its processes' results."""
    any_result = next(iter(got.values()))[0]
    cases = {case: case_summary(results) for case, results in got.items()}
    steady_from = next((c for c in ("warm", "aot", "cold") if c in cases), None)
    steady = median_of(cases, steady_from, "steady_us")
    first = {c: median_of(cases, c, "first_us") for c in ("cold", "aot", "warm")}
    rec = {
        "op": "first_call", "mode": mode, "impl": any_result["impl"],
        "dtype": "bf16" if mode == "normal" else "fp8", "ranks": any_result["ranks"],
        "tokens": args.tokens if mode == "normal" else args.ll_tokens,
        "hidden": args.hidden, "topk": args.topk, "experts": args.experts,
        "cold_us": first["cold"], "aot_first_us": first["aot"],
        "warm_first_us": first["warm"], "steady_us": steady,
        "ratio": sig(first["warm"] / steady) if first["warm"] and steady else None,
        "aot_ratio": sig(first["aot"] / steady) if first["aot"] and steady else None,
        "steady_calls": args.steady_calls, "steady_case": steady_from,
    }
    for key in TOP_LEVEL_TIMES:
        value = median_of(cases, steady_from, key)
        if value is not None:
            rec[key] = value
    if first["warm"] and rec.get("steady_alternating_us"):
        rec["ratio_alternating"] = sig(first["warm"] / rec["steady_alternating_us"])
    for key in ("buffer_create_s", "compile_s", "warmup_s"):
        values = [r["measures"][key] for results in got.values() for r in results
                  if key in r["measures"]]
        if values:
            rec[key] = sig(max(values), 4)
    rec["cases"] = cases
    return rec


def cell(stats, width, digits=1):
    """``median [spread%]`` right-aligned in ``width``, or ``-``."""
    if stats is None:
        return "-".rjust(width)
    text = f"{stats['median']:.{digits}f}"
    if stats["rel_spread"] is not None and len(stats["values"]) > 1:
        text += f" [{100 * stats['rel_spread']:.0f}%]"
    return text.rjust(width)


def print_tables(records, errors, processes):
    per = f"median of {processes} fresh processes per case [(max - min) / median]"
    print(f"First call, us: {per}")
    head = (f"{'mode':12s} {'impl':10s} {'tokens':>6s} {'cold_us':>17s} {'aot_first_us':>15s} "
            f"{'warm_first_us':>15s} {'steady_us':>15s} {'ratio':>6s} {'aot_ratio':>9s}")
    print(head)
    print("-" * len(head))
    for r in records:
        cases = r["cases"]
        ratios = " ".join(("-" if v is None else f"{v:.2f}").rjust(w)
                          for v, w in ((r["ratio"], 6), (r["aot_ratio"], 9)))
        print(f"{r['mode']:12s} {r['impl']:10s} {r['tokens']:>6d} "
              f"{cell(case_stats(cases, 'cold', 'first_us'), 17)} "
              f"{cell(case_stats(cases, 'aot', 'first_us'), 15)} "
              f"{cell(case_stats(cases, 'warm', 'first_us'), 15)} "
              f"{cell(case_stats(cases, r['steady_case'], 'steady_us'), 15)} {ratios}")
    print("ratio = warm_first_us / steady_us (goal <= 1.2); aot_ratio = aot_first_us / steady_us"
          " (of the medians); all wall times of one call, host dispatch included.\n")

    columns = ("steady", "same_args", "fresh_args", "fresh_args_second", "host_args",
               "recompiled", "steady_alternating", "paused")
    short = ("steady", "same", "fresh", "fresh2", "host", "recompiled", "alternating", "paused")
    print(f"Calls with new arguments, us: {per}")
    head = (f"{'mode':12s} {'impl':10s} {'case':15s} "
            + " ".join(f"{s:>14s}" for s in short) + f" {'captured s/f/f2/h/r':>20s}")
    print(head)
    print("-" * len(head))
    for r in records:
        for case, summary in r["cases"].items():
            if CASE_SETUP[case][0] == "cold":
                continue
            m = summary["measures"]
            captured = [m.get(f"{c}_captured") for c in NEW_ARGUMENT_CALLS]
            captured_text = "/".join("-" if c is None else f"{c['median']:g}" for c in captured)
            print(f"{r['mode']:12s} {r['impl']:10s} {case:15s} "
                  + " ".join(cell(m.get(f"{c}_us"), 14) for c in columns)
                  + f" {captured_text:>20s}")
    print("steady: median of --steady-calls calls on the same arguments; same: those arguments "
          "right after a new set was made on device; fresh: first call with that set; fresh2: "
          "first call with a second new set; host: first call with a set transferred from host; "
          "recompiled: the steady arguments right after a second executable of the step was "
          "compiled (XLA drops other executables' command buffers then); alternating: median "
          "of calls alternating two sets; paused: median of calls after 0.1 s idle. captured: "
          "jax_ep handlers run under CUDA-graph capture during same/fresh/fresh2/host/"
          "recompiled (median; '-' without jax_ep's CUDA backend). *_no_cmdbuf: XLA_FLAGS "
          f"{COMMAND_BUFFER_FLAG} (no CUDA graphs); *_fusion_cmdbuf: {COMMAND_BUFFER_FLAG}FUSION "
          "(jax_ep's calls outside CUDA graphs).", flush=True)
    for e in errors:
        print(f"{e['mode']:12s} {e['impl']:10s} {e['case']:15s} run {e['run']} "
              f"ERROR {e['error'][:160]}")


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.child:
        run_child(args)
        return
    deadline = (time.perf_counter() + 60 * args.max_minutes) if args.max_minutes else None

    impls = [("jax_ep", CASES)] + ([] if args.no_peer else [("all_to_all", PEER_CASES)])
    plan = [(mode, impl, case) for mode in args.modes for impl, cases in impls
            for case in cases if case in args.cases]
    if not plan:
        raise SystemExit(f"[first_call] no case to run: --cases {','.join(args.cases)} names "
                         f"none of jax_ep's {CASES}" + ("" if args.no_peer else
                                                        f" nor the peer's {PEER_CASES}"))
    got = {}  # (mode, impl) -> case -> results
    errors, header, path = [], None, None

    def write(partial):
        records = [make_record(args, mode, cases) for (mode, _), cases in got.items()]
        br.write_json(path, dict(header, partial=partial, results=records, errors=errors))
        return records

    for run, (mode, impl, case) in ((r, p) for r in range(args.processes) for p in plan):
        if deadline is not None and time.perf_counter() > deadline:
            errors.append({"op": "first_call", "mode": mode, "impl": impl, "case": case,
                           "run": run, "error": "not run, nor any later process: "
                                                "--max-minutes reached"})
            break
        result, error = spawn(argv, args, mode, case, impl)
        if error:
            errors.append({"op": "first_call", "mode": mode, "impl": impl, "case": case,
                           "run": run, "error": error})
            print(f"[first_call] run {run + 1}/{args.processes} {mode:11s} {impl:10s} "
                  f"{case:14s} ERROR {error}", flush=True)
        else:
            got.setdefault((mode, impl), {}).setdefault(case, []).append(result)
            m = result["measures"]
            print(f"[first_call] run {run + 1}/{args.processes} {mode:11s} "
                  f"{result['impl']:10s} {case:14s} first {m['first_us']:11.1f} us  "
                  f"steady {m['steady_us']:9.1f} us  fresh args {m['fresh_args_us']:9.1f} us  "
                  f"(process {m['process_s']:.1f} s)", flush=True)
        if header is None and result is not None:  # the machine is known once a child has run
            header = {"machine": result["machine"], "date": br.today(),
                      **br.tree_header(argv, args.note, __file__),
                      "platform": result["platform"], "processes_per_case": args.processes}
            name = f"{result['machine']}-{header['date']}-first_call" + (
                f"-{args.tag}" if args.tag else "")
            path = os.path.join(args.out, name + ".json")
        if header is not None and (mode, impl, case) == plan[-1]:  # a killed run keeps its rounds
            write(partial=True)

    if header is None:
        print("[first_call] every case failed; nothing to write", flush=True)
        for e in errors:
            print(f"  {e}")
        raise SystemExit(1)
    records = write(partial=False)
    print(f"\n[first_call] wrote {path}\n")
    print_tables(records, errors, args.processes)


if __name__ == "__main__":
    main()
