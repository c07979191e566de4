#!/usr/bin/env bash
# Session 22, call 2 (carry [".whl"], right after call1.sh while warm, ≤ ~580 s; kb/0040):
#  1. If call 1's bf16 GEMV variant won but had no time for its gate: the bf16 gate with it.
#  2. Both plain side by sides (tailored half; vLLM's from the kit), tarred into sbs.tgz: FP8
#     with the tree's defaults (FP8 GEMV with configs by shape), bf16 with the bf16 GEMV
#     switched on through the environment if its gate passed (recorded in env_switches).
#  3. With the time left: the FP8 and bf16 B=1 per-kernel profiles (where the step goes now).
# Usage: TAILORED_COMMIT=<sha> OUT=$OUT END=580 bash logs/gpu/2026-12-03-s22/call2.sh
source "$(dirname "$0")/../../../scripts/device_env.sh" call2
touch /tmp/s22-state; cat /tmp/s22-state
won=$(grep -o "bf16_won=.*" /tmp/s22-state | cut -d= -f2)
bf16_env=()
[ -n "$won" ] && bf16_env=(TAILORED_BF16_GEMV_UP_TO=2 TAILORED_BF16_GEMV_FP8_CFGS=$([ "$won" = bf16_gemv_fp8_cfgs ] && echo 1 || echo 0))
if [ -n "$won" ] && ! grep -q "gate_bf16=" /tmp/s22-state; then
    full_configs > /dev/null
    stamp "bf16 gate with $won"
    env "${bf16_env[@]}" TAILORED_MOE_GROUPED_FROM=1024 GATE_ARGS="--prefill-graphs" timeout 200 \
        bash scripts/gpu_gate.sh bf16 > "$OUT/gate-bf16.out" 2>&1
    grep "overall\|vs bf16\|gate PASSED\|gate FAILED\|not captured\|Traceback\|Error" "$OUT/gate-bf16.out" | head -10
    echo "gate_bf16=$(grep -o "gate PASSED\|gate FAILED" "$OUT/gate-bf16.out" | tail -1 | cut -d' ' -f2)" >> /tmp/s22-state
fi
grep -q "gate_bf16=PASSED" /tmp/s22-state || bf16_env=()
for prec in fp8 bf16; do
    e=(); [ "$prec" = bf16 ] && e=("${bf16_env[@]}")
    stamp "side by side $prec (tailored half) ${e[*]}"
    t=$([ -d /tmp/tailored-cache ] && echo 220 || echo 330)
    env "${e[@]}" OUT=/tmp/sbs-out timeout "$t" bash logs/gpu/2026-12-01-s12/sbs.sh $prec > "$OUT/sbs-$prec.out" 2>&1
    grep "c=1\|c=32" "$OUT/sbs-$prec.out" | tail -2
    tar czf "$OUT/sbs.tgz" -C /tmp sbs sbs-out 2>/dev/null
done
left=$(( ${END:-580} - ($(date +%s) - T0) ))
if [ "$left" -gt 60 ]; then
    full_configs > /dev/null
    stamp "B=1 per-kernel profiles, FP8 then bf16 ($left s left)"
    timeout $(( left / 2 )) python3 scripts/bench_decode.py /tmp/full-fp8 --batches 1 --profile \
        > "$OUT/profile-fp8.log" 2>&1
    left=$(( ${END:-580} - ($(date +%s) - T0) ))
    [ "$left" -gt 30 ] && env "${bf16_env[@]}" timeout "$left" python3 scripts/bench_decode.py /tmp/full \
        --batches 1 --profile > "$OUT/profile-bf16.log" 2>&1
    tar czf "$OUT/profiles.tgz" -C "$OUT" $(cd "$OUT" && ls profile-*.log 2>/dev/null) && rm -f "$OUT"/profile-*.log
fi
cp /tmp/s22-state "$OUT/state"
stamp done
