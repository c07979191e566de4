#!/usr/bin/env bash
# Session 13, grouped-GEMM prefill experts (kernels/moe_grouped.py, kb/0031), one call (~7 min,
# carry [".whl"]): GPU tests of the new kernels and of the fast path with it on; the prefill MoE
# layer bench (routed only, 1024..8192 tokens, bf16 and FP8); per precision the in-process A/B
# of the 8 x 1024-token eager prefill step, control vs moe_grouped.
# Usage: TAILORED_COMMIT=<sha> bash logs/gpu/2026-12-01-s13/call_grouped.sh
source "$(dirname "$0")/../../../scripts/device_env.sh" call_grouped
stamp "GPU tests: moe_grouped kernels, fast path vs plain (switches new: grouped from 64 tokens)"
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_moe_grouped.py tests/test_gpu.py \
    -k "grouped or unsort or dequantize_experts or fast_path_matches_plain" 2>&1 | grep -v "^$" \
    | grep -v "Warning\|warn" | tail -8
for prec in bf16 fp8; do
    stamp "bench_moe_prefill $prec"
    flag=""; [ "$prec" = fp8 ] && flag="--fp8"
    timeout 120 python3 scripts/bench_moe_prefill.py $flag --json "$OUT/moe_prefill_$prec.json" 2>&1 \
        | grep "^T=" | cut -c1-100
done
for prec in bf16 fp8; do
    stamp "micro $prec: 8 x 1024 eager prefill step, control vs moe_grouped"
    PRECISIONS=$prec MICRO_BATCHES=1 MICRO_TIMEOUT=200 MICRO_TAIL=12 \
        MICRO_ARGS="--prefill-graphs --prefill-batch 8 --prefill-variants control,moe_grouped --rounds 2" \
        timeout 230 bash scripts/gpu_fast.sh micro > "$OUT/micro-$prec.log" 2>&1
    grep "prefill variant\|^| control\|^| moe_grouped\|^B=\|Error\|error" "$OUT/micro-$prec.log" | cut -c1-110
done
stamp "done"
