#!/usr/bin/env bash
# Prepared in session 13, NOT RUN (~5 min, carry [".whl"]). The GPU tests session 13 could not
# finish for its new defaults (kb/0031: grouped-GEMM prefill experts, 64/128-row MoE tiles,
# graph bodies that always launch fused_moe): kernels, fast path vs plain at full width with the
# grouped experts from 64 tokens ("new" switches), graph replays, the mixed step, prefill graphs.
# The summary line is grepped unfiltered (session 13 lost one to a `grep -v warn`).
# Usage: TAILORED_COMMIT=<sha> bash logs/gpu/next/call1_verify.sh
source "$(dirname "$0")/../../../scripts/device_env.sh" call1_verify
stamp "GPU tests"
timeout 420 python3 -m pytest -q -p no:cacheprovider -x tests/test_moe_grouped.py tests/test_kernels.py \
    tests/test_gpu.py -k "grouped or unsort or dequantize_experts or fused_moe or fast_path_matches_plain or graph_replay or mixed_step or prefill_graph" \
    > "$OUT/tests.log" 2>&1
grep -E "passed|failed|^FAILED|^ERROR" "$OUT/tests.log" | tail -8
stamp "done"
