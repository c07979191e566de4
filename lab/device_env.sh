# Sourced by the lab/gpu_*.sh device runs: log everything to $OUT/$1.log, install the wheels
# carried in .whl/ (lab/fetch_wheels.sh) into /tmp/site, and define `stamp` (elapsed time).
set -uo pipefail
OUT=${OUT:-/tmp/tailored-out}
mkdir -p "$OUT"
LOG=$OUT/$1.log
exec > >(tee -a "$LOG") 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TAILORED_CACHE=/tmp/tailored-cache
T0=$(date +%s)
stamp() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
# config + tokenizer of the full-size model for --load-format dummy: bf16 and block FP8
full_configs() {
    python3 -m tailored synth /tmp/full --preset full --config-only 2>&1 | tail -1
    python3 -m tailored synth /tmp/full-fp8 --preset full --config-only --dtype fp8 2>&1 | tail -1
    python3 -m tailored synth /tmp/full-nvfp4 --preset full --config-only --dtype nvfp4 2>&1 | tail -1
}
# wait_for_server PORT PID LOG [SECONDS]: until GET /health answers; on the server's death, its log
wait_for_server() {
    for _ in $(seq 1 "${4:-240}"); do
        python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$1/health', timeout=2)" 2>/dev/null && return 0
        kill -0 "$2" 2>/dev/null || { echo "server died"; tail -40 "$3"; return 1; }
        sleep 1
    done
    echo "server not ready after ${4:-240} s"; return 1
}
