#!/usr/bin/env bash
# Session 18, call 3 (~6.5 min cold, carry [".whl"]): what call2.sh does, fitted into the one
# call the shrunken budget allows (four attempts found no machine): the GPU kernel tests of
# route_fused_moe and the gated decode attention, both gates with the shared expert as
# expert E up to 64 rows and routing in gate_up up to 4 (a superset of the served one-row /
# two-row defaults, kb/0036), then the bf16 side by side. The FP8 side by side is left for
# `call2.sh fp8`.
# Usage: TAILORED_COMMIT=<sha> bash logs/gpu/2026-12-03-s18/call3.sh
source "$(dirname "$0")/../../../scripts/device_env.sh" call3
stamp "GPU tests: route_fused_moe, paged decode attention (with the gate in the merge)"
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py -k "route_fused_moe or paged_decode" \
    2>&1 | grep "passed\|failed\|Error\|assert" | tail -8
for prec in bf16 fp8; do
    stamp "gate $prec, prefill graphs, shared expert as E up to 64 rows, route in gate_up up to 4"
    TAILORED_SHARED_IN_MOE_UP_TO=64 TAILORED_MOE_ROUTE_IN_GATE_UP_UP_TO=4 GATE_ARGS="--prefill-graphs" \
        timeout 150 bash scripts/gpu_gate.sh $prec \
        2>&1 | grep "overall\|vs bf16\|gate PASSED\|gate FAILED\|not captured\|Traceback\|Error" | head -8
done
stamp "side by side bf16 (tailored half)"
OUT=$OUT timeout 210 bash logs/gpu/2026-12-01-s12/sbs.sh bf16
stamp "done"
