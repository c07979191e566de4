#!/usr/bin/env bash
# Session 27's device calls (carry [".whl"]; END s of device time for the command; kb/0044).
# PARTS picks sections, in this order:
#  tiles    Launch-config sweep of the MoE expert GEMMs at decode batches, outside the
#           autotuner's candidates (scripts/bench_moe_tiles.py): FP8 down (the 2.3 TB/s
#           kernel, kb/0043 §0) and gate_up at B=32. The best configs go to $OUT/best-*.txt
#           for the A/B.
#  ab       FP8 decode A/B at B=8,32 (3 rounds): the swept best down / gate_up configs in the
#           model (bench_decode's down_cfg, gate_up_cfg, down_cfg_f16) against the autotuned
#           control; the MoE group through the tiled FP8 GEMM (moe_group_tiled, kb/0044).
#  ncu      One eager FP8 MoE layer at B=32 under ncu (--clock-control none): the down
#           kernel's speed of light, memory, occupancy and warp stall sections.
#  tilesbf16 The same sweep for bf16 down at B=32.
#  tests    GPU tests owed since session 25: PDL (tiles at 3 rows), the full-width
#           fast-vs-plain test with every switch on, fp32 invariance.
#  onegate  The bf16 gate with the prompts one at a time (the one-row bf16 GEMV alone).
# Usage: TAILORED_COMMIT=<sha> OUT=$OUT END=560 [PARTS=...] bash logs/gpu/2026-12-05-s27/call.sh
source "$(dirname "$0")/../../../scripts/device_env.sh" call
left() { echo $(( ${END:-560} - ($(date +%s) - T0) )); }
cap() { local l=$(( $(left) - 15 )); echo $(( l < $1 ? l : $1 )); }
enough() { [ "$(left)" -gt "$1" ] || { stamp "skipped ($(left) s left): $2"; false; }; }
PARTS=" ${PARTS:-tiles ab ncu tilesbf16 tests onegate} "
for part in $PARTS; do
    case $part in tiles|ab|ncu|tilesbf16|tests|onegate) ;;
        *) echo "unknown part '$part' in PARTS (tiles ab ncu tilesbf16 tests onegate)"; exit 2;;
    esac
done
want() { [[ "$PARTS" == *" $1 "* ]]; }
full_configs > /dev/null
export TRITON_CACHE_DIR=/tmp/triton-cache
want tiles && {
enough 60 "FP8 down sweep" && {
stamp "FP8 down sweep, B=32 ($(left) s left)"
timeout "$(cap 300)" python3 scripts/bench_moe_tiles.py --fp8 --kernel down --batches 32 \
    --json "$OUT/tiles-down-fp8.json" --best-out "$OUT/best-down.txt" > "$OUT/tiles-down-fp8.log" 2>&1
grep -A13 "fastest first" "$OUT/tiles-down-fp8.log"; tail -2 "$OUT/tiles-down-fp8.log"; }
enough 60 "FP8 gate_up sweep" && {
stamp "FP8 gate_up sweep, B=32 ($(left) s left)"
timeout "$(cap 200)" python3 scripts/bench_moe_tiles.py --fp8 --kernel gate_up --batches 32 \
    --json "$OUT/tiles-gate_up-fp8.json" --best-out "$OUT/best-gate_up.txt" \
    > "$OUT/tiles-gate_up-fp8.log" 2>&1
grep -A13 "fastest first" "$OUT/tiles-gate_up-fp8.log"; tail -1 "$OUT/tiles-gate_up-fp8.log"; }
}
want ab && enough 150 "FP8 A/B" && {
variants=control,moe_group_tiled
[ -s "$OUT/best-down.txt" ] && { export BENCH_MOE_DOWN_CFG=$(cat "$OUT/best-down.txt"); variants+=",down_cfg"; }
[ -s "$OUT/best-gate_up.txt" ] && { export BENCH_MOE_GATE_UP_CFG=$(cat "$OUT/best-gate_up.txt"); variants+=",gate_up_cfg"; }
[[ $variants == *down_cfg*gate_up_cfg* ]] && variants+=",down_cfg+gate_up_cfg"
[ -s "$OUT/best-down.txt.f16" ] && { export BENCH_MOE_DOWN_F16_CFG=$(cat "$OUT/best-down.txt.f16"); variants+=",down_cfg_f16"; }
stamp "A/B fp8 B=8,32: $variants (down ${BENCH_MOE_DOWN_CFG:-} / f16 ${BENCH_MOE_DOWN_F16_CFG:-}, gate_up ${BENCH_MOE_GATE_UP_CFG:-}; $(left) s left)"
timeout "$(cap 400)" python3 scripts/bench_decode.py /tmp/full-fp8 --batches 8,32 \
    --json "$OUT/ab-tiles.json" --rounds 3 --variants $variants > "$OUT/ab-tiles.log" 2>&1
grep "^| \|^B=\|min of rounds\|Error\|error" "$OUT/ab-tiles.log" | cut -c1-130 | head -30
}
want ncu && enough 90 "ncu" && {
stamp "ncu: one FP8 MoE layer at B=32 ($(left) s left)"
timeout "$(cap 150)" ncu --clock-control none --profile-from-start off \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
    --section LaunchStats --section WarpStateStats --section SchedulerStats \
    python3 scripts/bench_moe.py --fp8 --ab f16 --batches 32 --reps 5 --ncu \
    > "$OUT/ncu-moe-b32.log" 2>&1
grep -n "_down_kernel\|_gate_up_kernel\|Duration\|DRAM Throughput\|Memory Throughput\|Compute (SM)\|Achieved Occupancy\|Registers Per\|Stall Long\|Warp Cycles Per Issued\|Waves Per SM\|Block Limit" \
    "$OUT/ncu-moe-b32.log" | head -60
}
want tilesbf16 && {
enough 60 "bf16 down sweep" && {
stamp "bf16 down sweep, B=32 ($(left) s left)"
timeout "$(cap 150)" python3 scripts/bench_moe_tiles.py --kernel down --batches 32 \
    --json "$OUT/tiles-down-bf16.json" > "$OUT/tiles-down-bf16.log" 2>&1
grep -A13 "fastest first" "$OUT/tiles-down-bf16.log"; }
}
want tests && {
enough 90 "PDL tests" && {
stamp "GPU tests: PDL ($(left) s left)"
timeout "$(cap 300)" python3 -m pytest -q -p no:cacheprovider -rf tests/test_gpu.py -k "pdl" \
    > "$OUT/tests-pdl.log" 2>&1
tail -1 "$OUT/tests-pdl.log"; }
enough 90 "full-width test" && {
timeout "$(cap 240)" python3 -m pytest -q -p no:cacheprovider -rf tests/test_gpu.py \
    -k "full_width and new" > "$OUT/tests-full-width.log" 2>&1
tail -1 "$OUT/tests-full-width.log"; }
enough 90 "invariance tests" && {
timeout "$(cap 200)" python3 -m pytest -q -p no:cacheprovider -rf tests/test_gpu_invariance.py \
    > "$OUT/tests-invariance.log" 2>&1
tail -1 "$OUT/tests-invariance.log"; }
}
if want onegate && [ "$(left)" -gt 100 ]; then
    stamp "bf16 gate, prompts one at a time ($(left) s left)"
    GATE_ARGS="--one-at-a-time" timeout $(( $(left) - 5 )) bash scripts/gpu_gate.sh bf16 \
        > "$OUT/gate-bf16-one.out" 2>&1
    grep "overall\|gate PASSED\|gate FAILED" "$OUT/gate-bf16-one.out"
fi
stamp done
