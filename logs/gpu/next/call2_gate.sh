#!/usr/bin/env bash
# Prepared in session 12, NOT RUN. Second call (~3 min) if call1_pdl.sh shows PDL faster: both
# gates with TAILORED_PDL=1 (it should change no bit: the gate says so on the full model), then
# make it the default and rerun the side by sides (logs/gpu/2026-12-01-s12/sbs.sh bf16|fp8,
# ~5 min each on a cold machine).
# Usage: TAILORED_COMMIT=<sha> bash logs/gpu/next/call2_gate.sh
set -uo pipefail
for prec in bf16 fp8; do
    TAILORED_PDL=1 GATE_ARGS="--prefill-graphs" timeout 200 bash scripts/gpu_gate.sh "$prec" 2>&1 \
        | grep "overall\|vs bf16 reference\|gate PASSED\|gate FAILED\|Traceback\|Error" | head -6
done
