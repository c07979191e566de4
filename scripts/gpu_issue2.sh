#!/usr/bin/env bash
# Issue 2 on the H200, one call: install carried wheels, run the GPU tests, serve a full-width
# 4-layer synthetic checkpoint through the safetensors file path, then the full-size model
# (40 layers, bf16, --load-format dummy), and send the prompt set through the OpenAI client.
#
# Prepare here (once):  bash scripts/fetch_wheels.sh      (writes .whl/, git-ignored)
# Run there:            device run, carry [".whl"],
#                       command: TAILORED_COMMIT=<git rev-parse HEAD here> bash scripts/gpu_issue2.sh
# Output: $OUT/gpu_issue2.log (+ JSON reports); the table is printed last.
source "$(dirname "$0")/device_env.sh" gpu_issue2

stamp "manifest"
python3 - <<'PY' | tee "$OUT/manifest.json"
import json, subprocess, torch, triton, transformers
smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                      "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
import os
commit = os.environ.get("TAILORED_COMMIT") or subprocess.run(
    ["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
print(json.dumps({"commit": commit or "unknown (tree copied without .git)", "gpu": smi,
                  "torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__,
                  "transformers": transformers.__version__}, indent=1))
PY

stamp "GPU tests"
python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu.py 2>&1 | tail -15

serve_and_check() {  # $1 label, $2 extra client flags, $3.. serve args
    local label=$1 client_flags=$2; shift 2
    stamp "serve $label: $*"
    python3 -m tailored serve "$@" --port 8000 > "$OUT/server-$label.log" 2>&1 &
    local pid=$!
    for _ in $(seq 1 300); do
        python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8000/health', timeout=2)" 2>/dev/null && break
        kill -0 $pid 2>/dev/null || { echo "server $label died"; tail -30 "$OUT/server-$label.log"; return 1; }
        sleep 1
    done
    stamp "server $label ready"
    python3 scripts/check_prompts.py --base-url http://127.0.0.1:8000/v1 --out "$OUT/prompts-$label.json" $client_flags \
        | tee "$OUT/prompts-$label.txt"
    # bad input must not hurt the server
    python3 - <<'PY'
import json, urllib.request as u, urllib.error as e
req = u.Request("http://127.0.0.1:8000/v1/completions", method="POST",
                data=json.dumps({"model": "qwen36-35b-a3b", "prompt": "x", "max_tokens": 0}).encode(),
                headers={"Content-Type": "application/json"})
try:
    u.urlopen(req)
except e.HTTPError as err:
    print("bad input ->", err.code, err.read().decode()[:200])
print("health after bad input ->", u.urlopen("http://127.0.0.1:8000/health").read().decode())
PY
    kill $pid; wait $pid 2>/dev/null
    tail -5 "$OUT/server-$label.log"
}

stamp "synth full-width 4-layer checkpoint (file path)"
python3 -m tailored synth /tmp/full4 --preset full --num-layers 4 --device cuda 2>&1 | tail -2
du -sh /tmp/full4
# fp32 so that batched == sequential greedy text can be required exactly (--strict-batch)
serve_and_check full4-file-fp32 --strict-batch /tmp/full4 --dtype float32
rm -rf /tmp/full4

stamp "full-size config only"
python3 -m tailored synth /tmp/full --preset full --config-only 2>&1 | tail -1
serve_and_check full-dummy-bf16 "" /tmp/full --load-format dummy --max-model-len 8192 --max-num-seqs 32

stamp "summary"
for f in "$OUT"/prompts-*.txt; do echo "== $f"; tail -8 "$f"; done
