#!/usr/bin/env bash
# Prepared in session 10, NOT RUN (see call1.sh). Repository root, .whl carried, one call
# (~9.5 min) per precision: the side by side, tailored phase (vLLM's halves: sessions 7 (bf16)
# and 8 (FP8) of the same kit), with the defaults of this tree — kb/0024 decode switches, prefill
# graphs (FP8 too since kb/0026, and in mixed steps since kb/0028), async scheduling (kb/0025:
# +11 % c=1, +20 % c=32 on the smaller gpu_fast workload, never in a side by side) — then the
# accuracy gate of that precision with prefill graphs, which runs the async engine.
#   FP8: FP8_ENV carries the FP8 switch call1.sh picked, into both the server and the gate
#   (TAILORED_FP8_DENSE_DEQUANT changes the rounding: it must pass before it becomes a default).
# Usage: TAILORED_COMMIT=<sha> bash logs/gpu/2026-12-01-s10/sbs_gate.sh bf16
#        FP8_ENV="TAILORED_FP8_DENSE_DEQUANT=1" TAILORED_COMMIT=<sha> bash logs/gpu/2026-12-01-s10/sbs_gate.sh fp8
#        (FP8_ENV="" for today's W8A16 path). Run bf16 first: its async side by side is the
#        one the README's table most needs.
set -uo pipefail
PREC=${1:?usage: sbs_gate.sh bf16|fp8}
[ "$PREC" = fp8 ] || FP8_ENV=""
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
export SBS_DIR=/tmp/sbs READY_TIMEOUT=300
# shellcheck disable=SC2086
env ${FP8_ENV:-} CROSSCHECK=0 timeout 400 bash scripts/side_by_side.sh tailored "$PREC" > /tmp/sbs-call.log 2>&1
grep "^\[sbs\|ready\|WARNING\|died\|not ready" /tmp/sbs-call.log | tail -n 15
grep -v "step timing\|POST\|GET" "/tmp/sbs/tailored-server-$PREC.log" | grep "INFO tailored" | head -10 | cut -c1-220
grep "step timing" "/tmp/sbs/tailored-server-$PREC.log" | sed -n '4p;$p' | cut -c1-330
if [ "$(el)" -lt 420 ]; then
    echo "[sbs_gate +$(el)s] gate $PREC (${FP8_ENV:-no env switches})"
    # shellcheck disable=SC2086
    env ${FP8_ENV:-} GATE_ARGS="--prefill-graphs" timeout $(( 585 - $(el) )) bash scripts/gpu_gate.sh "$PREC"
fi
echo "[sbs_gate +$(el)s] done"
python3 scripts/device_results.py "${OUT:-/tmp/tailored-out}" /tmp/sbs
