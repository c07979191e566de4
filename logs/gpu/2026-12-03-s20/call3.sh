#!/usr/bin/env bash
# Session 20 (carry [".whl"], ~10 min cold; run2 measured no gain from the combine in the
# down GEMM, so it was reverted): what session 19 left owed, with the tree's defaults.
#  1. Both plain side by sides (tailored half; vLLM's from the kit), tarred into one file.
#  2. With the time left: the FP8 gate with the attention gate in the merge (on since
#     kb/0037; the bf16 gate passed with it, its numbers equal to the last digit), prefill
#     graphs, grouped experts from 1024 tokens (as logs/gpu/next/call7_fp8_gate.sh).
# Usage: TAILORED_COMMIT=<sha> OUT=$OUT bash logs/gpu/2026-12-03-s20/call3.sh
source "$(dirname "$0")/../../../scripts/device_env.sh" call3
for prec in bf16 fp8; do
    stamp "side by side $prec (tailored half, defaults)"
    # run3: 200 s was too short for the first, cold one (Triton compiles ~2 min before the
    # graphs are captured; ~280 s in all); the second finds the compile cache warm (~160 s)
    t=$([ "$prec" = bf16 ] && echo 330 || echo 220)
    OUT=/tmp/sbs-out timeout "$t" bash logs/gpu/2026-12-01-s12/sbs.sh $prec > "$OUT/sbs-$prec.out" 2>&1
    grep "c=1\|c=32" "$OUT/sbs-$prec.out" | tail -2
    tar czf "$OUT/sbs.tgz" -C /tmp sbs sbs-out 2>/dev/null
done
left=$(( ${BUDGET:-590} - ($(date +%s) - T0) ))
if [ "$left" -gt 200 ]; then  # a cold FP8 gate needs ~150-250 s
    stamp "FP8 gate, prefill graphs, grouped experts from 1024 tokens ($left s left)"
    TAILORED_MOE_GROUPED_FROM=1024 GATE_ARGS="--prefill-graphs" timeout "$left" bash scripts/gpu_gate.sh fp8 \
        2>&1 | grep "overall\|vs bf16\|gate PASSED\|gate FAILED\|not captured\|captured prefill\|Traceback\|Error" | head -10
else
    stamp "no time for the FP8 gate ($left s left)"
fi
stamp done
