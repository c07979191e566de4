"""`tailored bench --plot OUT.png --plot-kind cdf|goodput`: latency CDFs and goodput against
request rate, one line per engine, from `tailored bench` result files (issue 57).

cdf: two panels, TTFT and ITL (every gap between two text chunks, pooled over the run's
requests), the share of requests (gaps) at or below each latency, one line per file; the run
drawn is the one named by --plot-point (`c=32`, `rate=4`; default the file's last run). It
needs the per-request records, which `tailored bench --save-requests` keeps.
goodput: requests and output tokens per second within the SLO against the Poisson request
rate, one line per file, over the file's runs at a finite rate (`--request-rate` sweeps).
The engine's name comes from the file name (tailored-, sglang-, vllm-, vllm026-), else its label.
matplotlib is imported here only (the `plot` extra), on its Agg canvas.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from tailored.bench.plot import INSTALL_HINT, PlotUnavailable
from tailored.bench.results import load_runs

COLORS = {"tailored": "#1f6fb4", "vllm": "#d9822b", "sglang": "#2a9d4b", "vllm026": "#a0522d"}


def engine_of(path: str | Path, header: dict) -> str:
    name = Path(path).name
    for e in COLORS:
        if name.startswith(e + "-"):
            return e
    return header.get("label") or Path(path).stem


def run_name(run: dict) -> str:
    rate = run.get("request_rate", "inf")
    if rate not in (None, "inf"):
        return f"rate={float(rate):g}"
    return f"c={run.get('max_concurrency')}"


def pick_run(path: str | Path, point: str | None = None) -> tuple[dict, dict]:
    header, runs = load_runs(path)
    if not runs:
        raise ValueError(f"{path}: no runs")
    if point is None:
        return header, runs[-1]
    for r in runs:
        if run_name(r) == point:
            return header, r
    raise ValueError(f"{path}: no run {point} (it has {', '.join(run_name(r) for r in runs)})")


def cdf(values: list[float]) -> tuple[list[float], list[float]]:
    """(sorted values, share of values <= each): the empirical CDF's steps."""
    xs = sorted(v for v in values if v is not None and not math.isnan(v))
    n = len(xs)
    return xs, [(i + 1) / n for i in range(n)]


def latency_series(path: str | Path, point: str | None = None) -> dict[str, Any]:
    """{engine, run, ttft_ms, itl_ms}: the run's per-request TTFTs and pooled ITLs in ms."""
    header, run = pick_run(path, point)
    reqs = run.get("requests")
    if not reqs:
        raise ValueError(f"{path}: run {run_name(run)} has no per-request records: run "
                         f"`tailored bench` with --save-requests")
    ok = [r for r in reqs if r.get("ok")]
    return {"engine": engine_of(path, header), "run": run_name(run),
            "ttft_ms": [r["ttft_s"] * 1e3 for r in ok if r.get("ttft_s") is not None],
            "itl_ms": [g * 1e3 for r in ok for g in r.get("itl_s") or []]}


def goodput_series(path: str | Path) -> dict[str, Any]:
    """{engine, rate, request_goodput, output_goodput, slo}: the runs at a finite rate, by
    rate."""
    header, runs = load_runs(path)
    pts = sorted((float(r["request_rate"]), r) for r in runs
                 if r.get("request_rate") not in (None, "inf"))
    if not pts:
        raise ValueError(f"{path}: no run at a finite --request-rate")
    return {"engine": engine_of(path, header), "rate": [x for x, _ in pts],
            "request_goodput": [r.get("request_goodput") for _, r in pts],
            "output_goodput": [r.get("output_goodput") for _, r in pts],
            "slo": pts[0][1].get("slo")}


def _figure():
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise PlotUnavailable(f"tailored bench --plot needs matplotlib: {INSTALL_HINT}") from e
    fig = Figure(figsize=(10, 4.3), dpi=100, layout="constrained")
    return fig, fig.subplots(1, 2)


def _save(fig, out: str | Path) -> Path:
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path


def plot_cdfs(paths: list[str | Path], out: str | Path, *, point: str | None = None,
              title: str | None = None) -> Path:
    series = [latency_series(p, point) for p in paths]
    fig, (ax_ttft, ax_itl) = _figure()
    for s in series:
        color = COLORS.get(s["engine"])
        for ax, key in ((ax_ttft, "ttft_ms"), (ax_itl, "itl_ms")):
            xs, ys = cdf(s[key])
            if xs:
                ax.step(xs, ys, where="post", color=color, linewidth=1.6,
                        label=f"{s['engine']} ({s['run']}, n={len(xs):,})")
    for ax, what in ((ax_ttft, "TTFT (requests)"), (ax_itl, "ITL (gaps between chunks)")):
        ax.set_title(f"{what}: share at or below", fontsize=10)
        ax.set_xscale("log")
        ax.set_xlabel("ms (log scale)")
        ax.set_ylim(0, 1.02)
        ax.grid(True, alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
    fig.suptitle(title or "latency CDFs", fontsize=11)
    return _save(fig, out)


def plot_goodput(paths: list[str | Path], out: str | Path, *, title: str | None = None) -> Path:
    series = [goodput_series(p) for p in paths]
    fig, (ax_req, ax_tok) = _figure()
    for s in series:
        color = COLORS.get(s["engine"])
        for ax, key in ((ax_req, "request_goodput"), (ax_tok, "output_goodput")):
            ax.plot(s["rate"], s[key], marker="o", color=color, label=s["engine"], linewidth=1.6)
    slo = series[0]["slo"] or {}
    bound = (f" (TTFT <= {slo.get('ttft_ms', '?'):g} ms, TPOT <= {slo.get('itl_ms', '?'):g} ms)"
             if slo else "")
    ax_req.set_title("requests within the SLO per second" + bound, fontsize=10)
    ax_tok.set_title("their output tokens per second", fontsize=10)
    for ax in (ax_req, ax_tok):
        ax.set_xlabel("request rate (Poisson, requests / s)")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(loc="upper left", fontsize=9)
    fig.suptitle(title or "goodput against request rate", fontsize=11)
    return _save(fig, out)
