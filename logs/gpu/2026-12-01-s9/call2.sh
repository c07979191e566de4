#!/usr/bin/env bash
# Session 9, device call 2 (run from the repository root, .whl carried): the new decode defaults
# of kb/0024 (two-launch routing up to 64 rows, GDN step over 2 programs a head, MoE combine
# with the next norm) served side by side in bf16 (tailored phase only; the vLLM half is
# session 7's run of the same kit), then the full-size accuracy gate in bf16 and FP8 with
# prefill graphs on, as long as the 600 s call allows.
# Usage: TAILORED_COMMIT=<sha> bash logs/gpu/2026-12-01-s9/call2.sh
set -uo pipefail
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
export SBS_DIR=/tmp/sbs
# route_align at T <= 8: the one-program kernel vs the two-launch path (bench_route, ~20 s)

PYTHONPATH=$PWD python3 scripts/bench_route.py --batches 1,2,3,4,6,8,16 --one-program-up-to 8,0 2>&1 | tail -n 16
TAILORED_SERVE_ARGS="--prefill-graphs on" CROSSCHECK=0 bash scripts/side_by_side.sh tailored bf16 \
    > /tmp/sbs-call.log 2>&1  # $OUT brings back 8 files at most: the phase's own files are in $OUT/sbs
grep "^\[sbs\|ready\|WARNING\|died" /tmp/sbs-call.log | tail -n 15
parts="bf16"
[ "$(el)" -lt 330 ] && parts="bf16 fp8"
echo "[call2 +$(el)s] gate: $parts"
GATE_ARGS="--prefill-graphs" bash scripts/gpu_gate.sh $parts
echo "[call2 +$(el)s] done"
python3 - "$OUT" <<'PY'
import glob, json, sys
out = sys.argv[1]
for f in sorted(glob.glob(f"{out}/gate-*.json")):
    r = json.load(open(f))
    print(f, "PASSED" if r.get("passed") else "FAILED", {k: r.get(k) for k in ("summary",) if k in r})
for f in glob.glob(f"{out}/sbs/tailored-*.json"):
    r = json.load(open(f))
    for x in r["runs"]:
        print(f"c={x['max_concurrency']}: {x['output_throughput']:.1f} tok/s, TTFT p50 "
              f"{x['p50_ttft_ms']:.1f} ms, TPOT p50 {x.get('p50_tpot_ms', 0):.2f} ms")
PY
