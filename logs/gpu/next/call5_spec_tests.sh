#!/usr/bin/env bash
# Prepared in session 15 (~3 min, carry [".whl"]); its tests ran at 837c68c in s15 run6/run7
# (bf16 bitwise and test_gpu_spec passed; the fp32 bitwise check failed and is now a tolerance): the GDN verify kernels
# (kernels/gdn_verify.py) bitwise against the decode kernels in bf16 and fp32 on the GPU, the
# decode kernels themselves, then the verify/MTP graphs against their bodies and whole engine
# runs with drafts (tests/test_gpu_spec.py; run1 of session 15 passed them before the verify
# kernels and the lone-row / split changes).
# Usage: TAILORED_COMMIT=<sha> bash logs/gpu/next/call5_spec_tests.sh
: "${TAILORED_COMMIT:?TAILORED_COMMIT=<sha> of the tree}"
source "$(dirname "$0")/../../../scripts/device_env.sh" call5_spec_tests
stamp "GPU kernel and spec tests"
# two runs: a -k filter would deselect every test of test_gpu_spec.py (session 15 run6)
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py \
    -k "gdn_verify or gdn_decode or commit_snapshots" > "$OUT/tests.log" 2>&1
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_spec.py >> "$OUT/tests.log" 2>&1
grep -E "passed|failed|^FAILED|^ERROR" "$OUT/tests.log" | tail -10
stamp "done"
