#!/usr/bin/env bash
# Prepared in session 12, NOT RUN (~3 min, carry [".whl"]). Why the MoE prefill grouped GEMM runs
# at ~12-15 % of tensor peak (kb/0029: 134 ms of a 314 ms 8 x 1024-token FP8 step; 412 GFLOP a
# layer at 8192 tokens, 16.6 ms a step at 990 TFLOP/s): ncu of one eager layer at 8192 tokens
# (65536 pairs, ~256 a expert; the committed prefill launch configs), bf16 and FP8 experts.
# Read: SM / tensor-pipe throughput vs DRAM, achieved occupancy, registers (two fp32
# accumulators a program in gate_up), stall reasons (long scoreboard = the gathered x rows?).
# Usage: TAILORED_COMMIT=<sha> bash logs/gpu/next/call3_ncu_prefill_moe.sh
source "$(dirname "$0")/../../../scripts/device_env.sh" call3_ncu
NCU="ncu --profile-from-start off --clock-control none --kernel-name regex:gate_up|down_kernel
     --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis
     --section WarpStateStats --section Occupancy --section LaunchStats"
for v in "" "--fp8"; do
    stamp "bench_moe ${v:-bf16} B=8192, ncu"
    # shellcheck disable=SC2086
    timeout 150 $NCU python3 scripts/bench_moe.py $v --batches 8192 --reps 5 --ncu \
        > "$OUT/ncu-prefill${v:+-fp8}.txt" 2>&1
    grep "^B=\|^|" "$OUT/ncu-prefill${v:+-fp8}.txt"
done
grep -E "^  [a-z_]+kernel|DRAM Throughput|Duration|Compute \(SM\) Throughput|Achieved Occupancy|Registers Per|Block Limit|Warp Cycles Per Issued|Issue Slots Busy|No Eligible|Stall|Tensor" \
    "$OUT"/ncu-prefill*.txt | cut -c1-150 | head -120
stamp "done"
