#!/usr/bin/env bash
# Prepared in session 12, NOT RUN (its 30 minutes were spent). First call of the next session
# (~7 min, carry [".whl"]): TAILORED_PDL=1 (kernels/pdl.py, kb/0030), programmatic dependent
# launch of every Triton kernel, built and compile-checked for sm_90 on the CPU only.
#   1. GPU tests: the PDL bits test (graph + eager prefill, bf16 and FP8), the kernel tests.
#   2. Per precision, one process: decode B=1 / B=32 control vs pdl (graphs re-captured per
#      variant), prefill 1024 replay and 8 x 1024 step control vs pdl, 2 rounds.
# Read: B=1 is the target (c=1 needs <= 2.38 ms a step, 3.47 now; ~660 launches a step).
# Usage: TAILORED_COMMIT=<sha> bash logs/gpu/next/call1_pdl.sh
source "$(dirname "$0")/../../../scripts/device_env.sh" call1_pdl
stamp "GPU tests: PDL bits, kernels"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_kernels.py \
    -k "pdl or fused_moe or route or recurrent or conv" 2>&1 | tail -3
for prec in bf16 fp8; do
    stamp "micro $prec: control vs pdl"
    PRECISIONS=$prec MICRO_BATCHES=1,32 MICRO_TIMEOUT=200 MICRO_TAIL=30 \
        MICRO_ARGS="--prefill-graphs --prefill-batch 8 --variants control,pdl --prefill-variants control,pdl --rounds 2" \
        timeout 260 bash scripts/gpu_fast.sh micro > "$OUT/micro-$prec.log" 2>&1
    grep "in-process\|^| \|^B=" "$OUT/micro-$prec.log" | grep -v "^|---" | cut -c1-110
done
stamp "done"
