#!/usr/bin/env bash
# Session 18, call 1 (~6 min cold, carry [".whl"]): routing inside the gate_up GEMM's programs
# (moe.route_fused_moe, kb/0036) and the shared expert as expert E at 1-2 rows (kb/0019).
# GPU tests (bitwise vs route_align + fused_moe at full size, fast path vs plain with the new
# switches), then per precision the in-process B=1/B=2 graph-step A/B, 3 rounds, and the B=1
# kernel table with all of it on.
# Usage: TAILORED_COMMIT=<sha> bash logs/gpu/2026-12-03-s18/call1.sh
source "$(dirname "$0")/../../../scripts/device_env.sh" call1
stamp "GPU tests: route_fused_moe, fused_moe, route_align, fast path vs plain (switches new)"
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_gpu.py \
    -k "route_fused_moe or test_fused_moe or route_align or (fast_path_matches_plain and new)" \
    2>&1 | grep "passed\|failed\|Error\|assert" | tail -8
V=control,shared_in_moe+moe_up_to2,route_in_gate_up2,shared_in_moe+moe_up_to2+route_in_gate_up2
for prec in bf16 fp8; do
    stamp "micro $prec: B=1,2 A/B"
    PRECISIONS=$prec MICRO_BATCHES=1,2 MICRO_TIMEOUT=200 MICRO_TAIL=60 \
        MICRO_ARGS="--variants $V --rounds 3 --profile --profile-variant shared_in_moe+moe_up_to2+route_in_gate_up2" \
        timeout 215 bash scripts/gpu_fast.sh micro > "$OUT/micro-$prec.log" 2>&1
    grep "^| \|^B=\|Error\|error\|_kernel\|nvjet\|gemv" "$OUT/micro-$prec.log" | cut -c1-150 | head -60
done
stamp "done"
