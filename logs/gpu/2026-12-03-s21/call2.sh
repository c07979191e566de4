#!/usr/bin/env bash
# Session 21, call 2 (carry [".whl"], ~9.5 min cold): the FP8 experts of 1-2 row MoE inputs
# as GEMVs (MOE_GEMV_UP_TO = 2, kb/0039; bench of run1: T=1 23.0 -> 15.4 us a layer).
#  1. GPU tests: route_gemv_moe, fast path vs plain with the switches on (GEMVs for every
#     dtype up to 4 rows).
#  2. In-process FP8 A/B at B=1,2 (control = GEMV, no_moe_gemv = tiled), 5 rounds, and the
#     B=1 kernel table.
#  3. The FP8 gate (prefill graphs, grouped experts from 1024 tokens): the GEMV sums in another
#     order.
#  4. With the time left: bf16 B=1 A/B of MOE_GEMV_BF16 (off by default).
# Usage: TAILORED_COMMIT=<sha> OUT=$OUT bash logs/gpu/2026-12-03-s21/call2.sh
source "$(dirname "$0")/../../../scripts/device_env.sh" call2
stamp "GPU tests: route_gemv_moe, fast path vs plain (new switches)"
timeout 200 python3 -m pytest -q -rf -p no:cacheprovider tests/test_kernels.py tests/test_gpu.py \
    -k "route_gemv or (fast_path_matches_plain and new)" > "$OUT/tests.log" 2>&1
grep "passed\|failed\|FAILED\|Error" "$OUT/tests.log" | cut -c1-200 | tail -8
full_configs > /dev/null
stamp "micro fp8 B=1,2: control (GEMV), no_moe_gemv (tiled)"
timeout 170 python3 scripts/bench_decode.py /tmp/full-fp8 --batches 1,2 --json "$OUT/micro-fp8.json" \
    --variants control,no_moe_gemv --rounds 5 --profile > "$OUT/micro-fp8.log" 2>&1
grep "^| \|^B=\|Error\|error" "$OUT/micro-fp8.log" | cut -c1-200 | head -14
grep "_kernel\|nvjet\|gemv" "$OUT/micro-fp8.log" | head -16 | cut -c1-60,150-200
left=$(( 585 - ($(date +%s) - T0) ))
stamp "FP8 gate, prefill graphs, grouped experts from 1024 tokens ($left s left)"
TAILORED_MOE_GROUPED_FROM=1024 GATE_ARGS="--prefill-graphs" timeout "$left" bash scripts/gpu_gate.sh fp8 \
    2>&1 | grep "overall\|vs bf16\|gate PASSED\|gate FAILED\|not captured\|captured prefill\|Traceback\|Error" | head -10
left=$(( 585 - ($(date +%s) - T0) ))
if [ "$left" -gt 90 ]; then
    stamp "micro bf16 B=1: control, moe_gemv_bf16 ($left s left)"
    timeout "$left" python3 scripts/bench_decode.py /tmp/full --batches 1 --json "$OUT/micro-bf16.json" \
        --variants control,moe_gemv_bf16 --rounds 3 > "$OUT/micro-bf16.log" 2>&1
    grep "^| \|^B=\|Error\|error" "$OUT/micro-bf16.log" | cut -c1-200 | head -8
fi
stamp done
