#!/usr/bin/env bash
# Session 20, after run1 (kb/0038; carry [".whl"], ~5 min cold): run1 passed the GPU tests of
# q_k_norm_rope and conv_recurrent_step (bitwise in bf16) but the combine in the down GEMM
# did not compile on Triton 3.6 (a str constexpr between jit functions). Again, fixed:
#  1. its GPU tests (memory ordering: only compiled), failures named;
#  2. B=1 A/B, 5 rounds: control, the combine in the down GEMM (C), the two bitwise cuts of
#     kb/0037 (P), C+P; FP8: control, C+P.
# Usage: TAILORED_COMMIT=<sha> OUT=$OUT bash logs/gpu/2026-12-03-s20/call2.sh
source "$(dirname "$0")/../../../scripts/device_env.sh" call2
stamp "GPU tests: combine in down"
timeout 150 python3 -m pytest -q -rf -p no:cacheprovider tests/test_kernels.py \
    -k "combine_in_down or moe_combine" > "$OUT/tests.log" 2>&1
grep "passed\|failed\|FAILED" "$OUT/tests.log" | cut -c1-200 | tail -12
full_configs > /dev/null
C=combine_in_down
P=gdn_conv_fused+qk_one_launch
for spec in "bf16 /tmp/full 1 control,$C,$P,$C+$P" "fp8 /tmp/full-fp8 1 control,$C+$P"; do
    set -- $spec
    stamp "micro $1 B=$3: $4"
    timeout 200 python3 scripts/bench_decode.py "$2" --batches "$3" --json "$OUT/micro-$1.json" \
        --variants "$4" --rounds 5 > "$OUT/micro-$1.log" 2>&1
    grep "^| \|^B=\|Error\|error" "$OUT/micro-$1.log" | cut -c1-200 | head -12
done
stamp done
