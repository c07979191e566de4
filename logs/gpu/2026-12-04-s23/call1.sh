#!/usr/bin/env bash
# Session 23, call 1 (carry [".whl"], cold; END s of device time for the command; kb/0041):
# is TAILORED_PDL=1 (the weights / GDN state read before the PDL wait, kb/0040 §5) ready to be
# the default? In order, each while time is left:
#  1. GPU test: PDL changes no bit (decode graphs at 3 rows and 1 row, FP8 and bf16 GEMVs,
#     eager prefill), bf16 and FP8 (session 22's log of it was lost).
#  2. Served FP8 side by side (tailored half, c=1 and c=32) with TAILORED_PDL=1
#     (session 22 run2 without it: c=1 398.0 tok/s, TTFT 48.0 ms, c=32 2589.4).
#  3. The same in bf16 (run2: 305.9 / 44.5 / 2061.7).
# Usage: TAILORED_COMMIT=<sha> OUT=$OUT END=590 bash logs/gpu/2026-12-04-s23/call1.sh
source "$(dirname "$0")/../../../scripts/device_env.sh" call1
left() { echo $(( ${END:-590} - ($(date +%s) - T0) )); }
full_configs > /dev/null
stamp "GPU test: PDL changes no bit"
timeout 200 python3 -m pytest -q -p no:cacheprovider -rf tests/test_gpu.py -k pdl \
    > "$OUT/tests-pdl.log" 2>&1
grep -v "^$" "$OUT/tests-pdl.log" | grep -v "Warning\|warn" | tail -4
for prec in fp8 bf16; do
    [ "$(left)" -gt 150 ] || { stamp "no time for $prec"; break; }
    stamp "side by side $prec with TAILORED_PDL=1 (tailored half, $(left) s left)"
    TAILORED_PDL=1 OUT=/tmp/sbs-out timeout "$(left)" bash logs/gpu/2026-12-01-s12/sbs.sh $prec \
        > "$OUT/sbs-$prec-pdl.out" 2>&1
    grep "c=1\|c=32" "$OUT/sbs-$prec-pdl.out" | tail -2
    tar czf "$OUT/sbs.tgz" -C /tmp sbs sbs-out 2>/dev/null
done
stamp done
