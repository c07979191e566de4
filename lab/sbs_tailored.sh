#!/usr/bin/env bash
# The side by side's tailored half only (lab/side_by_side.sh tailored PREC), as gpu_call.sh's
# `sbs` part runs it; vLLM's halves stay those in bench/results. Prints the step timing and the
# results (lab/device_results.py).
# Usage: TAILORED_COMMIT=<sha> bash lab/sbs_tailored.sh bf16|fp8  (repo root, .whl carried)
set -uo pipefail
PREC=${1:?usage: sbs_tailored.sh bf16|fp8}
export SBS_DIR=/tmp/sbs READY_TIMEOUT=300
CROSSCHECK=0 timeout 540 bash lab/side_by_side.sh tailored "$PREC" > /tmp/sbs-call.log 2>&1
grep "^\[sbs\|ready\|WARNING\|died\|not ready" /tmp/sbs-call.log | tail -n 15
grep "step timing" "/tmp/sbs/tailored-server-$PREC.log" | sed -n '4p;$p' | cut -c1-330
mkdir -p "${OUT:-/tmp/tailored-out}"; cp /tmp/sbs-call.log "${OUT:-/tmp/tailored-out}/"
python3 lab/device_results.py "${OUT:-/tmp/tailored-out}" /tmp/sbs
