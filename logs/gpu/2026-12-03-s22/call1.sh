#!/usr/bin/env bash
# Session 22, call 1 (carry [".whl"], cold, ≤ ~560 s; kb/0040). Leaves its verdicts in
# /tmp/s22-state for call2.sh, which must follow while the machine is warm.
#  1. FP8 in-process A/B at B=1,2: control (fp8_gemv.FP8_CFGS, configs by shape) against
#     fp8_gemv_one_cfg (session 21's one CFG), control again; 3 rounds.
#  2. scripts/bench_fp8_gemv.py --bf16: the bf16 GEMV's 18 configs against cuBLAS (never run).
#  3. bf16 in-process A/B at B=1,2: control, bf16_gemv (one CFG), bf16_gemv_fp8_cfgs.
#  4. The FP8 gate with the table (defaults), then, if a bf16 GEMV variant won by ≥ 1 % at
#     B=1, the bf16 gate with it, in the time left (END s after the start).
# Usage: TAILORED_COMMIT=<sha> OUT=$OUT END=560 bash logs/gpu/2026-12-03-s22/call1.sh
source "$(dirname "$0")/../../../scripts/device_env.sh" call1
: > /tmp/s22-state
full_configs > /dev/null
stamp "micro fp8 B=1,2: control (configs by shape), fp8_gemv_one_cfg"
timeout 170 python3 scripts/bench_decode.py /tmp/full-fp8 --batches 1,2 --json "$OUT/micro-fp8.json" \
    --variants control,fp8_gemv_one_cfg,control --rounds 3 > "$OUT/micro-fp8.log" 2>&1
grep "^| \|^B=\|Error\|error" "$OUT/micro-fp8.log" | cut -c1-200 | head -10
stamp "dense GEMV bench, FP8 and bf16"
timeout 150 python3 scripts/bench_fp8_gemv.py --bf16 --json "$OUT/gemv.json" > "$OUT/gemv.log" 2>&1
grep "^|\|Error" "$OUT/gemv.log" | tail -14
stamp "micro bf16 B=1,2: control, bf16_gemv, bf16_gemv_fp8_cfgs"
timeout 170 python3 scripts/bench_decode.py /tmp/full --batches 1,2 --json "$OUT/micro-bf16.json" \
    --variants control,bf16_gemv,bf16_gemv_fp8_cfgs --rounds 3 > "$OUT/micro-bf16.log" 2>&1
grep "^| \|^B=\|Error\|error" "$OUT/micro-bf16.log" | cut -c1-200 | head -10
# the bf16 GEMV variant to gate: the faster of the two at B=1 if ≥ 1 % under control
python3 - "$OUT/micro-bf16.json" >> /tmp/s22-state <<'PY'
import json, sys
try:
    v = json.load(open(sys.argv[1]))["variants"]
    b1 = {k: r[0]["graph_ms_min"] for k, r in v.items()}
    best = min(("bf16_gemv", "bf16_gemv_fp8_cfgs"), key=b1.get)
    print(f"bf16_won={best if b1[best] < 0.99 * b1['control'] else ''}")
except Exception as e:  # no JSON: nothing won
    print("bf16_won=")
PY
cat /tmp/s22-state
gate() {  # gate PREC LEFT [env...]: the gate's summary lines; "gate_PREC=PASSED|FAILED" to the state
    local prec=$1 left=$2; shift 2
    env "$@" TAILORED_MOE_GROUPED_FROM=1024 GATE_ARGS="--prefill-graphs" timeout "$left" \
        bash scripts/gpu_gate.sh "$prec" > "$OUT/gate-$prec.out" 2>&1
    grep "overall\|vs bf16\|gate PASSED\|gate FAILED\|not captured\|Traceback\|Error" "$OUT/gate-$prec.out" | head -10
    echo "gate_$prec=$(grep -o "gate PASSED\|gate FAILED" "$OUT/gate-$prec.out" | tail -1 | cut -d' ' -f2)" >> /tmp/s22-state
}
left=$(( ${END:-560} - ($(date +%s) - T0) ))
if [ "$left" -gt 100 ]; then
    stamp "FP8 gate, configs by shape ($left s left)"; gate fp8 "$left"
fi
won=$(grep -o "bf16_won=.*" /tmp/s22-state | cut -d= -f2)
left=$(( ${END:-560} - ($(date +%s) - T0) ))
if [ -n "$won" ] && [ "$left" -gt 100 ]; then
    cfgs=$([ "$won" = bf16_gemv_fp8_cfgs ] && echo 1 || echo 0)
    stamp "bf16 gate with $won ($left s left)"
    gate bf16 "$left" TAILORED_BF16_GEMV_UP_TO=2 TAILORED_BF16_GEMV_FP8_CFGS=$cfgs
fi
cp /tmp/s22-state "$OUT/state"
stamp done
