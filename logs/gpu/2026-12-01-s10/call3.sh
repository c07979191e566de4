#!/usr/bin/env bash
# Prepared in session 10, NOT RUN (see call1.sh; it replaces session 9's unrun call4.sh).
# Repository root, .whl carried, one call (~9 min): the bf16 side by side, tailored phase
# (vLLM's bf16 half: session 7's run of the same kit), with the kb/0024 defaults, prefill graphs
# and async scheduling (kb/0025: +11 % c=1, +20 % c=32 on the smaller gpu_fast workload, never
# in a side by side); then the bf16 gate, which now runs the async engine.
# Usage: TAILORED_COMMIT=<sha> bash logs/gpu/2026-12-01-s10/call3.sh
set -uo pipefail
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
export SBS_DIR=/tmp/sbs READY_TIMEOUT=300
CROSSCHECK=0 timeout 390 bash scripts/side_by_side.sh tailored bf16 > /tmp/sbs-call.log 2>&1
grep "^\[sbs\|ready\|WARNING\|died\|not ready" /tmp/sbs-call.log | tail -n 12
grep "step timing" /tmp/sbs/tailored-server-bf16.log | sed -n '4p;$p' | cut -c1-330
if [ "$(el)" -lt 420 ]; then
    echo "[call3 +$(el)s] gate bf16"
    GATE_ARGS="--prefill-graphs" timeout $(( 585 - $(el) )) bash scripts/gpu_gate.sh bf16
fi
echo "[call3 +$(el)s] done"
python3 scripts/device_results.py "${OUT:-/tmp/tailored-out}" /tmp/sbs
