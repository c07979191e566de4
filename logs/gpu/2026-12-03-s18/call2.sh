#!/usr/bin/env bash
# Session 18, call 2 (one per precision, ~6-9 min cold, carry [".whl"]): the new defaults of kb/0036
# (shared expert as expert E at one row, routing inside the gate_up programs up to two rows).
# TESTS=1: GPU tests of route_fused_moe first (bitwise vs route_align + fused_moe, full size
# bf16/FP8). Then the gate with the shared expert as expert E at every decode batch up to 64
# rows and routing in gate_up up to 4 (the gate decodes all prompts at once, so one-row steps
# are rare there: this gates a superset of what is served), then the plain side by side.
# AB=1: also the B=1 A/B of TAILORED_ATTN_GATE_IN_MERGE before the side by side.
# Usage: TAILORED_COMMIT=<sha> [TESTS=1] [AB=1] bash logs/gpu/2026-12-03-s18/call2.sh bf16|fp8
PREC=${1:?usage: call2.sh bf16|fp8}
source "$(dirname "$0")/../../../scripts/device_env.sh" call2-$PREC
if [ "${TESTS:-0}" = 1 ]; then
    stamp "GPU tests: route_fused_moe, paged decode attention (with the gate in the merge)"
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py -k "route_fused_moe or paged_decode" \
        2>&1 | grep "passed\|failed\|Error\|assert" | tail -8
fi
stamp "gate $PREC, prefill graphs, shared expert as E up to 64 rows, route in gate_up up to 4"
TAILORED_SHARED_IN_MOE_UP_TO=64 TAILORED_MOE_ROUTE_IN_GATE_UP_UP_TO=4 GATE_ARGS="--prefill-graphs" \
    timeout 280 bash scripts/gpu_gate.sh $PREC \
    2>&1 | grep "overall\|vs bf16\|gate PASSED\|gate FAILED\|not captured\|Traceback\|Error" | head -8
if [ "${AB:-0}" = 1 ]; then
    stamp "micro $PREC: B=1 A/B of the attention gate in the merge (kb/0036)"
    PRECISIONS=$PREC MICRO_BATCHES=1 MICRO_TIMEOUT=150 MICRO_TAIL=6 \
        MICRO_ARGS="--variants control,attn_gate_in_merge --rounds 3" \
        timeout 160 bash scripts/gpu_fast.sh micro > "$OUT/micro-$PREC.log" 2>&1
    grep "^| \|^B=\|Error\|error" "$OUT/micro-$PREC.log" | cut -c1-150 | head -8
fi
stamp "side by side $PREC (tailored half)"
OUT=$OUT timeout 300 bash logs/gpu/2026-12-01-s12/sbs.sh $PREC
stamp "done"
