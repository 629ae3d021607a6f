#!/usr/bin/env bash
# One device call (issue 17/18 probe): build, the chained-halves repro, the step benchmark with a
# host trace, command buffers off, XLA's command-buffer logging, an HLO dump of the decode step.
set -uo pipefail
R="$PWD"; OUT="${OUT:-$R/gpu_out}"; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PATH="/usr/local/cuda/bin:$PATH"
export JAX_EP_TIMEOUT_S=10 JAX_EP_COMMIT="${JAX_EP_COMMIT:-unknown}"
sum=()
step() { local n=$1 l=$2; shift 2; local s; s=$(date +%s); timeout "$l" "$@" > "$OUT/$n.log" 2>&1; local rc=$?
  sum+=("$n rc=$rc $(( $(date +%s) - s ))s $(grep -E 'passed|failed' "$OUT/$n.log" | tail -1)"); }
step build 300 bash -c "python3 -m pip wheel --no-build-isolation --no-deps -w /tmp/whl . && python3 -m pip install --no-deps --force-reinstall /tmp/whl/jax_ep-*.whl"
cd /tmp
step hang 150 python3 "$R/benchmarks/profile_ops.py" --ll-tokens 128 --hidden 1024 --ops ll_dispatch_split_fp8,ll_combine_split --out /tmp/p
step plan 150 python3 "$R/benchmarks/profile_ops.py" --tokens 4096 --ops dispatch_bf16,combine --out /tmp/p2
step step_base 400 python3 "$R/benchmarks/bench_step.py" --out "$OUT" --tag base --repeats 20 --host-trace
XLA_FLAGS=--xla_gpu_enable_command_buffer= step step_nocb 200 python3 "$R/benchmarks/bench_step.py" --out "$OUT" --tag nocmdbuf --impls jax_ep --repeats 20 --host-trace
TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_thunk=3,command_buffer_cmd=3,custom_call_thunk=2 step vlog 150 python3 "$R/benchmarks/bench_step.py" --out /tmp/v --impls jax_ep --ops decode_step --dtypes bf16 --repeats 4 --no-kernel-trace
XLA_FLAGS="--xla_dump_to=/tmp/dump --xla_dump_hlo_as_text" step dump 150 python3 "$R/benchmarks/bench_step.py" --out /tmp/d --impls jax_ep --ops decode_step --dtypes bf16 --repeats 2 --no-kernel-trace
(cd /tmp/dump && tar czf "$OUT/dump.tgz" $(ls | grep -E 'after_optimizations.txt|thunk' | head -20)) 2>/dev/null
cd "$R"
step t_chain 300 pytest -m gpu -q -p no:cacheprovider tests/test_split_chains.py tests/test_low_latency_split.py
printf '%s\n' "${sum[@]}"
grep -h -E "^(E  |FAILED)|Error|error" "$OUT"/hang.log "$OUT"/t_chain.log | head -20
grep -c -i "update" "$OUT/vlog.log"; grep -i -E "record|update" "$OUT/vlog.log" | sed -E 's/^.{0,40}\] //' | sort | uniq -c | sort -rn | head -15
grep -A12 "^op " "$OUT/step_base.log"; grep -A4 "^op " "$OUT/step_nocb.log"
(cd "$OUT" && tar czf logs.tgz --remove-files ./*.log)
