#!/usr/bin/env bash
# SGLang 0.5.17 beside tailored and vLLM (issue 57): Qwen3.6-35B-A3B, dummy weights, one GPU.
# Runs ON the GPU machine, from the root of the repository tree copied there.
#
# Usage: bash lab/peers/sglang/remote.sh [--port N] COMMAND [ARGS...]
#   check                  GPU, Python, torch, Triton, glibc, nvcc
#   stage DIR              add a chunk folder of fetch.sh (chunkNN) to $SGLANG_TMP/sglang-stage
#   install                join and check the parts, install the wheels (--no-deps) into
#                          $SGLANG_TMP/sglang-site, the model folder, then `probe`
#   probe                  import SGLang's serving path; list every package it lacks
#   serve VARIANT [ARGS]   start the server in the background; VARIANT bf16 | fp8 (the kit's
#                          block-FP8 config) | bf16-lowlat | fp8-lowlat (the cookbook's H200
#                          settings: MTP, 3 steps, 4 draft tokens, extra_buffer mamba cache);
#                          ARGS go to sglang.launch_server after the kit's own
#   wait [SECONDS]         poll /health until ready (default 600)
#   stop                   stop the server this script started on the port
#
# Environment: PORT (8002), OUT (a folder for the server log), SGLANG_TMP (/tmp),
# MODEL_SRC (config + tokenizer folder, default .baseline-kit/model: the vLLM kit's),
# MEM_FRACTION (0.8, the cookbook's), SIM_ACC_LEN (lowlat variants: the accepted length per
# verify step SGLang simulates, default 2.95 = 1 + 0.8 + 0.8^2 + 0.8^3, i.e. each draft token
# accepted at 0.8 as in the vLLM kit's MTP run: dummy weights would accept nothing).
set -euo pipefail

KIT=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$KIT/../../.." && pwd)
TMPD=${SGLANG_TMP:-/tmp}
STAGE=$TMPD/sglang-stage SITE=$TMPD/sglang-site
MODEL=$TMPD/sglang-model MODEL_FP8=$TMPD/sglang-model-fp8
MODEL_SRC=${MODEL_SRC:-$ROOT/.baseline-kit/model}
NAME=qwen36-35b-a3b
PORT=${PORT:-8002}
while [ $# -gt 0 ]; do
  case "$1" in
    --port) PORT=${2:?--port needs a value}; shift 2 ;;
    --port=*) PORT=${1#--port=}; shift ;;
    *) break ;;
  esac
done
LOG=$TMPD/sglang-$PORT.log PIDF=$TMPD/sglang-$PORT.pid VARF=$TMPD/sglang-$PORT.variant
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 DO_NOT_TRACK=1
die() { echo "remote.sh: $*" >&2; exit 1; }
with_site() { PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH} "$@"; }

# the block-FP8 quantization of the vLLM kit's `serve fp8` (same tensors kept in bf16)
FP8_QUANT='{"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
  "weight_block_size": [128, 128],
  "modules_to_not_convert": ["lm_head", "mlp.gate", "shared_expert_gate", "in_proj_a",
                             "in_proj_b", "in_proj_ba", "visual", "mtp"]}'

cmd=${1:-}; shift || true
case "$cmd" in
check)
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  python3 -c 'import sys, torch, triton
print(sys.version.split()[0], torch.__version__, torch.version.cuda, triton.__version__,
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no cuda")'
  v=$(ldd --version 2>&1 || true); echo "${v%%$'\n'*}"
  command -v gcc nvcc ninja || true
  ;;

stage)
  src=${1:?usage: stage DIR}
  [ -d "$src" ] || die "stage: no folder $src (carry it)"
  mkdir -p "$STAGE" && cp -r "$src"/. "$STAGE"/
  ls -la "$STAGE"
  ;;

install)
  [ -d "$STAGE" ] || die "no $STAGE: stage every chunk first"
  bash "$KIT/../unpack_chunks.sh" "$STAGE" sglang-kit "$STAGE/kit"
  cd "$STAGE/kit"
  wheels=() absent=()
  while read -r group file _; do
    case "$group" in
      always) wheels+=("$file") ;;
      probe=*)  # only where the machine's own python lacks the module
        if ! python3 -c "import importlib.util, sys; sys.exit(importlib.util.find_spec(sys.argv[1]) is None)" "${group#probe=}" 2>/dev/null; then
          wheels+=("$file"); absent+=("${group#probe=}")
        fi ;;
    esac
  done < MANIFEST
  echo "installing ${#wheels[@]} wheels; of the probed ones the machine lacked: ${absent[*]:-none}"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$SITE" "${wheels[@]}"
  cd "$ROOT"
  [ -f "$MODEL_SRC/config.json" ] || die "no $MODEL_SRC/config.json: carry .baseline-kit (cp -r ../shared/baseline .baseline-kit) or set MODEL_SRC"
  rm -rf "$MODEL" && cp -r "$MODEL_SRC" "$MODEL"
  if [ -f "$MODEL/tokenizer.json.xz" ]; then
    python3 -c "import lzma, sys; open(sys.argv[2], 'wb').write(lzma.open(sys.argv[1]).read())" \
        "$MODEL/tokenizer.json.xz" "$MODEL/tokenizer.json" && rm -f "$MODEL/tokenizer.json.xz"
  fi
  du -sh "$SITE"
  with_site python3 "$KIT/probe_imports.py" || echo "WARNING: the probe found gaps (above): add their wheels to wheels.lock"
  ;;

probe)
  with_site python3 "$KIT/probe_imports.py" "$@"
  ;;

serve)
  variant=${1:-bf16}; shift || true
  model=$MODEL extra=() envs=()
  case "$variant" in
    bf16|bf16-lowlat) ;;
    fp8|fp8-lowlat)
      rm -rf "$MODEL_FP8" && cp -r "$MODEL" "$MODEL_FP8" && model=$MODEL_FP8
      python3 - "$MODEL/config.json" "$MODEL_FP8/config.json" "$FP8_QUANT" <<'EOF'
import json, sys
cfg = json.load(open(sys.argv[1]))
cfg["quantization_config"] = json.loads(sys.argv[3])
json.dump(cfg, open(sys.argv[2], "w"), indent=2)
EOF
      ;;
    *) die "serve: VARIANT is bf16, fp8, bf16-lowlat or fp8-lowlat" ;;
  esac
  if [[ $variant == *-lowlat ]]; then
    # the cookbook's H200 command (SGLANG_ENABLE_SPEC_V2=1, MTP via NEXTN, 3 steps, top-k 1,
    # 4 draft tokens, extra_buffer mamba scheduling); acceptance simulated (dummy weights)
    envs=(SGLANG_ENABLE_SPEC_V2=1 "SGLANG_SIMULATE_ACC_LEN=${SIM_ACC_LEN:-2.95}")
    extra=(--speculative-algorithm NEXTN --speculative-num-steps 3 --speculative-eagle-topk 1
           --speculative-num-draft-tokens 4 --mamba-scheduler-strategy extra_buffer)
  fi
  [ -f "$model/config.json" ] || die "no $model: run install first"
  if [ -f "$PIDF" ] && kill -0 "$(cat "$PIDF")" 2>/dev/null; then
    die "a server already runs on port $PORT (pid $(cat "$PIDF")): stop it first"
  fi
  # the vLLM kit's limits (16384 context, 128 running, 8192-token prefill chunks); FA3 is
  # SGLang's own default on Hopper, named so that the log and manifest say it
  env "${envs[@]}" PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" setsid nohup \
    python3 -m sglang.launch_server --model-path "$model" --served-model-name "$NAME" \
      --load-format dummy --dtype bfloat16 --context-length 16384 --max-running-requests 128 \
      --chunked-prefill-size 8192 --mem-fraction-static "${MEM_FRACTION:-0.8}" \
      --attention-backend fa3 --enable-metrics --host 127.0.0.1 --port "$PORT" \
      "${extra[@]}" "$@" > "$LOG" 2>&1 < /dev/null &
  echo $! > "$PIDF"; echo "$variant" > "$VARF"
  echo "started pid $(cat "$PIDF") variant=$variant model=$model port=$PORT log=$LOG ${envs[*]} ${extra[*]} $*"
  ;;

wait)
  limit=${1:-600}; t0=$(date +%s)
  [ -f "$PIDF" ] || die "no server started on port $PORT"
  pid=$(cat "$PIDF")
  until python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$PORT/health', timeout=2)" 2>/dev/null; do
    kill -0 "$pid" 2>/dev/null || { echo "server died"; tail -n 80 "$LOG"; exit 1; }
    [ $(( $(date +%s) - t0 )) -lt "$limit" ] || { echo "not ready after $limit s"; tail -n 40 "$LOG"; exit 2; }
    sleep 5
  done
  echo "ready after $(( $(date +%s) - t0 )) s"
  grep -iE "backend|cuda graph|max_total_num_tokens|mem|speculative" "$LOG" | tail -n 30 || true
  if [ -n "${OUT:-}" ]; then mkdir -p "$OUT" && cp "$LOG" "$OUT/sglang-server-$(cat "$VARF").log"; fi
  ;;

stop)
  [ -f "$PIDF" ] || { echo "no server recorded for port $PORT"; exit 0; }
  pid=$(cat "$PIDF")
  kill -TERM -- "-$pid" 2>/dev/null || kill "$pid" 2>/dev/null || true
  for _ in $(seq 30); do kill -0 -- "-$pid" 2>/dev/null || break; sleep 1; done
  kill -0 -- "-$pid" 2>/dev/null && { kill -KILL -- "-$pid" 2>/dev/null || true; sleep 2; }
  rm -f "$PIDF"; echo stopped
  ;;

*) sed -n '2,25p' "$0"; exit 1 ;;
esac
