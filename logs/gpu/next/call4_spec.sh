#!/usr/bin/env bash
# Prepared in session 14, NOT RUN (carry [".whl"]). Speculative decoding with the MTP head
# (model/mtp.py, model/fast_spec.py; kb/0032) on the H200:
#   tests            the GPU tests of the verify/MTP CUDA graphs and the engine (~3 min)
#   serve N RATE P   tailored serve P (bf16|fp8) with N drafts a step and synthetic acceptance
#                    RATE (random weights accept nothing real; the kit's `serve mtp` runs vLLM
#                    with 1 draft at 0.8: 266.1 tok/s c=1, TTFT 128.5 ms, TPOT 3.33 ms), then
#                    tailored bench c=1 x 16 (1024 in / 512 out) and c=4 x 16 (~4 min)
# Usage: TAILORED_COMMIT=<sha> bash logs/gpu/next/call4_spec.sh tests
#        TAILORED_COMMIT=<sha> bash logs/gpu/next/call4_spec.sh serve 2 0.8 bf16
source "$(dirname "$0")/../../../scripts/device_env.sh" "call4_spec-${1:-tests}${2:+-$2}${3:+-$3}${4:+-$4}"
case "${1:-}" in
tests)
    timeout 400 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_spec.py -x 2>&1 | tail -n 25
    ;;
serve)
    N=${2:?drafts} RATE=${3:?rate} PREC=${4:-bf16}
    CKPT=/tmp/spec-ckpt-$PREC
    dt=(); [ "$PREC" = fp8 ] && dt=(--dtype fp8)
    python3 -m tailored synth "$CKPT" --preset full --config-only "${dt[@]}" 2>&1 | tail -1
    LOGF=$OUT/server-spec$N-$RATE-$PREC.log
    stamp "serve $PREC, $N drafts, synthetic acceptance $RATE"
    setsid nohup python3 -m tailored serve "$CKPT" --load-format dummy --port 8001 \
        --served-model-name qwen36-35b-a3b --max-model-len 16384 --max-num-seqs 128 \
        --max-num-batched-tokens 8192 --num-speculative-tokens "$N" \
        --spec-synthetic-acceptance "$RATE" > "$LOGF" 2>&1 < /dev/null &
    PID=$!
    wait_for_server 8001 "$PID" "$LOGF" 330 || exit 1
    stamp "ready"
    grep -i "speculative\|captured" "$LOGF" | cut -c1-200
    # the manifest names the server's flags: these numbers pair with vLLM `serve mtp` only
    CFG=$(python3 -c 'import json, sys; print(json.dumps({"engine": "tailored serve",
        "variant": sys.argv[1] + " + MTP", "command": "python3 -m tailored serve " + sys.argv[2]
        + " --load-format dummy --max-model-len 16384 --max-num-seqs 128"
        " --max-num-batched-tokens 8192 --num-speculative-tokens " + sys.argv[3]
        + " --spec-synthetic-acceptance " + sys.argv[4]}))' "$PREC" "$CKPT" "$N" "$RATE")
    python3 -m tailored.bench --base-url http://127.0.0.1:8001 --model qwen36-35b-a3b \
        --concurrency 1,4 --num-prompts 16,16 --input-len 1024 --output-len 512 --ignore-eos \
        --temperature 0 --precision "$PREC" --label "tailored-$PREC-spec$N-$RATE" \
        --checkpoint-dir "$CKPT" --engine-config "$CFG" \
        --out "$OUT/tailored-$PREC-spec$N-$RATE.json" 2>&1 | tail -n 30
    grep -i "speculative decoding\|step timing\|Triton compile" "$LOGF" | tail -n 6 | cut -c1-300
    kill -TERM "$PID"; sleep 5; kill -9 "$PID" 2>/dev/null
    stamp "done"
    ;;
*) sed -n '2,13p' "$0"; exit 1 ;;
esac
