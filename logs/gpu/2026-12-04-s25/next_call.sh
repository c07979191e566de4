#!/usr/bin/env bash
# Prepared in session 25 for the next device session (carry [".whl"]; END s of device time for
# the command; kb/0042). Session 25's machine stopped answering after its gates: the bf16 GEMV
# default (one row) was never served, and the float16 down GEMM (TAILORED_MOE_FP8_DOWN_F16)
# was built afterwards, CPU-tested only. In order, each while time is left:
#  1. GPU tests of the new kernel code (pow2 rows, the down GEMM's f16 dots, f16 gate_up), and
#     the PDL bitwise test of the verify + chain graphs (written in session 25, never run).
#  2. FP8 A/B of the float16 down GEMM: decode B=8,32 (3 rounds) and the 1024-token prefill
#     plus an 8 x 1024 step (--prefill-variants), the B=32 kernel table with it; with it the
#     shared expert inside the MoE up to 32 rows (FP8 weights instead of the bf16 copy).
#  3. The FP8 gate with it on.
#  4. Served side by sides (tailored half) at the defaults, FP8 with SBS_ENV in front (e.g.
#     SBS_ENV="TAILORED_MOE_FP8_DOWN_F16=1" if 2 and 3 passed), then bf16.
#  5. The bf16 gate with the prompts one at a time (`--one-at-a-time`: every decode step one
#     row, the path of the bf16 GEMV default that the batched gate covers only in its tail).
# PARTS picks sections (default all: "tests ab gate sbs onegate"); on a flaky machine run two
# calls of ~300 s back to back, e.g. PARTS="sbs" first (the owed served numbers), then the rest.
# Usage: TAILORED_COMMIT=<sha> OUT=$OUT END=560 [PARTS=...] [SBS_ENV=...] \
#            bash logs/gpu/2026-12-04-s25/next_call.sh
source "$(dirname "$0")/../../../scripts/device_env.sh" next_call
left() { echo $(( ${END:-560} - ($(date +%s) - T0) )); }
PARTS=" ${PARTS:-tests ab gate sbs onegate} "
want() { [[ "$PARTS" == *" $1 "* ]]; }
full_configs > /dev/null
want tests && {
stamp "GPU tests: pow2 rows, f16 dots (gate_up and down); PDL in the verify + chain graphs"
timeout 120 python3 -m pytest -q -p no:cacheprovider -rf tests/test_kernels.py \
    -k "pow2 or f16_dots" > "$OUT/tests-f16.log" 2>&1
tail -1 "$OUT/tests-f16.log"
timeout 150 python3 -m pytest -q -p no:cacheprovider -rf tests/test_gpu_spec.py -k pdl \
    > "$OUT/tests-pdl-spec.log" 2>&1
tail -1 "$OUT/tests-pdl-spec.log"
# fp32 models now take the GEMV at one row too: "alone equals inside a batch" at 1e-5
timeout 200 python3 -m pytest -q -p no:cacheprovider -rf tests/test_gpu_invariance.py \
    > "$OUT/tests-invariance.log" 2>&1
tail -1 "$OUT/tests-invariance.log"
}
want ab && {
stamp "A/B fp8 down_f16: B=8,32, prefill 1024 and 8 x 1024 ($(left) s left)"
timeout $(( $(left) - 10 )) python3 scripts/bench_decode.py /tmp/full-fp8 --batches 8,32 \
    --json "$OUT/ab-down-f16.json" --rounds 3 \
    --variants control,down_f16,shared_up_to32,down_f16+shared_up_to32 \
    --prefill-variants control,down_f16 --prefill-batch 8 \
    --profile --profile-batch 32 --profile-variant down_f16 > "$OUT/ab-down-f16.log" 2>&1
grep "^| \|^B=\|min of rounds\|prefill\|_down_kernel\|Error\|error" "$OUT/ab-down-f16.log" \
    | cut -c1-130 | head -24
}
if want gate && [ "$(left)" -gt 120 ]; then
    stamp "FP8 gate with TAILORED_MOE_FP8_DOWN_F16=1 ($(left) s left)"
    TAILORED_MOE_FP8_DOWN_F16=1 timeout $(( $(left) - 5 )) bash scripts/gpu_gate.sh fp8 \
        > "$OUT/gate-fp8.out" 2>&1
    grep "overall\|vs bf16 reference\|gate PASSED\|gate FAILED" "$OUT/gate-fp8.out"
fi
want sbs && for prec in fp8 bf16; do
    [ "$(left)" -gt 170 ] || { stamp "no time for the $prec side by side"; break; }
    envs=""; [ "$prec" = fp8 ] && envs=${SBS_ENV:-}
    stamp "side by side $prec (tailored half, defaults + '$envs', $(left) s left)"
    env $envs OUT=/tmp/sbs-out timeout "$(left)" bash logs/gpu/2026-12-01-s12/sbs.sh $prec \
        > "$OUT/sbs-$prec.out" 2>&1
    grep "c=1\|c=32" "$OUT/sbs-$prec.out" | tail -2
    tar czf "$OUT/sbs.tgz" -C /tmp sbs sbs-out 2>/dev/null
done
if want onegate && [ "$(left)" -gt 100 ]; then  # the 1-row path alone: the bf16 GEMV default (kb/0042)
    stamp "bf16 gate, prompts one at a time ($(left) s left)"
    GATE_ARGS="--one-at-a-time" timeout $(( $(left) - 5 )) bash scripts/gpu_gate.sh bf16 \
        > "$OUT/gate-bf16-one.out" 2>&1
    grep "overall\|gate PASSED\|gate FAILED" "$OUT/gate-bf16-one.out"
fi
stamp done
