#!/usr/bin/env bash
# Prepared in session 21 for the next (carry [".whl"], ~5 min cold; kb/0039 §7.3; never run):
# the bf16 dense GEMV (`fp8_gemv.bf16_gemv`, switch TAILORED_BF16_GEMV_UP_TO, off).
#  1. scripts/bench_fp8_gemv.py --bf16: cuBLAS bf16 vs bf16_gemv's 18 configs at the decode
#     shapes, 1-2 rows (and the FP8 GEMV again).
#  2. bf16 in-process A/B at B=1,2: control, bf16_gemv (3 rounds).
# If it wins: the bf16 gate with TAILORED_BF16_GEMV_UP_TO=2 (scripts/gpu_gate.sh bf16, as in
# call5.sh for FP8), then make it the default and run the side by sides.
# Usage: TAILORED_COMMIT=<sha> OUT=$OUT bash logs/gpu/2026-12-03-s21/next_call_bf16_gemv.sh
source "$(dirname "$0")/../../../scripts/device_env.sh" next_call_bf16_gemv
stamp "dense GEMV bench, FP8 and bf16"
timeout 240 python3 scripts/bench_fp8_gemv.py --bf16 --json "$OUT/gemv.json" > "$OUT/gemv.log" 2>&1
grep "^|\|Error" "$OUT/gemv.log" | tail -16
full_configs > /dev/null
stamp "micro bf16 B=1,2: control, bf16_gemv"
timeout 200 python3 scripts/bench_decode.py /tmp/full --batches 1,2 --json "$OUT/micro-bf16.json" \
    --variants control,bf16_gemv --rounds 3 > "$OUT/micro-bf16.log" 2>&1
grep "^| \|^B=\|Error\|error" "$OUT/micro-bf16.log" | cut -c1-200 | head -10
stamp done
