#!/usr/bin/env bash
# Session 39, call 1 (kb/0059): the FP8 decode down GEMM as one-expert-a-program GEMVs.
#  1. GPU tests: the GEMV against the tiled down GEMM (bf16 + fp32 activations, B=32 full size).
#  2. The down GEMM alone: tiled (tuned.json's picks) vs the GEMV sweep, FP8 at B=8/16/32,
#     bf16 at B=32 (scripts/bench_moe_down.py); the best FP8 B=32 config goes to the A/B.
#  3. In-model FP8 A/B at B=8/32 with that config (control, down_gemv, control, down_gemv).
# Fits an H100 (FP8 model). Usage: TAILORED_COMMIT=<sha> OUT=$OUT bash logs/gpu/2026-12-06-s39/call1.sh
set -u
source "$(dirname "$0")/../../../scripts/device_env.sh" call1
END=${END:-570}
left() { echo $(( END - ($(date +%s) - T0) )); }
full_configs > /dev/null
export TRITON_CACHE_DIR=/tmp/triton-cache
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
stamp "tests"
timeout 150 python3 -m pytest -q -p no:cacheprovider -rf tests/test_kernels.py \
    -k "down_gemv or fused_moe_fp8" > "$OUT/tests.log" 2>&1
tail -3 "$OUT/tests.log"
stamp "bench ($(left) s left)"
timeout 200 python3 scripts/bench_moe_down.py --precisions fp8 --batches 8,16,32 \
    --json "$OUT/down-fp8.json" > "$OUT/down-fp8.log" 2>&1
tail -6 "$OUT/down-fp8.log"
cfg=$(python3 - "$OUT/down-fp8.json" <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
g = [r for r in rows if r["B"] == 32 and r["variant"] != "tiled"]
print(min(g, key=lambda r: r["us"])["variant"].split()[1] if g else "16x4x2")
PY
)
stamp "picked $cfg; bf16 B=32 ($(left) s left)"
timeout 60 python3 scripts/bench_moe_down.py --precisions bf16 --batches 32 \
    --cfgs "$cfg,16x8x1,32x8x1" --json "$OUT/down-bf16.json" > "$OUT/down-bf16.log" 2>&1
tail -3 "$OUT/down-bf16.log"
stamp "A/B with $cfg ($(left) s left)"
TAILORED_MOE_DOWN_GEMV_CFG=$cfg timeout $(( $(left) - 10 )) python3 scripts/bench_decode.py \
    /tmp/full-fp8 --batches 8,32 --rounds 3 --variants control,down_gemv,control,down_gemv \
    --json "$OUT/ab-fp8.json" > "$OUT/ab-fp8.log" 2>&1
grep "^| \|^B=\|min of rounds\|Error\|error" "$OUT/ab-fp8.log" | cut -c1-130 | head -30
stamp done
