#!/usr/bin/env bash
# Session 11, call 5: where the decode step's time goes with this tree's defaults (FP8 dense
# dequant on): kernel tables of the B=1 graph step (FP8, bf16) and of the B=32 step (bf16;
# FP8's is in run1), for the closing note's "which target resists and why".
# Usage: TAILORED_COMMIT=<sha> bash logs/gpu/2026-12-01-s11/call5.sh
source "$(dirname "$0")/../../../scripts/device_env.sh" call5
for spec in "fp8 1 1" "bf16 1 1" "bf16 32 32"; do
    set -- $spec
    stamp "profile $1 B=$3"
    PRECISIONS=$1 MICRO_BATCHES=$2 MICRO_TIMEOUT=150 MICRO_TAIL=60 \
        MICRO_ARGS="--profile --profile-batch $3" \
        timeout 170 bash scripts/gpu_fast.sh micro > /tmp/p.log 2>&1
    cp /tmp/p.log "$OUT/profile-$1-b$3.log"
done
stamp "done"
