#!/usr/bin/env bash
# Low-latency kernel probe on whatever GPUs are visible (one is enough: EP = number of GPUs):
# kernel times over T and grid sizes (CUPTI, profile_ops.py), then Nsight Compute's summary
# (duration, SM active cycles, occupancy, stall hints) of the fp8 dispatch and the combine
# kernels. Logs and reports under $OUT.
#   PROBE_TOKENS (default "1 16 128"), PROBE_BLOCKS (grid sizes at T=128, default "32 64 132"),
#   PROBE_NCU=0 skips Nsight Compute
set -uo pipefail
R="$PWD"; OUT="${OUT:-$R/probe_out}"; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PATH="/usr/local/cuda/bin:$PATH"
if ! python3 -c "import jax_ep._C" 2> /dev/null; then
  timeout 300 python3 -m pip install --no-build-isolation --no-deps . > "$OUT/build.log" 2>&1 ||
    { tail -30 "$OUT/build.log"; exit 1; }
fi
PROFILE="$R/benchmarks/profile_ops.py"
OPS=ll_dispatch_fp8,ll_dispatch_bf16,ll_combine
cd /tmp
spans() { grep -E "op span" "$1" | sed 's/ \+/ /g'; }
for t in ${PROBE_TOKENS:-1 16 128}; do
  timeout 90 python3 "$PROFILE" --ll-tokens "$t" --ops $OPS --out "$OUT" --tag "ll-t$t" \
    > "$OUT/profile_t$t.log" 2>&1
  echo "T=$t"; spans "$OUT/profile_t$t.log"
done
for b in ${PROBE_BLOCKS:-32 64 132}; do
  JAX_EP_LOW_LATENCY_BLOCKS=$b timeout 90 python3 "$PROFILE" --ll-tokens 128 --ops $OPS \
    --out "/tmp/probe_b$b" > "$OUT/profile_b$b.log" 2>&1
  echo "T=128 blocks=$b"; spans "$OUT/profile_b$b.log"
done
[[ "${PROBE_NCU:-1}" == 0 ]] && KERNELS="" || KERNELS="low_latency_dispatch_kernel low_latency_combine_kernel"
for kernel in $KERNELS; do
  op=$([[ $kernel == *dispatch* ]] && echo ll_dispatch_fp8 || echo ll_combine)
  timeout 240 ncu --section SourceCounters --section WarpStateStats --section LaunchStats \
    --section Occupancy --section SpeedOfLight -k "regex:$kernel" --launch-skip 4 \
    --launch-count 1 -f -o "$OUT/$kernel" python3 "$PROFILE" --ll-tokens 128 --ops "$op" \
    --iters 2 --no-trace > "$OUT/ncu_$kernel.log" 2>&1
  echo "== $kernel"
  # The details page (the source page's CSV of ncu 2025.3 carries no stall columns).
  ncu --import "$OUT/$kernel.ncu-rep" --page details > "$OUT/ncu_$kernel.details.log" 2>&1
  grep -E "^ +(Duration|Elapsed Cycles|SM Active Cycles|Registers Per Thread|Achieved Occupancy|Warp Cycles Per Issued)|Est\. (Local )?Speedup|stalled" \
    "$OUT/ncu_$kernel.details.log" | head -20
done
(cd "$OUT" && tar czf probe_logs.tgz --remove-files ./*.log 2> /dev/null; ls)
