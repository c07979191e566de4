#!/usr/bin/env bash
# Issue 3 on the H200, one call: kernel + fast-path GPU tests, in-process step timings of the
# full-size model (graphs vs eager, prefill, a B=1 kernel profile), then `tailored serve` on the
# full-size dummy bf16 model benchmarked with `tailored bench` (1024 in / 512 out, c=1 and c=32).
#
# Prepare here: bash scripts/fetch_wheels.sh   (writes .whl/, git-ignored; includes fla-core)
# Run there:    device run, carry [".whl"],
#               command: TAILORED_COMMIT=<sha> bash scripts/gpu_fast.sh [tests|moe|route|micro|serve]...
# Output: $OUT/gpu_fast.log, $OUT/*.json; the summary is printed last.
source "$(dirname "$0")/device_env.sh" gpu_fast
PARTS=${*:-tests micro serve}

stamp "manifest"
python3 - <<'PY' | tee "$OUT/manifest.json"
import json, os, subprocess, torch, triton
smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                      "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
try:
    import fla; fla_v = fla.__version__
except Exception as e:
    fla_v = f"unavailable: {e}"
print(json.dumps({"commit": os.environ.get("TAILORED_COMMIT", "unknown"), "gpu": smi,
                  "torch": torch.__version__, "cuda": torch.version.cuda,
                  "triton": triton.__version__, "fla": fla_v}, indent=1))
PY
full_configs
PRECISIONS=${PRECISIONS:-bf16}  # e.g. "bf16 fp8": micro and serve run once per precision
ckpt() { [ "$1" = fp8 ] && echo /tmp/full-fp8 || echo /tmp/full; }

if [[ " $PARTS " == *" tests "* ]]; then
    stamp "GPU tests: kernels, fast path, graphs"
    timeout 300 python3 -m pytest -q -p no:cacheprovider -s tests/kernels/test_kernels.py tests/gpu/test_gpu.py ${GPU_TEST_K:+-k "$GPU_TEST_K"} 2>&1 \
        | grep -v "^$" | grep -v "Warning\|warn" | tail -40
fi

if [[ " $PARTS " == *" moe "* ]]; then
    for prec in $PRECISIONS; do
        stamp "routed-expert MoE per layer ($prec experts), full vs compact expert grid (kb/0016)"
        timeout 240 python3 scripts/bench_moe.py --json "$OUT/moe-$prec.json" \
            $([ "$prec" = fp8 ] && echo --fp8) ${MOE_ARGS:-} 2>&1 | tail -12
    done
fi

if [[ " $PARTS " == *" route "* ]]; then
    stamp "route_align µs by batch, warps, shared expert as expert E (kb/0019)"
    timeout 180 python3 scripts/bench_route.py --json "$OUT/route.json" ${ROUTE_ARGS:-} 2>&1 | tail -12
fi

if [[ " $PARTS " == *" micro "* ]]; then
    # MICRO_ENVS: ';'-separated sets of TAILORED_* switches read at start (e.g.
    # "TAILORED_FP8_DENSE_DEQUANT=0;TAILORED_FP8_DENSE_DEQUANT=1"): one bench run each
    IFS=';' read -r -a MENVS <<< "${MICRO_ENVS:-}"
    [ ${#MENVS[@]} -eq 0 ] && MENVS=("")
    for prec in $PRECISIONS; do
      for ei in "${!MENVS[@]}"; do
        me="${MENVS[$ei]}"
        tag=$prec; [ ${#MENVS[@]} -gt 1 ] && tag=$prec-e$ei
        stamp "in-process step timings ($prec${me:+, $me})"
        env $me timeout ${MICRO_TIMEOUT:-240} python3 scripts/bench_decode.py "$(ckpt $prec)" --batches ${MICRO_BATCHES:-1,8,32} \
            --json "$OUT/micro-$tag.json" ${MICRO_ARGS:-} 2>&1 | tail -${MICRO_TAIL:-20}
      done
    done
fi

if [[ " $PARTS " == *" serve "* ]]; then
  # SERVE_VARIANTS: ';'-separated serve flag sets run one after another in this call (A/B in
  # one run, e.g. "--prefill-graphs on;--engine-process off"); default: one run with SERVE_ARGS.
  # The second server starts faster (Triton's cache is warm). Each variant's flags go into its
  # result's manifest; a table of all variants is printed last. Leading NAME=VALUE words of a
  # variant are environment switches for that server (e.g. "TAILORED_FP8_DENSE_DEQUANT=1").
  IFS=';' read -r -a VARIANTS <<< "${SERVE_VARIANTS:-${SERVE_ARGS:-}}"
  [ ${#VARIANTS[@]} -eq 0 ] && VARIANTS=("")
  for prec in $PRECISIONS; do
    for vi in "${!VARIANTS[@]}"; do
      va="${VARIANTS[$vi]}"
      venv=""; vflags=""
      for w in $va; do
        if [[ -z "$vflags" && "$w" =~ ^TAILORED_[A-Z0-9_]+= ]]; then venv="$venv $w"; else vflags="$vflags $w"; fi
      done
      tag=$prec; [ ${#VARIANTS[@]} -gt 1 ] && tag=$prec-v$vi
      stamp "serve full-size dummy $prec [${va:-defaults}]"
      env $venv python3 -m tailored serve "$(ckpt $prec)" --load-format dummy --max-model-len 4096 --max-num-seqs 64 \
          --port 8000 $vflags > "$OUT/server-$tag.log" 2>&1 &
      pid=$!
      wait_for_server 8000 $pid "$OUT/server-$tag.log" || { kill $pid 2>/dev/null; continue; }
      stamp "server ready"
      timeout 200 python3 -m tailored bench run --base-url http://127.0.0.1:8000 --concurrency 1,32 \
          --num-prompts 6,64 --input-len 1024 --output-len 512 --ignore-eos --num-warmups 1 \
          --precision $prec --checkpoint-dir "$(ckpt $prec)" --label "tailored-$prec${va:+ [$va]}" \
          --engine-config "{\"serve_args\": \"--load-format dummy --max-model-len 4096 --max-num-seqs 64 $va\", \"max_num_batched_tokens\": \"serve default (8192 on cuda)\"}" \
          --out "$OUT/tailored-$tag.json" 2>&1 | tail -${BENCH_TAIL:-30}
      kill $pid; wait $pid 2>/dev/null
      grep -i "error\|traceback\|warning" "$OUT/server-$tag.log" | head -5
      grep "step timing" "$OUT/server-$tag.log" | tail -2
    done
  done
  python3 - "$OUT" <<'PY'
import glob, json, sys
print("| run | c=1 tok/s | TTFT p50 ms | c=32 tok/s | c=32 ITL p50 ms |")
print("|---|---|---|---|---|")
for f in sorted(glob.glob(f"{sys.argv[1]}/tailored-*.json")):
    r = json.load(open(f))
    by = {x["max_concurrency"]: x for x in r["runs"]}
    c1, c32 = by.get(1, {}), by.get(32, {})
    print(f"| {r['label']} | {c1.get('output_throughput', 0):.1f} | {c1.get('p50_ttft_ms', 0):.1f} | "
          f"{c32.get('output_throughput', 0):.1f} | {c32.get('p50_itl_ms', 0):.2f} |")
PY
fi
stamp "done"
