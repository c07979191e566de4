#!/usr/bin/env bash
# Prepared in session 11, NOT RUN (its 30 minutes were spent). First call of the next session
# with device time (~8 min, carry [".whl"]). Three switches built in session 11, each off by
# default until this A/B and the gate (call2_gate.sh) say so (kb/0029):
#   TAILORED_MOE_FP8_DOT_F16=1  FP8 experts' dots in float16 (ncu: gate_up 122.6 -> 93.3 us at
#                               B=32; measured in the model: B=32 10.32 ms vs 12.21 / 12.40 in
#                               two other calls; never A/B'd in one process)
#   TAILORED_GDN_PREFILL_CONV=1 the GDN prefill conv in two launches instead of cat + cuDNN conv
#                               + cat per sequence (50 ms of the 314 ms 8 x 1024 FP8 step)
#   TAILORED_PROJ_ROW_ALIGN=64  fused bf16 projections padded to 64 rows (the 1281-row MoE group
#                               ran on an sm75 CUTLASS kernel: 19.4 ms of that step)
# Read: per precision, e0 vs e1 (row align) prefill 1024 replay / 8 x 1024 step / decode, and the
# prefill variants control vs gdn_conv (vs fp8_f16dot for FP8) in each.
# Usage: TAILORED_COMMIT=<sha> bash logs/gpu/next/call1_ab.sh
source "$(dirname "$0")/../../../scripts/device_env.sh" call1_ab
stamp "GPU tests: gdn_conv kernels, FP8 f16 dots"
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_gdn_conv.py tests/test_kernels.py \
    -k "gdn_conv or conv_prefill or f16_dots or fused_moe_fp8" 2>&1 | tail -3
for prec in fp8 bf16; do
    pv=control,gdn_conv; [ "$prec" = fp8 ] && pv=control,gdn_conv,fp8_f16dot
    dv=""; [ "$prec" = fp8 ] && dv="--variants control,fp8_f16dot"
    stamp "micro $prec: e0 defaults, e1 TAILORED_PROJ_ROW_ALIGN=64"
    PRECISIONS=$prec MICRO_BATCHES=1,32 MICRO_TIMEOUT=150 MICRO_TAIL=30 \
        MICRO_ENVS=";TAILORED_PROJ_ROW_ALIGN=64" \
        MICRO_ARGS="--prefill-graphs --prefill-batch 8 --prefill-variants $pv $dv --rounds 2" \
        timeout 320 bash scripts/gpu_fast.sh micro > "$OUT/micro-$prec.log" 2>&1
    grep "in-process\|^| \|^B=" "$OUT/micro-$prec.log" | grep -v "^|---" | cut -c1-110
done
stamp "done"
