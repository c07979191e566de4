"""`tailored bench --plot OUT.png`: the load sweep side by side as a picture.

Two panels against concurrency (log scale): output tok/s and TTFT p50, tailored and vLLM, the
throughput ratio at each point; the card, precision and commit in the title; the long prompts'
TTFTs in a footnote. Drawn from a `load` section (loadsweep.py) with matplotlib, imported here
only (the `plot` extra), on its Agg canvas: no display and no pyplot state.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

INSTALL_HINT = "pip install 'tailored[plot]' (or pip install matplotlib)"
STYLE = {"tailored": ("tailored", "#1f6fb4", "o"), "vllm": ("vLLM", "#d9822b", "s")}


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed."""


def _series(points: list[dict], key: str, engine: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for p in points:
        v = p[key][engine]
        if v is not None:
            xs.append(p["concurrency"])
            ys.append(v)
    return xs, ys


def title_of(load: dict[str, Any]) -> str:
    prec = (load.get("precision") or "?").upper().replace("FP8", "FP8 (block)")
    vllm = f"vLLM {load['vllm_version']}" if load.get("vllm_version") else "vLLM"
    return (f"Qwen3.6-35B-A3B on one {load.get('card') or '?'}, {prec}: "
            f"tailored {load.get('commit') or '?'} vs {vllm} ({load.get('date') or '?'})")


def plot_load(load: dict[str, Any], out: str | Path, *, dpi: int = 100) -> Path:
    """Draw the load section to `out` (PNG); PlotUnavailable without matplotlib."""
    try:
        from matplotlib.figure import Figure
        from matplotlib.ticker import FuncFormatter, LogLocator, NullLocator
    except ImportError as e:
        raise PlotUnavailable(f"tailored bench --plot needs matplotlib: {INSTALL_HINT}") from e
    points = load["points"]
    if not points:
        raise ValueError("the load section has no concurrency points to plot")
    concs = [p["concurrency"] for p in points]
    fig = Figure(figsize=(10, 4.3), dpi=dpi, layout="constrained")
    ax_tp, ax_ttft = fig.subplots(1, 2)
    for engine, (label, color, marker) in STYLE.items():
        for ax, key in ((ax_tp, "output_tok_s"), (ax_ttft, "ttft_p50_ms")):
            xs, ys = _series(points, key, engine)
            if xs:
                ax.plot(xs, ys, marker=marker, color=color, label=label, linewidth=1.8)
    for p in points:  # the throughput ratio above the higher of the two markers
        r = p["output_tok_s"]
        if r["ratio"] is not None:
            top = max(v for v in (r["tailored"], r["vllm"]) if v is not None)
            ax_tp.annotate(f"{r['ratio']:.2f}×", (p["concurrency"], top), textcoords="offset points",
                           xytext=(0, 7), ha="center", fontsize=8, color="#333333")
    wl = (load.get("workload") or {}).get("sweep") or {}
    shape = (f"random {wl.get('input_len', '?')} in / {wl.get('output_len', '?')} out"
             if wl else "")
    ax_tp.set_title("output tok/s (higher is better; label: tailored / vLLM)", fontsize=10)
    ax_tp.set_ylabel("output tokens / s")
    ax_tp.set_ylim(bottom=0, top=max(v for p in points for v in (
        p["output_tok_s"]["tailored"], p["output_tok_s"]["vllm"], 0) if v is not None) * 1.15)
    ax_ttft.set_title("TTFT p50 (lower is better)", fontsize=10)
    ax_ttft.set_ylabel("ms (log scale)")
    ax_ttft.set_yscale("log")
    ax_ttft.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax_ttft.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
    ax_ttft.yaxis.set_minor_locator(NullLocator())
    for ax in (ax_tp, ax_ttft):
        ax.set_xscale("log", base=2)
        ax.set_xticks(concs, [str(c) for c in concs])
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xlabel(f"concurrency (requests in flight; {shape})" if shape else "concurrency")
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(loc="upper left", fontsize=9)
    fig.suptitle(title_of(load), fontsize=11)
    longs = [lp for lp in load.get("long_prompts") or []
             if None not in (lp["ttft_p50_ms"]["tailored"], lp["ttft_p50_ms"]["vllm"])]
    if longs:
        fig.supxlabel("one long prompt, TTFT tailored / vLLM: " + "; ".join(
            f"{lp['prompt_tokens']:,} tokens {lp['ttft_p50_ms']['tailored'] / 1e3:.2f} / "
            f"{lp['ttft_p50_ms']['vllm'] / 1e3:.2f} s ({lp['ttft_p50_ms']['ratio']:.2f}×)"
            for lp in longs), fontsize=9)
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path
