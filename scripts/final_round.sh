#!/usr/bin/env bash
# The session's last device call: the README's GPU command (whole suite, default build), then a
# PTX-only compute_80 build (the A100 code path, JIT-compiled on this GPU) and its GPU tests.
set -uo pipefail
R="$PWD"; OUT="${OUT:-$R/gpu_out}"; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PATH="/usr/local/cuda/bin:$PATH" JAX_EP_TIMEOUT_S=10 JAX_EP_COMMIT=${JAX_EP_COMMIT:-unknown}
sum=()
step() { local n=$1 l=$2; shift 2; local s; s=$(date +%s); timeout "$l" "$@" > "$OUT/$n.log" 2>&1; local rc=$?
  sum+=("$n rc=$rc $(( $(date +%s) - s ))s $(grep -E 'passed|failed' "$OUT/$n.log" | tail -1)"); }
step build 300 python3 -m pip install --no-build-isolation --no-deps --force-reinstall .
step gpu_suite ${SUITE_S:-330} pytest -m gpu -q -p no:cacheprovider -rs --durations=15
step ptx_build 200 env JAX_EP_CUDA_ARCHS=80-virtual python3 -m pip install --no-build-isolation --no-deps --force-reinstall -C build-dir=/tmp/b80 .
step ptx_tests ${PTX_S:-200} pytest -m gpu -q -p no:cacheprovider tests/test_build.py tests/test_env.py tests/test_normal.py tests/test_low_latency.py
(cd /tmp && python3 -c "import jax_ep._C as C, jax; jax.devices(); print('built', C.cuda_architectures(), 'runs', C.kernel_image(0))") >> "$OUT/ptx_tests.log" 2>&1
printf '%s\n' "${sum[@]}"
grep -h -E "^(FAILED|ERROR)|^SKIPPED" "$OUT"/gpu_suite.log "$OUT"/ptx_tests.log | cut -c1-200 | head -30
tail -2 "$OUT/ptx_tests.log"
(cd "$OUT" && tar czf logs.tgz --remove-files ./*.log)
