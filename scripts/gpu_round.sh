#!/usr/bin/env bash
# One device call: build, then the sections named in $SECTIONS (unset or empty: all), each bounded by
# `timeout`; logs and JSON under $OUT, a short summary last.
#   tests      single-process GPU suite (test files in $TESTS)
#   multiproc  tests/test_gpu_multiprocess.py + the GPU suite under `jax_ep.launch -n 2`
#   nvshmem    the GPU suite and bench_ep under `JAX_EP_TRANSPORT=nvshmem jax_ep.launch -n 2
#              --share-gpus` (NVSHMEM's symmetric heap and peer-to-peer mappings)
#   memcheck   compute-sanitizer memcheck over the op tests
#   bench      bench_ep (normal T=4096 and low-latency T sweep, with peers) + 2-process figures
#   moe        bench_moe_layer with every transport
#   first      first_call.py
#   one_pe     one GPU: the GPU suite under JAX_EP_TRANSPORT=nvshmem as a job of one PE (EP=1)
#   shared     one GPU is enough: 2 processes share each GPU (jax_ep.launch --processes-per-gpu 2):
#              every op's bits with CUDA IPC and with NVSHMEM peers against the reference backend
#              (test_processes_sharing_one_gpu_move_the_bits_of_the_reference), then the op tests
#              (oracle) with IPC peers
# A wheel in .whl_jax_ep/ (carried) is installed instead of building; a build leaves its wheel
# in $OUT (cp312: build on the device machine, carry it to the next call).
set -uo pipefail
R="$PWD"; OUT="${OUT:-$R/gpu_out}"; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export PYTHONUNBUFFERED=1 PATH="/usr/local/cuda/bin:$PATH" JAX_EP_COMMIT="${JAX_EP_COMMIT:-unknown}"
export JAX_EP_TIMEOUT_S="${JAX_EP_TIMEOUT_S:-20}"
SECTIONS="${SECTIONS:-tests multiproc nvshmem memcheck bench moe first}"
TESTS="${TESTS:-tests/test_normal.py tests/test_low_latency.py tests/test_low_latency_split.py tests/test_gradients.py tests/test_gpu.py tests/test_aot.py}"
summary=()
step() {  # step NAME SECONDS CMD...: runs CMD with a timeout, logs to $OUT/NAME.log
  local name=$1 limit=$2; shift 2
  local s; s=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  summary+=("$name rc=$rc $(( $(date +%s) - s ))s $(grep -E '^[0-9]+ (passed|failed)|passed|ERROR SUMMARY' "$OUT/$name.log" | tail -1)")
}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nvidia-smi topo -m;
  command -v nvidia-cuda-mps-control; python3 -c "import nvidia.nvshmem, jax; print(jax.__version__)"; } \
  > "$OUT/machine.txt" 2>&1
if ls .whl_jax_ep/jax_ep-*.whl > /dev/null 2>&1; then
  step build 120 python3 -m pip install --no-deps --force-reinstall .whl_jax_ep/jax_ep-*.whl
else
  step build 500 bash -c "python3 -m pip wheel --no-build-isolation --no-deps -v -w '$OUT' . &&
    python3 -m pip install --no-deps --force-reinstall '$OUT'/jax_ep-*.whl"
fi
echo "${summary[0]}"; grep -E "error|warning: .*spill" "$OUT/build.log" | head -20
has() { [[ " $SECTIONS " == *" $1 "* ]]; }
if has tests; then  # one pytest per file: a kernel that traps takes its process down, not the run
  for f in $TESTS; do step "$(basename "$f" .py)" 200 pytest -m gpu -q -p no:cacheprovider ${PYTEST_ARGS:-} "$f"; done
fi
[[ -n "${PRE:-}" ]] && { bash -c "$PRE" > "$OUT/pre.log" 2>&1; cat "$OUT/pre.log"; }
has multiproc && step mp_tests 200 pytest -m gpu -q -p no:cacheprovider tests/test_gpu_multiprocess.py ${MP_ARGS:-}
has multiproc && step mp_suite 300 python3 -m jax_ep.launch -n 2 --timeout 280 -- \
  pytest -m gpu -q -p no:cacheprovider tests/test_normal.py tests/test_low_latency.py tests/test_gradients.py
has nvshmem && JAX_EP_TRANSPORT=nvshmem step nvshmem_suite 300 python3 -m jax_ep.launch -n 2 \
  --share-gpus --timeout 280 -- pytest -m gpu -q -p no:cacheprovider tests/test_normal.py \
  tests/test_low_latency.py tests/test_low_latency_split.py tests/test_gradients.py
has memcheck && XLA_PYTHON_CLIENT_ALLOCATOR=platform step memcheck 300 compute-sanitizer --tool memcheck \
  --report-api-errors no --target-processes all --error-exitcode 9 \
  pytest -m gpu -q -p no:cacheprovider tests/test_normal.py tests/test_low_latency.py \
  tests/test_low_latency_split.py -k "not data_axis and not gradients"
if has one_pe; then
  JAX_EP_TRANSPORT=nvshmem step one_pe 300 python3 -m jax_ep.launch -n 1 --timeout 280 -- \
    pytest -m gpu -q -p no:cacheprovider tests/test_normal.py tests/test_low_latency.py \
    tests/test_gradients.py
fi
if has shared; then  # digests of IPC and NVSHMEM peers against the reference, then the op tests
  step shared_digests 300 pytest -m gpu -q -p no:cacheprovider tests/test_gpu_multiprocess.py \
    -k sharing_one_gpu
  # The low-latency backward passes use XLA's all_to_all, which NCCL refuses on a shared GPU.
  step shared_suite 300 python3 -m jax_ep.launch -n 2 --processes-per-gpu 2 --timeout 290 -- \
    pytest -m gpu -q -p no:cacheprovider \
    --deselect tests/test_gradients.py::test_low_latency_gradients \
    --deselect tests/test_low_latency_split.py::test_gradients_through_send_and_recv_equal_fused \
    ${SHARED_ARGS:-tests/test_normal.py tests/test_low_latency.py}
fi
cd /tmp  # benchmarks import the installed jax_ep, not the source tree
if has bench; then
  step bench 300 python3 "$R/benchmarks/bench_ep.py" --out "$OUT" --tag final \
    --ll-tokens "${LL_TOKENS:-1,16,64,128,256}" --impls "${BENCH_IMPLS:-jax_ep,all_to_all,ragged_all_to_all}" \
    --ops layout,dispatch,combine,low_latency_dispatch,low_latency_combine --max-minutes "${BENCH_MINUTES:-4}"
  step bench_mp 240 python3 -m jax_ep.launch -n 2 --timeout 230 -- python3 \
    "$R/benchmarks/bench_ep.py" --out "$OUT" --tag 2proc --impls jax_ep --ll-tokens 128 \
    --ops layout,dispatch,combine,low_latency_dispatch,low_latency_combine
fi
has nvshmem && JAX_EP_TRANSPORT=nvshmem step bench_nvshmem 240 python3 -m jax_ep.launch -n 2 \
  --share-gpus --timeout 230 -- python3 "$R/benchmarks/bench_ep.py" --out "$OUT" --tag nvshmem \
  --impls jax_ep --ll-tokens 128 --ops layout,dispatch,combine,low_latency_dispatch,low_latency_combine
has split_bench && step bench_split 120 python3 "$R/benchmarks/bench_ep.py" --out "$OUT" --tag split \
  --impls jax_ep --ll-tokens 128 --ops low_latency_dispatch_send,low_latency_dispatch_recv,low_latency_combine_send,low_latency_combine_recv
has moe && step moe 300 python3 "$R/benchmarks/bench_moe_layer.py" --out "$OUT" --max-minutes "${MOE_MINUTES:-4}"
has first && step first 240 python3 "$R/benchmarks/first_call.py" --out "$OUT" --max-minutes 3
cd "$R"
printf '%s\n' "${summary[@]}"
grep -h -E "^(\[[0-9]\] )?(E  |FAILED)|Fatal Python|Segmentation" "$OUT"/test_*.log "$OUT"/mp_*.log \
  "$OUT"/one_pe.log "$OUT"/shared_*.log 2>/dev/null | head -40
for f in bench moe first; do [[ -f "$OUT/$f.log" ]] && tail -25 "$OUT/$f.log"; done
# At most 8 files come back from the device machine: every log in one archive, JSON beside it.
(cd "$OUT" && tar czf logs.tgz --remove-files ./*.log machine.txt 2>/dev/null; ls)
