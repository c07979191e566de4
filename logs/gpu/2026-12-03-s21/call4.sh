#!/usr/bin/env bash
# Session 21, call 4 (carry [".whl"], ~7 min cold; the session's last ~650 s of device time):
# the FP8 dense GEMV (kernels/fp8_gemv.py, kb/0039 §4; not in the model) against cuBLAS over
# the dequantized bf16 weights (what FP8 serving runs) and the tiled W8A16 GEMM, at the
# model's decode shapes, 1 and 2 rows.
# Usage: TAILORED_COMMIT=<sha> OUT=$OUT bash logs/gpu/2026-12-03-s21/call4.sh
source "$(dirname "$0")/../../../scripts/device_env.sh" call4
stamp "FP8 dense GEMV bench"
timeout "${LIMIT:-400}" python3 scripts/bench_fp8_gemv.py --json "$OUT/fp8-gemv.json" > "$OUT/fp8-gemv.log" 2>&1
grep "^|\|Error" "$OUT/fp8-gemv.log" | tail -16
stamp done
