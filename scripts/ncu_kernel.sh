#!/usr/bin/env bash
# One jax_ep kernel under Nsight Compute, from a profile_ops.py run (run from the repository root
# with jax_ep installed): launch statistics, warp states and, per SASS line, how often it ran
# and where warps stalled. Our short kernels give few stall samples; the instruction counts per
# line are the useful part (e.g. a 32-bit division per id showed up as ~30 lines run per id).
#   bash scripts/ncu_kernel.sh dispatch_plan_kernel --tokens 4096 --ops dispatch_bf16
#   bash scripts/ncu_kernel.sh low_latency_dispatch_kernel --ll-tokens 128 --ops ll_dispatch_bf16
# Writes $OUT/ncu/<kernel>.{ncu-rep,details.txt,sass.csv} and prints the details page's summary.
set -uo pipefail
R="$PWD"; OUT="${OUT:-$R/gpu_out}"; mkdir -p "$OUT/ncu"
kernel=$1; shift
rep="$OUT/ncu/$kernel"
(cd /tmp && timeout "${NCU_S:-200}" ncu --target-processes all --kernel-name "regex:$kernel" \
  --launch-skip "${NCU_SKIP:-3}" --launch-count 1 --section SpeedOfLight --section LaunchStats \
  --section Occupancy --section SchedulerStats --section WarpStateStats --section SourceCounters \
  -f -o "$rep" python3 "$R/benchmarks/profile_ops.py" --iters 4 --out "$OUT/ncu/profile" "$@" \
  > "$rep.log" 2>&1)
ncu -i "$rep.ncu-rep" --page details > "$rep.details.txt" 2>&1
ncu -i "$rep.ncu-rep" --page source --csv --print-source sass > "$rep.sass.csv" 2>&1
grep -E "^\s+(Duration|Elapsed Cycles|Grid Size|Block Size|Registers Per Thread|Warp Cycles Per Issued Instruction|Achieved Occupancy)" "$rep.details.txt"
