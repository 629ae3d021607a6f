#!/usr/bin/env bash
set -uo pipefail
R="$PWD"; OUT="${OUT:-$R/gpu_out}"; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PATH="/usr/local/cuda/bin:$PATH" JAX_EP_TIMEOUT_S=10 JAX_EP_COMMIT=${JAX_EP_COMMIT:-unknown}
sum=()
step() { local n=$1 l=$2; shift 2; local s; s=$(date +%s); timeout "$l" "$@" > "$OUT/$n.log" 2>&1; local rc=$?
  sum+=("$n rc=$rc $(( $(date +%s) - s ))s $(grep -E 'passed|failed' "$OUT/$n.log" | tail -1)"); }
step build 400 bash -c "python3 -m pip wheel --no-build-isolation --no-deps -w /tmp/whl . && python3 -m pip install --no-deps --force-reinstall /tmp/whl/jax_ep-*.whl"
cd /tmp
P="$R/benchmarks/profile_ops.py"
step profile 200 python3 "$P" --out "$OUT" --tokens 4096 --ll-tokens 128 --ops dispatch_bf16,combine,ll_dispatch_fp8,ll_dispatch_bf16,ll_combine,ll_dispatch_split_fp8,ll_combine_split
step step 400 python3 "$R/benchmarks/bench_step.py" --out "$OUT" --tag v3 --repeats 20 --host-trace
cd "$R"
step t_new 300 pytest -m gpu -q -p no:cacheprovider tests/test_split_chains.py tests/test_build.py tests/test_env.py "tests/test_gpu.py::test_ops_replay_in_command_buffers"
printf '%s\n' "${sum[@]}"
grep -h -E "op span" "$OUT"/profile.log
grep -h -E "^(E  |FAILED)" "$OUT"/t_new.log | head
grep -A14 "^op " "$OUT/step.log"
(cd "$OUT" && tar czf logs.tgz --remove-files ./*.log)
