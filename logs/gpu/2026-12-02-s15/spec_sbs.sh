#!/usr/bin/env bash
# Session 15: speculative decoding (kb/0032, kb/0033) on the H200. Optionally the GPU tests of
# the verify/MTP CUDA graphs first (TESTS=1, ~3 min), then the tailored half of the side by side
# (c=1 x 16, c=32 x 256, 1024 in / 512 out) with N drafts at synthetic acceptance RATE, drafting
# up to MAXRUN running requests. These numbers pair with vLLM's `serve mtp` of the baseline kit
# (1 draft at 0.8: c=1 266.1 tok/s, TTFT 128.5 ms; c=32 1981.6 tok/s), not with plain vLLM.
# Usage: TAILORED_COMMIT=<sha> [TESTS=1] bash logs/gpu/2026-12-02-s15/spec_sbs.sh PREC N RATE MAXRUN
#        (carry .whl)
PREC=${1:?prec} N=${2:?drafts} RATE=${3:?rate} MAXRUN=${4:?max running}
# the device's copy of .git is stale: without this the manifests name the wrong commit (s15)
: "${TAILORED_COMMIT:?TAILORED_COMMIT=<sha> of the tree}"
source "$(dirname "$0")/../../../scripts/device_env.sh" "spec_sbs-$PREC-$N-$RATE-$MAXRUN"
if [ "${TESTS:-0}" = 1 ]; then
    stamp "GPU spec tests"
    timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_spec.py tests/test_draft_head.py -x \
        > "$OUT/spec-tests.log" 2>&1
    grep -E "passed|failed|^FAILED|^ERROR|Error" "$OUT/spec-tests.log" | tail -8
fi
stamp "side by side, tailored $PREC, $N drafts at $RATE, drafting up to $MAXRUN running"
export TAILORED_SERVE_ARGS="--num-speculative-tokens $N --spec-synthetic-acceptance $RATE --spec-max-running $MAXRUN"
export SBS_DIR=/tmp/sbs READY_TIMEOUT=300
CROSSCHECK=0 timeout $(( ${TESTS:-0} == 1 ? 330 : 560 )) bash scripts/side_by_side.sh tailored "$PREC" \
    > /tmp/sbs-call.log 2>&1
grep "^\[sbs\|ready\|WARNING\|died\|not ready\|Traceback" /tmp/sbs-call.log | tail -n 12
L=/tmp/sbs/tailored-server-$PREC.log
grep -i "speculative\|captured\|Triton compile\|Error" "$L" | tail -n 12 | cut -c1-260
grep "step timing" "$L" | sed -n '4p;$p' | cut -c1-330
grep -o "verify: [^;]*" "$L" | sed -n '3p;6p;$p' | cut -c1-330
cp /tmp/sbs-call.log "$OUT/"
python3 scripts/device_results.py "$OUT" /tmp/sbs
stamp "done"
