"""Device-time benchmark of jax_ep against JAX's own collectives, in one run.

    python benchmarks/bench_ep.py [--quick] [--sweep] [--tokens 4096] [--out DIR]

Times, per op and per rank: jax_ep (backend "cuda"), its reference backend ("reference"),
``jax.lax.all_to_all`` with capacity padding, ``jax.lax.ragged_all_to_all`` with default XLA
flags, and ``ragged_all_to_all`` with ``--xla_gpu_unsupported_enable_ragged_all_to_all_decomposer``
(a child process, since XLA reads its flags once). Normal mode: layout, dispatch (bf16, fp8),
combine at ``--tokens``; low-latency mode: dispatch (fp8, bf16) and combine for each of
``--ll-tokens``, and (jax_ep's kernels only) the send and receive halves of both
(``low_latency_*_send`` / ``_recv``, see ``split_program``); ``--sweep`` adds normal mode over
256..8192 tokens and two PNG plots.

Method (see README.md): one jitted shard_map'd program runs the op N times unrolled, each call
chained to the previous one through an optimization barrier and fed a different pre-generated
input; per-op GPU time = (median t(N_long) - median t(N_short)) / (N_long - N_short), so the
host dispatch (~200 us for a 2-GPU call) cancels. Bytes are counted as DeepEP counts them
(docs/api.md, "Measuring"). A time within its timer noise of zero (twice the standard error of
the difference, ``bench_timing.noise_us``) is reported as "below noise (±x us)", not as a figure.
Writes ``<out>/<machine>-<date>.json`` (or ``--out`` itself when it ends in ``.json``) and prints
a table last. Without GPUs the script runs on 8 host CPU devices (unless ``XLA_FLAGS`` sets a
count) and skips jax_ep's kernels and ragged_all_to_all, so the script itself can be tested
there; its times (most below noise) say nothing about GPU speed, and ``nvlink_share`` is None.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import gc
import json
import os
import shutil
import subprocess
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
import numpy as np

DECOMPOSER_FLAG = "--xla_gpu_unsupported_enable_ragged_all_to_all_decomposer=true"
DECOMPOSER_IMPL = "ragged_all_to_all_decomposer"
IMPLS = ("jax_ep", "reference", "all_to_all", "ragged_all_to_all", DECOMPOSER_IMPL)
PEER_IMPLS = IMPLS[1:]  # everything that is not jax_ep's own kernels
OPS = ("layout", "dispatch", "combine", "low_latency_dispatch", "low_latency_combine",
       "low_latency_dispatch_send", "low_latency_dispatch_recv", "low_latency_combine_send",
       "low_latency_combine_recv")
# Send/receive halves of the low-latency ops -> (the fused op, the half). Timed for jax_ep's own
# kernels only: the reference backend's send is a no-op and the peers have no halves.
SPLIT_OPS = {f"low_latency_{op}_{half}": (f"low_latency_{op}", half)
             for op in ("dispatch", "combine") for half in ("send", "recv")}
DEFAULT_LL_TOKENS = (1, 16, 64, 128, 256)
SWEEP_TOKENS = tuple(2**i for i in range(8, 14))  # 256 .. 8192
QUICK = {"tokens": 128, "hidden": 512, "experts": 32, "ll_tokens": (1, 8),
         "sweep_tokens": (64, 128, 256), "n_short": 1, "n_long": 3, "repeats": 3, "warmup": 1}


@dataclasses.dataclass(frozen=True)
class Case:
    mode: str  # "normal" | "low_latency"
    op: str
    dtype: str  # "bf16" | "fp8"
    tokens: int


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="small shapes, few iterations (T=128, H=512, E=32, low-latency T=1,8): "
                        "for testing on CPU")
    p.add_argument("--sweep", action="store_true",
                   help="add normal mode for 256..8192 tokens per rank and write PNG plots")
    br.add_out_argument(p, "a folder for <machine>-<date>[-<tag>].json, or a file name ending "
                           "in .json (the --sweep plots go beside it, named after it)")
    p.add_argument("--tokens", type=int, help="normal-mode tokens per rank (default 4096)")
    p.add_argument("--hidden", type=int, help="default 7168")
    p.add_argument("--topk", type=int, default=8, help="experts per token (default 8)")
    p.add_argument("--experts", type=int, help="default 256")
    p.add_argument("--ranks", type=int, help="number of devices to use (default all)")
    p.add_argument("--ll-tokens", type=lambda s: tuple(int(t) for t in s.split(",")),
                   help="comma-separated low-latency tokens per rank (default 1,16,64,128,256)")
    p.add_argument("--sweep-tokens", type=lambda s: tuple(int(t) for t in s.split(",")),
                   help="comma-separated normal-mode tokens per rank of --sweep (default "
                        "256,512,...,8192; --quick: 64,128,256)")
    p.add_argument("--ops", type=lambda s: tuple(s.split(",")), default=OPS,
                   help=f"comma-separated subset of {','.join(OPS)}")
    p.add_argument("--impls", type=lambda s: tuple(s.split(",")), default=IMPLS,
                   help=f"comma-separated subset of {','.join(IMPLS)}")
    p.add_argument("--n-short", type=int, help="iterations of the short program (default 2)")
    p.add_argument("--n-long", type=int, help="iterations of the long program (default 12)")
    p.add_argument("--repeats", type=int, help="timed runs of each program (default 20)")
    p.add_argument("--outputs", choices=("all", "last"), default="last",
                   help="program outputs: the last call's only (default: what a model keeps; "
                        "the others feed the next call) or every call's (each one more output "
                        "buffer for XLA to allocate and hand back)")
    p.add_argument("--warmup", type=int, help="untimed runs of each program first (default 3)")
    p.add_argument("--tag", help="appended to the result file name: <machine>-<date>-<tag>.json")
    br.add_note_argument(p)
    p.add_argument("--seed", type=int, default=0, help="seed of the routing and inputs")
    p.add_argument("--max-minutes", type=float,
                   help="start no new case after this many minutes (the decomposer child gets "
                        "a quarter); results so far are written and the table printed")
    p.add_argument("--child-timeout", type=float, default=1800.0,
                   help="seconds allowed to the decomposer child process")
    p.add_argument("--child-out", help=argparse.SUPPRESS)  # set in the decomposer child
    args = p.parse_args(argv)
    defaults = {"tokens": 4096, "hidden": 7168, "experts": 256, "ll_tokens": DEFAULT_LL_TOKENS,
                "sweep_tokens": SWEEP_TOKENS, "n_short": 2, "n_long": 12, "repeats": 20,
                "warmup": 3}
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, QUICK[name] if args.quick else value)
    bad = [x for x in args.ops if x not in OPS] + [x for x in args.impls if x not in IMPLS]
    if bad:
        p.error(f"unknown op/impl {bad}")
    if args.n_long <= args.n_short or args.n_short < 1:
        p.error("need 1 <= --n-short < --n-long")
    return args


def plan_cases(args) -> list[Case]:
    cases = []
    normal_tokens = [args.tokens]
    if args.sweep:
        normal_tokens += [t for t in args.sweep_tokens if t != args.tokens]
    for tokens in normal_tokens:
        ops = [("layout", "bf16"), ("dispatch", "bf16"), ("dispatch", "fp8"), ("combine", "bf16")]
        for op, dtype in ops:
            if op == "layout" and tokens != args.tokens:
                continue
            if op in args.ops:
                cases.append(Case("normal", op, dtype, tokens))
    for tokens in args.ll_tokens:
        for op, dtype in [("low_latency_dispatch", "fp8"), ("low_latency_dispatch", "bf16"),
                          ("low_latency_combine", "bf16")]:
            for name in (op, f"{op}_send", f"{op}_recv"):
                if name in args.ops:
                    cases.append(Case("low_latency", name, dtype, tokens))
    return cases


# ----------------------------------------------------------------------------- inputs


class Inputs:
    """Pre-generated inputs of one (mode, tokens) group, shared by every impl; made lazily.

    One set per iteration of the long program (``--n-long``): every call of a timed program
    reads its own input, so XLA cannot merge two calls. All global arrays are
    ``[R * rows, ...]`` sharded along "ep" (see bench_mesh).
    """

    def __init__(self, mesh, args, tokens, jax_ep):
        self.mesh, self.args, self.tokens, self.jax_ep = mesh, args, tokens, jax_ep
        self.num_ranks = mesh.shape[bm.AXIS]
        self.num_sets = args.n_long
        self._cache = {}
        seed = args.seed * 1_000_003 + tokens * 101
        self.routing = [
            bi.random_routing(mesh, seed + i, tokens, args.experts, args.topk)
            for i in range(self.num_sets)
        ]
        idx = [bm.to_host(r[0]) for r in self.routing]
        stats = [bi.routing_stats(i, self.num_ranks, args.experts) for i in idx]
        # Dispatch-like ops use every routing; combine reuses the routing of set 0.
        self.stats_mean = {k: float(np.mean([s[k] for s in stats])) for k in stats[0]}
        self.stats_first = stats[0]

    def _get(self, name, make):
        if name not in self._cache:
            self._cache[name] = make()
        return self._cache[name]

    def x(self, i):
        shape = (self.num_ranks * self.tokens, self.args.hidden)
        seed = self.args.seed * 1_000_003 + 7000 + i
        return self._get(("x", i), lambda: bi.random_rows(self.mesh, seed, shape))

    def x_fp8(self, i):
        def make():
            cast = self.jax_ep.per_token_cast_to_fp8 if self.jax_ep else bi.cast_fp8
            return jax.block_until_ready(jax.jit(cast)(self.x(i)))

        return self._get(("x_fp8", i), make)

    def y(self, i):
        """Normal-mode expert output ``[C = R*T, H]`` per rank."""
        shape = (self.num_ranks * self.num_ranks * self.tokens, self.args.hidden)
        seed = self.args.seed * 1_000_003 + 8000 + i
        return self._get(("y", i), lambda: bi.random_rows(self.mesh, seed, shape))

    def y_low_latency(self, i):
        """Low-latency expert output ``[E_loc, R*T_max, H]`` per rank."""
        shape = (self.args.experts, self.num_ranks * self.tokens, self.args.hidden)
        seed = self.args.seed * 1_000_003 + 9000 + i
        return self._get(("y_ll", i), lambda: bi.random_rows(self.mesh, seed, shape))


# ----------------------------------------------------------------------------- op builders


def jax_ep_program(jax_ep, buf, case: Case, inputs: Inputs):
    """``(prologue, op, fixed, sets[, epilogue])`` of a jax_ep op (cuda or reference backend)."""
    if case.op in SPLIT_OPS:
        return split_program(jax_ep, buf, case, inputs)
    n = range(inputs.num_sets)
    idx = [r[0] for r in inputs.routing]
    w = [r[1] for r in inputs.routing]
    if case.op == "layout":
        return None, lambda ctx, i: jax_ep.get_dispatch_layout(buf, i), (), [(idx[k],) for k in n]
    if case.op == "dispatch" and case.dtype == "bf16":
        sets = [(inputs.x(k), idx[k], w[k]) for k in n]
        return None, lambda ctx, x, i, wt: jax_ep.dispatch(buf, x, i, wt), (), sets
    if case.op == "dispatch":
        sets = [(*inputs.x_fp8(k), idx[k], w[k]) for k in n]
        return None, lambda ctx, xq, s, i, wt: jax_ep.dispatch(buf, (xq, s), i, wt), (), sets
    if case.op == "combine":
        def prologue(x, i, wt):
            return jax_ep.dispatch(buf, x, i, wt).handle

        def op(handle, y):
            return jax_ep.combine(buf, y, handle)

        return prologue, op, (inputs.x(0), idx[0], w[0]), [(inputs.y(k),) for k in n]
    if case.op == "low_latency_dispatch":
        use_fp8 = case.dtype == "fp8"

        def op(ctx, x, i):
            return jax_ep.low_latency_dispatch(buf, x, i, use_fp8=use_fp8)

        return None, op, (), [(inputs.x(k), idx[k]) for k in n]
    if case.op == "low_latency_combine":
        def prologue(x, i, wt):
            return jax_ep.low_latency_dispatch(buf, x, i, use_fp8=False).handle, i, wt

        def op(ctx, y):
            handle, i, wt = ctx
            return jax_ep.low_latency_combine(buf, y, i, wt, handle)

        fixed = (inputs.x(0), idx[0], w[0])
        return prologue, op, fixed, [(inputs.y_low_latency(k),) for k in n]
    raise ValueError(case)


def split_program(jax_ep, buf, case: Case, inputs: Inputs):
    """Programs of the halves of a low-latency op. Neither half can be timed alone with the
    public API (every send needs its receive before the next send), so:

    - ``*_send``: the sends of one call, repeated (each chained to the previous one's ticket),
      and the call's receive once after the last (the epilogue, which cancels in the difference).
      A benchmark-only pattern through the backend (the public API refuses a second pending
      send): a send never waits and does the same work every time, every rank runs the same
      sequence, and the final receive completes the call, so later calls are unaffected (the
      data that receive returns is not meaningful).
    - ``*_recv``: the (send, receive) pair through the public API; ``run_all`` reports
      receive = pair - send.
    """
    op_name, half = SPLIT_OPS[case.op]
    impl = buf._impl
    n = range(inputs.num_sets)
    idx = [r[0] for r in inputs.routing]
    if op_name == "low_latency_dispatch":
        use_fp8 = case.dtype == "fp8"
        sets = [(inputs.x(k), idx[k]) for k in n]
        if half == "send":
            def send(ctx, x, i):
                return impl.low_latency_dispatch_send(x, i, None, use_fp8, False)

            def receive(ctx, args, ticket):
                x, i = args
                return impl.low_latency_dispatch_recv(x, i, ticket, use_fp8, False)

            return None, send, (), sets, receive

        def pair(ctx, x, i):
            pending = jax_ep.low_latency_dispatch_send(buf, x, i, use_fp8=use_fp8)
            return jax_ep.low_latency_dispatch_recv(buf, pending)

        return None, pair, (), sets

    def prologue(x, i, wt):
        return jax_ep.low_latency_dispatch(buf, x, i, use_fp8=False).handle, i, wt

    fixed = (inputs.x(0), idx[0], inputs.routing[0][1])
    sets = [(inputs.y_low_latency(k),) for k in n]
    if half == "send":
        def send(ctx, y):
            handle, i, wt = ctx
            return impl.low_latency_combine_send(y, i, wt, handle, None)

        def receive(ctx, args, ticket):
            handle, i, wt = ctx
            return impl.low_latency_combine_recv(args[0], i, wt, handle, ticket)

        return prologue, send, fixed, sets, receive

    def pair(ctx, y):
        handle, i, wt = ctx
        pending = jax_ep.low_latency_combine_send(buf, y, i, wt, handle)
        return jax_ep.low_latency_combine_recv(buf, pending)

    return prologue, pair, fixed, sets


def peer_program(peer, case: Case, inputs: Inputs):
    """``(prologue, op, fixed, sets)`` of a peer at the same shape.

    Low-latency cases use the same once-per-rank exchange (fp8: the cast is inside the op, as
    in low_latency_dispatch); the peers do not build the expert-major ``[E_loc, R*T, H]`` layout
    nor weight per expert, so they do less work than the op they are compared with.
    """
    n = range(inputs.num_sets)
    idx = [r[0] for r in inputs.routing]
    w = [r[1] for r in inputs.routing]
    if case.op == "dispatch" and case.dtype == "bf16":
        sets = [(inputs.x(k), idx[k], w[k]) for k in n]
        return None, lambda ctx, x, i, wt: peer.dispatch([x], i, wt), (), sets
    if case.op == "dispatch":
        sets = [(*inputs.x_fp8(k), idx[k], w[k]) for k in n]
        return None, lambda ctx, xq, s, i, wt: peer.dispatch([xq, s], i, wt), (), sets
    if case.op in ("combine", "low_latency_combine"):
        return (peer.plan, lambda plan, y: peer.combine(y, plan), (idx[0],),
                [(inputs.y(k),) for k in n])
    if case.op == "low_latency_dispatch":
        if case.dtype == "fp8":
            return None, lambda ctx, x, i: peer.dispatch(list(bi.cast_fp8(x)), i), (), [
                (inputs.x(k), idx[k]) for k in n]
        return None, lambda ctx, x, i: peer.dispatch([x], i), (), [
            (inputs.x(k), idx[k]) for k in n]
    raise ValueError(f"no {peer.name} peer for {case.op}")


# ----------------------------------------------------------------------------- running


def measure(mesh, args, program, pool):
    prologue, op, fixed, sets, *rest = program
    epilogue = rest[0] if rest else None
    call_args = (tuple(fixed), tuple(tuple(s) for s in sets))
    start = time.perf_counter()
    lowered = [
        bt.repeated_program(mesh, op, n, prologue, epilogue, args.outputs).lower(*call_args)
        for n in (args.n_short, args.n_long)
    ]
    short, long = pool.map(lambda low: low.compile(), lowered)  # compiles run in parallel
    compile_s = time.perf_counter() - start
    per_op_us, extra = bt.time_per_op_us(short, long, call_args, args.n_short, args.n_long,
                                         args.repeats, args.warmup)
    return per_op_us, dict(extra, compile_s=round(compile_s, 2))


def split_time(mesh, args, jax_ep, buf, case, inputs, pool, time_us, extra, send_us):
    """The record time of a half from its program's measurement (``split_program``): a send is
    its own measurement; a receive is the pair's minus the send's (measured now if the send
    case did not run). Adds ``method`` and, for a receive, ``pair_us`` and ``send_us``."""
    op_name, half = SPLIT_OPS[case.op]
    key = (op_name, case.dtype)
    if half == "send":
        send_us[key] = (time_us, extra["noise_us"])
        return time_us, dict(extra, method=(
            "unrolled difference of N sends of one call (the call's receive once after the "
            "last; benchmark-only, see split_program)"))
    if key not in send_us:
        send_case = dataclasses.replace(case, op=f"{op_name}_send")
        send_time, send_extra = measure(mesh, args,
                                        split_program(jax_ep, buf, send_case, inputs), pool)
        send_us[key] = (send_time, send_extra["noise_us"])
    send_time, send_noise = send_us[key]
    return time_us - send_time, dict(
        extra, pair_us=time_us, send_us=send_time,
        noise_us=(extra["noise_us"] ** 2 + send_noise ** 2) ** 0.5,
        method=f"pair - send: unrolled difference of N ({op_name}_send, {op_name}_recv) pairs "
               f"(pair_us) minus the {op_name}_send record (send_us)")


def make_record(args, num_ranks, case, impl, time_us, inputs, extra):
    """The result record of one case. A time at or below its timer noise
    (``bench_timing.noise_us``) is no figure: ``time_us`` and the rates are None,
    ``below_noise`` is true and ``measured_us`` keeps the difference measured."""
    stats = inputs.stats_first if "combine" in case.op else inputs.stats_mean
    # A send half moves the op's bytes; a receive half's GB/s would mean nothing (None).
    op_name, half = SPLIT_OPS.get(case.op, (case.op, None))
    nbytes, remote = bi.bytes_per_rank(op_name if half != "recv" else "", case.dtype,
                                       args.hidden, stats, peer=impl in bp.PEER_CLASSES)
    noisy = bt.below_noise(time_us, extra)
    rec = {
        "op": case.op, "impl": impl, "dtype": case.dtype, "ranks": num_ranks,
        "tokens": case.tokens, "hidden": args.hidden, "topk": args.topk,
        "experts": args.experts, "time_us": None if noisy else sig(time_us),
        "below_noise": noisy, "measured_us": sig(time_us),
        "gbps": None, "bytes_per_rank": nbytes, "remote_bytes_per_rank": remote,
        "nvlink_share": None, "n_short": args.n_short, "n_long": args.n_long,
        "repeats": args.repeats,
    }
    if nbytes is not None and not noisy:
        rec["gbps"] = sig(nbytes / 1e9 / (time_us * 1e-6))
        if bm.on_gpu():  # a share of NVLink's rate: nothing on CPU
            rec["nvlink_share"] = sig(remote / (time_us * 1e-6) / bi.NVLINK_BYTES_PER_S)
    rec.update({k: sig(v) if isinstance(v, float) else v for k, v in extra.items()})
    return rec


def sig(value, digits=6):
    """Rounds to significant digits (tiny CPU bandwidths stay positive)."""
    return float(f"{value:.{digits}g}")


def log(msg):
    print(msg, flush=True)


def run_all(args, impls, rename=None, deadline=None, checkpoint=None):
    """Runs every case for ``impls``; returns ``(records, errors, skipped)``.

    ``checkpoint(records, errors, skipped)`` is called after every case (results survive a
    crash or a kill); no case starts after ``deadline`` (a ``time.perf_counter()`` value).
    """
    mesh = bm.make_mesh(args.ranks)
    num_ranks = mesh.shape[bm.AXIS]
    if args.experts % num_ranks:
        raise SystemExit(f"--experts {args.experts} is not a multiple of {num_ranks} ranks")
    jax_ep, why = bm.import_jax_ep()
    gpu = bm.on_gpu()
    skipped = {}
    if not gpu:
        for impl in ("jax_ep", "ragged_all_to_all"):
            if impl in impls:
                skipped[impl] = f"no GPU ({jax.default_backend()}): " + (
                    "the cuda backend needs CUDA GPUs" if impl == "jax_ep"
                    else "ragged_all_to_all does not run on XLA:CPU")
    if jax_ep is None:
        for impl in ("jax_ep", "reference"):
            if impl in impls:
                skipped[impl] = f"import jax_ep failed: {why}"
    for impl, reason in skipped.items():
        log(f"[skip] {impl}: {reason}")
    active = [i for i in impls if i not in skipped]
    log(f"[bench] {num_ranks} x {jax.devices()[0].device_kind} ({jax.default_backend()}), "
        f"impls {active}, N = {args.n_short}/{args.n_long}, repeats {args.repeats}")

    records, errors = [], []
    groups = {}
    for case in plan_cases(args):
        groups.setdefault((case.mode, case.tokens), []).append(case)
    pool = concurrent.futures.ThreadPoolExecutor(2)
    t_start = time.perf_counter()
    not_run = 0
    for (mode, tokens), cases in groups.items():
        if deadline is not None and time.perf_counter() > deadline:
            not_run += len(cases) * len(active)
            continue
        try:
            inputs = Inputs(mesh, args, tokens, jax_ep)
        except Exception as e:  # noqa: BLE001
            for case in cases:
                for impl in active:
                    errors.append(error_row(case, impl, e, num_ranks))
            continue
        for impl in active:
            buf = None
            try:
                if impl in ("jax_ep", "reference"):
                    buf = jax_ep.Buffer(
                        mesh, bm.AXIS, num_experts=args.experts, hidden=args.hidden,
                        max_tokens_per_rank=tokens, num_topk=args.topk,
                        low_latency=mode == "low_latency",
                        backend="cuda" if impl == "jax_ep" else "reference",
                        report_errors=False)  # no host callback inside the timed programs
            except Exception as e:  # noqa: BLE001 - Buffer creation failed: every case fails
                for case in cases:
                    errors.append(error_row(case, impl, e, num_ranks))
                    log(f"  {case.op:25s} {impl:28s} ERROR {errors[-1]['error']}")
                continue
            send_us = {}  # (op, dtype) -> the send half's time, for the receive half's record
            for case in cases:
                if case.op == "layout" and buf is None:
                    continue  # layout exists only in jax_ep (both backends)
                if case.op in SPLIT_OPS and impl != "jax_ep":
                    continue  # halves: jax_ep's kernels only (see SPLIT_OPS)
                if deadline is not None and time.perf_counter() > deadline:
                    not_run += 1
                    continue
                name = rename or impl
                try:
                    if buf is not None:
                        program = jax_ep_program(jax_ep, buf, case, inputs)
                    else:
                        peer = bp.PEER_CLASSES[impl](num_ranks, args.experts, args.topk)
                        program = peer_program(peer, case, inputs)
                    time_us, extra = measure(mesh, args, program, pool)
                    if case.op in SPLIT_OPS:
                        time_us, extra = split_time(mesh, args, jax_ep, buf, case, inputs, pool,
                                                    time_us, extra, send_us)
                    rec = make_record(args, num_ranks, case, name, time_us, inputs, extra)
                    records.append(rec)
                    figure = (bt.noise_text(rec) if rec["below_noise"] else
                              f"{time_us:10.1f} us  {fmt(rec['gbps'], '8.1f')} GB/s")
                    log(f"  {case.op:25s} {name:28s} {case.dtype:4s} T={tokens:<5d} "
                        f"{figure}  (compile {extra['compile_s']:.1f} s, "
                        f"{time.perf_counter() - t_start:.0f} s so far)")
                except Exception as e:  # noqa: BLE001
                    errors.append(error_row(case, name, e, num_ranks))
                    log(f"  {case.op:25s} {name:28s} {case.dtype:4s} T={tokens:<5d} "
                        f"ERROR {errors[-1]['error']}")
                    if os.environ.get("BENCH_EP_TRACEBACK"):
                        traceback.print_exc()
                if checkpoint is not None:
                    checkpoint(records, errors, skipped)
            if buf is not None:
                buf.close()
            gc.collect()
        del inputs
        gc.collect()
    pool.shutdown()
    if not_run:
        skipped[f"{not_run} cases"] = f"--max-minutes {args.max_minutes} reached"
        log(f"[skip] {not_run} cases: --max-minutes {args.max_minutes} reached")
    return records, errors, skipped


def error_row(case, impl, exc, num_ranks):
    msg = f"{type(exc).__name__}: {exc}".strip().replace("\n", " ")
    return {"op": case.op, "impl": impl, "dtype": case.dtype, "tokens": case.tokens,
            "ranks": num_ranks, "error": msg[:500]}


def fmt(value, spec):
    """``format(value, spec)``, or a right-aligned "-" of the same width for None."""
    if isinstance(value, (int, float)):
        return format(value, spec)
    return "-".rjust(int(spec.split(".")[0]))


# ----------------------------------------------------------------------------- decomposer child


def gpu_likely() -> bool:
    """Without initialising JAX in this process: will JAX find CUDA GPUs?"""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms and not any(p in platforms for p in ("cuda", "gpu")):
        return False
    if not shutil.which("nvidia-smi"):
        return False
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    return out.returncode == 0 and "GPU" in out.stdout


def run_decomposer_child(argv, args):
    """Runs the ragged_all_to_all cases again with the decomposer flag, in a child process.

    Runs before this process touches the GPUs (both would otherwise claim 75% of their memory).
    """
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "child.json")
        env = dict(os.environ)
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + DECOMPOSER_FLAG).strip()
        cmd = [sys.executable, os.path.abspath(__file__), *argv, "--child-out", out_path]
        if args.max_minutes is not None:  # the last --max-minutes wins
            cmd += ["--max-minutes", str(args.max_minutes / 4)]
        log(f"[bench] {DECOMPOSER_IMPL}: child process with XLA_FLAGS={env['XLA_FLAGS']!r}")
        try:
            proc = subprocess.run(cmd, env=env, stderr=subprocess.PIPE, text=True,
                                  timeout=args.child_timeout)
            failure = None if proc.returncode == 0 else (
                f"child exited with {proc.returncode}: " + proc.stderr.strip()[-800:])
        except subprocess.TimeoutExpired:
            failure = f"child timed out after {args.child_timeout:.0f} s"
        if os.path.exists(out_path):
            with open(out_path) as f:
                child = json.load(f)
            errors = child["errors"]
            if failure:
                errors.append({"op": "*", "impl": DECOMPOSER_IMPL, "error": failure})
            return child["results"], errors, child["skipped"]
        return [], [{"op": "*", "impl": DECOMPOSER_IMPL, "error": failure or "no output"}], {}


# ----------------------------------------------------------------------------- report


def add_ratios(records):
    """``speedup_vs_best_peer`` = best peer time / this time (> 1: faster than every peer)."""
    best = {}
    for r in records:
        if r["impl"] in PEER_IMPLS and r["time_us"] is not None:
            key = (r["op"], r["dtype"], r["tokens"])
            if key not in best or r["time_us"] < best[key]["time_us"]:
                best[key] = r
    for r in records:
        peer = best.get((r["op"], r["dtype"], r["tokens"]))
        timed = peer is not None and r["time_us"] is not None
        r["best_peer"] = peer["impl"] if timed else None
        r["speedup_vs_best_peer"] = sig(peer["time_us"] / r["time_us"], 4) if timed else None


def sort_key(r):
    return (OPS.index(r["op"]) if r["op"] in OPS else len(OPS), r.get("dtype") or "",
            r.get("tokens") or 0, IMPLS.index(r["impl"]) if r["impl"] in IMPLS else len(IMPLS))


def print_table(records, errors):
    rows = sorted(records + errors, key=sort_key)
    on_gpu = bm.on_gpu()
    nvl = f" {'NVL%':>6s}" if on_gpu else ""
    head = (f"{'op':25s} {'impl':28s} {'dtype':5s} {'tokens':>6s} {'time_us':>10s} "
            f"{'GB/s':>8s}{nvl} {'x best peer':>11s}")
    if not on_gpu:
        print("\n" + bm.cpu_note() + " Most of the reference backend's ops take milliseconds "
              "and vary between runs by more than their time, so most rows are below noise.")
    print("\n" + head)
    print("-" * len(head))
    for r in rows:
        lead = f"{r['op']:25s} {r['impl']:28s} {r.get('dtype') or '':5s} {r.get('tokens') or '':>6}"
        if "error" in r:
            print(f"{lead} ERROR {r['error'][:160]}")
            continue
        if r["below_noise"]:
            print(f"{lead} {bt.noise_text(r):>10s}")
            continue
        share = r["nvlink_share"] * 100 if r["nvlink_share"] is not None else None
        share = f" {fmt(share, '6.1f')}" if on_gpu else ""
        print(f"{lead} {r['time_us']:10.1f} {fmt(r['gbps'], '8.1f')}{share} "
              f"{fmt(r['speedup_vs_best_peer'], '11.2f')}")
    print("x best peer = (fastest of reference, all_to_all, ragged_all_to_all[_decomposer]) "
          "time / this time; " + ("NVL% = remote bytes/s over 283 GB/s; " if on_gpu else "")
          + "below noise (±x us): the time was within x us of zero, x being twice its standard "
          "error.", flush=True)


def write_plots(records, out_prefix):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    panels = [("normal", "GB/s per rank", "tokens per rank",
               [("dispatch", "bf16"), ("dispatch", "fp8"), ("combine", "bf16")], "gbps"),
              ("low_latency", "time per op (us)", "tokens per rank (T_max)",
               [("low_latency_dispatch", "fp8"), ("low_latency_dispatch", "bf16"),
                ("low_latency_combine", "bf16")], "time_us")]
    for mode, ylabel, xlabel, ops, field in panels:
        fig, axes = plt.subplots(1, len(ops), figsize=(5 * len(ops), 4), squeeze=False)
        for ax, (op, dtype) in zip(axes[0], ops, strict=True):
            for impl in IMPLS:
                pts = sorted((r["tokens"], r[field]) for r in records
                             if r["op"] == op and r["dtype"] == dtype and r["impl"] == impl
                             and r[field] is not None)
                if pts:
                    ax.plot([t for t, _ in pts], [v for _, v in pts], marker="o", label=impl)
            ax.set_xscale("log", base=2)
            ticks = sorted({r["tokens"] for r in records if r["op"] == op})
            if ticks:
                ax.set_xticks(ticks, [str(t) for t in ticks])
            if field == "time_us":
                ax.set_yscale("log")
            ax.set_title(f"{op} {dtype}")
            ax.set_xlabel(xlabel)
            ax.set_ylabel(ylabel)
            ax.grid(True, which="both", alpha=0.3)
            if ax.get_legend_handles_labels()[0]:  # a panel whose cases all failed has none
                ax.legend(fontsize=7)
        fig.tight_layout()
        path = f"{out_prefix}-{mode}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    bm.default_host_devices()  # before anything starts a backend: 8 ranks on CPU
    args = parse_args(argv)
    deadline = (time.perf_counter() + 60 * args.max_minutes) if args.max_minutes else None

    if args.child_out:  # decomposer child: only ragged_all_to_all, under the flag
        def save(records, errors, skipped):
            if "ragged_all_to_all" in skipped:
                skipped = dict(skipped)
                skipped[DECOMPOSER_IMPL] = skipped.pop("ragged_all_to_all")
            br.write_json(args.child_out,
                          {"results": records, "errors": errors, "skipped": skipped})

        save(*run_all(args, ["ragged_all_to_all"], DECOMPOSER_IMPL, deadline, save))
        return

    child = ([], [], {})
    impls = [i for i in args.impls if i != DECOMPOSER_IMPL]
    multiprocess = bm.join_processes()
    if multiprocess and deadline is not None:
        # Processes must run the same cases (collectives): a per-process clock could split them.
        log("[bench] --max-minutes is ignored with several processes")
        deadline = None
    if DECOMPOSER_IMPL in args.impls:
        if multiprocess:
            child = ([], [], {DECOMPOSER_IMPL: "its child process runs single-process only"})
        elif gpu_likely():
            child = run_decomposer_child(argv, args)
        else:
            child = ([], [], {DECOMPOSER_IMPL: "no GPU: ragged_all_to_all does not run on "
                                               "XLA:CPU"})
            log(f"[skip] {DECOMPOSER_IMPL}: {child[2][DECOMPOSER_IMPL]}")
    header = br.result_header(argv, args.note, __file__)  # initialises JAX, after the child
    path = br.result_path(args.out, header, args.tag)
    prefix = path[: -len(".json")]
    out_dir = os.path.dirname(path)
    method = {"n_short": args.n_short, "n_long": args.n_long, "repeats": args.repeats,
              "warmup": args.warmup, "outputs": args.outputs,
              "nvlink_bytes_per_s": bi.NVLINK_BYTES_PER_S}

    def merged(records, errors, skipped):
        records = sorted(records + child[0], key=sort_key)
        add_ratios(records)
        return records, errors + child[1], dict(skipped, **child[2])

    def save_partial(records, errors, skipped):
        records, errors, skipped = merged(records, errors, skipped)
        if bm.is_reporter():
            br.write_json(path, dict(header, partial=True, results=records, errors=errors,
                                     skipped=skipped, method=method))

    records, errors, skipped = merged(*run_all(args, impls, None, deadline, save_partial))
    if not bm.is_reporter():
        return
    payload = dict(header, results=records, errors=errors, skipped=skipped, method=method)
    if args.sweep:
        try:
            payload["plots"] = [os.path.relpath(p, out_dir) for p in write_plots(records, prefix)]
        except Exception as e:  # noqa: BLE001
            errors.append({"op": "plot", "impl": "-", "error": f"{type(e).__name__}: {e}"})
    br.write_json(path, payload)
    log(f"\n[bench] wrote {path}" + "".join(
        f"\n[bench] wrote {os.path.join(out_dir, p)}" for p in payload.get("plots", [])))
    print_table(records, errors)


if __name__ == "__main__":
    main()
