#!/usr/bin/env bash
# Session 24, call 2 (carry [".whl"], cold; END s of device time for the command; kb/0041):
# run1's B=1 FP8 profile had `_fp8_gemv_kernel` at 10.7 µs a call where session 22's (before
# the reads before the PDL wait, 88c2b1e) had 6.8: the GEMV's loop carried the next tile. Now
# the first tile is peeled off and the loop loads each tile as it goes (bitwise the same).
# In order, each while time is left:
#  1. GPU tests: the GEMV kernels against their reference; PDL changes no bit.
#  2. FP8 in-process A/B at B=1,2 (control, pdl; 3 rounds) and the B=1 kernel table.
#  3. Served FP8 side by side (tailored half, defaults), then bf16.
# Usage: TAILORED_COMMIT=<sha> OUT=$OUT END=560 bash logs/gpu/2026-12-04-s24/call2.sh
source "$(dirname "$0")/../../../scripts/device_env.sh" call2
left() { echo $(( ${END:-560} - ($(date +%s) - T0) )); }
full_configs > /dev/null
stamp "GPU tests: FP8/bf16 GEMV kernels, PDL changes no bit"
timeout 200 python3 -m pytest -q -p no:cacheprovider -rf tests/test_fp8_kernels.py -k gemv \
    > "$OUT/tests-gemv.log" 2>&1
tail -1 "$OUT/tests-gemv.log"
timeout 150 python3 -m pytest -q -p no:cacheprovider -rf tests/test_gpu.py -k pdl \
    > "$OUT/tests-pdl.log" 2>&1
tail -1 "$OUT/tests-pdl.log"
stamp "micro fp8 B=1,2: control, pdl + profile ($(left) s left)"
timeout $(( $(left) - 15 )) python3 scripts/bench_decode.py /tmp/full-fp8 --batches 1,2 \
    --json "$OUT/micro-fp8.json" --rounds 3 --variants control,pdl --profile \
    > "$OUT/micro-fp8.log" 2>&1
grep "^| \|^B=\|Error\|error\|_fp8_gemv_kernel\|_gemv_gate_up\|Self CUDA time total" \
    "$OUT/micro-fp8.log" | cut -c1-60,150-200 | head -16
for prec in fp8 bf16; do
    [ "$(left)" -gt 150 ] || { stamp "no time for $prec"; break; }
    stamp "side by side $prec (tailored half, defaults, $(left) s left)"
    OUT=/tmp/sbs-out timeout "$(left)" bash logs/gpu/2026-12-01-s12/sbs.sh $prec \
        > "$OUT/sbs-$prec.out" 2>&1
    grep "c=1\|c=32" "$OUT/sbs-$prec.out" | tail -2
    tar czf "$OUT/sbs.tgz" -C /tmp sbs sbs-out 2>/dev/null
done
stamp done
