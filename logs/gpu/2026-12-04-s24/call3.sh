#!/usr/bin/env bash
# Session 24, call 3 (carry [".whl"], cold; END s of device time; kb/0041): with the FP8 GEMV's
# loop fixed (run2: 6.7 µs a call again; in-process PDL A/B B=1 -4.9 %, B=2 -6.1 %, bitwise,
# test_pdl_changes_no_bit passed), serve with TAILORED_PDL=1: FP8, then bf16 (tailored half;
# run2 served FP8 with the defaults: c=1 400.5 tok/s, TTFT 47.5 ms, c=32 2608.6).
# Usage: TAILORED_COMMIT=<sha> OUT=$OUT END=590 bash logs/gpu/2026-12-04-s24/call3.sh
source "$(dirname "$0")/../../../scripts/device_env.sh" call3
left() { echo $(( ${END:-590} - ($(date +%s) - T0) )); }
full_configs > /dev/null
for prec in fp8 bf16; do
    [ "$(left)" -gt 150 ] || { stamp "no time for $prec"; break; }
    stamp "side by side $prec with TAILORED_PDL=1 (tailored half, $(left) s left)"
    TAILORED_PDL=1 OUT=/tmp/sbs-out timeout "$(left)" bash logs/gpu/2026-12-01-s12/sbs.sh $prec \
        > "$OUT/sbs-$prec-pdl.out" 2>&1
    grep "c=1\|c=32" "$OUT/sbs-$prec-pdl.out" | tail -2
    tar czf "$OUT/sbs.tgz" -C /tmp sbs sbs-out 2>/dev/null
done
stamp done
