#!/usr/bin/env bash
# Session 18, call 2 (~5 min, carry [".whl"]): the new defaults of kb/0036 (shared expert as
# expert E at one row, routing inside the gate_up programs up to two rows). GPU tests of
# route_fused_moe (bitwise vs route_align + fused_moe, full size bf16/FP8) and the full-width
# fast path vs plain with every switch on; then both gates with the shared expert as expert E
# at every decode batch up to 64 rows (the gate decodes all prompts at once, so one-row steps
# are rare there: this gates a superset of what is served) and routing in gate_up up to 4.
# Usage: TAILORED_COMMIT=<sha> bash logs/gpu/2026-12-03-s18/call2.sh
source "$(dirname "$0")/../../../scripts/device_env.sh" call2
full_configs
stamp "GPU tests: route_fused_moe; fast path vs plain full width (switches new, bf16 dtype)"
timeout 170 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_gpu.py \
    -k "route_fused_moe or (fast_path_matches_plain and new and dtype1)" \
    2>&1 | grep "passed\|failed\|Error\|assert" | tail -8
for prec in bf16 fp8; do
    stamp "gate $prec, prefill graphs, shared expert as E up to 64 rows, route in gate_up up to 4"
    TAILORED_SHARED_IN_MOE_UP_TO=64 TAILORED_MOE_ROUTE_IN_GATE_UP_UP_TO=4 GATE_ARGS="--prefill-graphs" \
        timeout 170 bash scripts/gpu_gate.sh $prec \
        2>&1 | grep "overall\|vs bf16\|gate PASSED\|gate FAILED\|not captured\|Traceback\|Error" | head -8
done
stamp "done"
