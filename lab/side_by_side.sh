#!/usr/bin/env bash
# Side by side on one GPU: vLLM 0.25.1 from the baseline kit and `tailored serve`
# on the same config (Qwen3.6-35B-A3B, dummy weights) and precision, both measured with
# `tailored bench` (c=1: 16 prompts, c=32: 256 prompts, 1024 in / 512 out, ignore_eos, greedy),
# then bench/results/latest.json: for bf16 and fp8 the metrics c1_output_tok_s, ttft_p50_ms
# (c=1), c32_output_tok_s as tailored / vllm / ratio, plus roofline_fraction_c1 and the manifest.
#
# Runs ON the GPU machine, from the root of the repository tree copied there, one PHASE per
# device call (a call may last 10 minutes; the machine and /tmp survive between calls only while
# it stays warm, so make the calls back to back).
#
# ---- prepare here, once (the paths are git-ignored) -----------------------------------------
#   bash ../shared/baseline/fetch.sh .baseline-wheels           # vLLM chunks, ~2 min, from PyPI
#   rm -rf .baseline-kit && cp -r ../shared/baseline .baseline-kit
#   bash lab/fetch_wheels.sh                                # .whl/: fastapi, uvicorn, ... for tailored
#   git rev-parse HEAD        # paste this sha for <sha> below: the command runs on the device, where
#                             # the tree has no .git and a $(...) would expand there
#
# ---- device calls, in this order (carry = the device tool's `carry` list) --------------------
#  1  carry [".baseline-wheels/chunk1"]                          bash lab/side_by_side.sh stage .baseline-wheels/chunk1   (< 1 min)
#  2  carry [".baseline-wheels/chunk2"]                          bash lab/side_by_side.sh stage .baseline-wheels/chunk2   (< 1 min)
#  3  carry [".baseline-kit", ".baseline-wheels/chunk3", ".whl"] TAILORED_COMMIT=<sha> bash lab/side_by_side.sh vllm bf16   (~8 min: stage chunk3, install, start ~4 min, bench ~3 min)
#  4  carry [".baseline-kit", ".whl"]                            TAILORED_COMMIT=<sha> bash lab/side_by_side.sh tailored bf16
#  5  carry [".baseline-kit", ".whl"]                            TAILORED_COMMIT=<sha> bash lab/side_by_side.sh vllm fp8    (~7 min)
#  6  carry [".baseline-kit", ".whl"]                            TAILORED_COMMIT=<sha> bash lab/side_by_side.sh tailored fp8
#  7  carry [".baseline-kit", ".whl"]                            bash lab/side_by_side.sh summary                          (seconds)
#  The device tool refuses a call whose tree + carry is over 64 MiB: chunk1 (55 MiB) + this tree
#  (9.5 MiB with the nano model) is just over. Then run `bash lab/side_by_side.sh
#  split-chunks` here once and stage .baseline-wheels/chunk1a, chunk1b, chunk2a, chunk2b (four
#  calls of seconds each); `stage` joins the halves back on the GPU machine.
#  Calls 1-3 must follow each other within ~30 s (the kit's rule: /tmp is forgotten when the
#  machine idles). If the machine was released after call 3, repeat 1-3 (phase `vllm` installs
#  only when /tmp/site lacks vLLM, and stages chunk3 when it is carried). The tailored phases
#  take server start (dummy weights: ~1 min) + the two benches (~1 min).
#  Total: ~25 min of a 30-minute device budget; run bf16 and fp8 apart when the budget is
#  short (the summary accepts a missing precision).
#
# ---- results ----------------------------------------------------------------------------------
# Every phase leaves its files in $SBS_DIR (default /tmp/sbs) and copies the whole folder to
# $OUT/sbs (what the device tool brings back): {vllm,tailored}-{bf16,fp8}.json (tailored bench
# results with manifests) and .txt (their console output), server logs, vllmbench-bf16-c1.json
# (`vllm bench serve` on the same vLLM server, c=1: the GPU cross-check of our client; CROSSCHECK=0
# skips it), compare-{bf16,fp8}.txt (ratio tables, A = tailored, B = vLLM), summary.json and
# latest.json. To commit them (here, after the last call):
#   D=bench/results/$(date +%F); mkdir -p $D && cp <files_at>/sbs/* $D/
#   python -m tailored.bench summary --results-dir $D --latest bench/results/latest.json
#
# ---- the load sweep (docs/benchmarks.md "Under load" has the exact calls) -----------------------
# Phases `up vllm PREC` (install + start, left running), `load ENGINE [PREC]` (c = 1, 8, 32, 64,
# 128 x 8, 48, 160, 256, 512 prompts, 1024 in / 512 out, max-model-len 16384, one JSON per point:
# ENGINE-PREC-cC.json; reuses a vLLM server that `up` left), `long ENGINE [PREC]` (one prompt of
# 65,536 and of 120,000 tokens, one output token, max-model-len 131072: ENGINE-PREC-long-N.json),
# `load-summary [PREC]` (the table; the `load` section into $SBS/latest.json) and `load-all`
# (everything, for a machine without a per-call limit). PREC defaults to fp8. Here, after the
# last call: cp <files_at>/sbs/{tailored,vllm}-PREC-{c,long-}*.json into
# bench/results/<date>-<card>-load/, then `tailored bench load --results-dir THAT --latest
# bench/results/latest.json` and `tailored bench --plot docs/img/load-<card>-<prec>.png
# --latest bench/results/latest.json`. SBS_DRY_RUN=1 prints the servers' and the client's
# commands and starts nothing (tests/tools/test_bench_load.py runs it on the CPU).
#
# Environment: SBS_DIR, KIT (default .baseline-kit), VLLM_PORT (8000), TAILORED_PORT (8001),
# BASELINE_TMP (the kit's /tmp), HBM_BW (B/s for the roofline, default 4.3e12), CROSSCHECK (1),
# TAILORED_SERVE_ARGS (extra `tailored serve` flags), VLLM_SERVE_ARGS (extra `vllm serve` flags),
# READY_TIMEOUT (s, default 600);
# SBS_CONCURRENCY / SBS_PROMPTS (comma lists: the side by side's c=1,32 x 16,256, or the load
# sweep's points), SBS_LONG (65536,120000), SBS_LONG_PROMPTS (2), SBS_WARMUPS (warm-up requests
# per load point: 1, as in the 2026-12-07 run), SBS_DRY_RUN (1: print, run nothing).
# TAILORED_PORT and TAILORED_SERVE_ARGS are this script's settings, not switches: no child
# process sees them (an unknown TAILORED_* name stops tailored at start, tailored/flags.py).
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 1
KIT=${KIT:-.baseline-kit}
R="$KIT/remote.sh"
SBS=${SBS_DIR:-/tmp/sbs}
BTMP=${BASELINE_TMP:-/tmp}
VLLM_PORT=${VLLM_PORT:-8000}
TAILORED_PORT=${TAILORED_PORT:-8001}
export -n TAILORED_PORT TAILORED_SERVE_ARGS  # kept as shell variables, not passed on
NAME=qwen36-35b-a3b
TSITE=/tmp/tailored-site
HBM_BW=${HBM_BW:-4.3e12}
READY_TIMEOUT=${READY_TIMEOUT:-600}
export PYTHONUNBUFFERED=1 TAILORED_CACHE=/tmp/tailored-cache HF_HUB_OFFLINE=1
# Same engine limits for both servers (the kit's vLLM flags).
MAX_MODEL_LEN=16384 MAX_NUM_SEQS=128 MAX_BATCHED=8192 GPU_UTIL=0.90
# The load sweep's points and long prompts (SBS_* above override them)
LOAD_CONCURRENCY=1,8,32,64,128 LOAD_PROMPTS=8,48,160,256,512 LONG_MAX_MODEL_LEN=131072
LONG_LENS=${SBS_LONG:-65536,120000} LONG_PROMPTS=${SBS_LONG_PROMPTS:-2} WARMUPS=${SBS_WARMUPS:-1}
DRY=${SBS_DRY_RUN:-0}

T0=$(date +%s)
stamp() { echo "[sbs +$(( $(date +%s) - T0 ))s] $*"; }
die() { echo "side_by_side.sh: $*" >&2; exit 1; }

sync_out() {
  if [ -n "${OUT:-}" ]; then mkdir -p "$OUT/sbs" && cp -r "$SBS"/. "$OUT/sbs/" 2>/dev/null; fi
  return 0
}
trap sync_out EXIT

# The client: `tailored bench` from this tree (httpx is on the GPU machine; .whl adds sniffio etc.).
client() { PYTHONPATH="$ROOT:$TSITE" python3 -m tailored.bench "$@"; }

bench_client() {  # LABEL ARGS...: `tailored bench ARGS`, its console in $SBS/LABEL.txt
  local label=$1; shift
  if [ "$DRY" = 1 ]; then printf '+ tailored bench'; printf ' %q' "$@"; echo; return 0; fi
  client "$@" 2>&1 | tee "$SBS/$label.txt"
  local rc=${PIPESTATUS[0]}
  [ "$rc" = 0 ] || echo "WARNING: tailored bench exit $rc for $label (failed requests?)" \
      | tee -a "$SBS/$label.txt"
  sync_out
}

bench_both() {  # ENGINE PREC PORT CHECKPOINT_DIR ENGINE_CONFIG_JSON
  local engine=$1 prec=$2 port=$3 ckpt=$4 cfg=$5
  # SBS_CONCURRENCY / SBS_PROMPTS: a shorter run (e.g. 1 / 16, c=1 alone) when device time is short
  local conc=${SBS_CONCURRENCY:-1,32} prompts=${SBS_PROMPTS:-16,256}
  stamp "bench $engine $prec: c=$conc x $prompts, 1024 in / 512 out, ignore_eos, greedy"
  bench_client "$engine-$prec" --base-url "http://127.0.0.1:$port" --model "$NAME" \
      --concurrency "$conc" --num-prompts "$prompts" --input-len 1024 --output-len 512 --ignore-eos \
      --temperature 0 --precision "$prec" --hbm-bw "$HBM_BW" --label "$engine-$prec" \
      --checkpoint-dir "$ckpt" --engine-config "$cfg" --out "$SBS/$engine-$prec.json"
}

bench_point() {  # ENGINE PREC LABEL CONC PROMPTS IN_LEN OUT_LEN: one load point, the server that
  # start_engine started (EPORT, ECKPT, ECFG), one result file $SBS/LABEL.json
  local engine=$1 prec=$2 label=$3 c=$4 n=$5 in_len=$6 out_len=$7
  local args=(--base-url "http://127.0.0.1:$EPORT" --model "$NAME" --concurrency "$c"
              --num-prompts "$n" --input-len "$in_len" --output-len "$out_len" --ignore-eos
              --temperature 0 --num-warmups "$WARMUPS" --label "$label"
              --checkpoint-dir "$ECKPT" --engine-config "$ECFG" --out "$SBS/$label.json")
  # the decode roofline fraction means something with 512 output tokens, not with one
  [ "$out_len" -gt 1 ] && args+=(--precision "$prec" --hbm-bw "$HBM_BW")
  stamp "bench $engine $prec: c=$c x $n, $in_len in / $out_len out, ignore_eos, greedy"
  bench_client "$label" "${args[@]}"
}

port_free() {  # PORT: die when something already listens there. Once a call's `timeout`
  # ended the bf16 script but not its server or bench (their own process group), the FP8
  # server could not bind, and the FP8 phase benchmarked the bf16 server instead (kb/0038)
  if python3 -c 'import socket, sys; sys.exit(socket.socket().connect_ex(("127.0.0.1", int(sys.argv[1]))) != 0)' "$1"; then
    die "port $1 is taken (a server left by an earlier run?): not benchmarking it"
  fi
}

wait_health() {  # PORT PID LOG
  local port=$1 pid=$2 log=$3 t
  t=$(date +%s)
  until python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$port/health', timeout=2)" 2>/dev/null; do
    kill -0 "$pid" 2>/dev/null || { echo "server died"; tail -n 60 "$log"; return 1; }
    [ $(( $(date +%s) - t )) -lt "$READY_TIMEOUT" ] || { echo "not ready after $READY_TIMEOUT s"; tail -n 40 "$log"; return 2; }
    sleep 3
  done
  stamp "ready on :$port after $(( $(date +%s) - t )) s"
}

# ---- phases -----------------------------------------------------------------------------------
phase_stage() {  # DIR: add a chunk's files to the kit's stage folder (no kit needed)
  [ $# -ge 1 ] || die "usage: stage DIR (a chunk folder, carried)"
  local src=$1
  [ -d "$src" ] || die "stage: no folder $src (carry it)"
  mkdir -p "$BTMP/stage" && cp -r "$src"/. "$BTMP/stage/" || return 1
  # pieces from `split-chunks` (NAME.KofN): once all N are here, join them back into NAME
  local first base n k ok
  for first in "$BTMP"/stage/*.1of*; do
    [ -e "$first" ] || continue
    base=${first%.1of*}; n=${first##*.1of}; ok=1
    for k in $(seq 1 "$n"); do [ -f "$base.${k}of$n" ] || ok=0; done
    if [ "$ok" = 1 ]; then
      for k in $(seq 1 "$n"); do cat "$base.${k}of$n"; done > "$base" && rm -f "$base".*of"$n"
    fi
  done
  ls -la "$BTMP/stage"
}

phase_split_chunks() {  # here: chunk1/chunk2 (55 MiB each) → halves, so tree + one piece < 64 MiB
  local c f
  for c in chunk1 chunk2; do
    f=$(ls .baseline-wheels/$c/vllm.whl.part?? 2>/dev/null) || die "no .baseline-wheels/$c (run fetch.sh)"
    [ "$(echo "$f" | wc -l)" = 1 ] && [ -s "$f" ] || die "split-chunks: expected one non-empty vllm.whl.part?? in .baseline-wheels/$c, found: $f"
    mkdir -p ".baseline-wheels/${c}a" ".baseline-wheels/${c}b"
    local size half; size=$(stat -c %s "$f"); half=$(( (size + 1) / 2 ))
    head -c "$half" "$f" > ".baseline-wheels/${c}a/$(basename "$f").1of2"
    tail -c +$(( half + 1 )) "$f" > ".baseline-wheels/${c}b/$(basename "$f").2of2"
  done
  ls -la .baseline-wheels/chunk?[ab]
}

install_vllm() {
  [ -f "$R" ] || die "no $R: carry .baseline-kit (cp -r ../shared/baseline .baseline-kit)"
  if [ -d "$BTMP/site/vllm" ] && [ -f "$BTMP/model/config.json" ]; then
    stamp "vLLM already installed in $BTMP/site"
    return 0
  fi
  if [ -d .baseline-wheels/chunk3 ]; then phase_stage .baseline-wheels/chunk3 >/dev/null || return 1; fi
  stamp "install vLLM (kit)"
  bash "$R" check && bash "$R" install
}

install_tailored() {
  if [ -f "$TSITE/.done" ]; then return 0; fi
  ls .whl/*.whl >/dev/null 2>&1 || die "no .whl/*.whl: run lab/fetch_wheels.sh here and carry .whl"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$TSITE" .whl/*.whl || die "pip install of .whl failed"
  touch "$TSITE/.done"
}

# ---- the two servers --------------------------------------------------------------------------
# start_engine ENGINE PREC MAX_MODEL_LEN TAG sets EPORT, ECKPT (the checkpoint folder the
# manifest fingerprints) and ECFG (the engine config JSON: command, switches); stop_engine
# ENGINE TAG stops it and keeps its log as ENGINE-server-TAG.log.
EPORT= ECKPT= ECFG=

vllm_up() {  # PREC MAX_MODEL_LEN: is the kit's server up on VLLM_PORT with this variant and length?
  local pidf=$BTMP/vllm-$VLLM_PORT.pid
  [ -f "$pidf" ] && kill -0 "$(cat "$pidf")" 2>/dev/null || return 1
  [ "$(cat "$BTMP/vllm-$VLLM_PORT.variant" 2>/dev/null)" = "$1" ] || return 1
  python3 -c 'import json, sys, urllib.request as u
d = json.load(u.urlopen(f"http://127.0.0.1:{sys.argv[1]}/v1/models", timeout=5))
sys.exit(d["data"][0].get("max_model_len") != int(sys.argv[2]))' "$VLLM_PORT" "$2" 2>/dev/null
}

start_vllm() {  # PREC MAX_MODEL_LEN: the kit's server (its own flags; a later --max-model-len wins)
  local prec=$1 maxlen=$2 extra=() args
  case "$prec" in bf16) ECKPT=$BTMP/model ;; fp8) ECKPT=$BTMP/model-fp8 ;; *) die "precision bf16|fp8" ;; esac
  [ "$maxlen" = "$MAX_MODEL_LEN" ] || extra=(--max-model-len "$maxlen")
  # shellcheck disable=SC2206
  extra+=(${VLLM_SERVE_ARGS:-})  # lab/peers.sh: prefix caching and its cached-token counts
  EPORT=$VLLM_PORT
  if [ "$DRY" = 1 ]; then
    echo "+ bash $R --port $VLLM_PORT serve $prec ${extra[*]}"
    args="(dry run) vllm serve $prec ${extra[*]}"
  elif vllm_up "$prec" "$maxlen"; then
    stamp "vLLM $prec (max-model-len $maxlen) is already up on :$VLLM_PORT: benchmarking it"
  else
    install_vllm || die "vLLM install failed"
    bash "$R" --port "$VLLM_PORT" stop >/dev/null 2>&1 || true
    port_free "$VLLM_PORT"
    stamp "start vLLM $prec on :$VLLM_PORT ${extra[*]}"
    OUT="$SBS" bash "$R" --port "$VLLM_PORT" serve "$prec" "${extra[@]}" || die "vLLM serve failed"
    if ! OUT="$SBS" bash "$R" --port "$VLLM_PORT" wait 540; then
      bash "$R" --port "$VLLM_PORT" stop; die "vLLM $prec did not come up"
    fi
  fi
  if [ "$DRY" != 1 ]; then
    install_tailored
    args=$(ps -o args= -p "$(cat "$BTMP/vllm-$VLLM_PORT.pid")" 2>/dev/null || echo "?")
  fi
  ECFG=$(python3 -c 'import json, sys; print(json.dumps({"engine": sys.argv[3],
      "variant": sys.argv[1], "command": sys.argv[2],
      "env": {"VLLM_USE_FLASHINFER_SAMPLER": "0"}}))' "$prec" "$args" \
      "${VLLM_LABEL:-vllm 0.25.1 (baseline kit)}")
}

stop_vllm() {  # TAG
  if [ "$DRY" = 1 ]; then echo "+ bash $R --port $VLLM_PORT stop"; return 0; fi
  stamp "stop vLLM"
  bash "$R" --port "$VLLM_PORT" stop
  cp "$BTMP/vllm-$VLLM_PORT.log" "$SBS/vllm-server-$1.log" 2>/dev/null || true
}

TPID=
stop_tailored() {  # the server runs in its own session (setsid): stop its whole group
  [ -n "$TPID" ] || return 0
  kill -TERM -- "-$TPID" 2>/dev/null || kill "$TPID" 2>/dev/null
  for _ in $(seq 30); do kill -0 "$TPID" 2>/dev/null || break; sleep 1; done
  kill -KILL -- "-$TPID" 2>/dev/null || true
  TPID=
}

write_tailored_checkpoint() {  # PREC DIR
  # synth --dtype fp8 writes the same quantization_config as the kit's FP8 variant
  # (tailored.model.fp8.DEFAULT_NOT_CONVERT == remote.sh FP8_QUANT), so both engines read one file
  local prec=$1 dir=$2 dt=()
  rm -rf "$dir"
  [ "$prec" = fp8 ] && dt=(--dtype fp8)
  PYTHONPATH="$TSITE:$ROOT" python3 -m tailored synth "$dir" --preset full --config-only "${dt[@]}"
}

start_tailored() {  # PREC MAX_MODEL_LEN TAG: `tailored serve`, the same limits as the kit's vLLM
  local prec=$1 maxlen=$2 tag=$3
  case "$prec" in bf16|fp8) ;; *) die "precision bf16|fp8" ;; esac
  ECKPT=/tmp/sbs-ckpt-$prec EPORT=$TAILORED_PORT
  local log=$SBS/tailored-server-$tag.log
  local flags=(--load-format dummy --served-model-name "$NAME" --host 127.0.0.1 --port "$TAILORED_PORT"
               --max-model-len "$maxlen" --max-num-seqs "$MAX_NUM_SEQS"
               --max-num-batched-tokens "$MAX_BATCHED" --gpu-memory-utilization "$GPU_UTIL")
  # shellcheck disable=SC2206
  local extra=(${TAILORED_SERVE_ARGS:-})
  # switches from the environment (TAILORED_FP8_DENSE_DEQUANT=0 ..., docs/switches.md) go into
  # the manifest with the command: the server inherits them
  ECFG=$(python3 -c 'import json, os, sys; print(json.dumps({"engine": "tailored serve", "variant": sys.argv[1],
      "command": "python3 -m tailored serve " + " ".join(sys.argv[2:]),
      "env_switches": {k: v for k, v in sorted(os.environ.items()) if k.startswith("TAILORED_")
                       and k not in ("TAILORED_CACHE", "TAILORED_COMMIT", "TAILORED_PORT", "TAILORED_SERVE_ARGS")}}))' \
      "$prec" "$ECKPT" "${flags[@]}" "${extra[@]}")
  if [ "$DRY" = 1 ]; then echo "+ python3 -m tailored serve $ECKPT ${flags[*]} ${extra[*]}"; return 0; fi
  install_tailored
  write_tailored_checkpoint "$prec" "$ECKPT" || die "tailored synth --config-only failed"
  port_free "$TAILORED_PORT"
  stamp "start tailored serve $prec on :$TAILORED_PORT: $ECKPT ${flags[*]} ${extra[*]}"
  # the launch configs tuned at this start are saved next to the results (kernels/tuning.py):
  # commit them as tailored/kernels/tuned.json and later starts on an H200 skip the tuning
  TAILORED_TUNING_DUMP="$SBS/tuned-$prec.json" PYTHONPATH="$TSITE:$ROOT" setsid nohup python3 -m tailored serve "$ECKPT" "${flags[@]}" "${extra[@]}" \
      > "$log" 2>&1 < /dev/null &
  TPID=$!
  trap 'stop_tailored; sync_out' EXIT
  wait_health "$TAILORED_PORT" "$TPID" "$log" || die "tailored serve $prec did not come up"
  if [ "$prec" = fp8 ] && ! grep -qi 'fp8' "$log"; then
    echo "WARNING: the tailored server log never mentions fp8: is the FP8 path (issue 3 part 4) in?" \
        | tee "$SBS/tailored-fp8.warning"
  fi
}

stop_engine() {  # ENGINE TAG
  case "$1" in
    vllm) stop_vllm "$2" ;;
    tailored)
      if [ "$DRY" = 1 ]; then echo "+ stop tailored serve"; return 0; fi
      stamp "stop tailored"; stop_tailored; trap sync_out EXIT ;;
  esac
}

start_engine() {  # ENGINE PREC MAX_MODEL_LEN TAG
  case "$1" in
    vllm) start_vllm "$2" "$3" ;;
    tailored) start_tailored "$2" "$3" "$4" ;;
    *) die "engine: vllm or tailored, not '$1'" ;;
  esac
}

# ---- phases of the side by side (c=1 and c=32) --------------------------------------------------
phase_vllm() {  # PREC
  local prec=${1:?usage: vllm bf16|fp8}
  start_vllm "$prec" "$MAX_MODEL_LEN"
  bench_both vllm "$prec" "$VLLM_PORT" "$ECKPT" "$ECFG"
  if [ "$DRY" != 1 ] && [ "${CROSSCHECK:-1}" = 1 ] && [ "$prec" = bf16 ]; then
    stamp "cross-check: vllm bench serve c=1 x 16 on the same server"
    OUT="$SBS" bash "$R" --port "$VLLM_PORT" bench "vllmbench-$prec-c1" 1 16 2>&1 | tail -n 30
    client --compare "$SBS/vllm-$prec.json" "$SBS/vllmbench-$prec-c1.json" \
        | tee "$SBS/crosscheck-vllmbench-$prec.txt"
  fi
  stop_vllm "$prec"
}

phase_tailored() {  # PREC
  local prec=${1:?usage: tailored bf16|fp8}
  start_tailored "$prec" "$MAX_MODEL_LEN" "$prec"
  bench_both tailored "$prec" "$TAILORED_PORT" "$ECKPT" "$ECFG"
  stop_engine tailored "$prec"
}

# ---- phases of the load sweep --------------------------------------------------------------------
phase_up() {  # vllm PREC [MAX_MODEL_LEN]: install and start the kit's vLLM; `load` benchmarks it
  [ "${1:-}" = vllm ] || die "usage: up vllm bf16|fp8 [MAX_MODEL_LEN] (tailored starts within its phase)"
  start_vllm "${2:?usage: up vllm bf16|fp8}" "${3:-$MAX_MODEL_LEN}"
}

phase_load() {  # ENGINE [PREC]: one result file per concurrency, at max-model-len MAX_MODEL_LEN
  local engine=${1:?usage: load vllm|tailored [bf16|fp8]} prec=${2:-fp8} concs prompts i
  IFS=, read -r -a concs <<< "${SBS_CONCURRENCY:-$LOAD_CONCURRENCY}"
  IFS=, read -r -a prompts <<< "${SBS_PROMPTS:-$LOAD_PROMPTS}"
  [ "${#concs[@]}" = "${#prompts[@]}" ] || die "SBS_CONCURRENCY and SBS_PROMPTS: one value each per point"
  start_engine "$engine" "$prec" "$MAX_MODEL_LEN" "$prec-load"
  for i in "${!concs[@]}"; do
    bench_point "$engine" "$prec" "$engine-$prec-c${concs[$i]}" "${concs[$i]}" "${prompts[$i]}" 1024 512
  done
  stop_engine "$engine" "$prec-load"
}

phase_long() {  # ENGINE [PREC]: one prompt of each SBS_LONG length, one output token
  local engine=${1:?usage: long vllm|tailored [bf16|fp8]} prec=${2:-fp8} n
  start_engine "$engine" "$prec" "$LONG_MAX_MODEL_LEN" "$prec-long"
  for n in ${LONG_LENS//,/ }; do
    bench_point "$engine" "$prec" "$engine-$prec-long-$n" 1 "$LONG_PROMPTS" "$n" 1
  done
  stop_engine "$engine" "$prec-long"
}

phase_load_summary() {  # [PREC]: the table, and the `load` section into $SBS/latest.json
  stamp "load sweep of $SBS"
  client load --results-dir "$SBS" --precision "${1:-fp8}" --latest "$SBS/latest.json"
}

phase_summary() {
  stamp "summary of $SBS"
  client summary --results-dir "$SBS" --latest "$SBS/latest.json" --hbm-bw "$HBM_BW"
  # does this vLLM run reproduce the 2026-11-29 baseline? (A = today, B = kit's raw JSON)
  local base="$KIT/results/2026-11-29"
  for pair in "bf16:c1" "fp8:fp8-c1"; do
    local prec=${pair%%:*} ref=${pair#*:}
    if [ -f "$SBS/vllm-$prec.json" ] && [ -f "$base/$ref.json" ]; then
      client --compare "$SBS/vllm-$prec.json" "$base/$ref.json" > "$SBS/vllm-$prec-vs-baseline.txt"
      head -n 8 "$SBS/vllm-$prec-vs-baseline.txt"
    fi
  done
}

# sourced (lab/peers.sh reuses the servers' start and stop and the client): functions only
if [[ "${BASH_SOURCE[0]}" != "$0" ]]; then return 0; fi
cmd=${1:-}; shift || true
case "$cmd" in stage|vllm|tailored|summary|all|up|load|long|load-summary|load-all) mkdir -p "$SBS" ;; esac
case "$cmd" in
  stage) phase_stage "$@" ;;
  split-chunks) phase_split_chunks ;;
  vllm) phase_vllm "$@" ;;
  tailored) phase_tailored "$@" ;;
  summary) phase_summary ;;
  all)  # everything in one go, for a machine without a per-call limit and with all chunks here
    for c in chunk1 chunk2; do [ -d ".baseline-wheels/$c" ] && phase_stage ".baseline-wheels/$c" >/dev/null; done
    for prec in bf16 fp8; do
      (phase_vllm "$prec") || echo "vllm $prec failed"
      (phase_tailored "$prec") || echo "tailored $prec failed"
    done
    phase_summary ;;
  up) phase_up "$@" ;;
  load) phase_load "$@" ;;
  long) phase_long "$@" ;;
  load-summary) phase_load_summary "$@" ;;
  load-all)  # the load sweep in one go ([PREC]), for a machine without a per-call limit
    for c in chunk1 chunk2; do [ -d ".baseline-wheels/$c" ] && phase_stage ".baseline-wheels/$c" >/dev/null; done
    for engine in vllm tailored; do
      (phase_load "$engine" "${1:-fp8}") || echo "load $engine failed"
      (phase_long "$engine" "${1:-fp8}") || echo "long $engine failed"
    done
    [ "$DRY" = 1 ] || phase_load_summary "${1:-fp8}" ;;
  *) sed -n '2,/^set -uo pipefail/p' "$0" | sed '$d'; exit 1 ;;  # the header above
esac
