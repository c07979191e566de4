#!/usr/bin/env bash
# Session 21, call 5 (carry [".whl"], the last ~460 s of device time, cold): the FP8 dense
# projections of 1-2 rows through the FP8 GEMV in the model (FP8_GEMV_UP_TO, off by default,
# kb/0039 §4; run4's bench: ~0.45 ms a B=1 step).
#  1. In-process FP8 A/B at B=1,2: control, fp8_gemv; 3 rounds.
#  2. The FP8 gate with TAILORED_FP8_GEMV_UP_TO=2, in the time left (END s after the start).
# Usage: TAILORED_COMMIT=<sha> OUT=$OUT END=300 bash logs/gpu/2026-12-03-s21/call5.sh
source "$(dirname "$0")/../../../scripts/device_env.sh" call5
full_configs > /dev/null
stamp "micro fp8 B=1,2: control, fp8_gemv"
timeout 150 python3 scripts/bench_decode.py /tmp/full-fp8 --batches 1,2 --json "$OUT/micro-fp8.json" \
    --variants control,fp8_gemv --rounds 3 > "$OUT/micro-fp8.log" 2>&1
grep "^| \|^B=\|Error\|error" "$OUT/micro-fp8.log" | cut -c1-200 | head -10
left=$(( ${END:-300} - ($(date +%s) - T0) ))
if [ "$left" -gt 100 ]; then
    stamp "FP8 gate with the FP8 GEMV ($left s left)"
    TAILORED_FP8_GEMV_UP_TO=2 TAILORED_MOE_GROUPED_FROM=1024 GATE_ARGS="--prefill-graphs" \
        timeout "$left" bash scripts/gpu_gate.sh fp8 2>&1 \
        | grep "overall\|vs bf16\|gate PASSED\|gate FAILED\|not captured\|Traceback\|Error" | head -10
else
    stamp "no time for the gate ($left s left)"
fi
stamp done
