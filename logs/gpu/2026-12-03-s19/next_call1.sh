#!/usr/bin/env bash
# Prepared in session 19 for the next (kb/0037 §3, §5; carry [".whl"], ~5 min cold):
#  1. GPU tests of the two bitwise launch cuts, failures named (-rf): q_k_norm_rope and
#     conv_recurrent_step (run6 failed 8 of its 24 cases without names).
#  2. B=1/B=2 A/B with 5 rounds: each cut alone, both, and attention splits; FP8 at B=1.
# Usage: TAILORED_COMMIT=<sha> OUT=$OUT bash logs/gpu/2026-12-03-s19/next_call1.sh
source "$(dirname "$0")/../../../scripts/device_env.sh" next_call1
stamp "GPU tests: q_k_norm_rope, conv_recurrent_step"
timeout 150 python3 -m pytest -q -rf -p no:cacheprovider tests/test_kernels.py \
    -k "q_k_norm_rope or conv_recurrent" > "$OUT/tests.log" 2>&1
grep "passed\|failed\|FAILED" "$OUT/tests.log" | cut -c1-160 | tail -20
full_configs > /dev/null
V=control,gdn_conv_fused,qk_one_launch,gdn_conv_fused+qk_one_launch,attn_splits
for spec in "bf16 /tmp/full 1,2 $V" "fp8 /tmp/full-fp8 1 control,gdn_conv_fused+qk_one_launch"; do
    set -- $spec
    stamp "micro $1 B=$3: $4"
    timeout 200 python3 scripts/bench_decode.py "$2" --batches "$3" --json "$OUT/micro-$1.json" \
        --variants "$4" --rounds 5 > "$OUT/micro-$1.log" 2>&1
    grep "^| \|^B=\|Error\|error" "$OUT/micro-$1.log" | cut -c1-200 | head -8
done
stamp done
