#!/usr/bin/env bash
# Session 22, call 3 (carry [".whl"], cold, the last ~250 s of device time; kb/0040 §3): the
# weights of the FP8/bf16 GEMV and the GDN state read before the PDL wait (TAILORED_PDL, off).
#  1. FP8 in-process A/B at B=1,2: control, pdl, pdl+bf16_gemv (the bf16 router + shared
#     gate, cuBLAS gemvx 3.1 µs × 40 a step, through the GEMV too); 3 rounds.
#  2. Served FP8 c=1 alone (16 prompts) with TAILORED_PDL=1 (run2 without it: 398.0 tok/s).
#  3. GPU tests: PDL changes no bit (decode graphs at 3 rows and 1 row, FP8 and bf16 GEMVs,
#     eager prefill), the GEMV and recurrent kernel tests.
#  4. bf16 at B=1: control, pdl, pdl+bf16_gemv (2 rounds), in the time left (END).
# Usage: TAILORED_COMMIT=<sha> OUT=$OUT END=340 bash logs/gpu/2026-12-03-s22/call3.sh
source "$(dirname "$0")/../../../scripts/device_env.sh" call3
full_configs > /dev/null
stamp "micro fp8 B=1,2: control, pdl, pdl+bf16_gemv (the router through the GEMV)"
timeout 150 python3 scripts/bench_decode.py /tmp/full-fp8 --batches 1,2 --json "$OUT/micro-fp8.json" \
    --variants control,pdl,pdl+bf16_gemv --rounds 3 > "$OUT/micro-fp8.log" 2>&1
grep "^| \|^B=\|Error\|error" "$OUT/micro-fp8.log" | cut -c1-200 | head -10
stamp "served FP8 c=1 with TAILORED_PDL=1 (tailored half, 16 prompts)"
TAILORED_PDL=1 SBS_CONCURRENCY=1 SBS_PROMPTS=16 OUT=/tmp/sbs-out timeout 150 \
    bash logs/gpu/2026-12-01-s12/sbs.sh fp8 > "$OUT/sbs-fp8-pdl.out" 2>&1
grep "c=1" "$OUT/sbs-fp8-pdl.out" | tail -1
cp /tmp/sbs/tailored-fp8.json "$OUT/tailored-fp8-pdl-c1.json" 2>/dev/null
left=$(( ${END:-340} - ($(date +%s) - T0) ))
[ "$left" -gt 40 ] && { stamp "GPU tests: pdl, gemv, recurrent"
timeout "$left" python3 -m pytest -q -p no:cacheprovider -rf tests/test_gpu.py tests/test_fp8_kernels.py \
    tests/test_kernels.py -k "pdl or gemv or recurrent" > "$OUT/tests.log" 2>&1
grep -v "^$" "$OUT/tests.log" | grep -v "Warning\|warn" | tail -8; }
left=$(( ${END:-340} - ($(date +%s) - T0) ))
if [ "$left" -gt 60 ]; then
    stamp "micro bf16 B=1: control, pdl, pdl+bf16_gemv ($left s left)"
    timeout "$left" python3 scripts/bench_decode.py /tmp/full --batches 1 --json "$OUT/micro-bf16.json" \
        --variants control,pdl,pdl+bf16_gemv --rounds 2 > "$OUT/micro-bf16.log" 2>&1
    grep "^| \|^B=\|Error\|error" "$OUT/micro-bf16.log" | cut -c1-200 | head -10
fi
stamp done
