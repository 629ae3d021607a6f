"""Probe (one H200, EP=1): which of jax's stream mechanisms puts our custom calls on another
stream, whether they run beside XLA's and Mosaic's kernels, and kernel time against SMs."""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.compute_on import compute_on
try:
    from jax.experimental.compute_on import compute_on2
except ImportError:
    compute_on2 = None
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import timeline  # noqa: E402

import jax_ep  # noqa: E402
from jax_ep.backends import cuda as cuda_backend  # noqa: E402

OUT = os.environ.get("OUT", "/tmp/probe_out")
os.makedirs(OUT, exist_ok=True)
RESULTS = {}
mesh = Mesh(np.array(jax.devices()[:1]), ("ep",))
SH = NamedSharding(mesh, P("ep"))
STREAM_ATTR = [None]
ON_STREAM = [False]
GROUP = [None]
_orig_cc = cuda_backend.custom_call
_orig_tn = cuda_backend.target_name


def _cc(*a, **kw):
    attrs = []
    if STREAM_ATTR[0] is not None:
        attrs.append(("_xla_stream_annotation", STREAM_ATTR[0]))
    if GROUP[0] is not None:
        attrs.append(("_scheduling_group_id", GROUP[0]))
    if attrs:
        kw["frontend_attributes"] = tuple(attrs)
    return _orig_cc(*a, **kw)


def _tn(op):
    return _orig_tn(op + "_on_stream" if ON_STREAM[0] else op)


cuda_backend.custom_call = _cc
cuda_backend.target_name = _tn


@contextlib.contextmanager
def stream_attr(value, on_stream=False, group=None):
    STREAM_ATTR[0], ON_STREAM[0], GROUP[0] = value, on_stream, group
    try:
        yield
    finally:
        STREAM_ATTR[0], ON_STREAM[0], GROUP[0] = None, False, None


def group_ctx(group):
    if group is None:
        return contextlib.nullcontext()
    from jax.experimental.xla_metadata import set_xla_metadata
    return set_xla_metadata(_scheduling_group_id=group)


def schedule(compiled):
    """The entry computation's instructions in order (bookkeeping ops left out)."""
    text = compiled.as_text()
    entry = text[text.index("ENTRY"):]
    entry = entry[:entry.index("\n}")]
    skip = ("parameter(", "get-tuple-element(", "constant(", "bitcast(", "tuple(")
    out = []
    for ln in entry.splitlines()[1:]:
        if "=" not in ln or any(k in ln for k in skip):
            continue
        name, rest = ln.strip().split(" = ", 1)
        opcode = (rest.split("(")[0].split() or ["?"])[-1]
        extra = ""
        for key in ("custom_call_target=", "calls="):
            if key in rest:
                extra = rest.split(key)[1].split(",")[0].split("}")[0]
        out.append(f"{name.replace('ROOT ', '')}:{opcode}:{extra}"[:90])
    return out


def log(*a):
    print(*a, flush=True)


def put(a):
    return jax.device_put(a, SH)


def routing(T, E, K, seed=0):
    rng = np.random.default_rng(seed)
    idx = np.stack([rng.choice(E, K, replace=False) for _ in range(T)]).astype(np.int32)
    w = rng.random((T, K), dtype=np.float32)
    return put(idx), put(w)


def rows(shape, seed=1, dtype=jnp.bfloat16):
    return put(jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype))


def ours(name):
    return "jax_ep" in name


def wall_us(fn, args, n=20):
    jax.block_until_ready(fn(*args))
    t = time.perf_counter()
    for _ in range(n):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / n * 1e6


def compile_fn(body, args, opts, in_specs=None):
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs or P("ep"), out_specs=P("ep")))
    lowered = f.lower(*args)
    compiled = lowered.compile(compiler_options=opts) if opts else lowered.compile()
    return compiled


def hlo_facts(compiled):
    text = compiled.as_text()
    lines = [ln.strip()[:300] for ln in text.splitlines() if "jax_ep_" in ln]
    return {"async_start": text.count("async-start") + text.count("call-start")
            + text.count("custom-call-start"),
            "command_buffer": text.count("command_buffer"),
            "our_lines": lines[:6]}


def measure(compiled, args, calls=5):
    ev = timeline.kernels(compiled, *args, calls=calls)
    hf = timeline.hidden_fraction(ev, ours)
    by_stream = {}
    for k in ev:
        if ours(k.name):
            by_stream.setdefault(k.stream, set()).add(k.name.split("(")[0][-40:])
    return {"ours_by_stream": {s: sorted(v) for s, v in by_stream.items()},
            "wall_us": wall_us(compiled, args), "busy_us": timeline.busy_us(ev) / calls,
            "span_us": timeline.span_us(ev) / calls, **hf,
            "ours_us": hf["ours_us"] / calls, "hidden_us": hf["hidden_us"] / calls,
            "all_streams": sorted({k.stream for k in ev})}


ANN = {"xla_gpu_experimental_stream_annotation": True}
NOCMD = {"xla_gpu_experimental_stream_annotation": True, "xla_gpu_enable_command_buffer": ""}


def section_mech():
    T, H, E, K = 4096, 7168, 256, 8
    buf = jax_ep.Buffer(mesh, "ep", num_experts=E, hidden=H, max_tokens_per_rank=T, num_topk=K,
                        backend="cuda")
    x = rows((T, H))
    idx, w = routing(T, E, K)
    a, b = rows((4096, 7168), 2), rows((7168, 4096), 3)

    def dispatch(x, idx, w):
        return jax_ep.dispatch(buf, x, idx, w).recv_x

    def make(mech, stream="1"):
        def body(x, idx, w, a, b):
            if mech == "none":
                r = dispatch(x, idx, w)
            elif mech == "attr":
                with stream_attr(stream):
                    r = dispatch(x, idx, w)
            elif mech == "ctx":
                with compute_on(f"gpu_stream:{stream}"):
                    r = dispatch(x, idx, w)
            elif mech == "call2":
                r = compute_on2(dispatch, compute_type=f"gpu_stream:{stream}",
                                out_memory_spaces=jax.memory.Space.Device)(x, idx, w)
            elif mech == "nodispatch":
                r = x
            m = jnp.dot(a, b, preferred_element_type=jnp.bfloat16)
            return r, m
        return body

    args = (x, idx, w, a, b)
    cases = [("none", None, "1"), ("nodispatch", None, "1"), ("none", ANN, "1"),
             ("attr", ANN, "1"), ("attr", NOCMD, "1"), ("attr", None, "1"),
             ("ctx", ANN, "1"), ("ctx", NOCMD, "1"), ("call2", ANN, "1"), ("call2", NOCMD, "1"),
             ("attr", ANN, "collective")]
    for mech, opts, stream in cases:
        key = f"mech/{mech}/{'nocmd' if opts is NOCMD else 'ann' if opts else 'default'}/{stream}"
        try:
            c = compile_fn(make(mech, stream), args, opts)
            RESULTS[key] = {**hlo_facts(c), **measure(c, args)}
        except Exception as e:  # noqa: BLE001
            RESULTS[key] = {"error": f"{type(e).__name__}: {e}"[:1500]}
            traceback.print_exc()
        log(key, json.dumps(RESULTS[key])[:600])
    # The low-latency ops, fused, on stream 1 beside the dot.
    Tl = 128
    ll = jax_ep.Buffer(mesh, "ep", num_experts=E, hidden=H, max_tokens_per_rank=Tl, num_topk=K,
                       low_latency=True, backend="cuda")
    xl = rows((Tl, H), 4)
    il, wl = routing(Tl, E, K, 5)

    def ll_body(mech):
        def body(x, idx, w, a, b):
            ctx = stream_attr("1") if mech == "attr" else contextlib.nullcontext()
            with ctx:
                d = jax_ep.low_latency_dispatch(ll, x, idx, use_fp8=False)
                y = jax_ep.low_latency_combine(ll, d.recv_x, idx, w, d.handle)
            return y, jnp.dot(a, b, preferred_element_type=jnp.bfloat16)
        return body
    for mech, opts in (("none", None), ("attr", ANN), ("attr", NOCMD)):
        key = f"ll/{mech}/{'nocmd' if opts is NOCMD else 'ann' if opts else 'default'}"
        try:
            c = compile_fn(ll_body(mech), (xl, il, wl, a, b), opts)
            RESULTS[key] = {**hlo_facts(c), **measure(c, (xl, il, wl, a, b))}
        except Exception as e:  # noqa: BLE001
            RESULTS[key] = {"error": f"{type(e).__name__}: {e}"[:1500]}
            traceback.print_exc()
        log(key, json.dumps(RESULTS[key])[:600])
    buf.close()
    ll.close()


def per_kernel(ev, calls):
    by = {}
    for k in ev:
        short = k.name.split("(")[0].split("<")[0][-60:]
        by.setdefault(short, []).append(k.duration_ns / 1e3)
    return {n: statistics.median(v) for n, v in by.items() if len(v) >= calls}


def section_sms():
    T, H, E, K, Tl = 4096, 7168, 256, 8, 128
    x, xl = rows((T, H)), rows((Tl, H), 4)
    idx, w = routing(T, E, K)
    il, wl = routing(Tl, E, K, 5)
    for blocks in (16, 24, 32, 48, 66, 132):
        os.environ["JAX_EP_NORMAL_BLOCKS"] = str(blocks)
        os.environ["JAX_EP_LOW_LATENCY_BLOCKS"] = str(blocks)
        try:
            nb = jax_ep.Buffer(mesh, "ep", num_experts=E, hidden=H, max_tokens_per_rank=T,
                               num_topk=K, backend="cuda")
            lb = jax_ep.Buffer(mesh, "ep", num_experts=E, hidden=H, max_tokens_per_rank=Tl,
                               num_topk=K, low_latency=True, backend="cuda")

            def nbody(x, idx, w):
                d = jax_ep.dispatch(nb, x, idx, w)
                return jax_ep.combine(nb, d.recv_x, d.handle)[0]

            def lbody(x, idx, w):
                d = jax_ep.low_latency_dispatch(lb, x, idx, use_fp8=True)
                d2 = jax_ep.low_latency_dispatch(lb, x, idx, use_fp8=False)
                return jax_ep.low_latency_combine(lb, d2.recv_x, idx, w, d2.handle), d.recv_count
            cn = compile_fn(nbody, (x, idx, w), None)
            cl = compile_fn(lbody, (xl, il, wl), None)
            RESULTS[f"sms/{blocks}"] = {
                "normal": per_kernel(timeline.kernels(cn, x, idx, w, calls=8), 8),
                "low_latency": per_kernel(timeline.kernels(cl, xl, il, wl, calls=8), 8)}
            nb.close()
            lb.close()
        except Exception as e:  # noqa: BLE001
            RESULTS[f"sms/{blocks}"] = {"error": f"{type(e).__name__}: {e}"[:1500]}
            traceback.print_exc()
        log(f"sms/{blocks}", json.dumps(RESULTS[f"sms/{blocks}"])[:900])
    os.environ.pop("JAX_EP_NORMAL_BLOCKS")
    os.environ.pop("JAX_EP_LOW_LATENCY_BLOCKS")


@contextlib.contextmanager
def mosaic_grid(n):
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu
    plgpu = ragged_dot_mgpu.plgpu
    orig = plgpu.kernel

    def kernel(body, *a, grid=None, grid_names=None, **kw):
        if n and grid_names == ("sm",):
            grid = (n,)
        return orig(body, *a, grid=grid, grid_names=grid_names, **kw)
    plgpu.kernel = kernel
    try:
        yield
    finally:
        plgpu.kernel = orig


def section_gemm():
    from jax_ep.moe import grouped_gemm
    T, H, E, K, F = 4096, 7168, 256, 8, 2048
    N = T * K
    xs = rows((N, H), 7)
    wg = rows((E, H, 2 * F), 8)
    sizes = np.bincount(np.random.default_rng(0).integers(0, E, N), minlength=E).astype(np.int32)
    gs = put(sizes)
    x = rows((T, H))
    idx, w = routing(T, E, K)

    def gemm(xs, wg, gs):
        return grouped_gemm.library_matmul(xs, wg, gs, "mosaic")
    in_specs = (P("ep"), P("ep"), P("ep"), P(), P(), P())
    for grid in (None, 116, 108):
        key = f"gemm/alone/{grid or 132}"
        try:
            with mosaic_grid(grid):
                c = compile_fn(lambda xs, wg, gs: gemm(xs, wg, gs), (xs, wg, gs), None,
                               in_specs=(P("ep"), P("ep"), P()))
            ev = timeline.kernels(c, xs, wg, gs, calls=5)
            RESULTS[key] = {"per_kernel": per_kernel(ev, 5), "busy_us": timeline.busy_us(ev) / 5}
        except Exception as e:  # noqa: BLE001
            RESULTS[key] = {"error": f"{type(e).__name__}: {e}"[:1500]}
            traceback.print_exc()
        log(key, json.dumps(RESULTS[key])[:600])
    for blocks in (132, 24, 16):
        os.environ["JAX_EP_NORMAL_BLOCKS"] = str(blocks)
        buf = jax_ep.Buffer(mesh, "ep", num_experts=E, hidden=H, max_tokens_per_rank=T,
                            num_topk=K, backend="cuda")
        os.environ.pop("JAX_EP_NORMAL_BLOCKS")
        for grid in (None, 132 - blocks) if blocks < 132 else (None,):
            for mech, opts in (("none", None), ("attr", ANN)):
                key = f"gemm/with_dispatch/blocks{blocks}/grid{grid or 132}/{mech}"

                def body(x, idx, w, xs, wg, gs, mech=mech):
                    ctx = stream_attr("1") if mech == "attr" else contextlib.nullcontext()
                    with ctx:
                        d = jax_ep.dispatch(buf, x, idx, w)
                    return d.recv_x, gemm(xs, wg, gs)
                try:
                    with mosaic_grid(grid):
                        c = compile_fn(body, (x, idx, w, xs, wg, gs), opts,
                                       in_specs=(P("ep"), P("ep"), P("ep"), P("ep"), P("ep"), P()))
                    RESULTS[key] = {**hlo_facts(c), **measure(c, (x, idx, w, xs, wg, gs))}
                except Exception as e:  # noqa: BLE001
                    RESULTS[key] = {"error": f"{type(e).__name__}: {e}"[:1500]}
                    traceback.print_exc()
                log(key, json.dumps(RESULTS[key])[:600])
        buf.close()


def section_mech2():
    T, H, E, K = 4096, 7168, 256, 8
    buf = jax_ep.Buffer(mesh, "ep", num_experts=E, hidden=H, max_tokens_per_rank=T, num_topk=K,
                        backend="cuda")
    x = rows((T, H))
    idx, w = routing(T, E, K)
    a, b = rows((4096, 7168), 2), rows((7168, 4096), 3)
    Tl = 128
    ll = jax_ep.Buffer(mesh, "ep", num_experts=E, hidden=H, max_tokens_per_rank=Tl, num_topk=K,
                       low_latency=True, backend="cuda")
    xl = rows((Tl, H), 4)
    il, wl = routing(Tl, E, K, 5)

    def make(mode, on_stream, group, op):
        def body(x, idx, w, a, b):
            with group_ctx(group):
                ctx = (stream_attr("1", on_stream, group) if mode == "attr"
                       else contextlib.nullcontext())
                with ctx:
                    if op == "normal":
                        r = jax_ep.dispatch(buf, x, idx, w).recv_x
                    else:
                        d = jax_ep.low_latency_dispatch(ll, x, idx, use_fp8=False)
                        r = d.recv_x
                m = jnp.dot(a, b, preferred_element_type=jnp.bfloat16)
            return r, m
        return body

    for op in ("normal", "ll"):
        args = (x, idx, w, a, b) if op == "normal" else (xl, il, wl, a, b)
        cases = [("attr", True, g, o) for g in (None, "1") for o in (ANN, NOCMD)]
        cases.append(("attr", True, "1", None))
        if op == "ll":
            cases = [("attr", True, "1", o) for o in (ANN, NOCMD)]
        for mode, on_stream, group, opts in cases:
            key = (f"mech2/{op}/{mode}/{'onstream' if on_stream else 'compat'}/"
                   f"{'group' if group else 'nogroup'}/"
                   f"{'nocmd' if opts is NOCMD else 'ann' if opts else 'default'}")
            try:
                c = compile_fn(make(mode, on_stream, group, op), args, opts)
                RESULTS[key] = {**hlo_facts(c), "schedule": schedule(c), **measure(c, args)}
            except Exception as e:  # noqa: BLE001
                RESULTS[key] = {"error": f"{type(e).__name__}: {e}"[:1500]}
                traceback.print_exc()
            log(key, json.dumps({k: v for k, v in RESULTS[key].items()
                                 if k not in ("our_lines",)})[:1200])
    buf.close()
    ll.close()


def section_gemm2():
    from jax_ep.moe import grouped_gemm
    T, H, E, K, F = 4096, 7168, 256, 8, 2048
    N = T * K
    xs = rows((N, H), 7)
    wg = rows((E, H, 2 * F), 8)
    sizes = np.bincount(np.random.default_rng(0).integers(0, E, N), minlength=E).astype(np.int32)
    gs = put(sizes)
    x = rows((T, H))
    idx, w = routing(T, E, K)
    for blocks in (24, 16):
        os.environ["JAX_EP_NORMAL_BLOCKS"] = str(blocks)
        grids = (None, 108) if blocks == 24 else (116,)
        buf = jax_ep.Buffer(mesh, "ep", num_experts=E, hidden=H, max_tokens_per_rank=T,
                            num_topk=K, backend="cuda")
        os.environ.pop("JAX_EP_NORMAL_BLOCKS")
        for grid in grids:
            for opts in (ANN,):
                key = (f"gemm2/blocks{blocks}/grid{grid or 132}/"
                       f"{'nocmd' if opts is NOCMD else 'ann'}")

                def body(x, idx, w, xs, wg, gs, buf=buf):
                    with group_ctx("1"):
                        with stream_attr("1", True, "1"):
                            d = jax_ep.dispatch(buf, x, idx, w)
                        y = grouped_gemm.library_matmul(xs, wg, gs, "mosaic")
                    return d.recv_x, y
                try:
                    with mosaic_grid(grid):
                        c = compile_fn(body, (x, idx, w, xs, wg, gs), opts,
                                       in_specs=(P("ep"), P("ep"), P("ep"), P("ep"), P("ep"),
                                                 P()))
                    RESULTS[key] = {**hlo_facts(c), "schedule": schedule(c),
                                    **measure(c, (x, idx, w, xs, wg, gs))}
                except Exception as e:  # noqa: BLE001
                    RESULTS[key] = {"error": f"{type(e).__name__}: {e}"[:1500]}
                    traceback.print_exc()
                log(key, json.dumps({k: v for k, v in RESULTS[key].items()
                                     if k not in ("our_lines",)})[:1200])
        buf.close()


def main():
    log("jax", jax.__version__, jax.devices())
    for name in sys.argv[1:] or ["mech", "sms", "gemm"]:
        t = time.time()
        try:
            globals()[f"section_{name}"]()
        except Exception:  # noqa: BLE001
            traceback.print_exc()
        log(f"== section {name}: {time.time() - t:.0f} s")
        with open(os.path.join(OUT, "probe.json"), "w") as f:
            json.dump(RESULTS, f, indent=1, default=str)
    log("\n=== summary")
    for k, v in RESULTS.items():
        if "error" in v:
            log(f"{k:55s} ERROR {v['error'][:150]}")
        elif "hidden_fraction" in v:
            log(f"{k:55s} async={v['async_start']} cmd={v['command_buffer']} wall={v['wall_us']:.0f} "
                f"busy={v['busy_us']:.0f} ours={v['ours_us']:.1f} hidden={v['hidden_fraction']} "
                f"streams={v['streams']}")


if __name__ == "__main__":
    main()
