"""Communication hidden behind compute: one model segment, two micro-batches, with and without
overlap, and the GPU timeline.

    python benchmarks/bench_overlap.py [--cases train:bench,decode:deepseek]
        [--num-sms 24] [--gemm-sms 0] [--unpinned] [--steps 10] [--repeats 3] [--out DIR] [--quick]
        [--sm-curve]

The segment, per micro-batch (half of each rank's tokens): attention stand-in + router ->
dispatch -> experts (SwiGLU, ``--matmul``) -> combine -> attention stand-in, as the stages of
``jax_ep.moe.two_batch`` (so each communication stage runs under the other micro-batch's
compute); train runs forward + backward, decode the forward over the low-latency ops. The
attention stand-in is ``x + gelu(x W1) W2`` with ``W1, W2 [H, H]``. Per case, each measured as
the loop of ``--steps`` steps dispatched back to back (the host runs ahead) and awaited once,
per step, the median of ``--repeats``:

- ``serial_us``: the segment on a serial Buffer (one stream, XLA's command buffers);
- ``overlapped_us``: on ``Buffer(overlap=True, num_sms=--num-sms)``;
- ``compute_us``: the same compute with the communication stages replaced by nothing (each
  rank's own rows, routed locally: at EP=1 exactly the serial step's compute);
- ``comm_us``: dispatch and combine alone (serial Buffer), the same routing (train: their
  backward too, the gradient w.r.t. x);
- ``hidden_fraction``: of jax_ep's kernel time in the overlapped step's timeline (a profiler
  trace of ``--steps`` steps), the share during which a compute kernel ran on another stream.

``--gemm-sms N`` (bench-only, jax's Mosaic GPU grouped GEMMs): their persistent grid of one
CTA per SM is cut to N CTAs during the trace, leaving the other SMs to our kernels; 0 keeps it.
``--unpinned``: one more program, ``unpinned``, on the first budget's overlap Buffer with each op
waited right after its start (no two-micro-batch overlap): what the async calls and the side
stream cost apart from the pinned schedule.
Each program's row (under ``programs``) also has ``comm_kernels_us``, the communication
kernels' GPU time per step, and ``largest_us``, its largest kernels summed per step.

The peers (``peers``: ``all_to_all``, ``ragged_all_to_all``; ``bench_peers``'): the same
segment, each micro-batch's layer written as its own dataflow, so that XLA's scheduler may
overlap one's collectives with the other's compute by itself. Their rows have the same fields,
of their collective kernels (NCCL's). At EP=1 they move nothing and their rows say so; XLA:CPU
has no ``ragged_all_to_all``, so that row says so there.

``--sm-curve``: each op's kernel time against its SM budget (``num_sms``), from a profiler
trace. Records ``overlap-<mode>-<shape>.json`` and ``sm-curve.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

import bench_mesh as bm
import bench_peers as bp
import bench_records as br
import jax
import jax.numpy as jnp
import numpy as np
import timeline
from jax.sharding import PartitionSpec as P

jax_ep, _IMPORT_ERROR = bm.import_jax_ep()

SHAPES = {  # hidden, ffn, experts, topk; train / decode tokens per rank
    "bench": dict(hidden=2048, ffn=1024, experts=64, topk=8, train=4096, decode=128),
    "deepseek": dict(hidden=7168, ffn=2048, experts=256, topk=8, train=4096, decode=128),
}
QUICK = dict(hidden=256, ffn=128, experts=8, topk=2, train=64, decode=16)
SM_BUDGETS = (16, 24, 32, 48, 66)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="train:bench,decode:bench,train:deepseek,decode:deepseek",
                   help="mode:shape pairs, comma-separated. Modes: train (T=4096 per rank, "
                        "forward + backward), decode (T=128, low-latency ops, forward); shapes: "
                        "bench (H=2048, F=1024, 64 experts), deepseek (H=7168, F=2048, 256 "
                        "experts), top-8 (default: all four)")
    p.add_argument("--num-sms", default="24",
                   help="SM budgets of the overlapped Buffer's kernels, comma-separated, 0 = all "
                        "SMs (default 24); one overlapped program each")
    p.add_argument("--gemm-sms", type=int, default=0,
                   help="CTAs of jax's Mosaic GPU grouped GEMMs in the overlapped step (0: "
                        "their default, one per SM)")
    p.add_argument("--unpinned", action="store_true",
                   help="also run the overlap Buffer with each op waited right after its start")
    p.add_argument("--matmul", default="auto", help="expert matmul (jax_ep.moe.MATMULS)")
    p.add_argument("--steps", type=int, default=10, help="steps per timed loop and per trace")
    p.add_argument("--repeats", type=int, default=3, help="timed loops per program (median)")
    p.add_argument("--sm-curve", action="store_true",
                   help="also record each op's kernel time against its SM budget")
    p.add_argument("--quick", action="store_true", help="tiny shapes (CPU: checks the script)")
    br.add_out_argument(p, "folder of the JSON records")
    p.add_argument("--note", default="", help="free text stored in the records")
    return p.parse_args(argv)


def log(msg):
    print(msg, flush=True)


# ------------------------------------------------------------------------------- the segment
def attention_standin(w1, w2, x):
    h = jax.nn.gelu(jnp.dot(x, w1, preferred_element_type=jnp.float32)).astype(x.dtype)
    return x + jnp.dot(h, w2, preferred_element_type=jnp.float32).astype(x.dtype)


def make_stages(kind, buf, shape, matmul, num_ranks):
    """The segment's stages; ``kind``: "ep" (jax_ep ops), "none" (no communication: each rank's
    own rows, routed to its local experts) or "comm" (the ops without the experts)."""
    from jax_ep import moe

    topk, experts = shape["topk"], shape["experts"]
    num_local = experts // num_ranks

    def pre(params, state):
        (x, idx, w), _ = state
        if kind == "comm":  # the ops alone: the routing the program was given, no compute
            return (x, idx, w), x
        h = attention_standin(params["w1"], params["w2"], x)
        logits = jnp.dot(h, params["router"], preferred_element_type=jnp.float32)
        idx, w, _ = moe.router(logits, topk)
        if kind == "none":  # every token to its own rank's experts
            idx = idx % num_local
        return (h, idx, w), h

    def post(params, state):
        (combined,), h = state
        if kind == "comm":
            return (combined,), None
        return (attention_standin(params["w1"], params["w2"], h + combined),), None

    def swiglu(params, xs, group_sizes):
        return moe.swiglu_experts(xs, group_sizes, *params["experts"], matmul=matmul)

    if kind == "ep":
        comm = [moe.dispatch_stage(buf), moe.combine_stage(buf)]
        experts_stage = moe.expert_stage(buf, swiglu)
    else:
        comm = [local_dispatch_stage(), local_combine_stage()]
        experts_stage = local_expert_stage(num_local, swiglu)
    if kind == "comm":
        comm = [moe.dispatch_stage(buf), moe.combine_stage(buf)]
        experts_stage = moe.Compute(lambda params, state: ((state[0][0], state[0][3]),
                                                           state[1]))
    return [moe.Compute(pre), comm[0], experts_stage, comm[1], moe.Compute(post)]


def local_dispatch_stage():
    """Each rank's own rows as its received rows (no kernel)."""
    from jax_ep import moe

    def forward(state):
        (h, idx, w), carry = state
        return ((h, idx, w, None), carry), idx.shape

    def backward(idx_shape, ct):
        (ct_h, _, ct_w, _), ct_carry = ct
        return (ct_h, np.zeros(idx_shape, jax.dtypes.float0), ct_w), ct_carry
    return moe.Comm(forward, backward)


def local_combine_stage():
    from jax_ep import moe

    def forward(state):
        (y, _), carry = state
        return ((y,), carry), None

    def backward(_, ct):
        (ct_y,), ct_carry = ct
        return (ct_y, None), ct_carry
    return moe.Comm(forward, backward)


def local_expert_stage(num_local, swiglu):
    from jax_ep import moe

    def fn(params, state):
        (x, idx, w, handle), carry = state
        num_rows = x.shape[0] * min(idx.shape[1], num_local)
        xs, sizes, perm = moe.permute(x, idx, num_local, num_rows=num_rows)
        y = moe.unpermute(swiglu(params, xs, sizes), perm, w).astype(x.dtype)
        return (y, handle), carry
    return moe.Compute(fn)


def decode_stages(kind, buf, shape, matmul, num_ranks):
    """Decode: the low-latency ops (forward only)."""
    from jax_ep import moe

    stages = make_stages("none" if kind == "none" else "ep", buf, shape, matmul, num_ranks)

    def swiglu(params, xs, group_sizes):
        return moe.swiglu_experts(xs, group_sizes, *params["experts"], matmul=matmul)
    if kind == "none":
        return stages
    experts_stage = moe.low_latency_expert_stage(buf, swiglu)
    if kind == "comm":
        experts_stage = moe.Compute(lambda params, state: (
            (state[0][0].astype(jnp.bfloat16), *state[0][2:]), state[1]))
    return [stages[0], moe.low_latency_dispatch_stage(buf), experts_stage,
            moe.low_latency_combine_stage(buf), stages[4]]


def make_params(shape, num_ranks, key, dtype=jnp.bfloat16):
    h, f, e = shape["hidden"], shape["ffn"], shape["experts"]
    ks = jax.random.split(key, 5)

    def init(k, s, scale):
        return (jax.random.normal(k, s, jnp.float32) * scale).astype(dtype)
    local = e // num_ranks
    # Per rank (shard_map over "ep"): the attention stand-in and router replicated, the experts
    # this rank's own; stored as [R * ...] arrays sharded along axis 0.
    return {
        "w1": init(ks[0], (num_ranks * h, h), h ** -0.5),
        "w2": init(ks[1], (num_ranks * h, h), h ** -0.5),
        "router": init(ks[2], (num_ranks * h, e), h ** -0.5).astype(jnp.float32),
        "experts": (init(ks[3], (num_ranks * local, h, 2 * f), h ** -0.5), None,
                    init(ks[4], (num_ranks * local, f, h), f ** -0.5)),
    }


# ------------------------------------------------------------------------------- programs
@contextlib.contextmanager
def mosaic_grid(num_ctas):
    """jax's Mosaic GPU grouped GEMMs with ``num_ctas`` CTAs instead of one per SM (their
    work loop strides over whatever grid it has), while programs are traced. 0: unchanged."""
    if not num_ctas:
        yield
        return
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    plgpu = ragged_dot_mgpu.plgpu
    original = plgpu.kernel

    def kernel(body, *args, grid=None, grid_names=None, **kwargs):
        if grid_names == ("sm",):
            grid = (num_ctas,)
        return original(body, *args, grid=grid, grid_names=grid_names, **kwargs)
    plgpu.kernel = kernel
    try:
        yield
    finally:
        plgpu.kernel = original


def unpinned(on):
    """While traced, an overlap Buffer's ops wait right after their starts: no op is left to
    ``deferred.overlap``, so the stages run in order without its barriers
    (``deferred.pins``)."""
    if not on:
        return contextlib.nullcontext()
    from jax_ep.backends import deferred

    return deferred.pins(waits_after_compute=False)


def two_batch_segment(stages):
    """``segment(params, x, idx, w) -> [T, H]``: ``two_batch`` of the stages over the halves."""
    from jax_ep import moe

    def segment(params, x, idx, w):
        half = x.shape[0] // 2
        ((a,), _), ((b,), _) = moe.two_batch(
            stages, params, ((x[:half], idx[:half], w[:half]), None),
            ((x[half:], idx[half:], w[half:]), None))
        return jnp.concatenate([a, b])
    return segment


def peer_segment(impl, shape, matmul, num_ranks):
    """The same segment over a peer all-to-all (``bench_peers.PEER_CLASSES``), each half's
    layer written as its own dataflow: XLA's scheduler may run one half's collectives beside the
    other's compute (its own overlap). The routing is computed in the segment, as the stages do."""
    import bench_moe_layer

    from jax_ep import moe

    peer = bp.PEER_CLASSES[impl](num_ranks, shape["experts"], shape["topk"])

    def layer(params, x):
        h = attention_standin(params["w1"], params["w2"], x)
        logits = jnp.dot(h, params["router"], preferred_element_type=jnp.float32)
        idx, w, _ = moe.router(logits, shape["topk"])
        # The weights travel as data, not in the peer's bit-packed metadata: the router's
        # gradient flows back through them, as through jax_ep's dispatch.
        recv_x, recv_w, recv_idx, _ = peer.dispatch([h, w], idx)
        recv_w = jnp.where(recv_idx >= 0, recv_w, 0.0)
        w_gate_up, _, w_down = params["experts"]
        y = bench_moe_layer.expert_block(recv_x, recv_idx, recv_w, (w_gate_up, w_down), matmul)
        return attention_standin(params["w1"], params["w2"], h + peer.combine(y, peer.plan(idx)))

    def segment(params, x, idx, w):
        half = x.shape[0] // 2
        return jnp.concatenate([layer(params, x[:half]), layer(params, x[half:])])
    return segment


def build_program(mesh, segment, inputs, mode, gemm_sms=0, pinned=True, check_vma=True,
                  reads_params=True):
    """A jitted step of ``segment`` over the global ``inputs = (params, x [R*T, H], topk_idx,
    topk_weights)`` (train: the grad of a loss w.r.t. the parameters it ``reads_params`` and x;
    the gradient of parameters it does not read would be zeros the step writes out);
    ``pinned=False``: see ``unpinned``; ``check_vma=False`` for the peers, as
    ``bench_timing.shard_mapped`` (jax types ``ragged_all_to_all``'s result as varying over no
    axis)."""
    if mode == "train":
        def body(params, x, idx, w):
            def loss(params, x):
                return jnp.sum(jnp.square(segment(params, x, idx, w).astype(jnp.float32)))
            return jax.grad(loss, argnums=(0, 1) if reads_params else 1)(params, x)
    else:
        body = segment
    specs = (jax.tree.map(lambda _: P("ep"), inputs[0]), P("ep"), P("ep"), P("ep"))
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P("ep"),
                               check_vma=check_vma))
    with mosaic_grid(gemm_sms), unpinned(not pinned):
        return fn.lower(*inputs).compile()


def loop_us(compiled, args, steps, repeats):
    """Per step: ``steps`` calls dispatched back to back and awaited once; median of repeats."""
    jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            out = compiled(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / steps * 1e6)
    return statistics.median(times)


def is_ours(name):
    return "jax_ep" in name


def is_collective(name):
    """XLA's collective kernels (NCCL's, or its own all-to-all kernels)."""
    name = name.lower()
    return any(key in name for key in ("nccl", "all_to_all", "alltoall", "all-to-all"))


def measure(compiled, args, args_ns, is_comm=is_ours):
    """Wall per step, then from a trace: busy GPU time, the communication kernels' time
    (``is_comm``: jax_ep's, or a peer's collectives) and the share of it hidden, per step."""
    wall = loop_us(compiled, args, args_ns.steps, args_ns.repeats)
    events = timeline.kernels(compiled, *args, calls=args_ns.steps)
    hidden = timeline.hidden_fraction(events, is_comm)
    return {"wall_us": wall, "busy_us": timeline.busy_us(events) / args_ns.steps,
            "comm_kernels_us": hidden["kernels_us"] / args_ns.steps,
            "hidden_us": hidden["hidden_us"] / args_ns.steps,
            "hidden_fraction": hidden["hidden_fraction"], "streams": hidden["streams"],
            "largest_us": {name: us / args_ns.steps
                           for name, us in timeline.largest_us(events).items()}}


def failed_row(label, error):
    log(f"  {label}: ERROR {type(error).__name__}: {str(error)[:200]}")
    return {"error": f"{type(error).__name__}: {error}"[:600], "wall_us": None,
            "hidden_fraction": None, "comm_kernels_us": None}


def run_program(label, build, inputs, args_ns, is_comm=is_ours):
    """``measure`` of the program ``build()`` compiles, or the row of its error (one program's
    failure leaves the others' rows), with the seconds both took."""
    start = time.time()
    try:
        row = measure(build(), inputs, args_ns, is_comm)
        hidden = row["hidden_fraction"]
        log(f"  {label}: {row['wall_us']:.1f} us/step" + ("" if hidden is None else
            f", communication kernels {row['comm_kernels_us']:.1f} us, hidden {hidden:.2f}"))
    except Exception as e:  # noqa: BLE001
        row = failed_row(label, e)
    row["compile_and_run_s"] = round(time.time() - start, 1)
    return row


def routing_for(mesh, params, x, topk):
    """The router's choice on ``x`` (the communication-alone program's routing)."""
    from jax_ep import moe

    def route(router, x):
        logits = jnp.dot(x, router, preferred_element_type=jnp.float32)
        idx, w, _ = moe.router(logits, topk)
        return idx, w
    return jax.jit(jax.shard_map(route, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))(
        params["router"], x)


def run_case(mesh, shape_name, mode, a):
    shape = QUICK if a.quick else SHAPES[shape_name]
    num_ranks = mesh.shape["ep"]
    tokens = shape[mode]
    params = jax.device_put(make_params(shape, num_ranks, jax.random.key(0)), bm.sharded(mesh))
    x = jax.device_put(
        (jax.random.normal(jax.random.key(1), (num_ranks * tokens, shape["hidden"]))
         ).astype(jnp.bfloat16), bm.sharded(mesh))
    inputs = (params, x, *routing_for(mesh, params, x, shape["topk"]))
    low_latency = mode == "decode"
    common = dict(num_experts=shape["experts"], hidden=shape["hidden"],
                  max_tokens_per_rank=tokens // 2, num_topk=shape["topk"],
                  low_latency=low_latency, report_errors=False)
    on_gpu = bm.on_gpu()
    budgets = [int(b) for b in str(a.num_sms).split(",")]
    buffers = {"serial": jax_ep.Buffer(mesh, "ep", **common)}
    for budget in budgets:
        buffers[f"overlapped_sms{budget}"] = jax_ep.Buffer(
            mesh, "ep", overlap=True, num_sms=(budget or None) if on_gpu else None, **common)
    stages_of = decode_stages if low_latency else make_stages
    # (row, buffer, stages' kind, GEMM CTAs, pinned schedule)
    programs = [("serial", "serial", "ep", 0, True)]
    programs += [(f"overlapped_sms{b}", f"overlapped_sms{b}", "ep", a.gemm_sms, True)
                 for b in budgets]
    if a.unpinned:
        programs.append(("unpinned", f"overlapped_sms{budgets[0]}", "ep", 0, False))
    programs += [("compute", "serial", "none", 0, True), ("comm", "serial", "comm", 0, True)]
    rows = {}
    for name, buf_name, kind, gemm, pinned in programs:
        def build(buf_name=buf_name, kind=kind, gemm=gemm, pinned=pinned):
            stages = stages_of(kind, buffers[buf_name], shape, a.matmul, num_ranks)
            return build_program(mesh, two_batch_segment(stages), inputs, mode,
                                 gemm if on_gpu else 0, pinned, reads_params=kind != "comm")
        rows[name] = run_program(f"{mode} {shape_name} {name}", build, inputs, a)
    for buf in buffers.values():
        buf.close()
    peers = {}
    for impl in bp.PEER_CLASSES:
        if num_ranks == 1:
            peers[impl] = "not run: at EP=1 it moves nothing (XLA turns it into a local copy)"
            continue
        if impl == "ragged_all_to_all" and not on_gpu:
            peers[impl] = "not run: XLA:CPU has no ragged_all_to_all"
            continue
        segment = peer_segment(impl, shape, a.matmul, num_ranks)
        peers[impl] = run_program(
            f"{mode} {shape_name} {impl}",
            lambda segment=segment: build_program(mesh, segment, inputs, mode, check_vma=False),
            inputs, a,
            is_comm=is_collective)
    first = rows[f"overlapped_sms{budgets[0]}"]

    def saved(row):
        if row.get("wall_us") is None or rows["serial"].get("wall_us") is None:
            return None
        return rows["serial"]["wall_us"] - row["wall_us"]
    return {
        "op": "overlap_step", "mode": mode, "shape": shape_name, "ranks": num_ranks,
        "tokens": tokens, "hidden": shape["hidden"], "ffn": shape["ffn"],
        "experts": shape["experts"], "topk": shape["topk"], "matmul": a.matmul,
        "num_sms": budgets[0], "gemm_sms": a.gemm_sms,
        "serial_us": rows["serial"]["wall_us"], "overlapped_us": first["wall_us"],
        "compute_us": rows["compute"]["wall_us"], "comm_us": rows["comm"]["wall_us"],
        "hidden_fraction": first["hidden_fraction"], "saved_us": saved(first),
        "by_num_sms": {b: {"overlapped_us": rows[f"overlapped_sms{b}"]["wall_us"],
                           "hidden_fraction": rows[f"overlapped_sms{b}"]["hidden_fraction"],
                           "saved_us": saved(rows[f"overlapped_sms{b}"])} for b in budgets},
        "programs": rows, "peers": peers,
    }


# ------------------------------------------------------------------------------- SM curve
def sm_curve(mesh, a):
    """Kernel time of each op (GPU time, profiler) against the Buffer's num_sms."""
    shape = QUICK if a.quick else SHAPES["deepseek"]
    num_ranks = mesh.shape["ep"]
    tokens, ll_tokens = shape["train"], shape["decode"]
    rng = np.random.default_rng(0)

    def routing(t):
        idx = np.stack([rng.choice(shape["experts"], shape["topk"], replace=False)
                        for _ in range(num_ranks * t)]).astype(np.int32)
        w = rng.random((num_ranks * t, shape["topk"]), dtype=np.float32)
        return jax.device_put(idx, bm.sharded(mesh)), jax.device_put(w, bm.sharded(mesh))

    x = jax.device_put(jnp.ones((num_ranks * tokens, shape["hidden"]), jnp.bfloat16) * 0.5,
                       bm.sharded(mesh))
    xl = x[:num_ranks * ll_tokens]
    idx, w = routing(tokens)
    il, wl = routing(ll_tokens)
    budgets = [b for b in SM_BUDGETS if b < jax.devices()[0].core_count] + [None] if bm.on_gpu() \
        else [None]
    points = []
    for budget in budgets:
        nb = jax_ep.Buffer(mesh, "ep", num_experts=shape["experts"], hidden=shape["hidden"],
                           max_tokens_per_rank=tokens, num_topk=shape["topk"],
                           report_errors=False, num_sms=budget)
        lb = jax_ep.Buffer(mesh, "ep", num_experts=shape["experts"], hidden=shape["hidden"],
                           max_tokens_per_rank=ll_tokens, num_topk=shape["topk"],
                           low_latency=True, report_errors=False, num_sms=budget)

        def normal(x, idx, w, nb=nb):
            d = jax_ep.dispatch(nb, x, idx, w)
            return jax_ep.combine(nb, d.recv_x, d.handle)[0]

        def decode(x, idx, w, lb=lb):
            d = jax_ep.low_latency_dispatch(lb, x, idx, use_fp8=False)
            return jax_ep.low_latency_combine(lb, d.recv_x, idx, w, d.handle)

        def decode_fp8(x, idx, w, lb=lb):
            return jax_ep.low_latency_dispatch(lb, x, idx, use_fp8=True).recv_count
        per_op = {}
        for program, fn, args in (("normal", normal, (x, idx, w)),
                                  ("decode", decode, (xl, il, wl)),
                                  ("decode_fp8", decode_fp8, (xl, il, wl))):
            compiled = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("ep"),
                                             out_specs=P("ep"))).lower(*args).compile()
            events = timeline.kernels(compiled, *args, calls=a.steps)
            for k in events:
                if is_ours(k.name):
                    name = f"{program}/{kernel_role(k.name)}"
                    per_op.setdefault(name, []).append(k.duration_ns / 1e3)
        point = {"num_sms": budget or jax.devices()[0].core_count if bm.on_gpu() else None,
                 "kernel_us": {n: statistics.median(v) for n, v in sorted(per_op.items())}}
        points.append(point)
        log(f"  num_sms {point['num_sms']}: {point['kernel_us']}")
        nb.close()
        lb.close()
    return {"op": "sm_curve", "ranks": num_ranks, "tokens": tokens, "ll_tokens": ll_tokens,
            "hidden": shape["hidden"], "experts": shape["experts"], "topk": shape["topk"],
            "points": points}


def kernel_role(name):
    """A kernel's role from its (demangled) name: the plan and transfer kernels of the normal
    dispatch and combine, the low-latency dispatch and combine."""
    for key in ("dispatch_plan", "dispatch_transfer", "combine_plan", "combine_transfer"):
        if key in name:
            return key
    return "dispatch" if "dispatch" in name else "combine" if "combine" in name else name[:40]


def main(argv=None):
    bm.default_host_devices()  # before anything starts a backend: 8 ranks on CPU
    argv = sys.argv[1:] if argv is None else argv
    a = parse_args(argv)
    if jax_ep is None:
        raise SystemExit(f"jax_ep: {_IMPORT_ERROR}")
    mesh = bm.make_mesh()
    header = br.result_header(argv, note=a.note)
    table = []
    on_gpu = bm.on_gpu()
    if not on_gpu:
        log(bm.cpu_note() + " The reference backend runs the ops in order (no side stream, "
            "no kernel trace): hidden and saved/comm are left out.")
    if a.sm_curve:
        record = {**header, **sm_curve(mesh, a)}
        br.write_json(os.path.join(a.out, f"{br.machine_name()}-sm-curve.json"), record)
    for mode, shape_name in (c.split(":") for c in a.cases.split(",")):
        log(f"{mode} {shape_name}:")
        record = {**header, **run_case(mesh, shape_name, mode, a)}
        path = os.path.join(a.out, f"{br.machine_name()}-overlap-{mode}-{shape_name}.json")
        br.write_json(path, record)
        table.append(record)
    log("\nmode    shape     serial_us  overlapped_us  compute_us  comm_us  hidden  saved/comm")
    def cell(value, digits=1):
        return "-" if value is None else f"{value:.{digits}f}"
    for r in table:
        for budget, row in r["by_num_sms"].items():
            ratio = (row["saved_us"] / r["comm_us"] if on_gpu and row["saved_us"] is not None
                     and r["comm_us"] else None)
            log(f"{r['mode']:7s} {r['shape']:9s} {cell(r['serial_us']):>9} "
                f"{cell(row['overlapped_us']):>14} {cell(r['compute_us']):>11} "
                f"{cell(r['comm_us']):>8} {cell(row['hidden_fraction'], 3):>7} "
                f"{cell(ratio, 2):>10}  num_sms={budget or 'all'}")
        for impl, row in r["peers"].items():  # XLA's own overlap of the peer's collectives
            text = row if isinstance(row, str) else row.get("error") or (
                f"{cell(row['wall_us']):>9} us/step" + (
                    f", collectives {cell(row['comm_kernels_us'])} us, hidden "
                    f"{cell(row['hidden_fraction'], 3)}" if on_gpu else ""))
            log(f"{r['mode']:7s} {r['shape']:9s} {impl}: {text[:160]}")
    log("us per step. hidden: the share of jax_ep's kernel time in the overlapped step during "
        "which a compute kernel ran on another stream (profiler trace); saved/comm: (serial - "
        "overlapped) / comm, the share of the communication-alone step the overlap saved (< 0: "
        "the overlapped step is the slower).")


if __name__ == "__main__":
    main()
