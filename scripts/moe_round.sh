#!/usr/bin/env bash
# One GPU call for the MoE expert matmuls (~8-10 minutes; every step bounded by `timeout`; to
# fit a 10-minute call leave steps out, e.g. SKIP="products ragged peak"): run from the repo root
# on the GPU machine, with jax_ep already installed. Installs
# the carried wheels of .whl/ (tokamax and the dependencies the machine lacks) into /tmp/site,
# then runs, logs and JSON under $OUT:
#   env       jax-ep-env (its last line: the matmul that matmul="auto" picks, and why)
#   tests     pytest -m gpu tests/test_grouped_gemm.py (plain pytest: the installed jax_ep, with
#             its extension): every library matmul (tokamax, tokamax+mosaic, mosaic) against
#             float32 references, alone and in the MoE layer
#   profile   profile_moe_experts.py --matmul mosaic: where a step of the expert GEMMs goes
#             (kernel time per kernel, device span, wall), gate and up split and fused (~1 min)
#   bench     bench_moe_layer at the issue's shape (T=4096, H=2048, F=1024, E=64, top-8, bf16,
#             all GPUs, gate and up fused): the expert GEMMs alone and the whole layer step per
#             matmul, jax_ep with every matmul, all_to_all / ragged_all_to_all with
#             $PEER_MATMUL. Each Pallas program compiles in 14-21 s: BENCH_MINUTES (default 5)
#   products  bench_moe_layer: each library product (forward, dx, dw) alone, both shapes
#   sweep     only with SWEEP=1 (~6 more minutes): each library product at the gate/up and the
#             down shape with every tile config of bench_moe_layer.SWEEP_CONFIGS (records carry
#             their config)
#   ragged    bench_moe_layer: jax.lax.ragged_dot's expert GEMMs (XLA's experimental grouped-GEMM
#             option, then default XLA: ~250 ms a step) bounded to 1/2 steps, 2 repeats
#   peak      a dense bf16 matmul (16384 x 8192 x 8192): the GPU's ceiling
# and prints a short table last (TFLOP/s of useful expert-GEMM work per GPU; the bar at EP=1:
# expert GEMMs >= 450, layer step >= 300).
# Environment: OUT (default ./moe_out), MATMULS (bench's list), PEER_MATMUL, SKIP (step names to
# leave out, e.g. "ragged peak"), BENCH_ARGS (appended to every bench command, e.g. "--quick"
# for a CPU dry run).
set -uo pipefail
OUT="${OUT:-$PWD/moe_out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
MATMULS="${MATMULS:-mosaic,tokamax+mosaic,tiled,dense}"
PEER_MATMUL="${PEER_MATMUL:-mosaic}"
SKIP="${SKIP:-}"
BENCH_ARGS="${BENCH_ARGS:-}"
summary=()
step() {  # step NAME SECONDS CMD...: CMD under a timeout, output in $OUT/NAME.log
  local name=$1 limit=$2; shift 2
  [[ " $SKIP " == *" $name "* ]] && return
  local s; s=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  summary+=("$name rc=$rc $(( $(date +%s) - s ))s $(grep -E '[0-9]+ (passed|failed|skipped)' "$OUT/$name.log" | tail -1)")
}
if ls .whl/*.whl > /dev/null 2>&1; then
  step wheels 120 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
if command -v jax-ep-env > /dev/null; then step env 60 jax-ep-env; else step env 60 python3 -m jax_ep.env; fi
step tests 150 pytest -m gpu -q -p no:cacheprovider -rs tests/test_grouped_gemm.py
step profile 150 python3 benchmarks/profile_moe_experts.py --out "$OUT" --matmul mosaic
BENCH_MINUTES="${BENCH_MINUTES:-5}"
step bench "$(( ${BENCH_MINUTES%.*} * 60 + 120 ))" python3 benchmarks/bench_moe_layer.py \
  --out "$OUT" --tag matmuls --check --matmul "$MATMULS" --sections experts,gemms,layer \
  --peers-with "$PEER_MATMUL" --max-minutes "$BENCH_MINUTES" $BENCH_ARGS
step products 90 python3 benchmarks/bench_moe_layer.py --out "$OUT" --tag products \
  --matmul tokamax+mosaic --sections products --max-minutes 1.1 $BENCH_ARGS
[[ -n "${SWEEP:-}" ]] && step sweep 420 python3 benchmarks/bench_moe_layer.py --out "$OUT" \
  --tag sweep --matmul "$PEER_MATMUL" --sections products --sweep --max-minutes 6 $BENCH_ARGS
step ragged 80 python3 benchmarks/bench_moe_layer.py --out "$OUT" --tag ragged \
  --matmul ragged_dot+grouped_gemm,ragged_dot --sections experts --ragged-dot-sections experts \
  --max-minutes 0.8 $BENCH_ARGS
step peak 60 python3 - <<'EOF'
import time, jax, jax.numpy as jnp
m, k, n, reps = 16384, 8192, 8192, 8
a = jax.random.normal(jax.random.key(0), (m, k), jnp.bfloat16)
bs = [jax.random.normal(jax.random.key(i + 1), (k, n), jnp.bfloat16) for i in range(reps)]
f = jax.jit(lambda a, bs: [a @ b for b in bs])
jax.block_until_ready(f(a, bs))
times = []
for _ in range(5):
    t0 = time.perf_counter()
    jax.block_until_ready(f(a, bs))
    times.append(time.perf_counter() - t0)
print(f"dense bf16 matmul {m}x{k}x{n}: {reps * 2 * m * k * n / min(times) / 1e12:.0f} TFLOP/s")
EOF

printf '%s\n' "${summary[@]}"
grep -h "MoE expert matmul" "$OUT/env.log" 2>/dev/null
grep -hE "^(split|fused) " "$OUT/profile.log" 2>/dev/null
grep -h "TFLOP/s" "$OUT/peak.log" 2>/dev/null
grep -hE "^(FAILED|ERROR|SKIPPED)" "$OUT/tests.log" 2>/dev/null | cut -c1-200 | head -12
python3 - "$OUT" <<'EOF'
import glob, json, sys
rows, products, sweep, errors, ranks = {}, [], {}, [], None
for path in sorted(glob.glob(f"{sys.argv[1]}/*-moe_layer-*.json")):
    d = json.load(open(path))
    errors += [f"{e.get('op')} {e.get('matmul', e.get('library', ''))} {e.get('impl', '')}: "
               f"{e['error'][:150]}" for e in d.get("errors", [])]
    for m, why in d.get("skipped", {}).items():
        if m not in ("jax_ep", "all_to_all", "ragged_all_to_all"):
            rows.setdefault(m, {})["skipped"] = why
    for r in d["results"]:
        if r["op"] == "expert_gemm_product":
            if "-sweep" in path:  # the best config per (library, product, shape)
                key = (r["library"], r["product"], r["shape"])
                if key not in sweep or r["tflops_per_rank"] > sweep[key]["tflops_per_rank"]:
                    sweep[key] = r
            else:
                products.append(r)
            continue
        key = {"expert_gemms_fwd_bwd": "experts",
               "expert_gemm_products_fwd_bwd": "gemms"}.get(r["op"], r.get("impl"))
        rows.setdefault(r["matmul"], {})[key] = r
        ranks = r["ranks"]
impls = ["jax_ep", "all_to_all", "ragged_all_to_all"]
if products:
    print("\nproduct TFLOP/s (one device):", "  ".join(
        f"{p['library']}/{p['product']}/{p['shape']} {p['tflops_per_rank']:.0f}" for p in products))
for (library, product, shape), r in sorted(sweep.items()):
    print(f"sweep best {library}/{product}/{shape} {r['tflops_per_rank']:.0f} TFLOP/s "
          f"{r['config']}")
print(f"\nEP={ranks}")
print(f"{'matmul':24s} {'gemms':>8s} {'experts':>8s}" + "".join(f" {i:>17s}" for i in impls)
      + "   bar (EP=1)")
for m, cells in rows.items():
    if "skipped" in cells and len(cells) == 1:
        print(f"{m:24s} {cells['skipped'][:90]}")
        continue
    tf = lambda k: cells[k]["tflops_per_rank"] if k in cells else None
    fmt = lambda v: "-" if v is None else f"{v:.0f}"
    bar = ""
    if ranks == 1 and tf("gemms") is not None and tf("jax_ep") is not None:
        ok = tf("gemms") >= 450 and tf("jax_ep") >= 300
        bar = "MET" if ok else "not met"
    print(f"{m:24s} {fmt(tf('gemms')):>8s} {fmt(tf('experts')):>8s}"
          + "".join(f" {fmt(tf(i)):>17s}" for i in impls) + f"   {bar}")
for e in errors[:10]:
    print("ERROR", e)
print("TFLOP/s per GPU of useful expert-GEMM work (18*T*K*H*F per step), in-program wall; gemms "
      "= the six grouped GEMMs of a step alone, experts = swiglu_experts fwd+bwd (the GEMMs, "
      "SwiGLU, masks, loss), impl columns = whole layer step; bar: gemms >= 450, jax_ep >= 300")
EOF
