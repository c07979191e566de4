#!/usr/bin/env bash
# Session 16 (~5 min cold, carry [".whl"]; its run8 with a 150 s limit was cut before the
# gate's numbers, so the limit is now 300 s): the FP8 gate with prefill graphs and the grouped
# experts from 1024 tokens, as call1_verify.sh ran the bf16 one (run2). The last FP8 gate pass
# (session 13, run5) predates the prefill-graph capture fix (58cb8d8).
# Usage: TAILORED_COMMIT=<sha> bash logs/gpu/next/call7_fp8_gate.sh
source "$(dirname "$0")/../../../scripts/device_env.sh" call7_fp8_gate
stamp "FP8 gate, prefill graphs, grouped experts from 1024 tokens"
TAILORED_MOE_GROUPED_FROM=1024 GATE_ARGS="--prefill-graphs" timeout 300 bash scripts/gpu_gate.sh fp8 \
    2>&1 | grep "overall\|vs bf16\|gate PASSED\|gate FAILED\|not captured\|captured prefill\|Traceback\|Error" | head -8
stamp "done"
