#!/usr/bin/env bash
# Session 11, call 7 (kb/0029): the FP8 experts' float16 dots in the model. ncu (call 6) read the
# B=32 gate_up at 79 % SM throughput and 61 % DRAM with bf16 dots, 57 % / 81 % with f16 dots
# (122.6 -> 93.3 us; down 66.1 -> 57.0). Decode steps with the switch on (the controls: call 4's
# e0, 12.21 ms at B=32, and call 1's e1, 12.40 ms, same tree otherwise: 273 s of device time
# left do not hold both arms and the gate), then the FP8 gate with it (prefill graphs, async).
# Usage: TAILORED_COMMIT=<sha> bash logs/gpu/2026-12-01-s11/call7.sh
source "$(dirname "$0")/../../../scripts/device_env.sh" call7
stamp "micro fp8: TAILORED_MOE_FP8_DOT_F16=1"
PRECISIONS=fp8 MICRO_BATCHES=1,32 MICRO_TIMEOUT=120 MICRO_TAIL=4 \
    MICRO_ENVS="TAILORED_MOE_FP8_DOT_F16=1" \
    timeout 130 bash scripts/gpu_fast.sh micro > /tmp/micro.log 2>&1
grep "in-process\|^| [0-9]" /tmp/micro.log | cut -c1-90
stamp "gate fp8 with TAILORED_MOE_FP8_DOT_F16=1"
TAILORED_MOE_FP8_DOT_F16=1 GATE_ARGS="--prefill-graphs" timeout 120 bash scripts/gpu_gate.sh fp8 2>&1 \
    | grep "overall\|vs bf16 reference\|gate PASSED\|gate FAILED\|Traceback\|Error" | head -8
stamp "done"
