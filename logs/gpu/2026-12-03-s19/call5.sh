#!/usr/bin/env bash
# Session 19, call 5 (cold machine, ~6-7 min; carry [".whl"]): kb/0037.
#  1. GPU tests of gdn_decode.conv_recurrent_step: bitwise against conv_step + recurrent_step
#     (bf16 and fp32, full-size heads) and the decode-step tests beside it.
#  2. In-process A/B of the fused GDN conv (bench_decode variant gdn_conv_fused): bf16 B=1,2,
#     FP8 B=1, 3 rounds each against a re-captured control; bf16 also attention splits by
#     batch (kb/0019: B=1 -2.9 % in session 9, inside that run's noise); both the MoE's first
#     GEMM in the norm's launch at one row (norm_router: changes numerics, gate owed if kept).
#  3. While time is left (< 200 s used): the bf16 side by side with the tree's defaults (the
#     attention gate in the merge now on; the fused conv off), its files tarred into one.
# Usage: TAILORED_COMMIT=<sha> OUT=$OUT bash logs/gpu/2026-12-03-s19/call5.sh
source "$(dirname "$0")/../../../scripts/device_env.sh" call5
stamp "GPU tests: conv_recurrent_step, gdn decode step"
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py \
    -k "conv_recurrent" 2>&1 | grep "passed\|failed\|Error\|assert" | tail -6
full_configs > /dev/null
for spec in "bf16 /tmp/full 1,2 control,gdn_conv_fused,attn_splits,norm_router" "fp8 /tmp/full-fp8 1 control,gdn_conv_fused,norm_router"; do
    set -- $spec
    stamp "micro $1 B=$3: $4"
    timeout 150 python3 scripts/bench_decode.py "$2" --batches "$3" --json "$OUT/micro-$1.json" \
        --variants $4 --rounds 3 > "$OUT/micro-$1.log" 2>&1
    grep "^| \|^B=\|Error\|error" "$OUT/micro-$1.log" | cut -c1-150 | head -8
done
USED=$(( $(date +%s) - T0 ))
if [ "$USED" -lt 200 ]; then
    stamp "side by side bf16 (tailored half, defaults)"
    OUT=$OUT timeout 200 bash logs/gpu/2026-12-01-s12/sbs.sh bf16 > "$OUT/sbs-bf16.out" 2>&1
    grep "c=1\|c=32" "$OUT/sbs-bf16.out" | tail -2
    tar czf "$OUT/sbs-bf16.tgz" -C /tmp sbs 2>/dev/null; rm -rf "$OUT/sbs"
else
    stamp "no time for the side by side ($USED s used)"
fi
stamp done
