#!/usr/bin/env bash
# Prepared in session 13, NOT RUN (~2.5 min, carry [".whl"]). FP8 prefill tiles (kb/0031 §3):
# the 1024-token prefill graph and the 8 x 1024 step with the session-13 defaults (FP8 64-row
# tiles above 32 rows an expert; its 64-row tuned.json entry now the bench's BLOCK_K = KB = 64
# config) against 64-row tiles from 16 rows an expert (`fp8_tiles16`). If it wins (the layer
# bench: 1060 -> 853 us a layer at 1024 tokens, ~8 ms of FP8 TTFT), set moe.BM64_ABOVE_FP8 = 16
# (no numerics change: M tiling does not change any row's sums).
# Usage: TAILORED_COMMIT=<sha> bash logs/gpu/next/call2_fp8_tiles.sh
source "$(dirname "$0")/../../../scripts/device_env.sh" call2_fp8_tiles
PRECISIONS=fp8 MICRO_BATCHES=8 MICRO_TIMEOUT=200 MICRO_TAIL=10 \
    MICRO_ARGS="--prefill-graphs --prefill-batch 8 --prefill-variants control,fp8_tiles16 --rounds 3" \
    timeout 215 bash scripts/gpu_fast.sh micro > "$OUT/micro-fp8.log" 2>&1
grep "prefill variant\|^| control\|^| fp8_tiles16\|Error\|error" "$OUT/micro-fp8.log" | cut -c1-110
stamp "done"
