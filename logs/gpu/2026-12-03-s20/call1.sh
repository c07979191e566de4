#!/usr/bin/env bash
# Session 20 (kb/0038; carry [".whl"], ~8 min cold):
#  1. GPU tests, failures named (-rf): the combine in the down GEMM's last program (its
#     memory ordering only shows compiled), q_k_norm_rope and conv_recurrent_step (never
#     passed on the GPU yet).
#  2. B=1/B=2 A/B, 5 rounds: the combine in the down GEMM, the two bitwise launch cuts of
#     kb/0037, all three; FP8 at B=1.
#  3. If time is left: test_gpu.py's fast-vs-plain steps with every switch on.
# Usage: TAILORED_COMMIT=<sha> OUT=$OUT bash logs/gpu/2026-12-03-s20/call1.sh
source "$(dirname "$0")/../../../scripts/device_env.sh" call1
stamp "GPU tests: combine in down, q_k_norm_rope, conv_recurrent_step"
timeout 200 python3 -m pytest -q -rf -p no:cacheprovider tests/test_kernels.py \
    -k "combine_in_down or q_k_norm_rope or conv_recurrent" > "$OUT/tests.log" 2>&1
grep "passed\|failed\|FAILED" "$OUT/tests.log" | cut -c1-200 | tail -20
full_configs > /dev/null
C=combine_in_down
P=gdn_conv_fused+qk_one_launch
for spec in "bf16 /tmp/full 1,2 control,$C,$P,$C+$P" "fp8 /tmp/full-fp8 1 control,$C,$C+$P"; do
    set -- $spec
    stamp "micro $1 B=$3: $4"
    timeout 230 python3 scripts/bench_decode.py "$2" --batches "$3" --json "$OUT/micro-$1.json" \
        --variants "$4" --rounds 5 > "$OUT/micro-$1.log" 2>&1
    grep "^| \|^B=\|Error\|error" "$OUT/micro-$1.log" | cut -c1-200 | head -12
done
left=$(( 570 - ($(date +%s) - T0) ))
if [ "$left" -gt 60 ]; then
    stamp "test_gpu fast vs plain, every switch ($left s)"
    timeout "$left" python3 -m pytest -q -rf -p no:cacheprovider tests/test_gpu.py -k "full_width and new" \
        > "$OUT/test_gpu.log" 2>&1
    grep "passed\|failed\|FAILED\|fast vs plain" "$OUT/test_gpu.log" | cut -c1-200 | tail -8
fi
stamp done
