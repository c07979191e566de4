#!/usr/bin/env bash
# Session 21, call 1 (carry [".whl"], ~8 min cold): the GEMV experts of kb/0039 against the
# tiled ones at B=1-2, and session 20's L2-prefetch bench (kb/0038 §8), both never run.
#  1. GPU tests of route_gemv_moe (full-size cases compile here).
#  2. scripts/bench_moe_gemv.py: tiled vs the GEMV (ROWS, warps) sweep, bf16 and FP8, T=1,2.
#  3. scripts/bench_l2_prefetch.py with chains of 12 and 30 small kernels.
# Usage: TAILORED_COMMIT=<sha> OUT=$OUT bash logs/gpu/2026-12-03-s21/call1.sh
source "$(dirname "$0")/../../../scripts/device_env.sh" call1
stamp "GPU tests: route_gemv_moe"
timeout 200 python3 -m pytest -q -rf tests/test_kernels.py -k "route_gemv" 2>&1 | tail -4
stamp "MoE layer: tiled vs GEMV"
timeout 330 python3 scripts/bench_moe_gemv.py --json "$OUT/moe-gemv.json" > "$OUT/moe-gemv.log" 2>&1
tail -12 "$OUT/moe-gemv.log"
for c in 12 30; do
    left=$(( 570 - ($(date +%s) - T0) ))
    [ "$left" -lt 40 ] && { stamp "no time for the L2 bench ($left s)"; break; }
    stamp "L2 prefetch bench, chain of $c"
    timeout "$left" python3 scripts/bench_l2_prefetch.py --chain "$c" --json "$OUT/l2-chain$c.json" \
        > "$OUT/l2-chain$c.log" 2>&1
    grep -v "^\s*$" "$OUT/l2-chain$c.log" | tail -12 | cut -c1-220
done
stamp done
