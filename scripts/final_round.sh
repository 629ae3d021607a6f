#!/usr/bin/env bash
# One device call on one GPU (issues 17, 18, 22): build, then the sections in $SECTIONS (default
# all), each under `timeout`, logs and JSON under $OUT, a short summary last.
#   suite   the README's GPU command (pytest -m gpu, the default build)
#   step    profile_ops (kernel times) and bench_step (what a program pays per step: with the
#           stand-in expert, and --bare: the op pairs alone)
#   shared  2 processes sharing the GPU (jax_ep.launch --processes-per-gpu 2): the normal ops, the
#           split ops, their chains and the adversarial routings, over CUDA IPC peers and as two
#           fake hosts over the emulated transport (SHARED_K=one_host or two_fake_hosts: one)
#   transport  tests/test_transport_gpu.py alone (issue 20's emulated transport; SUITE_ARGS
#           "--ignore=tests/test_transport_gpu.py" keeps it out of the suite)
#   devtransport  tests/test_device_transport.py alone (the ops over every device transport,
#           in child processes: several minutes; SUITE_ARGS
#           "--ignore=tests/test_device_transport.py" keeps it out of the suite)
#   mutants  issue 20: the normal-mode protocol mutants under the ops (two fake hosts, two seeds
#           each; ~35 s a caught run, ~4 min)
#   seeds20  issue 20's bar for the normal mode: the fake-hosts normal digests under 20 emulator
#           seeds, two runs each (JAX_EP_TRANSPORT_SEEDS=20; a call of its own)
#   cublaslt  scripts/cublaslt_probe.sh: cuBLASLt's grouped matmul on the expert GEMMs' products
#           (issue 21; ~1 min)
#   launchfloor  benchmarks/launch_floor.py: a custom call's cost by how its kernel launches
#   timeline  a diagnostic build with JAX_EP_PHASE_TIMELINE, benchmarks/phase_timeline.py at T=128
#           (fused and split) and T=1, then the release build again
#   variants  scripts/kernel_variants.sh with $VARIANTS and $MEASURE (replaces the build: last
#           but ptx)
#   ptx     scripts/ptx_check.sh: a PTX-only compute_80 build (the A100 code path, JIT-compiled
#           on this GPU), the image the driver loaded, the GPU suite (last: it replaces the build)
set -uo pipefail
R="$PWD"; OUT="${OUT:-$R/gpu_out}"; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PATH="/usr/local/cuda/bin:$PATH"
export JAX_EP_TIMEOUT_S=10 JAX_EP_COMMIT=${JAX_EP_COMMIT:-unknown}
SECTIONS="${SECTIONS:-suite shared step ptx}"  # ptx runs last
has() { [[ " $SECTIONS " == *" $1 "* ]]; }
sum=()
step() { local n=$1 l=$2; shift 2; local s; s=$(date +%s); timeout "$l" "$@" > "$OUT/$n.log" 2>&1; local rc=$?
  sum+=("$n rc=$rc $(( $(date +%s) - s ))s $(grep -E 'passed|failed' "$OUT/$n.log" | tail -1)"); }
# BUILD_ARCHS (e.g. 90): only this GPU's architecture, a faster build (not with the ptx section)
# SKIP_BUILD=1: jax_ep is already installed (an earlier step of the same call built it)
[[ ${SKIP_BUILD:-0} == 1 ]] || step build 300 env ${BUILD_ARCHS:+JAX_EP_CUDA_ARCHS=$BUILD_ARCHS} \
  python3 -m pip install --no-build-isolation --no-deps --force-reinstall .
has suite && step gpu_suite "${SUITE_S:-330}" pytest -m gpu -q -p no:cacheprovider -rs \
  --durations=15 ${SUITE_ARGS:-}
has transport && step transport "${TRANSPORT_S:-200}" pytest -m gpu -q -p no:cacheprovider -rs \
  --durations=10 tests/test_transport_gpu.py
has devtransport && step devtransport "${DEVTRANSPORT_S:-500}" pytest -m gpu -q \
  -p no:cacheprovider -rs --durations=10 tests/test_device_transport.py
# (The tests give their child processes the transport's environment themselves.)
has mutants && step mutants "${MUTANTS_S:-330}" pytest -m gpu -v -p no:cacheprovider -rs \
  --durations=0 tests/test_device_transport.py -k normal_protocol_mutant
has seeds20 && step seeds20 "${SEEDS20_S:-540}" env JAX_EP_TRANSPORT_SEEDS=20 pytest -m gpu -q -s \
  -p no:cacheprovider -rs --durations=0 tests/test_device_transport.py \
  -k normal_ops_across_fake_hosts
has shared && step shared "${SHARED_S:-580}" pytest -m gpu -q -p no:cacheprovider -rs \
  --durations=0 tests/test_gpu_multiprocess.py -k "pair_on_one_gpu${SHARED_K:+ and $SHARED_K}"
if has step; then
  (cd /tmp && step profile 200 python3 "$R/benchmarks/profile_ops.py" --out "$OUT" --tokens 4096 \
     --ll-tokens 128 --ops dispatch_bf16,combine,ll_dispatch_fp8,ll_dispatch_bf16,ll_combine,ll_dispatch_split_fp8,ll_combine_split
   # STEP_BARE_ONLY=1: the op pairs alone (the bars' measure), no stand-in expert run;
   # STEP_ARGS: more bench_step arguments (e.g. --impls jax_ep)
   [[ "${STEP_BARE_ONLY:-0}" == 1 ]] || step bench_step 300 python3 "$R/benchmarks/bench_step.py" \
     --out "$OUT" --repeats 20 ${STEP_ARGS:-}
   step bench_step_bare 150 python3 "$R/benchmarks/bench_step.py" --out "$OUT" --repeats 20 \
     --bare --ops decode_step,normal_step --tag bare ${STEP_ARGS:-}
   printf '%s\n' "${sum[@]}" > "$OUT/step_summary.txt")
fi
has cublaslt && step cublaslt "${CUBLASLT_S:-150}" bash "$R/scripts/cublaslt_probe.sh"
has launchfloor && (cd /tmp && step launch_floor 120 python3 "$R/benchmarks/launch_floor.py" --out "$OUT")
if has timeline; then
  arch=(env ${BUILD_ARCHS:+JAX_EP_CUDA_ARCHS=$BUILD_ARCHS})
  step timeline_build 300 "${arch[@]}" JAX_EP_PHASE_TIMELINE=ON python3 -m pip install \
    --no-build-isolation --no-deps --force-reinstall . -C build-dir=/tmp/build-timeline
  (cd /tmp && step timeline 200 sh -c "python3 '$R/benchmarks/phase_timeline.py' --ll-tokens 128 &&
     python3 '$R/benchmarks/phase_timeline.py' --ll-tokens 128 --split &&
     python3 '$R/benchmarks/phase_timeline.py' --ll-tokens 1")
  step release_build 300 "${arch[@]}" python3 -m pip install --no-build-isolation --no-deps \
    --force-reinstall .
fi
has variants && step variants "${VARIANTS_S:-400}" bash "$R/scripts/kernel_variants.sh"
if has ptx; then  # the whole GPU suite by default (PTX_TESTS narrows it)
  step ptx "${PTX_S:-300}" bash "$R/scripts/ptx_check.sh"
  tail -1 "$OUT/ptx.log"
fi
printf '%s\n' "${sum[@]}"; cat "$OUT/step_summary.txt" 2>/dev/null
grep -h -E "^(FAILED|ERROR)|^SKIPPED" "$OUT"/*.log 2>/dev/null | cut -c1-200 | head -30
grep -h "op span" "$OUT/profile.log" 2>/dev/null
grep -h -E "per call|^ll_|^  " "$OUT/launch_floor.log" "$OUT/timeline.log" 2>/dev/null | head -60
grep -h -A3 "^== " "$OUT/variants.log" 2>/dev/null
grep -h -A14 "^op " "$OUT/bench_step.log" "$OUT/bench_step_bare.log" 2>/dev/null
(cd "$OUT" && tar czf logs.tgz --remove-files ./*.log)
