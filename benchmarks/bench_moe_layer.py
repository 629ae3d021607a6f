"""End-to-end MoE layer (forward + backward) device time for three transports, one expert block.

    python benchmarks/bench_moe_layer.py [--quick] [--matmul tiled|ragged_dot] [--max-minutes 2]
        [--out benchmarks/results]

One expert-parallel SwiGLU MoE layer per rank, with the router's top-k given as input (uniform
random scores, seeded) and the SAME local expert computation for every transport:
``jax_ep.moe.permute`` -> ``jax_ep.moe.swiglu_experts`` -> ``jax_ep.moe.unpermute``, whose three
grouped matmuls are ``--matmul``: ``tiled`` (``jax_ep.moe.grouped_matmul``, the jax_ep.moe
default) or ``ragged_dot`` (``jax.lax.ragged_dot``, which XLA:GPU rewrites into a dense matmul
over all local experts: 32x the FLOPs and 61-76 GiB of temporaries at the default shape, against
3.4-4.1 GiB tiled). Every record carries the ``matmul`` it ran with. The transports (impls):

- ``jax_ep``: ``jax_ep.moe.moe_ffn`` with a ``Buffer(backend="cuda")`` on GPUs, the reference
  backend (``"xla"``) elsewhere (``report_errors=False``: no host callback in timed programs);
- ``all_to_all``: ``bench_common.AllToAllPeer`` (capacity-padded ``jax.lax.all_to_all``; each rank
  receives ``[R*T, H]`` rows, local ids -1 where not local);
- ``ragged_all_to_all``: ``bench_common.RaggedAllToAllPeer`` (MaxText pattern; GPU only, skipped
  with a message elsewhere: XLA:CPU has no ``ragged_all_to_all``).

Timed step: ``jax.value_and_grad`` of ``loss = sum(out * cotangent)`` w.r.t. ``x [T, H]`` and the
rank's three expert weights ``[E_loc, H, F]``, ``[E_loc, H, F]``, ``[E_loc, F, H]`` (bf16,
``E_loc = E / R``). Device time per step with bench_common's unrolled N_short / N_long difference
(distinct x, routing and cotangent per iteration; see README.md). Before timing (always with
``--quick``, else with ``--check``) each impl's forward output is compared with the jax_ep
reference backend's forward on the same inputs (bf16 tolerance), so every row computes the same
function. Writes ``<out>/<machine>-<date>-moe_layer.json`` and prints a table last.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import gc
import os
import sys
import time
import traceback

import bench_common as bc
import jax
import jax.numpy as jnp
import numpy as np

OP = "moe_layer_fwd_bwd"
DTYPE = "bf16"
IMPLS = ("jax_ep", "all_to_all", "ragged_all_to_all")
MATMULS = ("tiled", "ragged_dot")  # jax_ep.moe.MATMULS: the expert matmul of swiglu_experts
PEER_IMPLS = IMPLS[1:]
DEFAULTS = {"tokens": 4096, "hidden": 2048, "ffn": 1024, "experts": 64, "topk": 8,
            "n_short": 2, "n_long": 6, "repeats": 10, "warmup": 2, "max_minutes": 2.0}
QUICK = {"tokens": 64, "hidden": 256, "ffn": 128, "experts": 16, "topk": 2,
         "n_short": 1, "n_long": 3, "repeats": 3, "warmup": 1, "max_minutes": None}
# bf16 tolerance of the forward check: |got - want| <= ATOL * max|want| + RTOL * |want|.
RTOL, ATOL = 2e-2, 2e-2


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="tiny shapes (T=64, H=256, F=128, E=16, top-2), few iterations, forward "
                        "check on: for CPU with 8 host devices")
    p.add_argument("--out", default=os.path.join(bc.REPO_ROOT, "benchmarks", "results"))
    p.add_argument("--tokens", type=int, help="tokens per rank (default 4096)")
    p.add_argument("--hidden", type=int, help="model width H (default 2048)")
    p.add_argument("--ffn", type=int, help="expert FFN width F (default 1024)")
    p.add_argument("--experts", type=int, help="experts over all ranks (default 64)")
    p.add_argument("--topk", type=int, help="default 8")
    p.add_argument("--ranks", type=int, help="number of devices to use (default all)")
    p.add_argument("--impls", type=lambda s: tuple(s.split(",")), default=IMPLS,
                   help=f"comma-separated subset of {','.join(IMPLS)}")
    p.add_argument("--matmul", choices=MATMULS,
                   help="expert matmul of every impl (default: jax_ep.moe.DEFAULT_MATMUL, tiled)")
    p.add_argument("--check", action="store_true",
                   help="compare each impl's forward with the jax_ep reference (on with --quick)")
    p.add_argument("--n-short", type=int, help="steps of the short program (default 2)")
    p.add_argument("--n-long", type=int, help="steps of the long program (default 6)")
    p.add_argument("--repeats", type=int, help="timed runs of each program (default 10)")
    p.add_argument("--warmup", type=int, help="untimed runs of each program first (default 2)")
    p.add_argument("--max-minutes", type=float,
                   help="start no new impl after this many minutes (default 2; none with "
                        "--quick); results so far are written and the table printed")
    p.add_argument("--tag", help="file name <machine>-<date>-moe_layer-<tag>.json")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for name, value in DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, QUICK[name] if args.quick else value)
    args.check = args.check or args.quick
    jax_ep, _ = bc.import_jax_ep()
    if jax_ep is not None and not hasattr(jax_ep.moe, "DEFAULT_MATMUL"):
        p.error(f"{jax_ep.__file__} predates jax_ep.moe's matmul option: reinstall jax_ep")
    if args.matmul is None and jax_ep is not None:
        args.matmul = jax_ep.moe.DEFAULT_MATMUL
    bad = [i for i in args.impls if i not in IMPLS]
    if bad:
        p.error(f"unknown impl {bad}")
    if args.n_long <= args.n_short or args.n_short < 1:
        p.error("need 1 <= --n-short < --n-long")
    return args


def log(msg):
    print(msg, flush=True)


def sig(value, digits=6):
    return float(f"{value:.{digits}g}")


# ----------------------------------------------------------------------------- inputs


class Inputs:
    """Global inputs, sharded along "ep" on axis 0 (per rank: its own block).

    ``sets[i] = (x [R*T, H] bf16, topk_idx [R*T, K] int32, topk_weights [R*T, K] f32,
    cotangent [R*T, H] bf16)``, one per step of the long program; ``weights`` =
    ``(w_gate [E, H, F], w_up [E, H, F], w_down [E, F, H])`` bf16 (rank r holds experts
    ``[r*E_loc, (r+1)*E_loc)``), scaled so that the layer output is O(1).
    """

    def __init__(self, mesh, args):
        num_ranks = mesh.shape[bc.AXIS]
        rows = num_ranks * args.tokens
        seed = args.seed * 1_000_003
        self.sets = []
        for i in range(args.n_long):
            idx, w = bc.random_routing(mesh, seed + i, args.tokens, args.experts, args.topk)
            x = bc.random_rows(mesh, seed + 1000 + i, (rows, args.hidden))
            ct = bc.random_rows(mesh, seed + 2000 + i, (rows, args.hidden))
            self.sets.append((x, idx, w, ct))
        e, h, f = args.experts, args.hidden, args.ffn

        def make(key):
            k1, k2, k3 = jax.random.split(key, 3)
            normal = jax.random.normal
            return ((normal(k1, (e, h, f)) * h**-0.5).astype(jnp.bfloat16),
                    (normal(k2, (e, h, f)) * h**-0.5).astype(jnp.bfloat16),
                    (normal(k3, (e, f, h)) * f**-0.5).astype(jnp.bfloat16))

        shard = bc.sharded(mesh)
        self.weights = jax.block_until_ready(
            jax.jit(make, out_shardings=(shard, shard, shard))(jax.random.key(seed + 3000)))


# ----------------------------------------------------------------------------- the layers


def expert_block(recv_x, recv_idx, recv_w, w_gate, w_up, w_down, matmul):
    """The local expert computation every transport shares (as in ``jax_ep.moe.moe_ffn``).

    ``recv_x [C, H]``, ``recv_idx [C, K]`` local ids (-1: not here), ``recv_w [C, K]`` f32 ->
    ``[C, H]`` weighted expert outputs in ``recv_x``'s dtype; ``matmul`` as ``--matmul``.
    """
    from jax_ep import moe

    num_local, num_topk = w_gate.shape[0], recv_idx.shape[1]
    num_rows = recv_x.shape[0] * min(num_topk, num_local)  # lossless: ids of a row are distinct
    x_sorted, group_sizes, state = moe.permute(recv_x, recv_idx, num_local, num_rows=num_rows)
    y_sorted = moe.swiglu_experts(x_sorted, group_sizes, w_gate, w_up, w_down, matmul=matmul)
    return moe.unpermute(y_sorted, state, recv_w).astype(recv_x.dtype)


def make_layer(impl, num_ranks, experts, topk, buf=None, matmul=None):
    """Per-rank forward ``layer(x, topk_idx, topk_weights, w_gate, w_up, w_down) -> [T, H]``.

    ``matmul``: the expert matmul (``--matmul``; None: ``jax_ep.moe.DEFAULT_MATMUL``), the same
    for every impl.
    """
    from jax_ep import moe

    matmul = moe.DEFAULT_MATMUL if matmul is None else matmul
    if impl == "jax_ep":
        def layer(x, idx, w, w_gate, w_up, w_down):
            return moe.moe_ffn(buf, x, idx, w, w_gate, w_up, w_down, matmul=matmul)

        return layer
    peer = bc.PEER_CLASSES[impl](num_ranks, experts, topk)

    def layer(x, idx, w, w_gate, w_up, w_down):
        recv_x, recv_idx, recv_w = peer.dispatch([x], idx, w)
        y = expert_block(recv_x, recv_idx, recv_w, w_gate, w_up, w_down, matmul)
        return peer.combine(y, peer.plan(idx))

    return layer


def fwd_bwd(layer):
    """``step(weights, x, idx, w, ct) -> (loss, (dx, dw_gate, dw_up, dw_down))`` per rank."""

    def step(weights, x, idx, w, ct):
        def loss_fn(x, w_gate, w_up, w_down):
            out = layer(x, idx, w, w_gate, w_up, w_down)
            return jnp.sum(out.astype(jnp.float32) * ct.astype(jnp.float32))

        return jax.value_and_grad(loss_fn, argnums=(0, 1, 2, 3))(x, *weights)

    return step


def forward(mesh, layer, inputs, k=0):
    """Global forward output ``[R*T, H]`` of set ``k`` (a host float32 array)."""
    x, idx, w, _ = inputs.sets[k]

    def fn(x, idx, w, w_gate, w_up, w_down):
        return layer(x, idx, w, w_gate, w_up, w_down)

    out = bc.shard_mapped(mesh, fn, 6)(x, idx, w, *inputs.weights)
    return np.asarray(out.astype(jnp.float32))


def compare(got, want):
    """Max abs error and whether ``got`` is within the bf16 tolerance of ``want``."""
    err = np.abs(got - want)
    bound = ATOL * max(float(np.max(np.abs(want))), 1e-6) + RTOL * np.abs(want)
    return float(np.max(err)), bool(np.all(err <= bound) and np.all(np.isfinite(got)))


# ----------------------------------------------------------------------------- timing


def measure(mesh, args, step, inputs, pool):
    def prologue(w_gate, w_up, w_down):
        return (w_gate, w_up, w_down)

    call_args = (tuple(inputs.weights), tuple(tuple(s) for s in inputs.sets))
    start = time.perf_counter()
    lowered = [bc.repeated_program(mesh, step, n, prologue).lower(*call_args)
               for n in (args.n_short, args.n_long)]
    short, long = pool.map(lambda low: low.compile(), lowered)  # the two compile in parallel
    compile_s = time.perf_counter() - start
    per_step_us, extra = bc.time_per_op_us(short, long, call_args, args.n_short, args.n_long,
                                           args.repeats, args.warmup)
    return per_step_us, dict(extra, compile_s=round(compile_s, 2))


def make_record(args, num_ranks, impl, time_us, extra):
    # Model FLOPs per rank per step: T*K (token, expert) pairs, 3 matmuls of 2*H*F each forward,
    # twice that backward (the useful work, whatever --matmul computes on top of it).
    flops = 18.0 * args.tokens * args.topk * args.hidden * args.ffn
    rec = {"op": OP, "impl": impl, "dtype": DTYPE, "matmul": args.matmul, "ranks": num_ranks,
           "tokens": args.tokens, "hidden": args.hidden, "ffn": args.ffn, "topk": args.topk,
           "experts": args.experts, "time_us": sig(time_us),
           "tflops_per_rank": sig(flops / (time_us * 1e-6) / 1e12),
           "n_short": args.n_short, "n_long": args.n_long, "repeats": args.repeats}
    rec.update({k: sig(v) if isinstance(v, float) else v for k, v in extra.items()})
    return rec


def error_row(impl, exc, args, num_ranks):
    msg = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
    return {"op": OP, "impl": impl, "dtype": DTYPE, "matmul": args.matmul, "ranks": num_ranks,
            "tokens": args.tokens, "error": msg.strip().replace("\n", " ")[:500]}


def add_ratios(records):
    """``speedup_vs_best_peer`` = fastest peer's time / this time (> 1: faster than every peer)."""
    peers = [r for r in records if r["impl"] in PEER_IMPLS]
    best = min(peers, key=lambda r: r["time_us"]) if peers else None
    for r in records:
        r["best_peer"] = best["impl"] if best else None
        r["speedup_vs_best_peer"] = sig(best["time_us"] / r["time_us"], 4) if best else None


def sort_key(r):
    return IMPLS.index(r["impl"]) if r["impl"] in IMPLS else len(IMPLS)


def print_table(records, errors, matmul):
    head = (f"{'impl':18s} {'tokens':>6s} {'hidden':>6s} {'experts':>7s} {'topk':>4s} "
            f"{'time_us':>11s} {'x best peer':>11s}")
    print("\n" + head)
    print("-" * len(head))
    for r in sorted(records + errors, key=sort_key):
        if "error" in r:
            print(f"{r['impl']:18s} {r['tokens']:>6} ERROR {r['error'][:160]}")
            continue
        ratio = r["speedup_vs_best_peer"]
        ratio = f"{ratio:11.2f}" if ratio is not None else "-".rjust(11)
        print(f"{r['impl']:18s} {r['tokens']:>6d} {r['hidden']:>6d} {r['experts']:>7d} "
              f"{r['topk']:>4d} {r['time_us']:11.1f} {ratio}")
    print(f"{OP}: forward + backward per step per rank (bf16, expert matmul {matmul}); x best "
          f"peer = fastest of {', '.join(PEER_IMPLS)} time / this time.", flush=True)


# ----------------------------------------------------------------------------- running


def run(args, mesh, deadline, checkpoint):
    """Returns ``(records, errors, skipped, checks)``; ``checkpoint`` is called after each impl."""
    num_ranks = mesh.shape[bc.AXIS]
    jax_ep, why = bc.import_jax_ep()
    gpu = bc.on_gpu()
    skipped, records, errors, checks = {}, [], [], {}
    if jax_ep is None:
        skipped["jax_ep"] = f"import jax_ep failed: {why}"
    if not gpu:
        skipped["ragged_all_to_all"] = (f"no GPU ({jax.default_backend()}): ragged_all_to_all "
                                        "does not run on XLA:CPU")
    impls = [i for i in args.impls if i not in skipped]
    for impl in args.impls:
        if impl in skipped:
            log(f"[skip] {impl}: {skipped[impl]}")
    backend = "cuda" if gpu else "xla"
    log(f"[bench] {num_ranks} x {jax.devices()[0].device_kind} ({jax.default_backend()}), "
        f"T={args.tokens} H={args.hidden} F={args.ffn} E={args.experts} top-{args.topk}, "
        f"expert matmul {args.matmul!r}, impls {impls} (jax_ep backend {backend!r}), "
        f"N = {args.n_short}/{args.n_long}, repeats {args.repeats}, "
        f"forward check {'on' if args.check else 'off'}")

    def buffer(kind):
        return jax_ep.Buffer(mesh, bc.AXIS, num_experts=args.experts, hidden=args.hidden,
                             max_tokens_per_rank=args.tokens, num_topk=args.topk,
                             dtype=jnp.bfloat16, low_latency=False, backend=kind,
                             report_errors=False)

    try:
        inputs = Inputs(mesh, args)
    except Exception as e:  # noqa: BLE001 - no inputs: every impl fails
        errors += [error_row(i, e, args, num_ranks) for i in impls]
        return records, errors, skipped, checks

    want = None
    if args.check:
        try:
            if jax_ep is None:
                raise RuntimeError(f"no reference: {skipped['jax_ep']}")
            ref_buf = buffer("xla")
            want = forward(mesh, make_layer("jax_ep", num_ranks, args.experts, args.topk,
                                            ref_buf, args.matmul), inputs)
            ref_buf.close()
            log(f"[check] reference forward: max |out| = {np.max(np.abs(want)):.4g}")
        except Exception as e:  # noqa: BLE001
            errors += [error_row(i, f"forward check: reference failed: {type(e).__name__}: {e}",
                                 args, num_ranks) for i in impls]
            return records, errors, skipped, checks

    pool = concurrent.futures.ThreadPoolExecutor(2)
    t_start = time.perf_counter()
    for impl in impls:
        if deadline is not None and time.perf_counter() > deadline:
            skipped[impl] = f"--max-minutes {args.max_minutes} reached"
            log(f"[skip] {impl}: {skipped[impl]}")
            continue
        buf = None
        try:
            if impl == "jax_ep":
                buf = buffer(backend)
            layer = make_layer(impl, num_ranks, args.experts, args.topk, buf, args.matmul)
            if args.check:
                err, ok = compare(forward(mesh, layer, inputs), want)
                checks[impl] = {"max_abs_err": sig(err), "ok": ok}
                log(f"[check] {impl:18s} forward vs jax_ep reference: max abs err {err:.3g} "
                    f"{'ok' if ok else 'MISMATCH'}")
                if not ok:
                    raise AssertionError(f"forward differs from the jax_ep reference (max abs "
                                         f"err {err:.3g}, tolerance rtol={RTOL} atol={ATOL}*max)")
            time_us, extra = measure(mesh, args, fwd_bwd(layer), inputs, pool)
            if time_us <= 0:
                raise RuntimeError(f"non-positive time {time_us:.3f} us (noise larger than the "
                                   f"step; raise --n-long/--repeats): {extra}")
            if impl == "jax_ep":
                extra["backend"] = buf.backend
            rec = make_record(args, num_ranks, impl, time_us, extra)
            records.append(rec)
            log(f"  {impl:18s} {time_us:11.1f} us/step  {rec['tflops_per_rank']:8.2f} TFLOP/s "
                f"(compile {extra['compile_s']:.1f} s, {time.perf_counter() - t_start:.0f} s "
                f"so far)")
        except Exception as e:  # noqa: BLE001 - an error row, not a crash
            errors.append(error_row(impl, e, args, num_ranks))
            log(f"  {impl:18s} ERROR {errors[-1]['error']}")
            if os.environ.get("BENCH_EP_TRACEBACK"):
                traceback.print_exc()
        finally:
            if buf is not None:
                buf.close()
            gc.collect()
        checkpoint(records, errors, skipped, checks)
    pool.shutdown()
    return records, errors, skipped, checks


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    deadline = (time.perf_counter() + 60 * args.max_minutes) if args.max_minutes else None
    mesh = bc.make_mesh(args.ranks)
    num_ranks = mesh.shape[bc.AXIS]
    if args.experts % num_ranks:
        raise SystemExit(f"--experts {args.experts} is not a multiple of {num_ranks} ranks")
    header = bc.result_header(argv)
    name = f"{header['machine']}-{header['date']}-moe_layer" + (
        f"-{args.tag}" if args.tag else "")
    path = os.path.join(args.out, name + ".json")
    method = {"n_short": args.n_short, "n_long": args.n_long, "repeats": args.repeats,
              "warmup": args.warmup, "loss": "sum(out * cotangent)",
              "grads": ["x", "w_gate", "w_up", "w_down"], "routing": "top-k of uniform scores",
              "matmul": args.matmul,
              "check_tolerance": {"rtol": RTOL, "atol_times_max": ATOL} if args.check else None}

    def payload(records, errors, skipped, checks, partial):
        records = sorted(records, key=sort_key)
        add_ratios(records)
        out = dict(header, results=records, errors=errors, skipped=skipped, checks=checks,
                   method=method)
        return dict(out, partial=True) if partial else out

    def checkpoint(*state):
        bc.write_json(path, payload(*state, partial=True))

    records, errors, skipped, checks = run(args, mesh, deadline, checkpoint)
    final = payload(records, errors, skipped, checks, partial=False)
    bc.write_json(path, final)
    log(f"\n[bench] wrote {path}")
    print_table(final["results"], errors, args.matmul)


if __name__ == "__main__":
    main()
