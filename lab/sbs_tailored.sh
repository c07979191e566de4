#!/usr/bin/env bash
# The side by side's tailored half only (lab/side_by_side.sh tailored PREC), as gpu_call.sh's
# `sbs` part runs it; vLLM's halves stay those in bench/results. Prints the step timing and the
# results (lab/device_results.py). MODE load or long runs the load sweep's tailored half instead
# (side_by_side.sh load|long tailored PREC: c = 1..128, or the 65k and 120k prompts), to set
# beside vLLM's of a run on the same card (another machine than vLLM's: say so when quoting it).
# Usage: TAILORED_COMMIT=<sha> bash lab/sbs_tailored.sh bf16|fp8 [sbs|load|long]  (repo root, .whl carried)
set -uo pipefail
PREC=${1:?usage: sbs_tailored.sh bf16|fp8 [sbs|load|long]}
MODE=${2:-sbs}
case "$MODE" in
  sbs) PHASE=(tailored "$PREC"); TAG=$PREC ;;
  load|long) PHASE=("$MODE" tailored "$PREC"); TAG=$PREC-$MODE ;;
  *) echo "sbs_tailored.sh: MODE is sbs, load or long, not $MODE" >&2; exit 2 ;;
esac
export SBS_DIR=/tmp/sbs READY_TIMEOUT=300
CROSSCHECK=0 timeout 540 bash lab/side_by_side.sh "${PHASE[@]}" > /tmp/sbs-call.log 2>&1
grep "^\[sbs\|ready\|WARNING\|died\|not ready" /tmp/sbs-call.log | tail -n 15
grep "step timing" "/tmp/sbs/tailored-server-$TAG.log" | sed -n '4p;$p' | cut -c1-330
mkdir -p "${OUT:-/tmp/tailored-out}"; cp /tmp/sbs-call.log "${OUT:-/tmp/tailored-out}/"
python3 lab/device_results.py "${OUT:-/tmp/tailored-out}" /tmp/sbs
