#!/usr/bin/env bash
# Session 11, call 6 (kb/0029): is the FP8 experts' e4m3 -> bf16 conversion what holds them at
# ~2.8 TB/s (bf16 experts: ~4.1)? bench_moe --ab f16 runs the same launch configs (the
# committed table) with the dots in bf16 and in float16 (e4m3 -> f16 is one instruction per
# pair), B=1 and B=32, and ncu reads the counters of one eager layer of each (and of bf16
# experts at B=32, for comparison).
# Usage: TAILORED_COMMIT=<sha> bash logs/gpu/2026-12-01-s11/call6.sh
source "$(dirname "$0")/../../../scripts/device_env.sh" call6
stamp "GPU tests: FP8 fused MoE, f16 dots vs bf16 dots"
timeout 75 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py -k "f16_dots or fused_moe_fp8" 2>&1 | tail -3
NCU="ncu --profile-from-start off --clock-control none --kernel-name regex:gate_up|down_kernel
     --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy --section LaunchStats"
stamp "bench_moe FP8: bf16 dots vs f16 dots, with ncu"
timeout 120 $NCU python3 scripts/bench_moe.py --fp8 --ab f16 --batches 1,32 --ncu \
    --json "$OUT/moe-fp8-f16.json" > "$OUT/ncu-fp8.txt" 2>&1
grep "^B=\|^|" "$OUT/ncu-fp8.txt"
stamp "bench_moe bf16 experts B=32, with ncu"
timeout 90 $NCU python3 scripts/bench_moe.py --batches 32 --ncu > "$OUT/ncu-bf16.txt" 2>&1
grep "^B=\|^|" "$OUT/ncu-bf16.txt"
grep -E "^  [a-z_]+kernel|DRAM Throughput|Memory Throughput|Duration|Compute \(SM\) Throughput|Achieved Occupancy|Registers Per|Block Limit Reg|Warp Cycles Per Issued|Issue Slots Busy|One or More Eligible|No Eligible" "$OUT"/ncu-*.txt | cut -c1-150 | head -90
stamp "done"
