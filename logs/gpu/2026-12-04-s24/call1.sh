#!/usr/bin/env bash
# Session 24, call 1 (carry [".whl"], cold; END s of device time for the command; kb/0041):
# two bitwise rewrites of FP8 B=1 decode kernels that stream far below the dense GEMV's rate
# (session 22 profile: MoE gate_up 12.0 µs/layer for 18.9 MB; attention split 13.0 µs for ~2 MB).
#  route_separate: the routing in one program of its own before gate_up (moe_gemv.ROUTE_SEPARATE)
#  attn_for_loop:  the attention key loop as a counted, pipelinable `for` (FOR_LOOP)
# In order, each while time is left:
#  1. GPU tests: both bitwise against the defaults (+ the kernels' reference tests).
#  2. FP8 in-process A/B at B=1,2, 3 rounds, and the kernel table of the combination at B=1.
#  3. bf16 A/B at B=1,32 of attn_for_loop (the MoE GEMV serves FP8 only).
# Usage: TAILORED_COMMIT=<sha> OUT=$OUT END=570 bash logs/gpu/2026-12-04-s24/call1.sh
source "$(dirname "$0")/../../../scripts/device_env.sh" call1
left() { echo $(( ${END:-570} - ($(date +%s) - T0) )); }
full_configs > /dev/null
stamp "GPU tests: route_separate, for_loop, paged decode attention, route_gemv_moe"
timeout 150 python3 -m pytest -q -p no:cacheprovider -rf tests/test_kernels.py \
    -k "route_separate or for_loop or paged_decode or route_gemv" > "$OUT/tests.log" 2>&1
grep -v "^$" "$OUT/tests.log" | grep -v "Warning\|warn" | tail -4
stamp "micro fp8 B=1,2 ($(left) s left)"
timeout $(( $(left) - 15 )) python3 scripts/bench_decode.py /tmp/full-fp8 --batches 1,2 \
    --json "$OUT/micro-fp8.json" --rounds 3 \
    --variants control,route_separate,attn_for_loop,route_separate+attn_for_loop \
    --profile --profile-variant route_separate+attn_for_loop > "$OUT/micro-fp8.log" 2>&1
grep "^| \|^B=\|Error\|error" "$OUT/micro-fp8.log" | cut -c1-160 | head -40
[ "$(left)" -gt 120 ] || { stamp "no time for bf16"; exit 0; }
stamp "micro bf16 B=1,32 ($(left) s left)"
timeout $(( $(left) - 5 )) python3 scripts/bench_decode.py /tmp/full --batches 1,32 \
    --json "$OUT/micro-bf16.json" --rounds 3 --variants control,attn_for_loop \
    > "$OUT/micro-bf16.log" 2>&1
grep "^| \|^B=\|Error\|error" "$OUT/micro-bf16.log" | cut -c1-160 | head -12
stamp done
