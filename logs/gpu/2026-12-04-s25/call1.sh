#!/usr/bin/env bash
# Session 25, call 1 (carry [".whl"], cold; END s of device time for the command):
#  1. GPU tests never run since session 24: PDL in a mixed step with a prefill graph, the
#     refactored mixed-step test (`_mixed_step`).
#  2. The bf16 GEMV (`TAILORED_BF16_GEMV_UP_TO`) A/B again, now that PDL is on: session 22 measured
#     it with PDL off (+0.8 % / -1.2 %, kb/0040 §3); cuBLAS kernels never take part in PDL, so
#     each cuBLAS launch (FP8: the router, 40 a step; bf16: every projection) is a full
#     serialization point. FP8 and bf16, B=1,2, 3 rounds.
#  3. The B=32 kernel tables, FP8 then bf16 (the c=32 targets need ~1.7x; kb/0041 §7).
# Usage: TAILORED_COMMIT=<sha> OUT=$OUT END=560 bash logs/gpu/2026-12-04-s25/call1.sh
source "$(dirname "$0")/../../../scripts/device_env.sh" call1
left() { echo $(( ${END:-560} - ($(date +%s) - T0) )); }
full_configs > /dev/null
stamp "GPU tests: pdl, mixed step"
timeout 240 python3 -m pytest -q -p no:cacheprovider -rf tests/test_gpu.py -k "pdl or mixed_step" \
    > "$OUT/tests-pdl-mixed.log" 2>&1
tail -3 "$OUT/tests-pdl-mixed.log"
for prec in fp8 bf16; do
    d=/tmp/full; [ "$prec" = fp8 ] && d=/tmp/full-fp8
    [ "$(left)" -gt 90 ] || { stamp "no time for the $prec A/B"; break; }
    stamp "A/B $prec B=1,2: control, bf16_gemv, bf16_gemv_fp8_cfgs ($(left) s left)"
    timeout $(( $(left) - 10 )) python3 scripts/bench_decode.py $d --batches 1,2 \
        --json "$OUT/ab-$prec.json" --rounds 3 --variants control,bf16_gemv,bf16_gemv_fp8_cfgs \
        > "$OUT/ab-$prec.log" 2>&1
    grep "^| \|^B=\|Error\|error" "$OUT/ab-$prec.log" | cut -c1-120 | head -20
done
for prec in fp8 bf16; do
    d=/tmp/full; [ "$prec" = fp8 ] && d=/tmp/full-fp8
    [ "$(left)" -gt 60 ] || { stamp "no time for the $prec B=32 profile"; break; }
    stamp "B=32 $prec kernel table ($(left) s left)"
    timeout $(( $(left) - 5 )) python3 scripts/bench_decode.py $d --batches 32 \
        --json "$OUT/b32-$prec.json" --profile --profile-batch 32 > "$OUT/b32-$prec.log" 2>&1
    grep "^B=\|Self CUDA time total" "$OUT/b32-$prec.log" | head -4
    grep -A14 "decode step profile" "$OUT/b32-$prec.log" | cut -c1-40,100-200 | head -16
done
stamp done
