#!/usr/bin/env bash
# Prepared in session 11, NOT RUN. Second call (~5 min): the bf16 and FP8 gates with the
# switches call1_ab.sh showed faster. SWITCHES: the bf16-side words (e.g.
# "TAILORED_GDN_PREFILL_CONV=1 TAILORED_PROJ_ROW_ALIGN=64"), FP8_SWITCHES: added for FP8 (e.g.
# "TAILORED_MOE_FP8_DOT_F16=1"). Each changes rounding, so each needs this gate before it
# becomes a default; the gate JSON records them under kernel_switches.
# Usage: SWITCHES="..." FP8_SWITCHES="..." TAILORED_COMMIT=<sha> bash logs/gpu/next/call2_gate.sh
set -uo pipefail
# shellcheck disable=SC2086
env ${SWITCHES:-} GATE_ARGS="--prefill-graphs" timeout 200 bash scripts/gpu_gate.sh bf16 2>&1 \
    | grep "overall\|vs bf16 reference\|gate PASSED\|gate FAILED\|Traceback\|Error" | head -6
# shellcheck disable=SC2086
env ${SWITCHES:-} ${FP8_SWITCHES:-} GATE_ARGS="--prefill-graphs" timeout 200 bash scripts/gpu_gate.sh fp8 2>&1 \
    | grep "overall\|vs bf16 reference\|gate PASSED\|gate FAILED\|Traceback\|Error" | head -6
