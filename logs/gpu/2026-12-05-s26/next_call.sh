#!/usr/bin/env bash
# Prepared in session 26 for the next device session (carry [".whl"]; END s of device time for
# the command; kb/0043). Sessions 25 and 26 got no served numbers: session 25's machine died
# before its side by sides and session 26 was lent none. Owed, in order, each while time is left:
#  sbs      Served side by sides (tailored half) at the defaults (the bf16 GEMV at one row,
#           kb/0042, never served), FP8 first with SBS_ENV in front (e.g.
#           SBS_ENV="TAILORED_MOE_FP8_DOWN_F16=1 TAILORED_FP8_DENSE_F16_UP_TO=64" once the A/B
#           and gate below passed), then bf16 (SBS_PRECS="fp8" or "bf16" for one of them).
#  tests    GPU tests of the CPU-only code of sessions 25-26: pow2 rows and the f16 dots
#           (MoE gate_up and down; fp8_linear with bf16 rows, kb/0043), the PDL bitwise tests
#           (verify + chain graphs; the tiled FP8 GEMM at 3 rows), the full-width
#           fast-vs-plain test with every switch on (FP8_DENSE_F16_UP_TO=4096 there), fp32
#           invariance. The new fp8_linear keys are not in tuned.json: they tune at first use.
#  kern     The FP8 dense shapes at 8 and 32 rows: cuBLAS over the bf16 copy against
#           fp8_linear with bf16 dots and with float16 dots (scripts/bench_fp8_gemv.py).
#  ab       FP8 A/B at B=8,32 (3 rounds): down_f16 (kb/0042), dense_f16 (kb/0043), both,
#           shared_up_to32, attention with 4 / 2 splits from 16 rows (kb/0043); prefill
#           1024 and 8 x 1024 with down_f16 and dense_f16_all; the B=32 kernel table with both.
#  bf16ab   bf16 B=1 (5 rounds): the bf16 MoE GEMV (kb/0039, measured with PDL off only)
#           against the tiles, and the B=1 kernel table (none since session 18's).
#  gate     The FP8 gate with both switches on (TAILORED_MOE_FP8_DOWN_F16=1
#           TAILORED_FP8_DENSE_F16_UP_TO=64); a failure means gating each alone next.
#  onegate  The bf16 gate with the prompts one at a time (`--one-at-a-time`, kb/0042 §5).
# PARTS picks sections (default all, in the order above); on a flaky machine run calls of
# ~300 s back to back: PARTS="sbs" SBS_PRECS=fp8, PARTS="sbs" SBS_PRECS=bf16, then
# PARTS="tests kern ab", then PARTS="bf16ab gate onegate".
# Usage: TAILORED_COMMIT=<sha> OUT=$OUT END=560 [PARTS=...] [SBS_PRECS=...] [SBS_ENV=...] \
#            bash logs/gpu/2026-12-05-s26/next_call.sh
source "$(dirname "$0")/../../../scripts/device_env.sh" next_call
left() { echo $(( ${END:-560} - ($(date +%s) - T0) )); }
# a step's timeout: its own limit, or what is left of END less a margin, whichever is less
cap() { local l=$(( $(left) - 15 )); echo $(( l < $1 ? l : $1 )); }
# whether more than $1 s are left (else say which step is skipped)
enough() { [ "$(left)" -gt "$1" ] || { stamp "skipped ($(left) s left): $2"; false; }; }
PARTS=" ${PARTS:-sbs tests kern ab bf16ab gate onegate} "
for part in $PARTS; do
    case $part in sbs|tests|kern|ab|bf16ab|gate|onegate) ;;
        *) echo "unknown part '$part' in PARTS (sbs tests kern ab bf16ab gate onegate)"; exit 2;;
    esac
done
want() { [[ "$PARTS" == *" $1 "* ]]; }
full_configs > /dev/null
want sbs && for prec in ${SBS_PRECS:-fp8 bf16}; do
    [ "$(left)" -gt 170 ] || { stamp "no time for the $prec side by side"; break; }
    envs=""; [ "$prec" = fp8 ] && envs=${SBS_ENV:-}
    stamp "side by side $prec (tailored half, defaults + '$envs', $(left) s left)"
    env $envs OUT=/tmp/sbs-out timeout "$(cap 600)" bash logs/gpu/2026-12-01-s12/sbs.sh $prec \
        > "$OUT/sbs-$prec.out" 2>&1
    cp /tmp/sbs-out/sbs-call.log "$OUT/sbs-call-$prec.log" 2>/dev/null  # bf16's overwrites it
    grep "c=1\|c=32" "$OUT/sbs-$prec.out" | tail -2
    tar czf "$OUT/sbs.tgz" -C /tmp sbs sbs-out 2>/dev/null
done
want tests && {
stamp "GPU tests: pow2 rows, f16 dots (MoE, fp8_linear); PDL (verify + chain, tiles at 3 rows)"
enough 60 "f16 tests" && {
timeout "$(cap 200)" python3 -m pytest -q -p no:cacheprovider -rf tests/test_kernels.py \
    tests/test_fp8_kernels.py tests/test_tuning.py \
    -k "pow2 or f16_dots or float16 or autotuned_with or shipped" > "$OUT/tests-f16.log" 2>&1
tail -1 "$OUT/tests-f16.log"; }
enough 90 "PDL tests" && {
timeout "$(cap 300)" python3 -m pytest -q -p no:cacheprovider -rf tests/test_gpu_spec.py \
    tests/test_gpu.py -k "pdl" > "$OUT/tests-pdl.log" 2>&1
tail -1 "$OUT/tests-pdl.log"; }
enough 90 "full-width test" && {
timeout "$(cap 240)" python3 -m pytest -q -p no:cacheprovider -rf tests/test_gpu.py \
    -k "full_width and new and fp8" > "$OUT/tests-full-width.log" 2>&1
tail -1 "$OUT/tests-full-width.log"; }
# fp32 models take the GEMV at one row too: "alone equals inside a batch" at 1e-5
enough 90 "invariance tests" && {
timeout "$(cap 200)" python3 -m pytest -q -p no:cacheprovider -rf tests/test_gpu_invariance.py \
    > "$OUT/tests-invariance.log" 2>&1
tail -1 "$OUT/tests-invariance.log"; }
}
want kern && enough 90 "kern" && {
stamp "FP8 dense shapes at 8 and 32 rows: cuBLAS bf16 vs fp8_linear bf16 / float16 dots"
timeout "$(cap 240)" python3 scripts/bench_fp8_gemv.py --batches 8,32 \
    --json "$OUT/kern-dense.json" > "$OUT/kern-dense.log" 2>&1
grep -A14 "fp8_linear f16" "$OUT/kern-dense.log" | head -16
}
want ab && enough 150 "FP8 A/B" && {
stamp "A/B fp8 down_f16, dense_f16: B=8,32, prefill 1024 and 8 x 1024 ($(left) s left)"
timeout "$(cap 600)" python3 scripts/bench_decode.py /tmp/full-fp8 --batches 8,32 \
    --json "$OUT/ab-f16.json" --rounds 3 \
    --variants control,down_f16,dense_f16,down_f16+dense_f16,shared_up_to32,attn_large4,attn_large2 \
    --prefill-variants control,down_f16,dense_f16_all --prefill-batch 8 \
    --profile --profile-batch 32 --profile-variant down_f16+dense_f16 > "$OUT/ab-f16.log" 2>&1
grep "^| \|^B=\|min of rounds\|prefill\|_down_kernel\|_fp8_linear\|Error\|error" \
    "$OUT/ab-f16.log" | cut -c1-130 | head -30
}
want bf16ab && enough 120 "bf16 A/B" && {  # the bf16 c=1 gap (320 vs 420 tok/s), PDL on
stamp "bf16 B=1: the MoE GEMV against the tiles, the kernel table ($(left) s left)"
timeout "$(cap 600)" python3 scripts/bench_decode.py /tmp/full --batches 1 \
    --json "$OUT/ab-bf16.json" --rounds 5 --variants control,moe_gemv_bf16 \
    --profile --profile-batch 1 > "$OUT/ab-bf16.log" 2>&1
grep "^| \|^B=\|min of rounds\|Error\|error" "$OUT/ab-bf16.log" | cut -c1-130 | head -40
}
if want gate && [ "$(left)" -gt 120 ]; then
    stamp "FP8 gate with down_f16 and dense_f16 ($(left) s left)"
    TAILORED_MOE_FP8_DOWN_F16=1 TAILORED_FP8_DENSE_F16_UP_TO=64 timeout $(( $(left) - 5 )) bash scripts/gpu_gate.sh fp8 \
        > "$OUT/gate-fp8.out" 2>&1
    grep "overall\|vs bf16 reference\|gate PASSED\|gate FAILED" "$OUT/gate-fp8.out"
fi
if want onegate && [ "$(left)" -gt 100 ]; then  # the 1-row path alone: the bf16 GEMV default (kb/0042)
    stamp "bf16 gate, prompts one at a time ($(left) s left)"
    GATE_ARGS="--one-at-a-time" timeout $(( $(left) - 5 )) bash scripts/gpu_gate.sh bf16 \
        > "$OUT/gate-bf16-one.out" 2>&1
    grep "overall\|gate PASSED\|gate FAILED" "$OUT/gate-bf16-one.out"
fi
stamp done
