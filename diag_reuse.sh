#!/usr/bin/env bash
# Untracked: the reuse_before_quiet mutant exchange with its native stack (SIGSEGV, 2026-12-02).
R="$PWD"; cd /tmp
CASES='{"reuse_before_quiet/0": {"transport": "emulated", "mutant": "reuse_before_quiet", "seed": 0, "warps_per_rank": 1, "combine_slots": 2, "timeout_s": 5.0, "chunk_bytes": 128, "max_delay_steps": 16, "snapshot_sources": true}}'
timeout 60 python3 -X faulthandler "$R/tests/transport_exchange.py" "$CASES" 2>&1 | cut -c1-300 | tail -45
cp "$(python3 -c 'import jax_ep._C as c; print(c.__file__)')" "$OUT/"
