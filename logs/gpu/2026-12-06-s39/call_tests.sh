#!/usr/bin/env bash
# Session 39: the GPU test files at one commit, in priority order, each its own pytest run and
# log (tests-<file>.log) under what is left of END s, with the slowest tests listed
# (--durations) so that a later session can split the suite over calls. Fits an H100 (the
# model tests run 4 full-width layers). A file cut by the deadline says so.
# Usage: TAILORED_COMMIT=<sha> OUT=$OUT END=560 [FILES="tests/a.py tests/b.py"] \
#            bash logs/gpu/2026-12-06-s39/call_tests.sh
set -u
source "$(dirname "$0")/../../../scripts/device_env.sh" call_tests
END=${END:-560}
left() { echo $(( END - ($(date +%s) - T0) )); }
export TRITON_CACHE_DIR=/tmp/triton-cache
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
FILES=${FILES:-"tests/test_gpu.py tests/test_kernels.py tests/test_fp8_kernels.py tests/test_gpu_invariance.py tests/test_gpu_spec.py tests/test_gpu_ctx.py tests/test_moe_grouped.py tests/test_gdn_conv.py tests/test_draft_head.py tests/test_logprobs.py"}
for f in $FILES; do
    l=$(( $(left) - 10 ))
    [ "$l" -gt 30 ] || { stamp "not run (no time left): $f"; continue; }
    stamp "$f ($l s left)"
    name=$(basename "$f" .py)
    timeout "$l" python3 -m pytest -q -p no:cacheprovider -rfE --durations=8 "$f" \
        > "$OUT/tests-$name.log" 2>&1 < /dev/null
    rc=$?
    [ "$rc" = 124 ] && echo "cut by the deadline after $l s"
    grep "^FAILED\|^ERROR" "$OUT/tests-$name.log" | head -8
    tail -1 "$OUT/tests-$name.log"
done
stamp done
