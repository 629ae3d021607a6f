#!/usr/bin/env bash
# Untracked: does the emulated probe's trap go with CUDA_DEVICE_MAX_CONNECTIONS (2026-12-02)?
cd /tmp
probe() {  # $1: label, $2: python kwargs
  echo "=== probe $1 (CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-default})"
  timeout 30 python3 -X faulthandler -c "
from jax_ep import _C
_C.print_native_stack_on_crash()
print(_C.transport_probe($2))" 2>&1 | tail -4 | cut -c1-300
}
probe r8w3 "transport='emulated', num_ranks=8, warps_per_rank=3, rows=13, rounds=1, transport_timeout_s=2"
CUDA_DEVICE_MAX_CONNECTIONS=32 probe r8w3 "transport='emulated', num_ranks=8, warps_per_rank=3, rows=13, rounds=1, transport_timeout_s=2"
CUDA_DEVICE_MAX_CONNECTIONS=32 probe r8w3harsh "transport='emulated', num_ranks=8, warps_per_rank=3, rows=13, chunk_bytes=128, max_delay_steps=16, snapshot_sources=True, transport_timeout_s=4"
