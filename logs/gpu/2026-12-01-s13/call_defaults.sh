#!/usr/bin/env bash
# Session 13, second look (~6 min, carry [".whl"]) at the new prefill MoE defaults (kb/0031):
# grouped-GEMM experts from 6144 tokens (fast.MOE_GROUPED) and the new M tiles (moe._blocks:
# 64 rows above 16 an expert, 128 above 48 for bf16). GPU tests, then per precision the
# in-process A/B of the 1024-token prefill graph and the 8 x 1024 eager step against each
# switch undone.
# Usage: TAILORED_COMMIT=<sha> bash logs/gpu/2026-12-01-s13/call_defaults.sh
source "$(dirname "$0")/../../../scripts/device_env.sh" call_defaults
stamp "GPU tests: moe_grouped, fused_moe (128-row tiles), fast path vs plain (bf16, switches new)"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_moe_grouped.py tests/test_kernels.py \
    tests/test_gpu.py -k "grouped or unsort or dequantize_experts or test_fused_moe or (fast_path_matches_plain and dtype1 and new)" \
    2>&1 | grep "passed\|failed\|Error" | tail -4
for prec in bf16 fp8; do
    stamp "micro $prec: prefill A/B"
    PRECISIONS=$prec MICRO_BATCHES=8 MICRO_TIMEOUT=200 MICRO_TAIL=14 \
        MICRO_ARGS="--prefill-graphs --prefill-batch 8 --prefill-variants control,old_tiles,no_moe_grouped,old_tiles+no_moe_grouped --rounds 2" \
        timeout 215 bash scripts/gpu_fast.sh micro > "$OUT/micro-$prec.log" 2>&1
    grep "prefill variant\|^| control\|^| old_tiles\|^| no_moe\|^B=\|Error\|error" "$OUT/micro-$prec.log" | cut -c1-110
done
stamp "done"
