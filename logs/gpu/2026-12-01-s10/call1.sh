#!/usr/bin/env bash
# Prepared in session 10, NOT RUN: that session had 136 s of device time (the 30 minutes count
# across retries of the same work, and session 9 spent them). Run it first when a session has
# device time. Repository root, .whl carried, one call (~8 min):
#  1. GPU tests of the new FP8 kernels (dequant bitwise vs the reference, fp8_linear vs its
#     reference, bf16 and fp32 compiled), of a mixed step replaying both graphs (kb/0028) and
#     of async scheduling (never run on the H200 yet);
#  2. FP8 in-process A/B (kb/0026), 2 rounds, prefill graphs on:
#     e0 = W8A16 GEMMs as served today, prefill variants control / fp8_deq256 / fp8_deq128
#          (dequantize into a scratch + cuBLAS for >= 256 / 128 rows);
#     e1 = TAILORED_FP8_DENSE_DEQUANT=1 (dense projections held dequantized, cuBLAS always).
#     Read: decode B=1 / B=32 graph ms (e0 vs e1), prefill 1024 replay ms and the 8 x 1024
#     eager step (the c=32 mixed-step proxy) per variant, and the kernel table of that step
#     and the B=32 decode step (FP8 MoE bandwidth, kb/0026 estimate)
#     (the c=32 benchmark runs in waves: 32 prompts prefilled in four 8192-token steps, then
#     511 decode steps; the waves' prefill is ~20 % of its time, kb/0028).
# Decide from it which FP8 setting `sbs_gate.sh fp8` serves and gates (FP8_ENV).
# Usage: TAILORED_COMMIT=<sha> bash logs/gpu/2026-12-01-s10/call1.sh
source "$(dirname "$0")/../../../scripts/device_env.sh" call1
stamp "GPU tests: FP8 kernels, async scheduling"
timeout 140 python3 -m pytest -q -p no:cacheprovider -s tests/test_fp8_kernels.py \
    tests/test_gpu.py::test_mixed_step_replays_both_graphs \
    tests/test_gpu_invariance.py::test_async_scheduling_same_tokens_and_no_sync_in_launched_ahead_steps 2>&1 \
    | grep -v "^$" | grep -v "Warning\|warn" | tail -15
stamp "FP8 in-process A/B"
PRECISIONS=fp8 MICRO_BATCHES=1,32 MICRO_TIMEOUT=205 MICRO_TAIL=200 \
    MICRO_ENVS="TAILORED_FP8_DENSE_DEQUANT=0;TAILORED_FP8_DENSE_DEQUANT=1" \
    MICRO_ARGS="--prefill-graphs --prefill-batch 8 --profile-prefill-batch --profile --profile-batch 32 --prefill-variants control,fp8_deq256,fp8_deq128 --rounds 2" \
    timeout 430 bash scripts/gpu_fast.sh micro > /tmp/micro.log 2>&1
grep -v "^round\|Warning\|warn" /tmp/micro.log | tail -160
stamp "done"
