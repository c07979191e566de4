#!/usr/bin/env bash
# Prepared in session 20 for the next (kb/0038 §8; carry [".whl"], ~2 min cold + start):
# does an L2 prefetch on a side stream, forked and joined inside a CUDA graph, hide a decode
# GEMV's weight stream behind a chain of small kernels? Both prefetch methods, 12- and
# 30-kernel chains. Compiled for sm_90 with Triton 3.6 on the CPU in session 20, never run.
# Usage: TAILORED_COMMIT=<sha> OUT=$OUT bash logs/gpu/2026-12-03-s20/call4_l2_prefetch.sh
source "$(dirname "$0")/../../../scripts/device_env.sh" call4_l2_prefetch
for c in 12 30; do
    stamp "L2 prefetch bench, chain of $c"
    timeout 150 python3 scripts/bench_l2_prefetch.py --chain "$c" --json "$OUT/l2-chain$c.json" \
        > "$OUT/l2-chain$c.log" 2>&1
    grep -v "^\s*$" "$OUT/l2-chain$c.log" | tail -12 | cut -c1-220
done
stamp done
