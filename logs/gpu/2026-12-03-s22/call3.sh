#!/usr/bin/env bash
# Session 22, call 3 (carry [".whl"], cold, what is left of the device time: END s; kb/0040
# §5): the weights of the FP8/bf16 GEMV and the GDN state read before the PDL wait
# (TAILORED_PDL, off). In order, each while time is left:
#  1. FP8 in-process A/B at B=1,2: control, pdl; 3 rounds.
#  2. GPU test: PDL changes no bit (decode graphs at 3 rows and 1 row, FP8 and bf16 GEMVs,
#     eager prefill), bf16 and FP8.
#  3. Served FP8 c=1 alone (16 prompts) with TAILORED_PDL=1 (run2 without it: 398.0 tok/s).
# Usage: TAILORED_COMMIT=<sha> OUT=$OUT END=300 bash logs/gpu/2026-12-03-s22/call3.sh
source "$(dirname "$0")/../../../scripts/device_env.sh" call3
left() { echo $(( ${END:-300} - ($(date +%s) - T0) )); }
full_configs > /dev/null
stamp "micro fp8 B=1,2: control, pdl"
timeout $(( $(left) - 10 )) python3 scripts/bench_decode.py /tmp/full-fp8 --batches 1,2 \
    --json "$OUT/micro-fp8.json" --variants control,pdl --rounds 3 > "$OUT/micro-fp8.log" 2>&1
grep "^| \|^B=\|Error\|error" "$OUT/micro-fp8.log" | cut -c1-200 | head -10
[ "$(left)" -gt 40 ] || { stamp "no time left"; exit 0; }
stamp "GPU test: PDL changes no bit"
timeout "$(left)" python3 -m pytest -q -p no:cacheprovider -rf tests/test_gpu.py -k pdl \
    > "$OUT/tests.log" 2>&1
grep -v "^$" "$OUT/tests.log" | grep -v "Warning\|warn" | tail -6
[ "$(left)" -gt 120 ] || { stamp "no time to serve"; exit 0; }
stamp "served FP8 c=1 with TAILORED_PDL=1 (tailored half, 16 prompts)"
TAILORED_PDL=1 SBS_CONCURRENCY=1 SBS_PROMPTS=16 OUT=/tmp/sbs-out timeout "$(left)" \
    bash logs/gpu/2026-12-01-s12/sbs.sh fp8 > "$OUT/sbs-fp8-pdl.out" 2>&1
grep "c=1" "$OUT/sbs-fp8-pdl.out" | tail -1
cp /tmp/sbs/tailored-fp8.json "$OUT/tailored-fp8-pdl-c1.json" 2>/dev/null
stamp done
