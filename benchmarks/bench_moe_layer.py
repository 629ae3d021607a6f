"""MoE layer (forward + backward) and its expert GEMMs alone, per expert-matmul implementation.

    python benchmarks/bench_moe_layer.py [--quick] [--matmul tiled,ragged_dot,tokamax,...]
        [--sections experts,gemms,products,layer] [--impls jax_ep,all_to_all,ragged_all_to_all]
        [--max-minutes 2] [--out DIR]

One expert-parallel SwiGLU MoE layer per rank, with the router's top-k given as input (uniform
random scores, seeded) and the SAME local expert computation for every implementation:
``jax_ep.moe.permute`` -> ``jax_ep.moe.swiglu_experts`` -> ``jax_ep.moe.unpermute``, whose three
grouped matmuls (forward and both backward products) are ``--matmul`` (a comma-separated list,
each measured in turn): a name of ``jax_ep.moe.MATMULS`` (``auto``, ``tiled``, ``ragged_dot``,
``tokamax``, ``tokamax+mosaic``, ``mosaic``; see ``jax_ep.moe.grouped_gemm``) or a bench variant:
``ragged_dot+grouped_gemm`` / ``ragged_dot+fusion`` (``jax.lax.ragged_dot`` compiled with XLA's
experimental grouped-GEMM / ragged-dot-fusion flag) and, in the experts section only, ``dense``
(equal groups as one batched matmul: the ceiling a grouped GEMM can approach). A library matmul
whose library does not import or has no Hopper GPU is reported as unavailable (``skipped``), not
run. ``ragged_dot`` variants on GPUs (XLA may expand them densely: ~250 ms per layer step) run
with 1/2 steps, 2 repeats, and only in the sections and impls named by ``--ragged-dot-sections``
/ ``--ragged-dot-impls``. Sections:

- ``experts``: the expert GEMMs alone on one device: ``jax.value_and_grad`` of
  ``sum(swiglu_experts(x_sorted, group_sizes, w_gate, w_up, w_down) * cotangent)`` w.r.t. the
  rows and the weights (``--gate-up fused``, the default: gate and up as one ``[E, H, 2F]``
  weight, ``w_up=None``; ``split``: two), at one rank's shapes (``E_loc = E / R`` experts,
  ``T*K`` used rows split over them multinomially (uniform), ``C * min(K, E_loc)`` rows in all
  as in the layer).
- ``gemms``: the six grouped GEMMs of one such step and nothing else (library matmuls only):
  forward, dx and dw of the gate / up product (``[N, H] x [E_loc, H, 2F]``) and of the down
  product (``[N, F] x [E_loc, F, H]``), on operands of the step's shapes prepared outside it
  (the SwiGLU, its masks and the loss are what ``experts`` adds).
- ``products``: each library product alone (``forward``, ``dx``, ``dw``) at the gate / up shape
  (``[N, H] x [E_loc, H, 2F]``, or ``[E_loc, H, F]`` with ``--gate-up split``) and the down
  shape (``[N, F] x [E_loc, F, H]``); with ``--sweep``, at each of them, every tile config of
  ``SWEEP_CONFIGS``.
- ``layer``: the whole layer step, for each implementation (impl):

- ``jax_ep``: ``jax_ep.moe.moe_ffn`` with a ``Buffer(backend="cuda")`` on GPUs, the reference
  backend (``"reference"``) elsewhere (``report_errors=False``: no host callback in timed programs);
- ``all_to_all``: ``bench_peers.AllToAllPeer`` (capacity-padded ``jax.lax.all_to_all``; each rank
  receives ``[R*T, H]`` rows, local ids -1 where not local);
- ``ragged_all_to_all``: ``bench_peers.RaggedAllToAllPeer`` (MaxText pattern; GPU only, skipped
  with a message elsewhere: XLA:CPU has no ``ragged_all_to_all``).

TFLOP/s count the useful expert-GEMM work only: ``18 * T * K * H * F`` per rank per step (three
matmuls of ``2 * H * F`` per (token, expert) pair forward, twice that backward), whatever a
matmul computes on top (padding rows, dense expansion); the products count ``2 * rows * K * M``.

Timed layer step: ``jax.value_and_grad`` of ``loss = sum(out * cotangent)`` w.r.t. ``x [T, H]``
and the rank's three expert weights ``[E_loc, H, F]``, ``[E_loc, H, F]``, ``[E_loc, F, H]`` (bf16,
``E_loc = E / R``). GPU time per step with bench_timing's unrolled N_short / N_long difference
(distinct inputs per iteration; see README.md). Before timing a layer (always with ``--quick``,
else with ``--check``) its forward output is compared with the jax_ep reference backend's forward
with the tiled matmul on the same inputs (bf16 tolerance), so every row computes the same
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

import bench_inputs as bi
import bench_mesh as bm
import bench_peers as bp
import bench_records as br
import bench_timing as bt
import jax
import jax.numpy as jnp
import numpy as np

OP = "moe_layer_fwd_bwd"
EXPERTS_OP = "expert_gemms_fwd_bwd"
GEMMS_OP = "expert_gemm_products_fwd_bwd"
PRODUCT_OP = "expert_gemm_product"
DTYPE = "bf16"
IMPLS = ("jax_ep", "all_to_all", "ragged_all_to_all")
SECTIONS = ("experts", "gemms", "products", "layer")
# Bench-only matmuls: jax.lax.ragged_dot compiled with an experimental XLA:GPU option, and the
# dense ceiling (experts section only).
XLA_VARIANTS = {
    "ragged_dot+grouped_gemm": {"xla_gpu_experimental_use_ragged_dot_grouped_gemm": True},
    "ragged_dot+fusion": {"xla_gpu_experimental_use_ragged_dot_fusion": True},
}
DENSE = "dense"
PEER_IMPLS = IMPLS[1:]
# Bounded runs of the ragged_dot variants on GPUs (XLA:GPU may expand them into dense matmuls
# over every local expert, ~250 ms per layer step).
SLOW = {"n_short": 1, "n_long": 2, "repeats": 2, "warmup": 1}
DEFAULTS = {"tokens": 4096, "hidden": 2048, "ffn": 1024, "experts": 64, "topk": 8,
            "n_short": 2, "n_long": 6, "repeats": 10, "warmup": 2, "max_minutes": 2.0}
QUICK = {"tokens": 64, "hidden": 256, "ffn": 128, "experts": 16, "topk": 2,
         "n_short": 1, "n_long": 2, "repeats": 3, "warmup": 1, "max_minutes": None}
# How the gate and up weights are held (jax_ep.moe.swiglu_experts): one [E, H, 2F] weight, or two.
GATE_UP = ("fused", "split")
# bf16 tolerance of the forward check: |got - want| <= ATOL * max|want| + RTOL * |want|.
RTOL, ATOL = 2e-2, 2e-2


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="tiny shapes (T=64, H=256, F=128, E=16, top-2), few iterations, forward "
                        "check on: for CPU with 8 host devices")
    br.add_out_argument(p)
    bi.add_shape_arguments(p, DEFAULTS)
    p.add_argument("--impls", type=_names, default=IMPLS,
                   help=f"comma-separated subset of {','.join(IMPLS)}")
    p.add_argument("--matmul", type=_names, default=None,
                   help="comma-separated expert matmuls, each measured in turn (default: auto)")
    p.add_argument("--sections", type=_names, default=SECTIONS,
                   help=f"comma-separated subset of {','.join(SECTIONS)}")
    p.add_argument("--peers-with", type=_names, default=None,
                   help="run all_to_all / ragged_all_to_all only with these matmuls (default: "
                        "every --matmul)")
    p.add_argument("--ragged-dot-sections", type=_names, default=("experts", "layer"),
                   help="sections the ragged_dot variants run in on GPUs (default experts,layer)")
    p.add_argument("--ragged-dot-impls", type=_names, default=("jax_ep",),
                   help="impls the ragged_dot variants run with on GPUs (default jax_ep)")
    p.add_argument("--check", action="store_true",
                   help="compare each impl's forward with the jax_ep reference (on with --quick)")
    p.add_argument("--n-short", type=int, help="steps of the short program (default 2)")
    p.add_argument("--n-long", type=int, help="steps of the long program (default 6)")
    p.add_argument("--repeats", type=int, help="timed runs of each program (default 10)")
    p.add_argument("--warmup", type=int, help="untimed runs of each program first (default 2)")
    p.add_argument("--max-minutes", type=float,
                   help="start no new measurement after this many minutes (default 2; none with "
                        "--quick); results so far are written and the table printed")
    p.add_argument("--tag", help="file name <machine>-<date>-moe_layer-<tag>.json")
    br.add_note_argument(p)
    p.add_argument("--sweep", action="store_true",
                   help="products section: try every tile config of SWEEP_CONFIGS per library "
                        "product and shape (records carry their config)")
    p.add_argument("--gate-up", choices=GATE_UP, default="fused",
                   help="experts and layer sections: gate and up as one [E, H, 2F] weight "
                        "(fused, default: what the Flax example stores) or two (split)")
    p.add_argument("--seed", type=int, default=0, help="seed of the routing and inputs")
    args = p.parse_args(argv)
    bi.fill_defaults(args, DEFAULTS, QUICK)
    args.check = args.check or args.quick
    jax_ep, _ = bm.import_jax_ep()
    if jax_ep is not None and not hasattr(jax_ep.moe, "grouped_gemm"):
        p.error(f"{jax_ep.__file__} predates jax_ep.moe.grouped_gemm: reinstall jax_ep")
    known = (jax_ep.moe.MATMULS if jax_ep is not None else ("tiled", "ragged_dot"))
    known = tuple(known) + tuple(XLA_VARIANTS) + (DENSE,)
    args.matmul = args.matmul or ("auto" if jax_ep is not None else "tiled",)
    bad = [m for m in args.matmul + (args.peers_with or ()) if m not in known]
    if bad:
        p.error(f"unknown matmul {bad}: expected some of {','.join(known)}")
    args.peers_with = args.peers_with or args.matmul
    bad = [i for i in args.impls if i not in IMPLS] + [
        s for s in args.sections + args.ragged_dot_sections if s not in SECTIONS]
    if bad:
        p.error(f"unknown impl or section {bad}")
    if args.n_long <= args.n_short or args.n_short < 1:
        p.error("need 1 <= --n-short < --n-long")
    return args


def _names(text):
    return tuple(n for n in text.split(",") if n)


def log(msg):
    print(msg, flush=True)


def sig(value, digits=6):
    return float(f"{value:.{digits}g}")


# ----------------------------------------------------------------------------- inputs


class Inputs:
    """Global inputs, sharded along "ep" on axis 0 (per rank: its own block).

    ``sets[i] = (x [R*T, H] bf16, topk_idx [R*T, K] int32, topk_weights [R*T, K] f32,
    cotangent [R*T, H] bf16)``, one per step of the long program; ``weights`` =
    ``(w_gate [E, H, F], w_up [E, H, F], w_down [E, F, H])`` bf16, or with ``--gate-up fused``
    ``(w_gate_up [E, H, 2F], w_down)`` (rank r holds experts ``[r*E_loc, (r+1)*E_loc)``),
    scaled so that the layer output is O(1).
    """

    def __init__(self, mesh, args):
        num_ranks = mesh.shape[bm.AXIS]
        rows = num_ranks * args.tokens
        seed = args.seed * 1_000_003
        self.sets = []
        for i in range(args.n_long):
            idx, w = bi.random_routing(mesh, seed + i, args.tokens, args.experts, args.topk)
            x = bi.random_rows(mesh, seed + 1000 + i, (rows, args.hidden))
            ct = bi.random_rows(mesh, seed + 2000 + i, (rows, args.hidden))
            self.sets.append((x, idx, w, ct))
        e, h, f = args.experts, args.hidden, args.ffn

        def make(key):
            k1, k2, k3 = jax.random.split(key, 3)
            normal = jax.random.normal
            return held_as(args.gate_up, ((normal(k1, (e, h, f)) * h**-0.5).astype(jnp.bfloat16),
                                          (normal(k2, (e, h, f)) * h**-0.5).astype(jnp.bfloat16),
                                          (normal(k3, (e, f, h)) * f**-0.5).astype(jnp.bfloat16)))

        shard = bm.sharded(mesh)
        count = 2 if args.gate_up == "fused" else 3
        self.weights = jax.block_until_ready(
            jax.jit(make, out_shardings=(shard,) * count)(jax.random.key(seed + 3000)))


def held_as(gate_up, weights):
    """``(w_gate, w_up, w_down)`` as ``--gate-up`` holds them: ``(w_gate_up [E, H, 2F], w_down)``
    for fused, unchanged for split."""
    if gate_up == "split":
        return tuple(weights)
    w_gate, w_up, w_down = weights
    return jnp.concatenate([w_gate, w_up], axis=2), w_down


def swiglu_weights(weights):
    """Held weights as ``swiglu_experts`` / ``moe_ffn`` take them: ``(w_gate, w_up or None,
    w_down)``."""
    return tuple(weights) if len(weights) == 3 else (weights[0], None, weights[1])


# ----------------------------------------------------------------------------- the layers


def expert_block(recv_x, recv_idx, recv_w, weights, matmul):
    """The local expert computation every implementation shares (as in ``jax_ep.moe.moe_ffn``).

    ``recv_x [C, H]``, ``recv_idx [C, K]`` local ids (-1: not here), ``recv_w [C, K]`` f32 ->
    ``[C, H]`` weighted expert outputs in ``recv_x``'s dtype; ``weights`` as ``Inputs`` holds
    them; ``matmul`` as ``--matmul``.
    """
    from jax_ep import moe

    num_local, num_topk = weights[0].shape[0], recv_idx.shape[1]
    num_rows = recv_x.shape[0] * min(num_topk, num_local)  # lossless: ids of a row are distinct
    x_sorted, group_sizes, state = moe.permute(recv_x, recv_idx, num_local, num_rows=num_rows)
    y_sorted = moe.swiglu_experts(x_sorted, group_sizes, *swiglu_weights(weights), matmul=matmul)
    return moe.unpermute(y_sorted, state, recv_w).astype(recv_x.dtype)


def make_layer(impl, num_ranks, experts, topk, buf=None, matmul=None):
    """Per-rank forward ``layer(x, topk_idx, topk_weights, *weights) -> [T, H]`` (``weights``
    as ``Inputs`` holds them).

    ``matmul``: the expert matmul (``--matmul``; None: ``jax_ep.moe.DEFAULT_MATMUL``), the same
    for every impl.
    """
    from jax_ep import moe

    matmul = moe.DEFAULT_MATMUL if matmul is None else matmul
    if impl == "jax_ep":
        def layer(x, idx, w, *weights):
            return moe.moe_ffn(buf, x, idx, w, *swiglu_weights(weights), matmul=matmul)

        return layer
    peer = bp.PEER_CLASSES[impl](num_ranks, experts, topk)

    def layer(x, idx, w, *weights):
        recv_x, recv_idx, recv_w = peer.dispatch([x], idx, w)
        y = expert_block(recv_x, recv_idx, recv_w, weights, matmul)
        return peer.combine(y, peer.plan(idx))

    return layer


def fwd_bwd(layer):
    """``step(weights, x, idx, w, ct) -> (loss, (dx, *dweights))`` per rank."""

    def step(weights, x, idx, w, ct):
        def loss_fn(x, *weights):
            out = layer(x, idx, w, *weights)
            return jnp.sum(out.astype(jnp.float32) * ct.astype(jnp.float32))

        return jax.value_and_grad(loss_fn, argnums=tuple(range(1 + len(weights))))(x, *weights)

    return step


def forward(mesh, layer, inputs, k=0):
    """Global forward output ``[R*T, H]`` of set ``k`` (a host float32 array)."""
    x, idx, w, _ = inputs.sets[k]

    def fn(x, idx, w, *weights):
        return layer(x, idx, w, *weights)

    out = bt.shard_mapped(mesh, fn, 3 + len(inputs.weights))(x, idx, w, *inputs.weights)
    return np.asarray(out.astype(jnp.float32))


def compare(got, want):
    """Max abs error and whether ``got`` is within the bf16 tolerance of ``want``."""
    err = np.abs(got - want)
    bound = ATOL * max(float(np.max(np.abs(want))), 1e-6) + RTOL * np.abs(want)
    return float(np.max(err)), bool(np.all(err <= bound) and np.all(np.isfinite(got)))


# ----------------------------------------------------------------------------- expert GEMMs


def base_matmul(matmul):
    """The jax_ep.moe matmul a bench matmul runs (XLA variants: ragged_dot)."""
    return "ragged_dot" if matmul in XLA_VARIANTS else matmul


def library_kernels(matmul):
    """The libraries a matmul's kernels come from (empty for XLA matmuls)."""
    from jax_ep.moe import grouped_gemm

    kernels = grouped_gemm.LIBRARY_MATMULS.get(matmul)
    return sorted({kernels.forward, kernels.dx, kernels.dw}) if kernels else []


def unavailable(matmul):
    """Why ``matmul`` cannot run here, or None."""
    from jax_ep.moe import grouped_gemm

    if matmul in XLA_VARIANTS and not bm.on_gpu():
        return f"{matmul}: an XLA:GPU option, no GPU ({jax.default_backend()})"
    for library in library_kernels(matmul):
        ok, why = grouped_gemm.library_status(library)
        if not ok:
            return f"unavailable: {library}: {why}"
    return None


def expert_shapes(args, num_ranks):
    """``(E_loc, rows N, used rows)`` of one rank's expert block in the layer: ``N = C *
    min(K, E_loc)`` sorted rows (``C = R * T``, the Buffer's default capacity), ``T * K`` of them
    used in expectation (uniform routing)."""
    e_loc = args.experts // num_ranks
    return e_loc, num_ranks * args.tokens * min(args.topk, e_loc), args.tokens * args.topk


class ExpertInputs:
    """One rank's expert block on one device, one set per step of the long program.

    ``sets[i] = (x [N, H] bf16 (rows past the used ones zero), group_sizes [E_loc] int32
    (multinomial split of the used rows), cotangent [N, H] bf16)``; ``weights`` as ``Inputs``
    but ``E_loc`` experts.
    """

    def __init__(self, args, num_ranks, n_sets):
        self.e_loc, self.rows, self.used = expert_shapes(args, num_ranks)
        rng = np.random.default_rng(args.seed + 17)
        h, f = args.hidden, args.ffn
        key = jax.random.key(args.seed + 4000)

        def rows(key, used):
            x = jax.random.normal(key, (self.rows, h), jnp.float32)
            return jnp.where(jnp.arange(self.rows)[:, None] < used, x, 0).astype(jnp.bfloat16)

        self.sets = []
        for i in range(n_sets):
            sizes = rng.multinomial(self.used, np.full(self.e_loc, 1.0 / self.e_loc))
            k1, k2 = jax.random.split(jax.random.fold_in(key, i))
            self.sets.append((rows(k1, self.used), jnp.asarray(sizes, jnp.int32),
                              jax.random.normal(k2, (self.rows, h)).astype(jnp.bfloat16)))
        k1, k2, k3 = jax.random.split(jax.random.fold_in(key, 10_000), 3)
        normal = jax.random.normal
        self.weights = ((normal(k1, (self.e_loc, h, f)) * h**-0.5).astype(jnp.bfloat16),
                        (normal(k2, (self.e_loc, h, f)) * h**-0.5).astype(jnp.bfloat16),
                        (normal(k3, (self.e_loc, f, h)) * f**-0.5).astype(jnp.bfloat16))
        # The experts section's weights, as --gate-up holds them (products use the split ones).
        self.held = held_as(args.gate_up, self.weights)
        jax.block_until_ready((self.sets, self.weights, self.held))


def dense_experts(x, w_gate, w_up, w_down, used):
    """The dense ceiling: the first ``used`` rows (rounded down to equal groups) as one batched
    SwiGLU over ``E_loc`` groups of equal size (cuBLAS batched GEMMs)."""
    e_loc = w_gate.shape[0]
    rows = used // e_loc * e_loc
    xb = x[:rows].reshape(e_loc, rows // e_loc, x.shape[1])
    gate = jnp.einsum("gth,ghf->gtf", xb, w_gate, preferred_element_type=jnp.float32)
    up = jnp.einsum("gth,ghf->gtf", xb, w_up, preferred_element_type=jnp.float32)
    hidden = (jax.nn.silu(gate) * up).astype(x.dtype)
    y = jnp.einsum("gtf,gfh->gth", hidden, w_down).reshape(rows, x.shape[1])
    return jnp.pad(y, ((0, x.shape[0] - rows), (0, 0)))


def experts_step(matmul, used):
    """``step(weights, x, sizes, ct) -> (loss, grads)``: the expert GEMMs alone, fwd + bwd."""
    from jax_ep import moe

    def step(weights, x, sizes, ct):
        def loss(x, *weights):
            w_gate, w_up, w_down = swiglu_weights(weights)
            if matmul == DENSE:
                if w_up is None:  # the dense ceiling multiplies gate and up apart
                    w_gate, w_up = jnp.split(w_gate, 2, axis=2)
                y = dense_experts(x, w_gate, w_up, w_down, used)
            else:
                y = moe.swiglu_experts(x, sizes, w_gate, w_up, w_down,
                                       matmul=base_matmul(matmul))
            return jnp.sum(y.astype(jnp.float32) * ct.astype(jnp.float32))

        return jax.value_and_grad(loss, argnums=tuple(range(1 + len(weights))))(x, *weights)

    return step


def gemms_step(matmul):
    """``step(weights, x, sizes, dy, h, dgate_up) -> products``: the six grouped GEMMs of one
    forward + backward step of ``swiglu_experts`` with gate and up in one weight, through the
    kernels library matmul ``matmul`` names, on operands of the step's shapes."""
    from jax_ep.moe import grouped_gemm

    kernels = grouped_gemm.LIBRARY_MATMULS[matmul]

    def step(weights, x, sizes, dy, h, dgate_up):
        w_gate_up, w_down = weights

        def product(library, name, a, b):
            return grouped_gemm._product(library, name, a, b, sizes)

        return (product(kernels.forward, "forward", x, w_gate_up),
                product(kernels.forward, "forward", h, w_down),
                product(kernels.dx, "dx", dy, w_down),
                product(kernels.dw, "dw", h, dy),
                product(kernels.dx, "dx", dgate_up, w_gate_up),
                product(kernels.dw, "dw", x, dgate_up))

    return step


def product_step(library, product):
    from jax_ep.moe import grouped_gemm

    def step(_, a, b, sizes):
        return grouped_gemm._product(library, product, a, b, sizes)

    return step


# The products' shapes per --gate-up: the gate and up weights as one [E_loc, H, 2F] weight
# (gate_up) or the gate's alone (gate), then the down weight.
PRODUCT_SHAPES = {"fused": ("gate_up", "down"), "split": ("gate", "down")}


def product_weight(inputs, shape):
    """The expert weight ``[E_loc, K, M]`` of a product shape."""
    w_gate, w_up, w_down = inputs.weights
    return {"gate": w_gate, "gate_up": jnp.concatenate([w_gate, w_up], axis=2),
            "down": w_down}[shape]


def width(a, n):
    """``a``'s columns repeated / cut to ``n``."""
    return jnp.tile(a, (1, -(-n // a.shape[1])))[:, :n]


def product_sets(inputs, shape, product, n_sets):
    """Operands of one product per step at a ``PRODUCT_SHAPES`` shape."""
    w = product_weight(inputs, shape)
    k, m = w.shape[1], w.shape[2]
    sets = []
    for i in range(n_sets):
        x, sizes, ct = inputs.sets[i]
        a, dy = width(x, k), width(ct, m)
        b = (w * (1 + i / 64)).astype(w.dtype)  # distinct operands per step
        sets.append({"forward": (a, b, sizes), "dx": (dy, b, sizes), "dw": (a, dy, sizes)}[product])
    return sets, k, m


# ----------------------------------------------------------------------------- timing


def iterations(args, matmul):
    """``(n_short, n_long, repeats, warmup)``: bounded for ragged_dot variants on GPUs."""
    if bm.on_gpu() and base_matmul(matmul) == "ragged_dot":
        return SLOW["n_short"], SLOW["n_long"], SLOW["repeats"], SLOW["warmup"]
    return args.n_short, args.n_long, args.repeats, args.warmup


def measure(mesh, args, step, fixed, sets, pool, matmul):
    """GPU time per step of ``step(prologue(*fixed), *sets[i])`` (unrolled N_short/N_long)."""
    n_short, n_long, repeats, warmup = iterations(args, matmul)
    options = XLA_VARIANTS.get(matmul)

    def prologue(*fixed):
        return fixed

    call_args = (tuple(fixed), tuple(tuple(s) for s in sets[:n_long]))
    start = time.perf_counter()
    lowered = [bt.repeated_program(mesh, step, n, prologue).lower(*call_args)
               for n in (n_short, n_long)]
    # The two compile in parallel.
    short, long = pool.map(lambda low: low.compile(options) if options else low.compile(),
                           lowered)
    compile_s = time.perf_counter() - start
    per_step_us, extra = bt.time_per_op_us(short, long, call_args, n_short, n_long, repeats,
                                           warmup)
    if per_step_us <= 0:
        raise RuntimeError(f"non-positive time {per_step_us:.3f} us (noise larger than the "
                           f"step; raise --n-long/--repeats): {extra}")
    return per_step_us, dict(extra, compile_s=round(compile_s, 2), n_short=n_short,
                             n_long=n_long, repeats=repeats)


def shape_fields(args, num_ranks):
    return {"ranks": num_ranks, "tokens": args.tokens, "hidden": args.hidden, "ffn": args.ffn,
            "topk": args.topk, "experts": args.experts}


def layer_flops(args):
    # Model FLOPs per rank per step: T*K (token, expert) pairs, 3 matmuls of 2*H*F each forward,
    # twice that backward (the useful work, whatever the matmul computes on top of it).
    return 18.0 * args.tokens * args.topk * args.hidden * args.ffn


def make_record(op, args, num_ranks, time_us, flops, extra, **fields):
    rec = {"op": op, **fields, "dtype": DTYPE, **shape_fields(args, num_ranks),
           "time_us": sig(time_us), "tflops_per_rank": sig(flops / (time_us * 1e-6) / 1e12)}
    rec.update({k: sig(v) if isinstance(v, float) else v for k, v in extra.items()})
    return rec


def error_row(op, exc, args, num_ranks, **fields):
    msg = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
    return {"op": op, **fields, "dtype": DTYPE, "ranks": num_ranks, "tokens": args.tokens,
            "error": msg.strip().replace("\n", " ")[:500]}


def add_ratios(records):
    """Layer records: ``speedup_vs_best_peer`` = fastest peer's time with the same matmul / this
    time (> 1: faster than every peer)."""
    layer = [r for r in records if r["op"] == OP]
    for r in layer:
        peers = [p for p in layer if p["impl"] in PEER_IMPLS and p["matmul"] == r["matmul"]]
        best = min(peers, key=lambda p: p["time_us"]) if peers else None
        r["best_peer"] = best["impl"] if best else None
        r["speedup_vs_best_peer"] = sig(best["time_us"] / r["time_us"], 4) if best else None


def sort_key(r):
    ops = (EXPERTS_OP, PRODUCT_OP, OP)
    return (ops.index(r["op"]) if r["op"] in ops else len(ops),
            IMPLS.index(r["impl"]) if r.get("impl") in IMPLS else len(IMPLS))


def print_table(records, errors, skipped, matmuls, impls):
    products = [r for r in records if r["op"] == PRODUCT_OP]
    if products:
        print(f"\n{'library':8s} {'product':8s} {'shape':5s} {'rows':>6s} {'K':>5s} {'M':>5s} "
              f"{'time_us':>9s} {'TFLOP/s':>8s}")
        for r in products:
            print(f"{r['library']:8s} {r['product']:8s} {r['shape']:5s} {r['rows_used']:>6d} "
                  f"{r['k']:>5d} {r['m']:>5d} {r['time_us']:9.1f} {r['tflops_per_rank']:8.1f}")
    for r in errors:
        print(f"ERROR {r['op']} {r.get('matmul', '')} {r.get('impl', '')} "
              f"{r.get('library', '')} {r.get('product', '')}: {r['error'][:200]}")
    head = (f"{'matmul':24s} {'gemms':>17s} {'experts':>17s}"
            + "".join(f" {i:>17s}" for i in impls))
    print("\nTFLOP/s per GPU (useful expert-GEMM work; time_us per step in brackets)")
    print(head)
    print("-" * len(head))

    def cell(rec):
        if rec is None:
            return "-"
        return f"{rec['tflops_per_rank']:.1f} ({rec['time_us'] / 1e3:.2f}ms)"

    for m in matmuls:
        if m in skipped:
            print(f"{m:24s} {skipped[m][:100]}")
            continue
        exp = next((r for r in records if r["op"] == EXPERTS_OP and r["matmul"] == m), None)
        gemms = next((r for r in records if r["op"] == GEMMS_OP and r["matmul"] == m), None)
        cells = [next((r for r in records if r["op"] == OP and r["matmul"] == m
                       and r["impl"] == i), None) for i in impls]
        resolved = next((r.get("resolved") for r in records if r.get("matmul") == m), None)
        name = f"{m}->{resolved}" if resolved and resolved != m else m
        print(f"{name:24s} {cell(gemms):>17s} {cell(exp):>17s}"
              + "".join(f" {cell(c):>17s}" for c in cells))
    print(f"{OP}: forward + backward per step per rank (bf16); gemms = {GEMMS_OP} (the six "
          f"grouped GEMMs of a step alone); experts = {EXPERTS_OP} (swiglu_experts alone, one "
          f"device); columns after it = whole layer per impl; x best peer in the JSON.",
          flush=True)


# ----------------------------------------------------------------------------- running


class Runner:
    """Runs every requested (section, matmul, impl) in its own try; records / errors / skips."""

    def __init__(self, args, mesh, deadline, checkpoint):
        self.args, self.mesh, self.deadline, self.checkpoint = args, mesh, deadline, checkpoint
        self.num_ranks = mesh.shape[bm.AXIS]
        self.records, self.errors, self.skipped, self.checks = [], [], {}, {}
        self.pool = concurrent.futures.ThreadPoolExecutor(2)
        self.t_start = time.perf_counter()

    def out_of_time(self, what):
        if self.deadline is not None and time.perf_counter() > self.deadline:
            self.skipped[what] = f"--max-minutes {self.args.max_minutes} reached"
            log(f"[skip] {what}: {self.skipped[what]}")
            return True
        return False

    def attempt(self, what, op, fields, fn):
        """``fn() -> (record or None)``; an exception becomes an error row."""
        if self.out_of_time(what):
            return
        try:
            rec = fn()
            if rec is not None:
                self.records.append(rec)
                log(f"  {what:52s} {rec['time_us']:11.1f} us  {rec['tflops_per_rank']:7.1f} "
                    f"TFLOP/s (compile {rec['compile_s']:.1f} s, "
                    f"{time.perf_counter() - self.t_start:.0f} s so far)")
        except Exception as e:  # noqa: BLE001 - an error row, not a crash
            self.errors.append(error_row(op, e, self.args, self.num_ranks, **fields))
            log(f"  {what:52s} ERROR {self.errors[-1]['error']}")
            if os.environ.get("BENCH_EP_TRACEBACK"):
                traceback.print_exc()
        finally:
            gc.collect()
        self.checkpoint(self.records, self.errors, self.skipped, self.checks)

    def runs_in(self, matmul, section, impl=None):
        if not (bm.on_gpu() and base_matmul(matmul) == "ragged_dot"):
            return True
        return section in self.args.ragged_dot_sections and (
            impl is None or impl in self.args.ragged_dot_impls)


def resolved_name(matmul):
    from jax_ep.moe import grouped_gemm

    if matmul == "auto":
        return grouped_gemm.resolve_matmul("auto", jnp.bfloat16)
    return matmul


def run_experts(r, matmuls):
    args = r.args
    one = bm.make_mesh(1)
    inputs = ExpertInputs(args, r.num_ranks, max(args.n_long, SLOW["n_long"]))
    for m in matmuls:
        if not r.runs_in(m, "experts"):
            continue

        def one_matmul(m=m):
            used = inputs.used if m != DENSE else inputs.used // inputs.e_loc * inputs.e_loc
            time_us, extra = measure(one, args, experts_step(m, inputs.used), inputs.held,
                                     inputs.sets, r.pool, m)
            flops = 18.0 * used * args.hidden * args.ffn
            return make_record(EXPERTS_OP, args, r.num_ranks, time_us, flops, extra, matmul=m,
                               resolved=resolved_name(m), gate_up=args.gate_up,
                               experts_local=inputs.e_loc, rows=inputs.rows, rows_used=used)

        r.attempt(f"experts {m}", EXPERTS_OP, {"matmul": m}, one_matmul)
    return inputs


# --sweep: tile configurations tried per library and kind ("rows": forward and dx, "contract":
# dw) at each product shape; each is a full replacement of grouped_gemm's config for that kind.
SWEEP_CONFIGS = {
    ("tokamax", "rows"): [
        dict(block_m=128, block_n=64, block_k=128, num_stages=4, split_k=1, persistent=True,
             grid_minor_dim=mg, grid_tile_width=w) for mg, w in ((1, 4), (1, 8), (0, 1), (0, 4))
    ] + [dict(block_m=128, block_n=64, block_k=64, num_stages=6, split_k=1, persistent=True,
              grid_minor_dim=1, grid_tile_width=4),
         dict(block_m=64, block_n=64, block_k=128, num_stages=4, split_k=1, persistent=True,
              grid_minor_dim=1, grid_tile_width=4),
         dict(block_m=128, block_n=64, block_k=128, num_stages=3, split_k=1, persistent=False,
              grid_minor_dim=0, grid_tile_width=1)],
    ("tokamax", "contract"): [
        dict(block_m=bm, block_n=64, block_k=bk, num_stages=st, split_k=1, persistent=False,
             grid_minor_dim=0, grid_tile_width=1)
        for bm, bk, st in ((128, 128, 4), (128, 128, 2), (64, 128, 4), (128, 64, 6))],
    ("mosaic", "rows"): [
        dict(block_m=bm, block_n=bn, block_k=bk, max_concurrent_steps=st, grid_block_n=g)
        for bm, bn, bk, st, g in ((128, 128, 64, 4, 4), (128, 128, 64, 5, 8),
                                  (128, 128, 64, 6, 8), (128, 128, 64, 5, 16),
                                  (128, 128, 128, 3, 8), (64, 256, 64, 4, 4),
                                  (64, 128, 64, 6, 8))],
    ("mosaic", "contract"): [
        dict(block_m=bm, block_n=bn, block_k=bk, max_concurrent_steps=st, grid_block_n=g)
        for bm, bn, bk, st, g in ((128, 128, 64, 4, 4), (128, 128, 64, 5, 8),
                                  (128, 128, 128, 3, 4), (128, 128, 128, 2, 8),
                                  (128, 128, 64, 4, 1), (128, 128, 64, 6, 2),
                                  (64, 128, 64, 6, 4))],
}


def run_gemms(r, matmuls, inputs):
    """The ``gemms`` section: the six products of a step, per library matmul."""
    from jax_ep.moe import grouped_gemm

    args = r.args
    one = bm.make_mesh(1)
    weights = held_as("fused", inputs.weights)
    sets = [(x, sizes, ct, width(x, args.ffn), width(ct, 2 * args.ffn))
            for x, sizes, ct in inputs.sets[:args.n_long]]
    for m in matmuls:
        resolved = resolved_name(m)
        if resolved not in grouped_gemm.LIBRARY_MATMULS:
            log(f"[skip] gemms {m}: {resolved} is not a library matmul")
            continue

        def one_matmul(m=m, resolved=resolved):
            time_us, extra = measure(one, args, gemms_step(resolved), weights, sets, r.pool, m)
            flops = 18.0 * inputs.used * args.hidden * args.ffn
            return make_record(GEMMS_OP, args, r.num_ranks, time_us, flops, extra, matmul=m,
                               resolved=resolved, experts_local=inputs.e_loc, rows=inputs.rows,
                               rows_used=inputs.used)

        r.attempt(f"gemms {m}", GEMMS_OP, {"matmul": m}, one_matmul)


def run_products(r, matmuls, inputs):
    args = r.args
    one = bm.make_mesh(1)
    libraries = sorted({lib for m in matmuls for lib in library_kernels(m)})
    from jax_ep.moe import grouped_gemm

    for library in libraries:
        configs = {"tokamax": grouped_gemm.TOKAMAX_CONFIGS,
                   "mosaic": grouped_gemm.MOSAIC_CONFIGS}[library]
        for shape in PRODUCT_SHAPES[args.gate_up]:
            for product in ("forward", "dx", "dw"):
                kind = "contract" if product == "dw" else "rows"
                tries = SWEEP_CONFIGS[(library, kind)] if args.sweep else [configs[kind]]
                for config in tries:
                    def one_product(library=library, shape=shape, product=product,
                                    kind=kind, config=config, configs=configs):
                        saved = configs[kind]
                        configs[kind] = config  # read when the kernels trace
                        try:
                            sets, k, m = product_sets(inputs, shape, product, args.n_long)
                            time_us, extra = measure(one, args, product_step(library, product),
                                                     (), sets, r.pool, library)
                        finally:
                            configs[kind] = saved
                        flops = 2.0 * inputs.used * k * m
                        return make_record(PRODUCT_OP, args, r.num_ranks, time_us, flops, extra,
                                           library=library, product=product, shape=shape,
                                           rows=inputs.rows, rows_used=inputs.used, k=k, m=m,
                                           groups=inputs.e_loc, config=config)

                    r.attempt(f"product {library} {product} {shape}"
                              + (f" {sorted(config.items())}"[:60] if args.sweep else ""),
                              PRODUCT_OP, {"library": library, "product": product,
                                           "shape": shape, "config": config}, one_product)


def run_layers(r, matmuls, impls):
    args, mesh, num_ranks = r.args, r.mesh, r.num_ranks
    jax_ep, _ = bm.import_jax_ep()
    backend = "cuda" if bm.on_gpu() else "reference"

    def buffer(kind):
        return jax_ep.Buffer(mesh, bm.AXIS, num_experts=args.experts, hidden=args.hidden,
                             max_tokens_per_rank=args.tokens, num_topk=args.topk,
                             dtype=jnp.bfloat16, low_latency=False, backend=kind,
                             report_errors=False)

    try:
        inputs = Inputs(mesh, args)
    except Exception as e:  # noqa: BLE001 - no inputs: every layer fails
        r.errors.append(error_row(OP, e, args, num_ranks))
        return
    want = None
    if args.check:
        try:
            if jax_ep is None:
                raise RuntimeError("no reference: jax_ep does not import")
            ref_buf = buffer("reference")
            want = forward(mesh, make_layer("jax_ep", num_ranks, args.experts, args.topk,
                                            ref_buf, "tiled"), inputs)
            ref_buf.close()
            log(f"[check] reference forward (reference backend, tiled): max |out| = "
                f"{np.max(np.abs(want)):.4g}")
        except Exception as e:  # noqa: BLE001
            r.errors.append(error_row(OP, f"forward check: reference failed: "
                                      f"{type(e).__name__}: {e}", args, num_ranks))
            return
    for m in matmuls:
        if m == DENSE:
            continue
        for impl in impls:
            if impl in PEER_IMPLS and m not in args.peers_with or not r.runs_in(m, "layer", impl):
                continue

            def one_layer(m=m, impl=impl):
                buf = buffer(backend) if impl == "jax_ep" else None
                try:
                    layer = make_layer(impl, num_ranks, args.experts, args.topk, buf,
                                       base_matmul(m))
                    if want is not None:
                        err, ok = compare(forward(mesh, layer, inputs), want)
                        r.checks[f"{impl}/{m}"] = {"max_abs_err": sig(err), "ok": ok}
                        log(f"[check] {impl:18s} {m:24s} forward vs reference: max abs err "
                            f"{err:.3g} {'ok' if ok else 'MISMATCH'}")
                        if not ok:
                            raise AssertionError(f"forward differs from the jax_ep reference "
                                                 f"(max abs err {err:.3g}, tolerance "
                                                 f"rtol={RTOL} atol={ATOL}*max)")
                    time_us, extra = measure(mesh, args, fwd_bwd(layer),
                                             inputs.weights, inputs.sets, r.pool, m)
                    if buf is not None:
                        extra["backend"] = buf.backend
                    return make_record(OP, args, num_ranks, time_us, layer_flops(args), extra,
                                       impl=impl, matmul=m, resolved=resolved_name(m),
                                       gate_up=args.gate_up)
                finally:
                    if buf is not None:
                        buf.close()

            r.attempt(f"layer {impl} {m}", OP, {"impl": impl, "matmul": m}, one_layer)


def run(args, mesh, deadline, checkpoint):
    """Returns ``(records, errors, skipped, checks)``; ``checkpoint`` is called after each run."""
    r = Runner(args, mesh, deadline, checkpoint)
    jax_ep, why = bm.import_jax_ep()
    impls = list(args.impls)
    if jax_ep is None:
        r.skipped["jax_ep"] = f"import jax_ep failed: {why}"
        impls.remove("jax_ep") if "jax_ep" in impls else None
    if not bm.on_gpu() and "ragged_all_to_all" in impls:
        r.skipped["ragged_all_to_all"] = (f"no GPU ({jax.default_backend()}): ragged_all_to_all "
                                          "does not run on XLA:CPU")
        impls.remove("ragged_all_to_all")
    matmuls = []
    for m in args.matmul:
        why_not = unavailable(m) if jax_ep is not None else "jax_ep does not import"
        if why_not:
            r.skipped[m] = why_not
        else:
            matmuls.append(m)
    for what, why_not in r.skipped.items():
        log(f"[skip] {what}: {why_not}")
    log(f"[bench] {r.num_ranks} x {jax.devices()[0].device_kind} ({jax.default_backend()}), "
        f"T={args.tokens} H={args.hidden} F={args.ffn} E={args.experts} top-{args.topk}, "
        f"matmuls {matmuls}, sections {list(args.sections)}, impls {impls}, "
        f"N = {args.n_short}/{args.n_long}, repeats {args.repeats}, "
        f"forward check {'on' if args.check else 'off'}")
    if jax_ep is not None:
        from jax_ep.moe import grouped_gemm

        log(f"[bench] matmul 'auto' -> {grouped_gemm.selection_report()}")
    # Order: experts, layer, then the products (a breakdown), so that --max-minutes cuts the
    # least needed first.
    inputs = None
    if jax_ep is not None and {"experts", "gemms", "products"} & set(args.sections):
        try:
            inputs = run_experts(r, matmuls if "experts" in args.sections else [])
        except Exception as e:  # noqa: BLE001 - e.g. out of memory for the inputs
            r.errors.append(error_row(EXPERTS_OP, e, args, r.num_ranks))
    if inputs is not None and "gemms" in args.sections:
        run_gemms(r, matmuls, inputs)
    if "layer" in args.sections:
        run_layers(r, matmuls, impls)
    if inputs is not None and "products" in args.sections:
        run_products(r, matmuls, inputs)
    r.pool.shutdown()
    return r.records, r.errors, r.skipped, r.checks


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    deadline = (time.perf_counter() + 60 * args.max_minutes) if args.max_minutes else None
    mesh = bm.make_mesh(args.ranks)
    num_ranks = mesh.shape[bm.AXIS]
    if args.experts % num_ranks:
        raise SystemExit(f"--experts {args.experts} is not a multiple of {num_ranks} ranks")
    header = br.result_header(argv, args.note, __file__)
    name = f"{header['machine']}-{header['date']}-moe_layer" + (
        f"-{args.tag}" if args.tag else "")
    path = os.path.join(args.out, name + ".json")
    method = {"n_short": args.n_short, "n_long": args.n_long, "repeats": args.repeats,
              "warmup": args.warmup, "loss": "sum(out * cotangent)",
              "grads": ["x", "w_gate_up", "w_down"] if args.gate_up == "fused"
              else ["x", "w_gate", "w_up", "w_down"], "gate_up": args.gate_up,
              "routing": "top-k of uniform scores",
              "matmuls": list(args.matmul), "sections": list(args.sections),
              "ragged_dot_on_gpu": dict(SLOW, sections=list(args.ragged_dot_sections),
                                        impls=list(args.ragged_dot_impls)),
              "flops": "18 * T * K * H * F per rank per step (useful expert-GEMM work)",
              "check_tolerance": {"rtol": RTOL, "atol_times_max": ATOL} if args.check else None}

    def payload(records, errors, skipped, checks, partial):
        records = sorted(records, key=sort_key)
        add_ratios(records)
        out = dict(header, results=records, errors=errors, skipped=skipped, checks=checks,
                   method=method)
        return dict(out, partial=True) if partial else out

    def checkpoint(*state):
        br.write_json(path, payload(*state, partial=True))

    records, errors, skipped, checks = run(args, mesh, deadline, checkpoint)
    final = payload(records, errors, skipped, checks, partial=False)
    br.write_json(path, final)
    log(f"\n[bench] wrote {path}")
    impls = [i for i in args.impls if i not in skipped]
    print_table(final["results"], errors, skipped, list(args.matmul), impls)


if __name__ == "__main__":
    main()
