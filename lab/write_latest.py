"""Write bench/results/latest.json: tailored vs vLLM per precision and headline metric.

    python lab/write_latest.py --tailored-bf16 T.json --vllm-bf16-c1 V1.json \
        --vllm-bf16-c32 V32.json [--fp8 ...] --note "..." --out bench/results/latest.json

Inputs: a `tailored bench` result (runs at c=1 and c=32) and `vllm bench serve` JSONs (one run
each, as in ../shared/baseline/results). `ratio` = tailored / vllm (for TTFT lower is better,
so a ratio < 1 is a win). Missing precisions are written as null with the reason.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tailored.bench.results import load_runs


def _by_c(path):
    header, runs = load_runs(path)
    return header, {r.get("max_concurrency"): r for r in runs}


def _metrics(tailored, v1, v32):
    th, tr = _by_c(tailored)
    _, r1 = _by_c(v1)
    _, r32 = _by_c(v32)
    t1, t32, b1, b32 = tr.get(1, {}), tr.get(32, {}), r1.get(1, {}), r32.get(32, {})

    def row(a, b):
        return {"tailored": a, "vllm": b, "ratio": (a / b) if a and b else None}

    return {
        "c1_output_tok_s": row(t1.get("output_throughput"), b1.get("output_throughput")),
        "ttft_p50_ms": row(t1.get("median_ttft_ms"), b1.get("median_ttft_ms")),
        "c32_output_tok_s": row(t32.get("output_throughput"), b32.get("output_throughput")),
        "roofline_fraction_c1": (t1.get("roofline") or {}).get("fraction"),
        "manifest": th.get("manifest"),
        "sources": {"tailored": str(tailored), "vllm_c1": str(v1), "vllm_c32": str(v32)},
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tailored-bf16", required=True)
    ap.add_argument("--vllm-bf16-c1", required=True)
    ap.add_argument("--vllm-bf16-c32", required=True)
    ap.add_argument("--tailored-fp8", default=None)
    ap.add_argument("--vllm-fp8-c1", default=None)
    ap.add_argument("--vllm-fp8-c32", default=None)
    ap.add_argument("--fp8-missing", default="not measured yet")
    ap.add_argument("--note", default="")
    ap.add_argument("--out", default="bench/results/latest.json")
    a = ap.parse_args()
    out = {
        "schema": "tailored-latest/1",
        "note": a.note,
        "bf16": _metrics(a.tailored_bf16, a.vllm_bf16_c1, a.vllm_bf16_c32),
        "fp8": (_metrics(a.tailored_fp8, a.vllm_fp8_c1, a.vllm_fp8_c32)
                if a.tailored_fp8 and a.vllm_fp8_c1 and a.vllm_fp8_c32
                else {"missing": a.fp8_missing}),
    }
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    for prec in ("bf16", "fp8"):
        if "missing" in out[prec]:
            print(f"{prec}: missing ({out[prec]['missing']})")
            continue
        for k in ("c1_output_tok_s", "ttft_p50_ms", "c32_output_tok_s"):
            r = out[prec][k]
            print(f"{prec} {k:18s} tailored {r['tailored']:9.1f}  vllm {r['vllm']:9.1f}  "
                  f"ratio {r['ratio']:.3f}")
        print(f"{prec} roofline_fraction_c1 {out[prec]['roofline_fraction_c1']:.3f}")


if __name__ == "__main__":
    main()
