#!/usr/bin/env bash
# Prepared in session 10, NOT RUN (see call1.sh). Repository root, .whl carried, one call
# (~9.5 min): the FP8 side by side, tailored phase (vLLM's FP8 half: session 8's run of the same
# kit), with prefill graphs (on by default for FP8 since kb/0026) and async scheduling, and the
# FP8 switch call1.sh picked; then the FP8 accuracy gate with the same switch and prefill graphs
# (the dense-dequant switch changes the rounding: it must pass before it becomes a default).
# Usage: FP8_ENV="TAILORED_FP8_DENSE_DEQUANT=1" TAILORED_COMMIT=<sha> bash logs/gpu/2026-12-01-s10/call2.sh
#        (FP8_ENV="" for today's W8A16 path)
set -uo pipefail
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
export SBS_DIR=/tmp/sbs READY_TIMEOUT=300
# shellcheck disable=SC2086
env ${FP8_ENV:-} CROSSCHECK=0 timeout 400 bash scripts/side_by_side.sh tailored fp8 > /tmp/sbs-call.log 2>&1
grep "^\[sbs\|ready\|WARNING\|died\|not ready" /tmp/sbs-call.log | tail -n 15
grep -v "step timing\|POST\|GET" /tmp/sbs/tailored-server-fp8.log | grep "INFO tailored" | head -10 | cut -c1-220
grep "step timing" /tmp/sbs/tailored-server-fp8.log | sed -n '4p;$p' | cut -c1-330
if [ "$(el)" -lt 420 ]; then
    echo "[call2 +$(el)s] gate fp8 (${FP8_ENV:-W8A16})"
    # shellcheck disable=SC2086
    env ${FP8_ENV:-} GATE_ARGS="--prefill-graphs" timeout $(( 585 - $(el) )) bash scripts/gpu_gate.sh fp8
fi
echo "[call2 +$(el)s] done"
python3 scripts/device_results.py "${OUT:-/tmp/tailored-out}" /tmp/sbs
