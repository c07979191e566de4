#!/usr/bin/env bash
# Session 12: the side by side, tailored phase only, with the new defaults (GDN prefill conv
# kernel, fused projections padded to 64 rows, FP8 float16 gate_up dots: kb/0030). Their gates
# passed in run2 with the same switches set through the environment (call2_gate.sh), so no
# gate here. vLLM's halves: sessions 7 (bf16) / 8 (FP8) of the same kit.
# Usage: TAILORED_COMMIT=<sha> bash logs/gpu/2026-12-01-s12/sbs.sh bf16|fp8  (repo root, .whl carried)
set -uo pipefail
PREC=${1:?usage: sbs.sh bf16|fp8}
export SBS_DIR=/tmp/sbs READY_TIMEOUT=300
CROSSCHECK=0 timeout 540 bash scripts/side_by_side.sh tailored "$PREC" > /tmp/sbs-call.log 2>&1
grep "^\[sbs\|ready\|WARNING\|died\|not ready" /tmp/sbs-call.log | tail -n 15
grep "step timing" "/tmp/sbs/tailored-server-$PREC.log" | sed -n '4p;$p' | cut -c1-330
mkdir -p "${OUT:-/tmp/tailored-out}"; cp /tmp/sbs-call.log "${OUT:-/tmp/tailored-out}/"
python3 scripts/device_results.py "${OUT:-/tmp/tailored-out}" /tmp/sbs
