#!/usr/bin/env bash
# Session 39: the GPU test files at one commit, in priority order, each entry its own pytest
# run and log (tests-N.log) under what is left of END s. Each line of a log carries the
# seconds since the call began (pytest -v), so a run cut by the deadline still tells how long
# each test took, for splitting the suite over calls. Fits an H100 (the model tests run 4
# full-width layers). Run 2 (session 39, H100): the first 12 of test_gpu.py's 27 took 430 s.
# ENTRIES: ';'-separated pytest arguments (shell words, quotes kept), e.g.
#   ENTRIES="tests/test_gpu.py -k 'tiny or full_width_4';tests/test_gpu_spec.py"
# Usage: TAILORED_COMMIT=<sha> OUT=$OUT END=560 [ENTRIES="..."] bash logs/gpu/2026-12-06-s39/call_tests.sh
set -u
source "$(dirname "$0")/../../../scripts/device_env.sh" call_tests
END=${END:-560}
left() { echo $(( END - ($(date +%s) - T0) )); }
export TRITON_CACHE_DIR=/tmp/triton-cache
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
ENTRIES=${ENTRIES:-"tests/test_gpu.py -k 'tiny or full_width_4 or fast_path';tests/test_gpu.py -k 'not (tiny or full_width_4 or fast_path)';tests/test_kernels.py;tests/test_fp8_kernels.py;tests/test_gpu_invariance.py;tests/test_gpu_spec.py;tests/test_gpu_ctx.py;tests/test_moe_grouped.py;tests/test_gdn_conv.py;tests/test_draft_head.py;tests/test_logprobs.py"}
n=0
while IFS= read -r e; do
    [ -n "${e// /}" ] || continue
    n=$((n + 1))
    l=$(( $(left) - 10 ))
    [ "$l" -gt 30 ] || { stamp "not run (no time left): $e"; continue; }
    stamp "tests $n: $e ($l s left)"
    eval "timeout $l python3 -m pytest -v -p no:cacheprovider -rfE --durations=8 $e" < /dev/null 2>&1 \
        | while IFS= read -r line; do echo "[+$(( $(date +%s) - T0 ))s] $line"; done \
        > "$OUT/tests-$n.log"
    grep -c " PASSED" "$OUT/tests-$n.log" | sed 's/^/passed: /'
    grep " FAILED\| ERROR" "$OUT/tests-$n.log" | head -8
    tail -1 "$OUT/tests-$n.log"
done < <(tr ';' '\n' <<< "$ENTRIES")
stamp done
