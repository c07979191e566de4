#!/usr/bin/env bash
# Issue 58 on the GPU (docs/evaluation.md): the local lm-eval task set (tests/lm_eval_tasks/)
# against the full-size servers on the accuracy gate's fixture weights (--load-format dummy
# --dummy-init stable, seed 0): bf16, bf16 on the plain PyTorch path (--kernels off: the
# noise floor, two correct bf16 implementations of one model), and block FP8 (the bf16
# weights of the same seed, quantized). Each server answers the task set's requests as
# lm-eval 0.4's local-completions sends them (lab/lm_eval_replay.py run: lm-eval's own wheels
# exceed what a device call carries; tests/server/test_evaluation.py checks the replay against
# lm-eval), and bf16 and FP8 time a 1,024-token prompt with and without echo (replay ttft).
# `compare` judges: FP8's per-token logprobs against bf16's, mean squared difference <= the
# gate's fp8.vs_bf16_reference.max_kl_vs_floor (4) x the floor's; echo's TTFT <= 1.3x.
# Where lm-eval is importable on the machine, its CLI runs the task set against each server too.
#
# Prepare here: bash lab/fetch_wheels.sh   (.whl/, git-ignored)
# Run there:    device run, carry [".whl"], command: bash lab/gpu_eval.sh [bf16] [floor] [fp8] [compare]
# Results: $OUT/eval-{bf16,floor,fp8}.json, $OUT/ttft-{bf16,fp8}.json, $OUT/eval-verdict.json
# (also kept in /tmp/eval-results while the machine stays warm, so the parts may run in
# separate calls); exit 1 when the verdict fails.
source "$(dirname "$0")/device_env.sh" gpu_eval
PARTS=${*:-bf16 floor fp8 compare}
RES=/tmp/eval-results
mkdir -p "$RES"
full_configs
URL=http://127.0.0.1:8001

serve_and_replay() {  # NAME CHECKPOINT_DIR [serve options...]
    local name=$1 dir=$2
    shift 2
    stamp "serve $name: $dir $*"
    python3 -m tailored serve "$dir" --load-format dummy --dummy-init stable --seed 0 \
        --max-model-len 4096 --port 8001 "$@" > "$OUT/server-$name.log" 2>&1 &
    local pid=$!
    wait_for_server 8001 $pid "$OUT/server-$name.log" 480 || return 1
    stamp "replay the task set ($name)"
    timeout 300 python3 lab/lm_eval_replay.py run $URL --tokenizer "$dir" --out "$RES/eval-$name.json"
    if [ "$name" != floor ]; then
        stamp "TTFT of 1,024 prompt tokens with and without echo ($name)"
        timeout 300 python3 lab/lm_eval_replay.py ttft $URL --tokens 1024 --repeats 10 \
            --out "$RES/ttft-$name.json" | tail -4
    fi
    if python3 -c "import lm_eval" 2>/dev/null; then
        stamp "lm-eval itself ($name)"
        HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 timeout 300 lm-eval run --model local-completions \
            --model_args "model=qwen36-35b-a3b,base_url=$URL/v1/completions" \
            --tasks nano_local --include_path tests/lm_eval_tasks --batch_size 4 \
            --output_path "$OUT/lm-eval-$name" --log_samples 2>&1 | grep -v "it/s\]" | tail -8
    fi
    kill $pid
    wait $pid 2>/dev/null
    cp "$RES"/*"$name".json "$OUT"/ 2>/dev/null
    nvidia-smi --query-gpu=memory.used --format=csv,noheader
}

[[ " $PARTS " == *" bf16 "* ]] && serve_and_replay bf16 /tmp/full
[[ " $PARTS " == *" floor "* ]] && serve_and_replay floor /tmp/full --kernels off
[[ " $PARTS " == *" fp8 "* ]] && serve_and_replay fp8 /tmp/full-fp8
rc=0
if [[ " $PARTS " == *" compare "* ]]; then
    stamp "verdict: FP8 against bf16 within the floor; echo's TTFT"
    python3 lab/lm_eval_replay.py compare --base "$RES/eval-bf16.json" \
        --floor "$RES/eval-floor.json" --other "$RES/eval-fp8.json" \
        --ttft "$RES/ttft-bf16.json" "$RES/ttft-fp8.json" --out "$OUT/eval-verdict.json"
    rc=$?
fi
stamp "done"
exit $rc
