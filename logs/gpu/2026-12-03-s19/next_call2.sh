#!/usr/bin/env bash
# Prepared in session 19 for the next (carry [".whl"], ~6 min warm, ~8 cold): both plain side
# by sides with the tree's defaults (the attention gate in the merge on since kb/0037), their
# files tarred into one (the device tool left run3's FP8 JSON out over its file count).
# Then: tar xzf sbs.tgz; copy tailored-*.{json,txt} and tailored-server-*.log into
# bench/results/<date>-s20/ with vllm-* from ../2026-12-03-s19/, and
# python -m tailored.bench summary --results-dir ... --latest bench/results/latest.json
# Usage: TAILORED_COMMIT=<sha> OUT=$OUT bash logs/gpu/2026-12-03-s19/next_call2.sh
source "$(dirname "$0")/../../../scripts/device_env.sh" next_call2
for prec in bf16 fp8; do
    stamp "side by side $prec (tailored half, defaults)"
    OUT=/tmp/sbs-out timeout 270 bash logs/gpu/2026-12-01-s12/sbs.sh $prec > "$OUT/sbs-$prec.out" 2>&1
    grep "c=1\|c=32" "$OUT/sbs-$prec.out" | tail -2
done
tar czf "$OUT/sbs.tgz" -C /tmp sbs sbs-out 2>/dev/null
stamp done
