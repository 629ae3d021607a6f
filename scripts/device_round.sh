#!/usr/bin/env bash
# One full device round: build, every GPU test file, kernel profile, first-call benchmark.
# Logs and JSON under $OUT; a short table last.
set -uo pipefail
R="$PWD"; OUT="${OUT:-$R/gpu_out}"; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
bash scripts/gpu_session.sh build | head -2
bash scripts/gpu_session.sh test tests/test_normal.py tests/test_low_latency.py \
  tests/test_gradients.py tests/test_gpu.py tests/test_env.py
(cd /tmp && timeout 200 python3 "$R/benchmarks/profile_ops.py" --out "$OUT" > "$OUT/profile.log" 2>&1;
 echo "profile rc=$?")
if [[ "${FIRST_CALL:-1}" == 1 ]]; then
  timeout 240 python3 benchmarks/first_call.py --out "$OUT" --max-minutes 3 > "$OUT/first_call.log" 2>&1
  echo "first_call rc=$?"; tail -12 "$OUT/first_call.log"
fi
grep -E "op span|^ +[0-9.]+ us" "$OUT/profile.log" | grep -v "fusion" | cut -c1-110
