#!/usr/bin/env bash
# Prepared in session 13, NOT RUN (~7 min, carry [".whl"]). The GPU tests session 13 could not
# finish for its new defaults (kb/0031: grouped-GEMM prefill experts, 64/128-row MoE tiles,
# graph bodies that always launch fused_moe): kernels, fast path vs plain at full width with the
# grouped experts from 64 tokens ("new" switches), graph replays, the mixed step, prefill graphs.
# The summary line is grepped unfiltered (session 13 lost one to a `grep -v warn`). Then the
# bf16 gate with prefill graphs again: session 13's ran before the capture fix (58cb8d8) and its
# prefill graphs failed to capture, so it gated eager prefill only (~2 min more).
# Usage: TAILORED_COMMIT=<sha> bash logs/gpu/next/call1_verify.sh
source "$(dirname "$0")/../../../scripts/device_env.sh" call1_verify
stamp "GPU tests"
timeout 420 python3 -m pytest -q -p no:cacheprovider -x tests/test_moe_grouped.py tests/test_kernels.py \
    tests/test_gpu.py -k "grouped or unsort or dequantize_experts or fused_moe or fast_path_matches_plain or graph_replay or mixed_step or prefill_graph" \
    > "$OUT/tests.log" 2>&1
grep -E "passed|failed|^FAILED|^ERROR" "$OUT/tests.log" | tail -8
stamp "bf16 gate, prefill graphs, grouped experts from 1024 tokens"
TAILORED_MOE_GROUPED_FROM=1024 GATE_ARGS="--prefill-graphs" timeout 200 bash scripts/gpu_gate.sh bf16 \
    2>&1 | grep "overall\|gate PASSED\|gate FAILED\|not captured\|captured prefill\|Traceback" | head -6
stamp "done"
