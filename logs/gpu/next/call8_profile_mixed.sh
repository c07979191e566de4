#!/usr/bin/env bash
# Prepared in session 16, NOT RUN (~5 min cold, carry [".whl"]): why a cold FP8 server's first
# mixed steps take ~660 ms each and later ones ~170-240 ms with no compile logged (kb/0034 §1).
# scripts/profile_mixed.py drives the engine in-process: 24 requests decode, then 3 rounds of
# 8 arriving 1024-token prompts; rounds 0 and 2 under torch.profiler (top ops by CUDA time).
# Then the same for bf16 (its first mixed window was ~287 ms against ~180 later).
# Usage: TAILORED_COMMIT=<sha> bash logs/gpu/next/call8_profile_mixed.sh
source "$(dirname "$0")/../../../scripts/device_env.sh" call8_profile_mixed
full_configs
for P in fp8 bf16; do
    C=/tmp/full; [ "$P" = fp8 ] && C=/tmp/full-fp8
    stamp "$P: first mixed steps of a cold engine against later ones"
    timeout 240 python3 scripts/profile_mixed.py "$C" --load-format dummy --rounds 3 \
        > "$OUT/profile_mixed_$P.log" 2>&1
    grep "^round\|Triton compile\|Error" "$OUT/profile_mixed_$P.log" | cut -c1-400
done
stamp "done"
