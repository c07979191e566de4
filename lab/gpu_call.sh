#!/usr/bin/env bash
# One device call in parts, each run while enough of END s is left (carry [".whl"], from
# lab/fetch_wheels.sh). What to run is given as settings, so a plan is one line of environment,
# not one more copied script.
# PARTS picks sections, run in this order:
#  tests    pytest on the GPU: each ';'-separated entry of TESTS is one pytest run (its own
#           log, tests-N.log; shell words, quotes kept), e.g.
#           TESTS="tests/kernels/test_tuning.py;tests/gpu/test_gpu.py -k 'pdl or full_width'".
#           TESTS_CAP: seconds an entry may run (default 300); TESTS_ARGS: more pytest words
#           for every entry after its -q, e.g. "-vv --durations=8" (a line a test).
#           TESTS_JOBS: entries run at once (default 1), each its own pytest process on the
#           one GPU: the GPU tests spend most of their time compiling Triton kernels on the
#           CPU (16 cores there): 3 jobs ran the whole GPU list in 570 s, ~2.5x one at a
#           time (kb/0060). Memory is the limit: keep the entries' GPU memory together under
#           the card's (on an H100 the full-width entries, test_gpu / test_gpu_spec /
#           test_gpu_ctx, held 30-55 GiB each before tests/conftest.py freed each test's model).
#           One -k an entry: pytest keeps only the last.
#  tune     Re-tune launchers from scratch (kernels/tuning.py): a copy of tuned.json without
#           the TUNE_DROP launchers (space-separated names) is loaded, an in-process decode
#           run at TUNE_BATCHES (TUNE_PREC bf16|fp8) warms every decode graph size up to the
#           largest batch + 1, so each dropped key of those sizes tunes once; the shipped
#           entries of keys it did not reach (larger batches) are put back. The table lands in
#           $OUT/tuned.json (commit it as tailored/kernels/tuned.json once the A/B agrees) and
#           in /tmp/tuned.json, which every later part, and every later call while the machine
#           stays warm, loads (TAILORED_TUNING). Nothing after `tune` dumps into it.
#  bench    Each ';'-separated command of BENCHES (a kernel bench; its own log bench-N.log,
#           whose last 25 lines are printed), e.g.
#           BENCHES="python3 lab/bench_fp8_gemv.py --batches 8,32 --splitk".
#  ab       bench_decode A/B (AB_PREC, AB_BATCHES, AB_VARIANTS, AB_ROUNDS; AB_ARGS more flags,
#           e.g. "--profile --profile-batch 32").
#  sbs      Served side by side, tailored half (vLLM's halves are in bench/results), for each
#           of SBS_PRECS with SBS_ENV in front (FP8 only).
#  gate     `tailored gate` for each of GATE_PRECS with GATE_ENV in front.
#  onegate  The bf16 gate with the prompts one at a time (the one-row paths alone).
# BORROW_TABLE=1: the shipped launch-config table stands in for this card's (no re-tuning in
# every process on a card without its own table; tests, not reported timings; kb/0066).
# STAMP_LINES=1: every line of a tests/bench log starts with the seconds since the call began,
# so an entry cut by its limit still tells how long each test it reached took (with -v).
# SBS_ENV / GATE_ENV are NAME=VALUE words split at spaces (no value may hold a space).
# The device returns a few files only: at the end everything in $OUT but this log and
# tuned.json is packed into $OUT/logs.tgz.
# Usage: TAILORED_COMMIT=<sha> OUT=$OUT END=560 PARTS="tests tune ab" [settings] \
#            bash lab/gpu_call.sh
source "$(dirname "$0")/device_env.sh" gpu_call
left() { echo $(( ${END:-560} - ($(date +%s) - T0) )); }
# a step's timeout: its own limit, or what is left of END less a margin, whichever is less
cap() { local l=$(( $(left) - 15 )); echo $(( l < $1 ? l : $1 )); }
# whether more than $1 s are left (else say which step is skipped)
enough() { [ "$(left)" -gt "$1" ] || { stamp "skipped ($(left) s left): $2"; false; }; }
ALL="tests tune bench ab sbs gate onegate"
PARTS=" ${PARTS:-$ALL} "
for part in $PARTS; do
    [[ " $ALL " == *" $part "* ]] || { echo "unknown part '$part' in PARTS ($ALL)"; exit 2; }
done
want() { [[ "$PARTS" == *" $1 "* ]]; }
# the settings each wanted part needs, checked before anything runs
[[ "${TESTS_JOBS:-1}" =~ ^[1-9][0-9]*$ ]] || { echo "TESTS_JOBS: a whole number >= 1"; exit 2; }
for need in "tests TESTS" "tune TUNE_DROP" "bench BENCHES" "ab AB_VARIANTS"; do
    set -- $need
    if want "$1" && [ -z "${!2:-}" ]; then echo "PARTS has $1: set $2"; exit 2; fi
done
ckpt() { [ "$1" = bf16 ] && echo /tmp/full || echo "/tmp/full-$1"; }
# ';'-separated entries of $1, blank ones dropped (a blank pytest entry would run everything)
entries() {
    local -a raw
    # newlines count as spaces: a list copied from a wrapped README line keeps its entries
    IFS=';' read -ra raw <<< "${1//$'\n'/ }"
    for e in "${raw[@]}"; do [ -n "${e// /}" ] && printf '%s\n' "$e"; done
}
full_configs > /dev/null
export TRITON_CACHE_DIR=/tmp/triton-cache
unset TAILORED_TUNING_DUMP
if [ -s /tmp/tuned.json ]; then  # an earlier call's `tune` on this (warm) machine
    export TAILORED_TUNING=/tmp/tuned.json
    stamp "loading the tuning table of an earlier call: /tmp/tuned.json"
elif [ "${BORROW_TABLE:-0}" = 1 ]; then
    # a card without its own shipped table (the H100) would re-tune in every process (135 s
    # an FP8 start): tests and A/B-free runs take the shipped table relabelled for this card
    # (other tiles, the same arithmetic; kb/0066). Never for timings that are reported.
    python3 -c "import json, torch; from tailored.kernels import tuning as t; \
d = json.loads(t.DEFAULT_TABLE.read_text()); d['gpu'] = torch.cuda.get_device_name(); \
open('/tmp/tuned-borrowed.json', 'w').write(json.dumps(d))" \
        && export TAILORED_TUNING=/tmp/tuned-borrowed.json \
        && stamp "BORROW_TABLE=1: the shipped table relabelled for this card"
fi
# a log's lines, each after the seconds since the call began with STAMP_LINES=1
stamp_lines() {
    if [ "${STAMP_LINES:-0}" = 1 ]; then
        while IFS= read -r l; do echo "[+$(( $(date +%s) - T0 ))s] $l"; done
    else
        cat
    fi
}
# each_entry NAME LIST LIMIT PREFIX TAIL [JOBS]: run every ';'-separated entry of LIST as shell
# words after PREFIX (eval: quotes kept, e.g. -k "a or b"), each under its own timeout of at most
# LIMIT s with its log NAME-N.log, up to JOBS (default 1) at once; prints each log's failures
# (tests) or its last TAIL lines (benches): one at a time after each entry, else in entry order
# once all have ended
each_entry() {
    local n=0 e i jobs=${6:-1} pids=()
    while IFS= read -r e; do
        n=$((n + 1))
        while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n; done
        enough 60 "$1 $e" || break
        stamp "$1 $n: $e ($(left) s left)"
        { eval "timeout $(cap "$3") $4 $e" < /dev/null 2>&1 | stamp_lines > "$OUT/$1-$n.log"
          rc=${PIPESTATUS[0]}  # timeout's: 124 when it cut the entry
          stamp "$1 $n ended, rc $rc$([ "$rc" = 124 ] && echo ' (cut by its time limit)')"
          [ "$jobs" -gt 1 ] || summary "$1" "$n" "$5"; } &
        pids+=($!)
    done < <(entries "$2")
    # these pids only: a bare `wait` would also wait for the log's tee (device_env.sh)
    [ ${#pids[@]} -eq 0 ] || wait "${pids[@]}"
    [ "$jobs" -gt 1 ] || return 0
    for ((i = 1; i <= n; i++)); do
        [ -f "$OUT/$1-$i.log" ] && echo "$1 $i:" && summary "$1" "$i" "$5"
    done
}
# summary NAME N TAIL: the failures and the last TAIL lines of NAME-N.log
summary() {
    grep "^\(\[+[0-9]*s\] \)\?\(FAILED\|ERROR\)" "$OUT/$1-$2.log" | head -5
    tail -"$3" "$OUT/$1-$2.log"
}
want tests && each_entry tests "$TESTS" "${TESTS_CAP:-300}" \
    "python3 -m pytest -q -p no:cacheprovider -rf ${TESTS_ARGS:-}" 1 "${TESTS_JOBS:-1}"
want tune && enough 120 "tune" && {
    prec=${TUNE_PREC:-fp8}
    stamp "tune $prec from scratch: $TUNE_DROP ($(left) s left)"
    TUNE_DROP=$TUNE_DROP python3 - /tmp/tuned.json <<'EOF'
import json, os, sys
from tailored.kernels import tuning
doc = json.loads(tuning.DEFAULT_TABLE.read_text())
for name in os.environ["TUNE_DROP"].split():
    print(f"dropped {len(doc['launchers'].pop(name, []))} entries of {name}")
open(sys.argv[1], "w").write(json.dumps(doc, indent=1) + "\n")
EOF
    # load the trimmed copy and dump into it: the dropped keys tune, the rest stay as shipped
    TAILORED_TUNING=/tmp/tuned.json TAILORED_TUNING_DUMP=/tmp/tuned.json \
        timeout "$(cap 400)" python3 lab/bench_decode.py "$(ckpt "$prec")" \
        --batches "${TUNE_BATCHES:-1,8,32}" --json "$OUT/tune.json" > "$OUT/tune.log" 2>&1
    grep "^| \|^B=\|Error\|error\|tuning table" "$OUT/tune.log" | cut -c1-130 | head -20
    TUNE_DROP=$TUNE_DROP python3 - /tmp/tuned.json <<'EOF'
# put back the shipped entries of dropped launchers whose keys this run did not reach, and
# print the new picks
import json, os, sys
from tailored.kernels import tuning
shipped = json.loads(tuning.DEFAULT_TABLE.read_text())["launchers"]
doc = json.loads(open(sys.argv[1]).read())
for name in os.environ["TUNE_DROP"].split():
    rows = doc["launchers"].setdefault(name, [])
    have = {json.dumps(r["key"]) for r in rows}
    back = [r for r in shipped.get(name, []) if json.dumps(r["key"]) not in have]
    for r in sorted(rows, key=lambda r: json.dumps(r["key"])):
        print(name, "tuned", r["key"][:5], r["kwargs"], r["num_warps"], r["num_stages"])
    for r in back:
        print(name, "kept (not reached)", r["key"][:5], r["kwargs"])
    rows += back
    rows.sort(key=lambda r: json.dumps(r["key"]))
open(sys.argv[1], "w").write(json.dumps(doc, indent=1) + "\n")
EOF
    cp /tmp/tuned.json "$OUT/tuned.json"
    export TAILORED_TUNING=/tmp/tuned.json
}
want bench && each_entry bench "$BENCHES" 400 "" 25
want ab && enough 150 "A/B" && {
    prec=${AB_PREC:-fp8}
    stamp "A/B $prec B=${AB_BATCHES:-8,32}: $AB_VARIANTS ($(left) s left)"
    # shellcheck disable=SC2086  # AB_ARGS: bench_decode's words
    timeout "$(cap 500)" python3 lab/bench_decode.py "$(ckpt "$prec")" \
        --batches "${AB_BATCHES:-8,32}" --rounds "${AB_ROUNDS:-3}" --variants "$AB_VARIANTS" \
        --json "$OUT/ab.json" ${AB_ARGS:-} > "$OUT/ab.log" 2>&1
    grep "^| \|^B=\|min of rounds\|Error\|error" "$OUT/ab.log" | cut -c1-130 | head -40
}
want sbs && for prec in ${SBS_PRECS:-fp8 bf16}; do
    [ "$(left)" -gt 170 ] || { stamp "no time for the $prec side by side"; break; }
    envs=""; [ "$prec" = fp8 ] && envs=${SBS_ENV:-}
    stamp "side by side $prec (tailored half, defaults + '$envs', $(left) s left)"
    # shellcheck disable=SC2086  # NAME=VALUE words
    env $envs OUT=/tmp/sbs-out timeout "$(cap 600)" bash lab/sbs_tailored.sh "$prec" \
        > "$OUT/sbs-$prec.out" 2>&1
    cp /tmp/sbs-out/sbs-call.log "$OUT/sbs-call-$prec.log" 2>/dev/null
    # its own lines: sbs.sh prints every result file in /tmp/sbs, the other precision's too
    grep "tailored-$prec.json: c=" "$OUT/sbs-$prec.out" | tail -2
    tar czf "$OUT/sbs.tgz" -C /tmp sbs sbs-out 2>/dev/null
done
# run_gate PREC OUTNAME [NAME=VALUE ...]: `lab/gpu_gate.sh PREC` with those variables set,
# in what is left of END; its verdict lines from $OUT/OUTNAME.out
run_gate() {
    local prec=$1 name=$2
    shift 2
    env "$@" timeout $(( $(left) - 5 )) bash lab/gpu_gate.sh "$prec" > "$OUT/$name.out" 2>&1
    grep "overall\|vs bf16 reference\|gate PASSED\|gate FAILED" "$OUT/$name.out"
}
want gate && for prec in ${GATE_PRECS:-fp8}; do
    [ "$(left)" -gt 120 ] || { stamp "no time for the $prec gate"; break; }
    stamp "$prec gate with '${GATE_ENV:-}' ($(left) s left)"
    # shellcheck disable=SC2086  # NAME=VALUE words
    run_gate "$prec" "gate-$prec" ${GATE_ENV:-}
done
if want onegate && [ "$(left)" -gt 100 ]; then
    stamp "bf16 gate, prompts one at a time ($(left) s left)"
    run_gate bf16 gate-bf16-one GATE_ARGS=--one-at-a-time
fi
# the compiled-kernel cache's size: whether it could come back and travel in carry to start
# the next call's tests warm (files back: 16 MiB each; carry: 64 MiB with the wheels)
# (du counts blocks: an archive of it weighs less)
size=$(du -sh "$TRITON_CACHE_DIR" 2>/dev/null | cut -f1)
stamp "Triton cache: ${size:-none} in $TRITON_CACHE_DIR"
stamp done
# the device returns a few files: this log and the table as they are, the rest in one archive
(cd "$OUT" && find . -maxdepth 1 -type f ! -name gpu_call.log ! -name tuned.json \
    ! -name logs.tgz -printf '%P\n' | tar czf logs.tgz -T - --remove-files 2>/dev/null)
