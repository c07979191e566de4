#!/usr/bin/env bash
# tailored vs SGLang 0.5.17 vs vLLM 0.25.1 on one GPU (issue 57), on the traffic users run:
# random 1024/512 at c = 1, 32, 128; the chat mix at Poisson rates (goodput under the SLO); the
# agent mix (8k-token system prompts with tools, multi-turn, prefix caching on everywhere); one
# prompt of 16k, 65k and 120k tokens. Every engine on the same config (dummy weights, context
# 16384, 128 running, 8192-token steps), measured by `tailored bench` (--save-requests: the
# CDFs). Results: $SBS_DIR/ENGINE-PREC-{random,chat-mix,agent-mix,long-N}.json, then `summary`
# writes the `peers` section (tailored bench peers) and the plots. docs/peers.md has the calls.
#
# Runs ON the GPU machine from the repository root, one phase per device call; lab/side_by_side.sh
# (sourced) starts and stops vLLM and tailored, lab/peers/sglang/remote.sh SGLang.
#
#   stage-sglang DIR         add an SGLang kit chunk (lab/peers/sglang/fetch.sh's chunkNN)
#   stage-vllm026 DIR        add a vLLM 0.26.0 kit chunk (lab/peers/vllm026/fetch.sh's chunkNN)
#   up ENGINE PREC           install (first time) and start sglang, vllm or vllm026, left running
#   run ENGINE [PREC]        random, chat mix and agent mix against ENGINE (started if not up)
#   long ENGINE [PREC]       the long prompts, the engine restarted at 131072
#   summary [PREC]           the peers section into $SBS_DIR/latest.json, plots peers-PREC-*.png
#   all [PREC]               everything, for a machine without a per-call limit
# ENGINE: tailored, sglang, vllm (0.25.1, the baseline kit) or vllm026 (0.26.0, the newest vLLM on
# torch 2.11: `all` runs it when PEERS_VLLM026=1); PREC: fp8 (default) or bf16.
#
# Environment (besides side_by_side.sh's): SGLANG_PORT (8002), SGLANG_VARIANT (PREC, or
# PREC-lowlat: the cookbook's MTP settings), PEERS_WORKLOADS ("random chat-mix agent-mix"),
# PEERS_RATES (1,2,4,8,16), PEERS_CHAT_PROMPTS (100), PEERS_LONG (16384,65536,120000),
# PEERS_TAILORED_ARGS ("--prefix-cache-entries 64"), PEERS_VLLM_ARGS ("--enable-prefix-caching
# --enable-prompt-tokens-details"), PEERS_SGLANG_ARGS ("--enable-cache-report"). SBS_DRY_RUN=1
# prints every server and client command and starts nothing.
set -uo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=side_by_side.sh
source "$HERE/side_by_side.sh"
SG=$ROOT/lab/peers/sglang/remote.sh
SGLANG_PORT=${SGLANG_PORT:-8002}
SGTMP=${SGLANG_TMP:-/tmp}
WORKLOADS=${PEERS_WORKLOADS:-random chat-mix agent-mix}
RATES=${PEERS_RATES:-1,2,4,8,16}
CHAT_PROMPTS=${PEERS_CHAT_PROMPTS:-100}
PEER_LONG=${PEERS_LONG:-16384,65536,120000}
TAILORED_SERVE_ARGS="${TAILORED_SERVE_ARGS:-} ${PEERS_TAILORED_ARGS---prefix-cache-entries 64}"
VLLM_SERVE_ARGS="${VLLM_SERVE_ARGS:-} ${PEERS_VLLM_ARGS---enable-prefix-caching --enable-prompt-tokens-details}"
SGLANG_ARGS=${PEERS_SGLANG_ARGS---enable-cache-report}

sglang_up() {  # VARIANT MAX_MODEL_LEN: is the kit's server up on SGLANG_PORT with these?
  local pidf=$SGTMP/sglang-$SGLANG_PORT.pid
  [ -f "$pidf" ] && kill -0 "$(cat "$pidf")" 2>/dev/null || return 1
  [ "$(cat "$SGTMP/sglang-$SGLANG_PORT.variant" 2>/dev/null)" = "$1" ] || return 1
  [ "$(cat "$SGTMP/sglang-$SGLANG_PORT.ctx" 2>/dev/null)" = "$2" ]
}

start_sglang() {  # PREC MAX_MODEL_LEN: the kit's server; sets EPORT, ECKPT, ECFG
  local prec=$1 maxlen=$2 variant=${SGLANG_VARIANT:-$1} args
  case "$prec" in bf16) ECKPT=$SGTMP/sglang-model ;; fp8) ECKPT=$SGTMP/sglang-model-fp8 ;;
    *) die "precision bf16|fp8" ;; esac
  EPORT=$SGLANG_PORT
  # shellcheck disable=SC2206
  local extra=(--context-length "$maxlen" $SGLANG_ARGS)
  if [ "$DRY" = 1 ]; then
    echo "+ bash $SG --port $SGLANG_PORT serve $variant ${extra[*]}"
    args="(dry run) sglang serve $variant ${extra[*]}"
  elif sglang_up "$variant" "$maxlen"; then
    stamp "SGLang $variant (context $maxlen) is already up on :$SGLANG_PORT: benchmarking it"
  else
    if [ ! -d "$SGTMP/sglang-site/sglang" ]; then
      stamp "install SGLang (kit)"; bash "$SG" check; bash "$SG" install || die "SGLang install failed"
    fi
    bash "$SG" --port "$SGLANG_PORT" stop >/dev/null 2>&1 || true
    port_free "$SGLANG_PORT"
    stamp "start SGLang $variant on :$SGLANG_PORT ${extra[*]}"
    bash "$SG" --port "$SGLANG_PORT" serve "$variant" "${extra[@]}" || die "SGLang serve failed"
    echo "$maxlen" > "$SGTMP/sglang-$SGLANG_PORT.ctx"
    if ! OUT="$SBS" bash "$SG" --port "$SGLANG_PORT" wait 600; then
      bash "$SG" --port "$SGLANG_PORT" stop; die "SGLang $variant did not come up"
    fi
  fi
  if [ "$DRY" != 1 ]; then
    install_tailored
    args=$(ps -o args= -p "$(cat "$SGTMP/sglang-$SGLANG_PORT.pid")" 2>/dev/null || echo "?")
  fi
  ECFG=$(python3 -c 'import json, sys; print(json.dumps({"engine": "sglang 0.5.17 (lab/peers/sglang kit)",
      "variant": sys.argv[1], "command": sys.argv[2]}))' "$variant" "$args")
}

# vLLM 0.26.0 (lab/peers/vllm026: the newest vLLM on torch 2.11): the 0.25.1 kit's server and
# phases, pointed at its own install (BASELINE_TMP) and port
V026_TMP=${V026_TMP:-/tmp/v026}
VLLM026_PORT=${VLLM026_PORT:-8003}
start_vllm026() {  # PREC MAX_MODEL_LEN
  local -x BASELINE_TMP=$V026_TMP
  local BTMP=$V026_TMP VLLM_PORT=$VLLM026_PORT VLLM_LABEL="vllm 0.26.0 (lab/peers/vllm026)"
  if [ "$DRY" != 1 ] && [ ! -d "$V026_TMP/site/vllm" ]; then
    stamp "install vLLM 0.26.0"; bash "$ROOT/lab/peers/vllm026/remote.sh" install || die "vLLM 0.26.0 install failed"
  fi
  start_vllm "$@"
}
stop_vllm026() {  # TAG
  local -x BASELINE_TMP=$V026_TMP
  local BTMP=$V026_TMP VLLM_PORT=$VLLM026_PORT
  stop_vllm "$@"
}

peer_start() {  # ENGINE PREC MAX_MODEL_LEN TAG
  case "$1" in
    sglang) start_sglang "$2" "$3" ;;
    vllm026) start_vllm026 "$2" "$3" ;;
    *) start_engine "$@" ;;
  esac
}

peer_stop() {  # ENGINE TAG
  case "$1" in
    sglang)
      if [ "$DRY" = 1 ]; then echo "+ bash $SG --port $SGLANG_PORT stop"; return 0; fi
      stamp "stop SGLang"; bash "$SG" --port "$SGLANG_PORT" stop
      cp "$SGTMP/sglang-$SGLANG_PORT.log" "$SBS/sglang-server-$2.log" 2>/dev/null || true ;;
    vllm026) stop_vllm026 "026-$2" ;;
    *) stop_engine "$@" ;;
  esac
}

peer_bench() {  # ENGINE PREC WORKLOAD ARGS...: one result file ENGINE-PREC-WORKLOAD.json
  local engine=$1 prec=$2 wl=$3; shift 3
  local label=$engine-$prec-$wl
  stamp "bench $label"
  bench_client "$label" --base-url "http://127.0.0.1:$EPORT" --model "$NAME" --temperature 0 \
      --save-requests --label "$label" --checkpoint-dir "$ECKPT" --engine-config "$ECFG" \
      --out "$SBS/$label.json" "$@"
}

phase_run() {  # ENGINE [PREC]
  local engine=${1:?usage: run tailored|sglang|vllm|vllm026 [bf16|fp8]} prec=${2:-fp8} wl
  peer_start "$engine" "$prec" "$MAX_MODEL_LEN" "$prec-peers"
  for wl in $WORKLOADS; do
    case "$wl" in
      random) peer_bench "$engine" "$prec" random --concurrency 1,32,128 --num-prompts 8,160,512 \
                  --input-len 1024 --output-len 512 --ignore-eos --num-warmups 1 ;;
      chat-mix) peer_bench "$engine" "$prec" chat-mix --workload chat-mix --request-rate "$RATES" \
                  --num-prompts "$CHAT_PROMPTS" --concurrency 128 --num-warmups 1 ;;
      agent-mix) peer_bench "$engine" "$prec" agent-mix --workload agent-mix \
                  --agent-system-prompts 4 --agent-conversations 32 --agent-turns 4 \
                  --agent-system-tokens 8000 --agent-tool-tokens 400 --output-len 128 \
                  --concurrency 16 ;;
      *) die "PEERS_WORKLOADS: random, chat-mix, agent-mix, not '$wl'" ;;
    esac
  done
  peer_stop "$engine" "$prec-peers"
}

phase_peer_long() {  # ENGINE [PREC]
  local engine=${1:?usage: long tailored|sglang|vllm|vllm026 [bf16|fp8]} prec=${2:-fp8} n
  peer_start "$engine" "$prec" "$LONG_MAX_MODEL_LEN" "$prec-peers-long"
  for n in ${PEER_LONG//,/ }; do
    peer_bench "$engine" "$prec" "long-$n" --input-len "$n" --output-len 1 --ignore-eos \
        --num-prompts "$LONG_PROMPTS" --num-warmups 0 --concurrency 1
  done
  peer_stop "$engine" "$prec-peers-long"
}

phase_peer_summary() {  # [PREC]
  local prec=${1:-fp8}
  stamp "peers section of $SBS"
  if [ "$DRY" = 1 ]; then echo "+ tailored bench peers --results-dir $SBS --precision $prec"; return 0; fi
  client peers --results-dir "$SBS" --precision "$prec" --latest "$SBS/latest.json"
  client --plot "$SBS/peers-$prec-goodput.png" --plot-kind goodput --results-dir "$SBS" \
      --precision "$prec" --plot-workload chat-mix || true
  client --plot "$SBS/peers-$prec-chat-cdf.png" --plot-kind cdf --results-dir "$SBS" \
      --precision "$prec" --plot-workload chat-mix || true
  client --plot "$SBS/peers-$prec-random-c32-cdf.png" --plot-kind cdf --results-dir "$SBS" \
      --precision "$prec" --plot-workload random --plot-point c=32 || true
  sync_out
}

cmd=${1:-}; shift || true
case "$cmd" in stage-sglang|stage-vllm026|up|run|long|summary|all) mkdir -p "$SBS" ;; esac
case "$cmd" in
  stage-sglang) bash "$SG" stage "${1:?usage: stage-sglang DIR}" ;;
  stage-vllm026) bash "$ROOT/lab/peers/vllm026/remote.sh" stage "${1:?usage: stage-vllm026 DIR}" ;;
  up)
    case "${1:-}" in
      sglang) start_sglang "${2:?usage: up sglang bf16|fp8}" "$MAX_MODEL_LEN" ;;
      vllm) start_vllm "${2:?usage: up vllm bf16|fp8}" "$MAX_MODEL_LEN" ;;
      vllm026) start_vllm026 "${2:?usage: up vllm026 bf16|fp8}" "$MAX_MODEL_LEN" ;;
      *) die "usage: up sglang|vllm|vllm026 bf16|fp8" ;;
    esac ;;
  run) phase_run "$@" ;;
  long) phase_peer_long "$@" ;;
  summary) phase_peer_summary "$@" ;;
  all)
    engines="vllm sglang tailored"; [ "${PEERS_VLLM026:-0}" = 1 ] && engines="vllm vllm026 sglang tailored"
    for engine in $engines; do
      (phase_run "$engine" "${1:-fp8}") || echo "run $engine failed"
      (phase_peer_long "$engine" "${1:-fp8}") || echo "long $engine failed"
    done
    phase_peer_summary "${1:-fp8}" ;;
  *) sed -n '2,/^set -uo pipefail/p' "$0" | sed '$d'; exit 1 ;;
esac
