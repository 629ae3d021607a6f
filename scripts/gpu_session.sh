#!/usr/bin/env bash
# One device-machine call: build, GPU tests, benchmarks; logs under $OUT (or ./gpu_out).
# Usage: bash scripts/gpu_session.sh [build|test|bench|all] [pytest args...]
set -uo pipefail
OUT="${OUT:-$PWD/gpu_out}"; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export PYTHONUNBUFFERED=1 PATH="/usr/local/cuda/bin:$PATH"
export JAX_EP_TIMEOUT_S="${JAX_EP_TIMEOUT_S:-20}"
what="${1:-all}"; shift || true
repo="$PWD"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nvidia-smi topo -m; } \
  > "$OUT/machine.txt" 2>&1
if [[ "$what" == build || "$what" == all ]]; then
  start=$(date +%s)
  timeout 500 python3 -m pip install --no-build-isolation --no-deps -v . > "$OUT/build.log" 2>&1
  echo "build rc=$? in $(( $(date +%s) - start )) s"; grep -E "error|warning: .*spill" "$OUT/build.log" | head -20
fi
if [[ "$what" == test || "$what" == all ]]; then
  # One pytest per file: a kernel that traps kills its process's CUDA context, not the run.
  files=("$@"); [[ ${#files[@]} -eq 0 ]] && files=(tests/test_normal.py tests/test_low_latency.py \
    tests/test_gradients.py tests/test_env.py)
  for f in "${files[@]}"; do
    name=$(basename "$f" .py)
    (cd "$repo" && timeout 300 pytest -m gpu -q -p no:cacheprovider "$f" \
       > "$OUT/$name.log" 2>&1; echo "$name rc=$?")
    grep -E "passed|failed|error" "$OUT/$name.log" | tail -3
    grep -E "^(E  |FAILED)" "$OUT/$name.log" | head -12
  done
fi
if [[ "$what" == bench || "$what" == all ]]; then
  (cd "$repo" && timeout 400 python3 benchmarks/bench_ep.py --out "$OUT" > "$OUT/bench.log" 2>&1; \
     echo "bench rc=$?")
  tail -40 "$OUT/bench.log"
fi
