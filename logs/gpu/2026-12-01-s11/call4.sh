#!/usr/bin/env bash
# Session 11, call 4 (kb/0029): does a deeper K tile lift the MoE decode kernels' bandwidth?
# The decode config space gained BLOCK_K = 512 (FP8: four 128-wide dots, bf16: two of 256;
# bitwise the same accumulations). tuned.json's entries stay valid candidates, so a server keeps
# the old choices; e1 loads a table without the MoE decode entries and re-tunes them over the
# wider space, dumping what it chose. e0 = the table as committed (the old choices).
# Read: B=1 / B=32 graph ms e0 vs e1 and the B=32 profile's _gate_up/_down µs.
# Usage: TAILORED_COMMIT=<sha> bash logs/gpu/2026-12-01-s11/call4.sh
source "$(dirname "$0")/../../../scripts/device_env.sh" call4
stamp "GPU tests: fused MoE (fixed configs, incl. 512-wide K bitwise)"
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py -k "fused_moe" 2>&1 | tail -3
python3 - <<'PY'
import json
t = json.load(open("tailored/kernels/tuned.json"))
for n in [n for n in t["launchers"] if n.startswith("moe/") and "/decode/" in n]:
    del t["launchers"][n]
json.dump(t, open("/tmp/tuned-nomoe.json", "w"))
PY
for prec in fp8 bf16; do
    stamp "micro $prec: e0 committed table, e1 MoE decode re-tuned over the wider space"
    PRECISIONS=$prec MICRO_BATCHES=1,32 MICRO_TIMEOUT=260 MICRO_TAIL=4 \
        MICRO_ENVS=";TAILORED_TUNING=/tmp/tuned-nomoe.json TAILORED_TUNING_DUMP=$OUT/tuned-$prec-wide.json" \
        MICRO_ARGS="--profile --profile-batch 32" \
        timeout 540 bash scripts/gpu_fast.sh micro > /tmp/micro-$prec.log 2>&1
    grep "in-process\|stack built\|^B=\|_gate_up_kernel\|_down_kernel  " /tmp/micro-$prec.log | cut -c1-60,150-230
    cp /tmp/micro-$prec.log "$OUT/"
done
stamp "done"
