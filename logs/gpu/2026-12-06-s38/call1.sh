#!/usr/bin/env bash
# Session 38, call 1 (kb/0058): the sweep of the ahead GEMV experts (its rel column checks them
# against the tiled kernels at full size; the GPU tests wait, device time is short), which picks
# their configs (written to /tmp/ahead_best.json) and the in-model A/B with those configs:
# bf16 on an H200, FP8 on an H100 (a bf16 model and its graphs do not fit 80 GB).
# Usage: TAILORED_COMMIT=<sha> OUT=$OUT bash logs/gpu/2026-12-06-s38/call1.sh
set -u
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if [ "${mem:-0}" -gt 100000 ]; then ab=/tmp/full; prec=bf16; else ab=/tmp/full-fp8; prec=fp8; fi
export END=${END:-570} PARTS="bench"
export TESTS="tests/test_kernels.py -k 'ahead or route_gemv_moe_matches'"
export BENCHES="python3 scripts/bench_moe_gemv.py --sweep ahead --batches 1,2 --reps 20 --rounds 3 --json $OUT/ahead.json --best-out /tmp/ahead_best.json;cp /tmp/ahead_best.json $OUT/;env TAILORED_MOE_AHEAD_CFG=/tmp/ahead_best.json python3 scripts/bench_decode.py $ab --batches 1,2 --rounds 3 --variants control,moe_ahead2,control,moe_ahead1 --json $OUT/ab-$prec.json"
bash scripts/gpu_call.sh
