#!/usr/bin/env bash
# The GPU checks of jax_ep in one entry point: run from the repository root on a GPU machine.
# Builds (or installs a wheel), then runs the sections named in $SECTIONS, each bounded by
# `timeout` (a section's bound: <NAME>_S, in seconds), with logs and JSON under $OUT and a short
# summary last. SECTIONS takes section names and groups (default: one_gpu):
#
#   one_gpu    = suite pair step ptx                   what one GPU checks
#   multi_gpu  = tests multiproc nvshmem memcheck bench moe first   what several GPUs check
#   matmuls    = matmul_env matmul_tests matmul_profile matmul_bench matmul_products matmul_ragged
#                matmul_peak                           the MoE expert matmuls
#
# Correctness
#   suite      the README's GPU command, the fast tier: pytest -m gpu (SUITE_ARGS: more pytest
#              arguments)
#   stress     the stress tier: pytest -m "gpu and stress" (one H200: ~12 min; SUITE_ARGS)
#   tests      the GPU tests of $TESTS, one pytest process per file (a kernel that traps takes its
#              process down, not the run)
#   multiproc  tests/test_gpu_multiprocess.py, then the GPU suite under `jax_ep.launch -n 2`
#   nvshmem    the GPU suite and bench_ep under `JAX_EP_PEER_MAPPING=nvshmem jax_ep.launch -n 2
#              --share-gpus` (NVSHMEM's symmetric heap and peer-to-peer mappings)
#   one_pe     the GPU suite under JAX_EP_PEER_MAPPING=nvshmem as a job of one PE (EP=1)
#   shared     2 processes sharing each GPU (jax_ep.launch --processes-per-gpu 2): every op's bits
#              with CUDA IPC and with NVSHMEM peers against the reference backend, then the op
#              tests (the oracle) with IPC peers (SHARED_ARGS: the test files)
#   pair       2 processes sharing the GPU: the normal ops, the split ops, their chains and the
#              adversarial routings, over CUDA IPC peers and as two fake hosts over the emulated
#              transport (tests/test_gpu_multiprocess.py; PAIR_K=one_host or two_fake_hosts: one)
#   memcheck   compute-sanitizer memcheck over the op tests (scripts/sanitize.sh runs every tool)
#   transport  tests/test_transport_gpu.py: both device transports, and the low-latency kernels
#              over them (SUITE_ARGS "--ignore=tests/test_transport_gpu.py" keeps it out of suite)
#   devtransport  tests/test_device_transport.py: the ops over every device transport, in child
#              processes (several minutes; SUITE_ARGS "--ignore=tests/test_device_transport.py")
#   mutants    the normal-mode protocol mutants under the ops (two fake hosts, two seeds each)
#   seeds20    the fake-hosts normal digests under 20 emulator seeds (JAX_EP_TRANSPORT_SEEDS=20)
#   groups     the stress tier's groups of many processes, one pytest run each (GROUP_K: its
#              -k selections, comma-separated; GROUP_S: each one's bound, default 300), with the
#              GPU's memory and every process's share sampled each second (gpu_memory.log)
#   ucx        NVSHMEM's own network path on one machine: the fake-hosts NVSHMEM test with P2P
#              off and NVSHMEM_REMOTE_TRANSPORT=ucx over TCP loopback (needs the libucx-cu13
#              wheel in .whl/; NVSHMEM_DEBUG=INFO in the log says which transport it took)
#   ptx        scripts/ptx_check.sh: a PTX-only compute_80 build (the A100 code path, JIT-compiled
#              on this GPU), the image the driver loaded, the GPU suite (replaces the build: last)
# Performance (records under $OUT, written by the benchmarks)
#   bench      bench_ep (normal T=4096 and a low-latency T sweep, with peers) and its 2-process run
#   split_bench  bench_ep of the split low-latency halves
#   moe        bench_moe_layer with every all-to-all implementation
#   first      benchmarks/first_call.py (FIRST_ARGS appended; FIRST_MINUTES, default 8: its
#              --max-minutes; FIRST_S: the section's bound, default 600)
#   step       profile_ops (kernel times) and bench_step (what a program pays per step: with the
#              stand-in expert, and --bare: the op pairs alone; STEP_BARE_ONLY=1, STEP_ARGS)
#   traffic    benchmarks/traffic_counts.py on fake hosts over the emulated network (processes
#              sharing the GPU; TRAFFIC_LAYOUTS, default "2x8 4x8": hosts x ranks per host;
#              TRAFFIC_ARGS appended, e.g. "--modes normal"), then benchmarks/traffic.py with
#              those counts: the counted traffic records
#   launchfloor  benchmarks/launch_floor.py: a custom call's cost by how its kernel launches
#   overlap    bench_overlap.py (train and decode at the bench shape, --num-sms 24 --unpinned),
#              with jax's Mosaic GPU GEMMs, then with the non-persistent tiled ones; records
#              under $OUT/overlap-<matmul> (OVERLAP_ARGS appended)
#   timeline   a diagnostic build with JAX_EP_PHASE_TIMELINE, benchmarks/phase_timeline.py at
#              T=128 (fused and split) and T=1, then the release build again
#   variants   scripts/kernel_variants.sh with $VARIANTS and $MEASURE (replaces the build)
# The MoE expert matmuls (wheels in .whl/, e.g. tokamax, go to /tmp/site first)
#   matmul_env       jax-ep-env (its last line: the matmul that matmul="auto" picks, and why)
#   matmul_tests     tests/test_grouped_gemm.py: every library matmul against float32 references
#   matmul_profile   profile_moe_experts.py --matmul mosaic: where a step of the expert GEMMs goes
#   matmul_bench     bench_moe_layer at T=4096, H=2048, F=1024, E=64, top-8, bf16: the expert
#                    GEMMs alone and the layer step per matmul ($MATMULS, peers with
#                    $PEER_MATMUL; MATMUL_MINUTES, default 5; BENCH_ARGS appended)
#   matmul_products  each library product (forward, dx, dw) alone, both shapes
#   matmul_sweep     (not in the group) each product with every tile config of SWEEP_CONFIGS
#   matmul_ragged    jax.lax.ragged_dot's expert GEMMs (XLA's grouped-GEMM option, then default)
#   matmul_peak      a dense bf16 matmul (16384 x 8192 x 8192): the GPU's ceiling
#
# Build: a wheel in .whl_jax_ep/ is installed instead of building; SKIP_BUILD=1 keeps what is
# installed; BUILD_ARCHS (e.g. 90) builds this GPU's architecture only.
set -uo pipefail
R="$PWD"; OUT="${OUT:-$R/gpu_out}"; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export PYTHONUNBUFFERED=1 PATH="/usr/local/cuda/bin:$PATH" JAX_EP_COMMIT="${JAX_EP_COMMIT:-unknown}"
export JAX_EP_TIMEOUT_S="${JAX_EP_TIMEOUT_S:-20}"
SECTIONS="${SECTIONS:-one_gpu}"
SECTIONS=" ${SECTIONS//one_gpu/suite pair step ptx} "
SECTIONS="${SECTIONS//multi_gpu/tests multiproc nvshmem memcheck bench moe first}"
SECTIONS="${SECTIONS//matmuls/matmul_env matmul_tests matmul_profile matmul_bench matmul_products matmul_ragged matmul_peak}"
TESTS="${TESTS:-tests/test_normal.py tests/test_low_latency.py tests/test_low_latency_split.py tests/test_gradients.py tests/test_gpu.py tests/test_aot.py}"
PYTEST=(pytest -m "gpu or stress" -q -p no:cacheprovider -rs)  # both tiers (pyproject.toml)
LL_OPS=layout,dispatch,combine,low_latency_dispatch,low_latency_combine
has() { [[ "$SECTIONS" == *" $1 "* ]]; }
limit() { local v="${1^^}_S"; echo "${!v:-$2}"; }  # limit NAME DEFAULT: $<NAME>_S or DEFAULT
summary=()
step() {  # step NAME SECONDS CMD...: CMD under a timeout, output in $OUT/NAME.log
  local name=$1 seconds=$2; shift 2
  local s; s=$(date +%s)
  timeout "$seconds" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  summary+=("$name rc=$rc $(( $(date +%s) - s ))s $(grep -E '[0-9]+ (passed|failed|skipped)|ERROR SUMMARY' "$OUT/$name.log" | tail -1)")
}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nvidia-smi topo -m;
  python3 -c "import jax; print(jax.__version__)";
  # MPS would let many processes share one GPU's hardware queues (docs/decisions.md, channels).
  echo "MPS control: $(command -v nvidia-cuda-mps-control || echo none)"; } > "$OUT/machine.txt" 2>&1
arch=(env ${BUILD_ARCHS:+JAX_EP_CUDA_ARCHS=$BUILD_ARCHS})
if [[ ${SKIP_BUILD:-0} == 1 ]]; then
  :
elif ls .whl_jax_ep/jax_ep-*.whl > /dev/null 2>&1; then
  step build 120 python3 -m pip install --no-deps --force-reinstall .whl_jax_ep/jax_ep-*.whl
else
  step build 500 "${arch[@]}" python3 -m pip install --no-build-isolation --no-deps \
    --force-reinstall .
fi
if ls .whl/*.whl > /dev/null 2>&1 && { has matmul_env || has ucx; }; then
  step wheels 120 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi

# Correctness.
has suite && step suite "$(limit suite 330)" pytest -m gpu -q -p no:cacheprovider -rs \
  --durations=15 ${SUITE_ARGS:-}
has stress && step stress "$(limit stress 900)" pytest -m "gpu and stress" -q -p no:cacheprovider \
  -rs --durations=30 ${SUITE_ARGS:-}
if has tests; then
  for f in $TESTS; do step "$(basename "$f" .py)" 200 "${PYTEST[@]}" ${PYTEST_ARGS:-} "$f"; done
fi
has multiproc && step mp_tests 200 "${PYTEST[@]}" tests/test_gpu_multiprocess.py ${MP_ARGS:-}
has multiproc && step mp_suite 300 python3 -m jax_ep.launch -n 2 --timeout 280 -- \
  "${PYTEST[@]}" tests/test_normal.py tests/test_low_latency.py tests/test_gradients.py
has nvshmem && JAX_EP_PEER_MAPPING=nvshmem step nvshmem_suite 300 python3 -m jax_ep.launch -n 2 \
  --share-gpus --timeout 280 -- "${PYTEST[@]}" tests/test_normal.py tests/test_low_latency.py \
  tests/test_low_latency_split.py tests/test_gradients.py
has one_pe && JAX_EP_PEER_MAPPING=nvshmem step one_pe 300 python3 -m jax_ep.launch -n 1 \
  --timeout 280 -- "${PYTEST[@]}" tests/test_normal.py tests/test_low_latency.py \
  tests/test_gradients.py
if has shared; then  # digests of IPC and NVSHMEM peers against the reference, then the op tests
  step shared_digests 300 "${PYTEST[@]}" tests/test_gpu_multiprocess.py -k sharing_one_gpu
  # The low-latency backward passes use XLA's all_to_all, which NCCL refuses on a shared GPU.
  step shared_suite 300 python3 -m jax_ep.launch -n 2 --processes-per-gpu 2 --timeout 290 -- \
    "${PYTEST[@]}" --deselect tests/test_gradients.py::test_low_latency_gradients \
    --deselect tests/test_low_latency_split.py::test_gradients_through_send_and_recv_equal_fused \
    ${SHARED_ARGS:-tests/test_normal.py tests/test_low_latency.py}
fi
has pair && step pair "$(limit pair 580)" "${PYTEST[@]}" --durations=0 \
  tests/test_gpu_multiprocess.py -k "pair_on_one_gpu${PAIR_K:+ and $PAIR_K}"
has memcheck && XLA_PYTHON_CLIENT_ALLOCATOR=platform step memcheck 300 compute-sanitizer \
  --tool memcheck --report-api-errors no --target-processes all --error-exitcode 9 \
  "${PYTEST[@]}" tests/test_normal.py tests/test_low_latency.py tests/test_low_latency_split.py \
  -k "not data_axis and not gradients"
# (The device transport's tests give their child processes its environment themselves.)
has transport && step transport "$(limit transport 200)" "${PYTEST[@]}" --durations=10 \
  tests/test_transport_gpu.py
has devtransport && step devtransport "$(limit devtransport 500)" "${PYTEST[@]}" --durations=10 \
  tests/test_device_transport.py
has mutants && step mutants "$(limit mutants 330)" pytest -m "gpu or stress" -v -p no:cacheprovider -rs \
  --durations=0 tests/test_device_transport.py -k normal_protocol_mutant
if has ucx; then
  ucx_lib=$(python3 -c "import libucx, os; print(os.path.join(os.path.dirname(libucx.__file__), 'lib'))")
  NVSHMEM_DISABLE_P2P=1 NVSHMEM_REMOTE_TRANSPORT=ucx UCX_TLS=tcp,cuda_copy,self UCX_NET_DEVICES=lo \
    NVSHMEM_DEBUG=INFO LD_LIBRARY_PATH="$ucx_lib:${LD_LIBRARY_PATH:-}" step ucx "$(limit ucx 300)" \
    "${PYTEST[@]}" -s tests/test_gpu_multiprocess.py -k "fake_hosts_over_nvshmem and 2-2"
fi
if has groups; then
  while :; do  # the GPU's memory in use, then each process's
    echo "$(date +%T) $(nvidia-smi --query-gpu=memory.used --format=csv,noheader) |" \
      $(nvidia-smi --query-compute-apps=used_memory --format=csv,noheader,nounits)
    sleep 1
  done >> "$OUT/gpu_memory.log" 2>&1 & sampler=$!
  groups="hierarchical and 2-8,emulated_network and 2-8,nvshmem_match and 2-2"
  groups+=",nvshmem_match and 2-8,killed,ep_group and 16,ep_group and 32,adversarial"
  IFS=, read -ra selections <<< "${GROUP_K:-$groups}"
  for k in "${selections[@]}"; do
    echo "== $(date +%T) $k" >> "$OUT/gpu_memory.log"
    step "group_${k//[^a-z0-9]/_}" "$(limit group 300)" "${PYTEST[@]}" -rA --durations=0 \
      tests/test_gpu_multiprocess.py -k "$k"
  done
  kill "$sampler"
fi
has seeds20 && step seeds20 "$(limit seeds20 540)" env JAX_EP_TRANSPORT_SEEDS=20 "${PYTEST[@]}" \
  -s --durations=0 tests/test_device_transport.py -k normal_ops_across_fake_hosts

# Performance: the benchmarks import the installed jax_ep, not the source tree.
cd /tmp
if has bench; then
  step bench 300 python3 "$R/benchmarks/bench_ep.py" --out "$OUT" --tag 1proc \
    --ll-tokens "${LL_TOKENS:-1,16,64,128,256}" --ops "$LL_OPS" \
    --impls "${BENCH_IMPLS:-jax_ep,all_to_all,ragged_all_to_all}" --max-minutes "${BENCH_MINUTES:-4}"
  step bench_mp 240 python3 -m jax_ep.launch -n 2 --timeout 230 -- python3 \
    "$R/benchmarks/bench_ep.py" --out "$OUT" --tag 2proc --impls jax_ep --ll-tokens 128 --ops "$LL_OPS"
fi
has nvshmem && JAX_EP_PEER_MAPPING=nvshmem step bench_nvshmem 240 python3 -m jax_ep.launch -n 2 \
  --share-gpus --timeout 230 -- python3 "$R/benchmarks/bench_ep.py" --out "$OUT" --tag nvshmem \
  --impls jax_ep --ll-tokens 128 --ops "$LL_OPS"
has split_bench && step bench_split 120 python3 "$R/benchmarks/bench_ep.py" --out "$OUT" \
  --tag split --impls jax_ep --ll-tokens 128 \
  --ops low_latency_dispatch_send,low_latency_dispatch_recv,low_latency_combine_send,low_latency_combine_recv
has moe && step moe 300 python3 "$R/benchmarks/bench_moe_layer.py" --out "$OUT" \
  --max-minutes "${MOE_MINUTES:-4}"
has first && step first "$(limit first 600)" python3 "$R/benchmarks/first_call.py" --out "$OUT" \
  --max-minutes "${FIRST_MINUTES:-8}" ${FIRST_ARGS:-}
if has step; then
  step profile 200 python3 "$R/benchmarks/profile_ops.py" --out "$OUT" --tokens 4096 \
    --ll-tokens 128 --ops dispatch_bf16,combine,ll_dispatch_fp8,ll_dispatch_bf16,ll_combine,ll_dispatch_split_fp8,ll_combine_split
  [[ "${STEP_BARE_ONLY:-0}" == 1 ]] || step bench_step 300 python3 "$R/benchmarks/bench_step.py" \
    --out "$OUT" --repeats 20 ${STEP_ARGS:-}
  step bench_step_bare 150 python3 "$R/benchmarks/bench_step.py" --out "$OUT" --repeats 20 \
    --bare --ops decode_step,normal_step --tag bare ${STEP_ARGS:-}
fi
if has traffic; then
  counts=()
  for layout in ${TRAFFIC_LAYOUTS:-2x8 4x8}; do
    n=$(( ${layout%x*} * ${layout#*x} ))
    # XLA takes what each process uses, not 0.7/n of the GPU up front: the workspaces (up to
    # 1.9 GB a rank at 16 ranks) live beside XLA's pool, in the GPU's other 30%.
    JAX_EP_DEVICE_TRANSPORT=emulated CUDA_DEVICE_MAX_CONNECTIONS=32 \
      XLA_PYTHON_CLIENT_PREALLOCATE=false step "traffic_$layout" \
      "$(limit traffic 400)" python3 -m jax_ep.launch -n "$n" --processes-per-gpu "$n" \
      --fake-hosts "${layout%x*}" --timeout "$(( $(limit traffic 400) - 20 ))" -- python3 \
      "$R/benchmarks/traffic_counts.py" --hosts "${layout%x*}" \
      --out "$OUT/traffic-counts-$layout.json" ${TRAFFIC_ARGS:-}
    [[ -f "$OUT/traffic-counts-$layout.json" ]] && counts+=(--counts "$OUT/traffic-counts-$layout.json")
  done
  step traffic_records 60 python3 "$R/benchmarks/traffic.py" --out "$OUT" "${counts[@]}"
fi
has launchfloor && step launch_floor 120 python3 "$R/benchmarks/launch_floor.py" --out "$OUT"
if has overlap; then
  for matmul in auto tiled; do
    mkdir -p "$OUT/overlap-$matmul"
    step "overlap_$matmul" 280 python3 "$R/benchmarks/bench_overlap.py" \
      --out "$OUT/overlap-$matmul" --cases train:bench,decode:bench --num-sms 24 --unpinned --steps 5 --repeats 3 \
      --matmul "$matmul" --note "gpu_check.sh overlap section, matmul $matmul" ${OVERLAP_ARGS:-}
  done
fi
cd "$R"

# The MoE expert matmuls.
MATMULS="${MATMULS:-mosaic,tokamax+mosaic,tiled,dense}"
PEER_MATMUL="${PEER_MATMUL:-mosaic}"
BENCH_ARGS="${BENCH_ARGS:-}"
MATMUL_MINUTES="${MATMUL_MINUTES:-5}"
MOE_BENCH=(python3 benchmarks/bench_moe_layer.py --out "$OUT")
if has matmul_env; then
  if command -v jax-ep-env > /dev/null; then step matmul_env 60 jax-ep-env
  else step matmul_env 60 python3 -m jax_ep.env; fi
fi
has matmul_tests && step matmul_tests 150 "${PYTEST[@]}" tests/test_grouped_gemm.py
has matmul_profile && step matmul_profile 150 python3 benchmarks/profile_moe_experts.py \
  --out "$OUT" --matmul mosaic
has matmul_bench && step matmul_bench "$(( ${MATMUL_MINUTES%.*} * 60 + 120 ))" "${MOE_BENCH[@]}" \
  --tag matmuls --check --matmul "$MATMULS" --sections experts,gemms,layer \
  --peers-with "$PEER_MATMUL" --max-minutes "$MATMUL_MINUTES" $BENCH_ARGS
has matmul_products && step matmul_products 90 "${MOE_BENCH[@]}" --tag products \
  --matmul tokamax+mosaic --sections products --max-minutes 1.1 $BENCH_ARGS
has matmul_sweep && step matmul_sweep 420 "${MOE_BENCH[@]}" --tag sweep \
  --matmul "$PEER_MATMUL" --sections products --sweep --max-minutes 6 $BENCH_ARGS
has matmul_ragged && step matmul_ragged 80 "${MOE_BENCH[@]}" --tag ragged \
  --matmul ragged_dot+grouped_gemm,ragged_dot --sections experts --ragged-dot-sections experts \
  --max-minutes 0.8 $BENCH_ARGS
if has matmul_peak; then
  step matmul_peak 60 python3 - <<'EOF'
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
fi

# Builds that replace the installed jax_ep: last.
if has timeline; then
  step timeline_build 300 "${arch[@]}" JAX_EP_PHASE_TIMELINE=ON python3 -m pip install \
    --no-build-isolation --no-deps --force-reinstall . -C build-dir=/tmp/build-timeline
  (cd /tmp && step timeline 200 sh -c "python3 '$R/benchmarks/phase_timeline.py' --ll-tokens 128 &&
     python3 '$R/benchmarks/phase_timeline.py' --ll-tokens 128 --split &&
     python3 '$R/benchmarks/phase_timeline.py' --ll-tokens 1")
  step release_build 300 "${arch[@]}" python3 -m pip install --no-build-isolation --no-deps \
    --force-reinstall .
fi
has variants && step variants "$(limit variants 400)" bash "$R/scripts/kernel_variants.sh"
has ptx && step ptx "$(limit ptx 300)" bash "$R/scripts/ptx_check.sh"

# The summary: one line a section, then failures and the benchmarks' tables.
printf '%s\n' "${summary[@]}"
grep -E "error|warning: .*spill" "$OUT/build.log" 2>/dev/null | head -20
grep -h -E "^(\[[0-9]\] )?(E  |FAILED|ERROR)|^SKIPPED|Fatal Python|Segmentation" "$OUT"/*.log \
  2>/dev/null | cut -c1-200 | head -40
grep -h "op span" "$OUT/profile.log" 2>/dev/null
grep -h -E "per call|^ll_|^  " "$OUT/launch_floor.log" "$OUT/timeline.log" 2>/dev/null | head -60
grep -h -A3 "^== " "$OUT/variants.log" 2>/dev/null
grep -h -A14 "^op " "$OUT/bench_step.log" "$OUT/bench_step_bare.log" 2>/dev/null
for f in bench moe first; do [[ -f "$OUT/$f.log" ]] && tail -25 "$OUT/$f.log"; done
grep -h "MoE expert matmul" "$OUT/matmul_env.log" 2>/dev/null
grep -hE "^(split|fused) " "$OUT/matmul_profile.log" 2>/dev/null
grep -h "TFLOP/s" "$OUT/matmul_peak.log" 2>/dev/null
# The expert matmuls' table: TFLOP/s of useful expert-GEMM work per GPU (the bar at EP=1: expert
# GEMMs >= 450, layer step >= 300).
if ls "$OUT"/*-moe_layer-*.json > /dev/null 2>&1; then
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
fi
(cd "$OUT" && tar czf logs.tgz --remove-files ./*.log machine.txt 2>/dev/null; ls)
