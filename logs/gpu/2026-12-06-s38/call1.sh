#!/usr/bin/env bash
# Session 38, call 1 (kb/0058): the GPU tests of the ahead GEMV experts, the sweep that picks
# their configs (written to /tmp/ahead_best.json) and the bf16 in-model A/B with those configs.
# Usage: TAILORED_COMMIT=<sha> OUT=$OUT bash logs/gpu/2026-12-06-s38/call1.sh
set -u
export END=${END:-570} PARTS="tests bench"
export TESTS="tests/test_kernels.py -k 'ahead or route_gemv_moe_matches'"
export BENCHES="python3 scripts/bench_moe_gemv.py --sweep ahead --batches 1,2 --reps 30 --rounds 3 --json $OUT/ahead.json --best-out /tmp/ahead_best.json;cp /tmp/ahead_best.json $OUT/;env TAILORED_MOE_AHEAD_CFG=/tmp/ahead_best.json python3 scripts/bench_decode.py /tmp/full --batches 1,2 --rounds 3 --variants control,moe_ahead2,control,moe_ahead1 --json $OUT/ab-bf16.json"
bash scripts/gpu_call.sh
