#!/usr/bin/env bash
# Prepared in session 9, NOT RUN (the device budget ran out; run it first in session 10). Repository
# root, .whl carried: async scheduling (kb/0025) on the
# H200 — first its GPU test (tokens equal to the synchronous engine, no host-device sync in a
# step launched ahead; full width, 4 layers, fp32, kernel path + graphs), then the bf16 side by
# side, tailored phase, with async scheduling on (its default) and everything else as call 2.
# Usage: TAILORED_COMMIT=<sha> bash logs/gpu/2026-12-01-s9/call4.sh
source "$(dirname "$0")/../../../scripts/device_env.sh" call4
stamp "GPU test: async scheduling"
timeout 150 python3 -m pytest -q -p no:cacheprovider -s tests/test_gpu_invariance.py -k async 2>&1 \
    | grep -v "^$" | grep -v "Warning\|warn" | tail -15
stamp "side by side, tailored bf16, async scheduling on"
SBS_DIR=/tmp/sbs TAILORED_SERVE_ARGS="--prefill-graphs on" CROSSCHECK=0 READY_TIMEOUT=300 \
    timeout 390 bash scripts/side_by_side.sh tailored bf16 > /tmp/sbs-call.log 2>&1
grep "^\[sbs\|ready\|WARNING\|died\|not ready" /tmp/sbs-call.log | tail -n 10
grep "step timing" /tmp/sbs/tailored-server-bf16.log | sed -n '4p;$p' | cut -c1-330
python3 - <<'PY'
import glob, json
for f in glob.glob("/tmp/sbs/tailored-*.json"):
    for x in json.load(open(f))["runs"]:
        print(f"c={x['max_concurrency']}: {x['output_throughput']:.1f} tok/s, TTFT p50 "
              f"{x['p50_ttft_ms']:.1f} ms, TPOT p50 {x.get('p50_tpot_ms', 0):.2f} ms")
PY
stamp "done"
