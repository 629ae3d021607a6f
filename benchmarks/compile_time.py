"""How long an MoE program takes to compile, and what its compiled program holds.

    python benchmarks/compile_time.py [--cases flax,moe_stack] [--layers 16] [--scan]
        [--matmul auto] [--quick] [--out DIR]

Cases:

- ``flax``: the Flax example's train step (``examples/flax_moe/train.py``'s ``setup``: forward,
  backward and the AdamW update of its ``MoETransformer``), default configuration or
  ``--flax-args`` (train.py's own flags, e.g. ``"--dtype bfloat16"`` for the Mosaic GPU
  grouped GEMMs on Hopper);
- ``moe_stack``: ``--layers`` chained ``jax_ep.moe.moe_ffn`` layers (``h = h + moe_ffn(h)``, each
  with its own routing and weights), forward + backward (``jax.value_and_grad`` of
  ``sum(out * cotangent)`` w.r.t. the tokens and every layer's weights), at
  ``bench_moe_layer.py``'s shape (T=4096 tokens per rank, H=2048, F=1024, 64 experts, top-8,
  bf16, gate and up as one ``[E, H, 2F]`` weight), built with ``bench_moe_layer.make_layer``.
  The layers are unrolled in Python (one copy of the layer per layer in the program);
  ``--scan`` adds the same stack as one ``jax.lax.scan`` over the stacked weights (the layer
  body appears once), the usual cure for compile time.

For each case: ``lower_s`` (tracing and lowering to StableHLO: ``jax.jit(f).lower(...)``, which
includes each Pallas kernel's lowering to its Mosaic GPU module), ``compile_s``
(``lowered.compile()``: XLA), and unless ``--no-run`` the first call (``first_call_s``: what a
custom call does on first use, such as loading or building its kernels, is in it) and a second
one (``second_call_s``).
From the compiled HLO: ``num_instructions``, ``num_fusions``, ``num_custom_calls`` and their
targets, ``num_mosaic_kernels`` (Mosaic GPU custom calls: Pallas on Hopper), ``num_triton_kernels``
and ``unique_kernels``, the distinct kernel bodies among those (Mosaic GPU's ``kernel_hash``),
so that ``unique_kernels`` much below the count means the same kernel appears many times.
jax's persistent compilation cache is off while a case compiles (a hit would hide the time).

On CPU (8 host devices unless ``XLA_FLAGS`` sets a count) the reference backend and the tiled
matmul run: the counts are XLA:CPU's fusions, and no Mosaic kernel. ``--quick``: small shapes.
Writes ``<out>/<machine>-<date>-compile_time[-<tag>].json`` (or ``--out`` itself when it ends in
``.json``) and prints a table last.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import os
import re
import shlex
import sys
import time
from collections import Counter

import bench_inputs as bi
import bench_mesh as bm
import bench_moe_layer as bml
import bench_records as br
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

OP = "compile_time"
CASES = ("flax", "moe_stack")
EXAMPLE = os.path.join(br.REPO_ROOT, "examples", "flax_moe", "train.py")
DEFAULTS = {"tokens": 4096, "hidden": 2048, "ffn": 1024, "experts": 64, "topk": 8, "layers": 16}
QUICK = {"tokens": 32, "hidden": 128, "ffn": 64, "experts": 16, "topk": 2, "layers": 4}
MOSAIC_TARGETS = ("mosaic_gpu_v2", "mosaic_gpu")
TRITON_TARGETS = ("__gpu$xla.gpu.triton", "triton_kernel_call", "triton_kernel_call_ffi")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help=f"small shapes ({', '.join(f'{k}={v}' for k, v in QUICK.items())}): "
                        "for CPU (the flax case keeps its configuration)")
    p.add_argument("--cases", type=lambda s: tuple(c for c in s.split(",") if c), default=CASES,
                   help=f"comma-separated subset of {','.join(CASES)}")
    p.add_argument("--layers", type=int, help="MoE layers in the stack (default 16)")
    bi.add_shape_arguments(p, DEFAULTS)
    p.add_argument("--matmul", default="auto",
                   help="the stack's expert matmul, a name of jax_ep.moe.MATMULS (default auto: "
                        "Mosaic GPU on Hopper, tiled elsewhere)")
    p.add_argument("--scan", action="store_true",
                   help="also build the stack as one jax.lax.scan over stacked weights (the "
                        "layer compiled once), beside the unrolled stack")
    p.add_argument("--flax-args", default="",
                   help="train.py flags of the flax case, quoted, e.g. \"--dtype bfloat16 "
                        "--hidden 512\" (default: its default configuration)")
    p.add_argument("--no-run", dest="run", action="store_false",
                   help="compile only: no first and second call")
    br.add_out_argument(p, "a folder for <machine>-<date>-compile_time[-<tag>].json, or a file "
                           "name ending in .json")
    p.add_argument("--tag", help="appended to the file name")
    p.add_argument("--seed", type=int, default=0, help="seed of the routing and inputs")
    args = p.parse_args(argv)
    bi.fill_defaults(args, DEFAULTS, QUICK)
    bad = [c for c in args.cases if c not in CASES]
    if bad:
        p.error(f"unknown case {bad}: expected some of {','.join(CASES)}")
    if args.layers < 1:
        p.error("--layers must be at least 1")
    return args


def log(msg):
    print(msg, flush=True)


# ----------------------------------------------------------------------------- what was compiled


def _attribute(text, start):
    """The attribute value starting at ``text[start]``: a quoted string (escapes kept) or a
    ``{...}`` block (nesting counted), else up to the next ``", "``."""
    if text.startswith('"', start):
        end = start + 1
        while end < len(text) and text[end] != '"':
            end += 2 if text[end] == "\\" else 1
        return text[start:end + 1]
    if text.startswith("{", start):
        depth = 0
        for end in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[end], 0)
            if depth == 0:
                return text[start:end + 1]
    end = text.find(", ", start)
    return text[start:] if end < 0 else text[start:end]


def hlo_counts(hlo_text: str) -> dict:
    """Counts of a compiled program's HLO text (``compiled.as_text()``).

    ``num_instructions`` (every instruction of every computation), ``num_fusions``,
    ``num_custom_calls`` and ``custom_call_targets`` (target -> count), ``num_mosaic_kernels``
    and ``num_triton_kernels`` (custom calls of those targets), ``unique_kernels`` (distinct
    kernel bodies among them: Mosaic GPU's ``kernel_hash``, else the whole backend config).
    """
    instructions = fusions = 0
    targets = Counter()
    bodies = set()
    for line in hlo_text.splitlines():
        line = line.strip()
        if " = " not in line or line.startswith(("HloModule", "//", "ENTRY", "}")):
            continue
        instructions += 1
        op = line.split(" = ", 1)[1]
        if re.search(r"\bfusion\(", op):
            fusions += 1
        if "custom-call(" not in op:
            continue
        match = re.search(r'custom_call_target="([^"]+)"', op)
        target = match.group(1) if match else "?"
        targets[target] += 1
        if target in MOSAIC_TARGETS + TRITON_TARGETS:
            at = op.find("kernel_hash")
            if at >= 0:
                key = _attribute(op, op.find("=", at) + 1).strip()
            else:
                at = op.find("backend_config=")
                key = _attribute(op, at + len("backend_config=")) if at >= 0 else op
            bodies.add((target, hashlib.sha256(key.encode()).hexdigest()))
    return {
        "num_instructions": instructions,
        "num_fusions": fusions,
        "num_custom_calls": sum(targets.values()),
        "custom_call_targets": dict(sorted(targets.items())),
        "num_mosaic_kernels": sum(targets[t] for t in MOSAIC_TARGETS),
        "num_triton_kernels": sum(targets[t] for t in TRITON_TARGETS),
        "unique_kernels": len(bodies),
    }


@contextlib.contextmanager
def no_compilation_cache():
    """jax's persistent compilation cache off (a cache hit would hide the compile time)."""
    enabled = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    yield
    jax.config.update("jax_enable_compilation_cache", enabled)


def measure(jitted, call_args, run: bool) -> dict:
    """Lowers and compiles ``jitted`` for ``call_args``, times each stage, counts the compiled
    HLO; with ``run``, times the first two calls of the compiled program."""
    with no_compilation_cache():
        start = time.perf_counter()
        lowered = jitted.lower(*call_args)
        lower_s = time.perf_counter() - start
        start = time.perf_counter()
        compiled = lowered.compile()
        compile_s = time.perf_counter() - start
    fields = {"lower_s": round(lower_s, 3), "compile_s": round(compile_s, 3),
              "first_call_s": None, "second_call_s": None}
    fields.update(hlo_counts(compiled.as_text()))
    if run:
        for key in ("first_call_s", "second_call_s"):
            start = time.perf_counter()
            jax.block_until_ready(compiled(*call_args))
            fields[key] = round(time.perf_counter() - start, 3)
    return fields


# ----------------------------------------------------------------------------- the cases


def load_example():
    """examples/flax_moe/train.py as a module (it puts its folder on sys.path for model.py)."""
    name = "flax_moe_train"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, EXAMPLE)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # its dataclasses look their module up there
        spec.loader.exec_module(module)
    return sys.modules[name]


def flax_case(args):
    """``(jitted, call_args, fields)`` of the Flax example's train step."""
    train = load_example()
    cfg = train.parse_args(shlex.split(args.flax_args))
    s = train.setup(cfg)
    batch = s.put(s.lang.batch(cfg.batch, np.random.default_rng(cfg.seed)))
    # nnx.jit's lower takes the step's own arguments (the model and optimizer as graph nodes).
    fields = {"layers": cfg.layers, "config": {k: getattr(cfg, k) for k in (
        "batch", "seq", "experts", "topk", "hidden", "ffn", "layers", "heads", "dtype",
        "backend", "data_parallel")}, "backend": s.buf.backend,
        "matmul": train.moe.expert_matmul("auto", jnp.dtype(cfg.dtype),
                                          (cfg.hidden, 2 * cfg.ffn), (cfg.ffn, cfg.hidden))}
    return s.train_step, (s.model, s.optimizer, *batch), fields, s.buf


def stack_inputs(mesh, args):
    """Global inputs of the stack, sharded along "ep" (axis 1 of the per-layer stacks):
    ``x [R*T, H]`` and ``ct [R*T, H]`` bf16, ``idx [L, R*T, K]`` int32, ``w [L, R*T, K]`` f32,
    ``w_gate_up [L, E, H, 2F]`` and ``w_down [L, E, F, H]`` bf16 (scaled for O(1) outputs)."""
    num_ranks = mesh.shape[bm.AXIS]
    rows = num_ranks * args.tokens
    seed = args.seed * 1_000_003
    x = bi.random_rows(mesh, seed + 1, (rows, args.hidden))
    ct = bi.random_rows(mesh, seed + 2, (rows, args.hidden))
    routing = [bi.random_routing(mesh, seed + 10 + i, args.tokens, args.experts, args.topk)
               for i in range(args.layers)]
    stacked = NamedSharding(mesh, P(None, bm.AXIS))
    idx = jax.device_put(jnp.stack([r[0] for r in routing]), stacked)
    w = jax.device_put(jnp.stack([r[1] for r in routing]), stacked)
    e, h, f, n = args.experts, args.hidden, args.ffn, args.layers

    def make(key):
        k1, k2 = jax.random.split(key)
        return ((jax.random.normal(k1, (n, e, h, 2 * f)) * h**-0.5).astype(jnp.bfloat16),
                (jax.random.normal(k2, (n, e, f, h)) * f**-0.5).astype(jnp.bfloat16))

    weights = jax.jit(make, out_shardings=(stacked, stacked))(jax.random.key(seed + 3))
    return jax.block_until_ready((x, ct, idx, w, *weights))


def stack_step(layer, num_layers: int, scan: bool):
    """Per rank: ``step(x, ct, idx, w, w_gate_up, w_down) -> (loss [1], dx, dw_gate_up,
    dw_down)``, the stack ``h = h + layer(h, idx[l], w[l], w_gate_up[l], w_down[l])`` unrolled
    or scanned."""

    def loss_fn(x, w_gate_up, w_down, ct, idx, w):
        if scan:
            def body(h, per_layer):
                i, wt, wgu, wd = per_layer
                return h + layer(h, i, wt, wgu, wd), None

            h, _ = jax.lax.scan(body, x, (idx, w, w_gate_up, w_down))
        else:
            h = x
            for n in range(num_layers):
                h = h + layer(h, idx[n], w[n], w_gate_up[n], w_down[n])
        return jnp.sum(h.astype(jnp.float32) * ct.astype(jnp.float32))

    def step(x, ct, idx, w, w_gate_up, w_down):
        loss, grads = jax.value_and_grad(loss_fn, argnums=(0, 1, 2))(
            x, w_gate_up, w_down, ct, idx, w)
        return (loss[None], *grads)

    return step


def stack_case(args, mesh, jax_ep, scan: bool):
    num_ranks = mesh.shape[bm.AXIS]
    buf = jax_ep.Buffer(mesh, bm.AXIS, num_experts=args.experts, hidden=args.hidden,
                        max_tokens_per_rank=args.tokens, num_topk=args.topk, dtype=jnp.bfloat16,
                        backend="cuda" if bm.on_gpu() else "reference", report_errors=False)
    layer = bml.make_layer("jax_ep", num_ranks, args.experts, args.topk, buf, args.matmul)
    stacked = P(None, bm.AXIS)
    step = jax.shard_map(
        stack_step(layer, args.layers, scan), mesh=mesh,
        in_specs=(P(bm.AXIS), P(bm.AXIS), stacked, stacked, stacked, stacked),
        out_specs=(P(bm.AXIS), P(bm.AXIS), stacked, stacked), check_vma=False)
    fields = {"backend": buf.backend, "matmul": args.matmul,
              "resolved_matmul": jax_ep.moe.expert_matmul(
                  args.matmul, jnp.dtype(jnp.bfloat16), (args.hidden, 2 * args.ffn),
                  (args.ffn, args.hidden)),
              "tokens": args.tokens, "hidden": args.hidden, "ffn": args.ffn,
              "experts": args.experts, "topk": args.topk, "ranks": num_ranks}
    return jax.jit(step), stack_inputs(mesh, args), fields, buf


# ----------------------------------------------------------------------------- report


def print_table(records, errors):
    head = (f"{'case':20s} {'layers':>6s} {'lower_s':>8s} {'compile_s':>9s} {'1st call':>9s} "
            f"{'fusions':>8s} {'custom':>7s} {'mosaic':>7s} {'unique':>7s}")
    print("\n" + head)
    print("-" * len(head))
    for r in records:
        first = "-" if r["first_call_s"] is None else f"{r['first_call_s']:.2f}"
        print(f"{r['case']:20s} {r['layers'] or '-':>6} {r['lower_s']:8.2f} "
              f"{r['compile_s']:9.2f} {first:>9s} {r['num_fusions']:8d} "
              f"{r['num_custom_calls']:7d} {r['num_mosaic_kernels']:7d} {r['unique_kernels']:7d}")
    for e in errors:
        print(f"{e['case']:20s} ERROR {e['error'][:160]}")
    print("seconds; 1st call: the first call of the compiled program; custom: custom calls in "
          "the compiled HLO; mosaic: Mosaic GPU kernels among them; unique: distinct kernel "
          "bodies (Mosaic / Triton).", flush=True)


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    bm.default_host_devices()  # before anything starts a backend: 8 ranks on CPU
    args = parse_args(argv)
    header = br.result_header(argv)
    path = br.result_path(args.out, header, OP, args.tag)
    jax_ep, why = bm.import_jax_ep()
    if jax_ep is None:
        raise SystemExit(f"jax_ep does not import: {why}")
    mesh = bm.make_mesh(args.ranks)
    if args.experts % mesh.shape[bm.AXIS]:
        raise SystemExit(f"--experts {args.experts} is not a multiple of "
                         f"{mesh.shape[bm.AXIS]} ranks")
    log(f"[compile] {mesh.shape[bm.AXIS]} x {jax.devices()[0].device_kind} "
        f"({jax.default_backend()}), cases {','.join(args.cases)}")
    plan = []
    if "flax" in args.cases:
        plan.append(("flax_train_step", None, lambda: flax_case(args)))
    if "moe_stack" in args.cases:
        plan.append(("moe_stack_unrolled", args.layers,
                     lambda: stack_case(args, mesh, jax_ep, scan=False)))
        if args.scan:
            plan.append(("moe_stack_scan", args.layers,
                         lambda: stack_case(args, mesh, jax_ep, scan=True)))
    records, errors = [], []
    for case, layers, build in plan:
        buf = None
        try:
            jitted, call_args, fields, buf = build()
            rec = {"op": OP, "case": case, "layers": fields.pop("layers", layers),
                   **measure(jitted, call_args, args.run), **fields}
            records.append(rec)
            log(f"  {case:20s} lower {rec['lower_s']:.2f} s, compile {rec['compile_s']:.2f} s, "
                f"{rec['num_custom_calls']} custom calls ({rec['num_mosaic_kernels']} Mosaic GPU, "
                f"{rec['unique_kernels']} distinct kernels), {rec['num_fusions']} fusions")
        except Exception as e:  # noqa: BLE001 - one case's failure is its record
            msg = f"{type(e).__name__}: {e}".replace("\n", " ")[:500]
            errors.append({"op": OP, "case": case, "layers": layers, "error": msg})
            log(f"  {case:20s} ERROR {msg}")
        finally:
            if buf is not None:
                buf.close()
            jitted = call_args = None  # this case's inputs go before the next case's come
        if bm.is_reporter():
            br.write_json(path, dict(header, partial=True, results=records, errors=errors))
    if not bm.is_reporter():
        return
    br.write_json(path, dict(header, results=records, errors=errors))
    log(f"\n[compile] wrote {path}")
    print_table(records, errors)


if __name__ == "__main__":
    main()
