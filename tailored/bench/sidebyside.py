"""Summary of a side-by-side run (issue 3 part 5): `bench/results/latest.json`.

Input: a folder with `tailored-bf16.json`, `vllm-bf16.json`, `tailored-fp8.json`,
`vllm-fp8.json` (tailored bench results, each with a c=1 and a c=32 run; a missing precision
gives nulls). Output, for each precision and metric, the values `tailored`, `vllm` and
`ratio` (= tailored / vllm; for TTFT lower is better, so the target is a ratio ≤ 0.43), the
achieved roofline fraction at c=1 (decode floor at batch 1 over the measured TPOT p50), the
issue's targets with met/not met, and the manifest of the tailored runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from tailored.bench import roofline
from tailored.bench.results import format_compare, load_runs, ratio, write_latest

ENGINES = ("tailored", "vllm")
PRECISIONS = ("bf16", "fp8")
# issue 3 "Targets": (metric, bound, "min" = at least / "max" = at most)
TARGETS = {
    "bf16": {
        "c1_output_tok_s": (420.0, "min"),
        "ttft_p50_ms": (72.0, "max"),
        "c32_output_tok_s": (3330.0, "min"),
    },
    "fp8": {
        "c1_output_tok_s": (430.0, "min"),
        "ttft_p50_ms": (80.0, "max"),
        "c32_output_tok_s": (4400.0, "min"),
    },
}


def result_path(results_dir: str | Path, engine: str, precision: str) -> Path:
    return Path(results_dir) / f"{engine}-{precision}.json"


def _run_at(runs: list[dict], concurrency: int) -> dict | None:
    for r in runs:
        if r.get("max_concurrency") == concurrency:
            return r
    return None


def metrics_of(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    header, runs = load_runs(path)
    c1, c32 = _run_at(runs, 1), _run_at(runs, 32)
    return {
        "header": header,
        "c1": c1,
        "c32": c32,
        "c1_output_tok_s": c1.get("output_throughput") if c1 else None,
        "ttft_p50_ms": c1.get("p50_ttft_ms") if c1 else None,
        "c32_output_tok_s": c32.get("output_throughput") if c32 else None,
        "c1_tpot_p50_ms": c1.get("p50_tpot_ms") if c1 else None,
    }


def c1_fraction(m: dict | None, precision: str, cfg, hbm_bw: float) -> dict | None:
    if not m or not m["c1"] or not m["c1_tpot_p50_ms"]:
        return None
    wl = m["header"].get("workload") or {}
    in_len = wl.get("input_len") or 1024
    out_len = wl.get("output_len") or 512
    return roofline.roofline_fraction(
        cfg,
        precision,
        tpot_ms=m["c1_tpot_p50_ms"],
        batch=1,
        ctx_len=int(in_len + out_len // 2),
        hbm_bw=hbm_bw,
    )


def summarize(
    results_dir: str | Path, *, hbm_bw: float = roofline.DEFAULT_HBM_BW, model_config=None
) -> dict[str, Any]:
    cfg = model_config or roofline.preset_model_config("full")
    out: dict[str, Any] = {
        "schema": "tailored-side-by-side/1",
        "results_dir": str(results_dir),
        "hbm_bw_Bps": hbm_bw,
    }
    manifest = None
    for prec in PRECISIONS:
        ms = {e: metrics_of(result_path(results_dir, e, prec)) for e in ENGINES}
        block: dict[str, Any] = {}
        for metric in ("c1_output_tok_s", "ttft_p50_ms", "c32_output_tok_s"):
            t = ms["tailored"][metric] if ms["tailored"] else None
            v = ms["vllm"][metric] if ms["vllm"] else None
            bound, kind = TARGETS[prec][metric]
            met = None if t is None else (t >= bound if kind == "min" else t <= bound)
            block[metric] = {
                "tailored": t,
                "vllm": v,
                "ratio": ratio(t, v),
                "target": bound,
                "target_kind": kind,
                "target_met": met,
            }
        fr = {e: c1_fraction(ms[e], prec, cfg, hbm_bw) for e in ENGINES}
        block["roofline_fraction_c1"] = {e: (fr[e]["fraction"] if fr[e] else None) for e in ENGINES}
        block["roofline_fraction_c1"]["detail"] = fr
        block["files"] = {
            e: str(result_path(results_dir, e, prec)) if ms[e] else None for e in ENGINES
        }
        out[prec] = block
        if manifest is None and ms["tailored"]:
            manifest = ms["tailored"]["header"].get("manifest")
    vllm_manifest = None
    for prec in PRECISIONS:
        m = metrics_of(result_path(results_dir, "vllm", prec))
        if m and m["header"].get("manifest"):
            vllm_manifest = m["header"]["manifest"]
            break
    out["manifest"] = manifest
    out["vllm_manifest"] = vllm_manifest
    out["date"] = (manifest or vllm_manifest or {}).get("date")
    return out


def format_summary(s: dict[str, Any]) -> str:
    lines = [f"{'precision':<9} {'metric':<18} {'tailored':>10} {'vllm':>10} {'ratio':>7}  target"]
    for prec in PRECISIONS:
        b = s[prec]
        for metric in ("c1_output_tok_s", "ttft_p50_ms", "c32_output_tok_s"):
            r = b[metric]

            def f(x, nd=1):
                return "—" if x is None else f"{x:.{nd}f}"

            met = {True: "met", False: "NOT met", None: ""}[r["target_met"]]
            sym = "≥" if r["target_kind"] == "min" else "≤"
            lines.append(
                f"{prec:<9} {metric:<18} {f(r['tailored']):>10} {f(r['vllm']):>10} "
                f"{f(r['ratio'], 3):>7}  {sym}{r['target']:g} {met}"
            )
        fr = b["roofline_fraction_c1"]

        def pct(x):
            return "—" if x is None else f"{100 * x:.1f}%"

        lines.append(
            f"{prec:<9} {'roofline c1':<18} {pct(fr['tailored']):>10} {pct(fr['vllm']):>10}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m tailored.bench.sidebyside",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("results_dir")
    p.add_argument("--latest", default=None, help="write the summary JSON here too")
    p.add_argument("--hbm-bw", type=float, default=roofline.DEFAULT_HBM_BW)
    a = p.parse_args(argv)
    s = summarize(a.results_dir, hbm_bw=a.hbm_bw)
    text = json.dumps(s, indent=1) + "\n"
    (Path(a.results_dir) / "summary.json").write_text(text)
    if a.latest:  # keeps the file's `load` section (the load sweep, loadsweep.py)
        write_latest(a.latest, s)
    print(format_summary(s))
    for prec in PRECISIONS:
        t, v = (result_path(a.results_dir, e, prec) for e in ENGINES)
        if t.is_file() and v.is_file():
            table = format_compare(t, v)
            (Path(a.results_dir) / f"compare-{prec}.txt").write_text(table + "\n")
            print(f"\n== {prec}: A = tailored, B = vLLM\n{table}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
