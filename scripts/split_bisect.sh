#!/usr/bin/env bash
# Bisects the chained split-dispatch failure of profile_ops (issue 18): tokens (plan vs expert
# receive), pairs per program, command buffers, with an HLO dump of the failing program.
set -uo pipefail
R="$PWD"; OUT="${OUT:-$R/gpu_out}"; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PATH="/usr/local/cuda/bin:$PATH" JAX_EP_TIMEOUT_S=5
python3 -m pip install -q --no-deps --force-reinstall /tmp/whl/jax_ep-*.whl > /dev/null 2>&1 || \
  { python3 -m pip wheel -q --no-build-isolation --no-deps -w /tmp/whl . && python3 -m pip install -q --no-deps --force-reinstall /tmp/whl/jax_ep-*.whl; } > "$OUT/build.log" 2>&1
cd /tmp
run() { local name=$1; shift; timeout 120 "$@" > "$OUT/$name.log" 2>&1; echo "$name rc=$? $(grep -m1 -o -E 'op span [0-9.]+ us' "$OUT/$name.log")"; }
P="$R/benchmarks/profile_ops.py"
run t128_i1 python3 "$P" --ll-tokens 128 --hidden 1024 --iters 1 --ops ll_dispatch_split_fp8
run t128_i2 python3 "$P" --ll-tokens 128 --hidden 1024 --iters 2 --ops ll_dispatch_split_fp8
run t8_i8 python3 "$P" --ll-tokens 8 --hidden 1024 --iters 8 --ops ll_dispatch_split_fp8
run t16_i8 python3 "$P" --ll-tokens 16 --hidden 1024 --iters 8 --ops ll_dispatch_split_fp8
run t128_i8_bf16 python3 "$P" --ll-tokens 128 --hidden 1024 --iters 8 --ops ll_dispatch_split_bf16
run t128_i8_comb python3 "$P" --ll-tokens 128 --hidden 1024 --iters 8 --ops ll_combine_split
XLA_FLAGS=--xla_gpu_enable_command_buffer= run t128_i8_nocb python3 "$P" --ll-tokens 128 --hidden 1024 --iters 8 --ops ll_dispatch_split_fp8
XLA_FLAGS="--xla_dump_to=/tmp/dump --xla_dump_hlo_as_text" run t128_i8_dump python3 "$P" --ll-tokens 128 --hidden 1024 --iters 8 --ops ll_dispatch_split_fp8
f=$(ls /tmp/dump/*jit_body*after_optimizations.txt | head -1); grep -c "custom_call_target=\"jax_ep" "$f"; grep -o "custom_call_target=\"jax_ep[a-z_0-9]*\"" "$f" | sort | uniq -c
cp "$f" "$OUT/body_after_opt.txt"; cp /tmp/dump/*jit_body*thunk_sequence.txt "$OUT/" 2>/dev/null
(cd "$OUT" && tar czf logs.tgz --remove-files ./*.log)
