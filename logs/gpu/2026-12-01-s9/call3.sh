#!/usr/bin/env bash
# Session 9, device call 3 (repository root, .whl carried): tailored FP8 served side by side
# (tailored phase; the vLLM FP8 half is session 8's run of the same kit), without prefill
# graphs: their FP8 GEMM tuning at 20 token buckets does not fit in one 600 s call on a fresh
# machine (kb/0020); then the FP8 accuracy gate if the call has time left.
# Usage: TAILORED_COMMIT=<sha> bash logs/gpu/2026-12-01-s9/call3.sh
set -uo pipefail
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
export SBS_DIR=/tmp/sbs READY_TIMEOUT=450
CROSSCHECK=0 timeout 530 bash scripts/side_by_side.sh tailored fp8 > /tmp/sbs-call.log 2>&1
grep "^\[sbs\|ready\|WARNING\|died\|not ready" /tmp/sbs-call.log | tail -n 15
grep -v "step timing\|POST\|GET" /tmp/sbs/tailored-server-fp8.log | grep "INFO tailored" | head -8 | cut -c1-200
if [ "$(el)" -lt 480 ]; then
    echo "[call3 +$(el)s] gate fp8"
    GATE_ARGS="--prefill-graphs" timeout $(( 590 - $(el) )) bash scripts/gpu_gate.sh fp8
fi
echo "[call3 +$(el)s] done"
python3 - "$OUT" <<'PY'
import glob, json, sys
out = sys.argv[1]
for f in sorted(glob.glob(f"{out}/gate-*.json")):
    r = json.load(open(f))
    print(f, "PASSED" if r.get("passed") else "FAILED")
for f in glob.glob(f"{out}/sbs/tailored-*.json"):
    r = json.load(open(f))
    for x in r["runs"]:
        print(f"c={x['max_concurrency']}: {x['output_throughput']:.1f} tok/s, TTFT p50 "
              f"{x['p50_ttft_ms']:.1f} ms, TPOT p50 {x.get('p50_tpot_ms', 0):.2f} ms")
PY
