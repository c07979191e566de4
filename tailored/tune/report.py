"""What a tune run leaves: report.json (manifest, every trial, the Pareto front, the chosen
point, the gain over the defaults), tune.png, profile.yaml and the kb record."""

from __future__ import annotations

import json
import time
from pathlib import Path

from tailored.tune import search

SCHEMA = "tailored-tune/1"
# the SLO metrics the front is drawn over: (key, higher is better)
FRONT = (("output_throughput", True), ("p99_ttft_ms", False), ("p99_itl_ms", False))
GAIN = ("output_throughput", "request_goodput", "p50_ttft_ms", "p99_ttft_ms", "p99_itl_ms")


def _num(v) -> float:
    return float(v) if isinstance(v, (int, float)) and v == v else float("nan")


def dominates(a: dict, b: dict) -> bool:
    better = False
    for k, up in FRONT:
        x, y = _num(a.get(k)), _num(b.get(k))
        if x != x or y != y:
            continue
        if (x < y) if up else (x > y):
            return False
        if x != y:
            better = True
    return better


def pareto(records: list[dict]) -> list[dict]:
    kept = [r for r in records if r["status"] == search.KEPT and r["metrics"]]
    return [r for r in kept if not any(dominates(o["metrics"], r["metrics"]) for o in kept
                                       if o is not r)]


def choose(contract, records: list[dict]) -> dict:
    """The best kept record by the goal among those meeting every SLO; when none does, the
    one with the fewest violations (then the goal)."""
    kept = [r for r in records if r["status"] == search.KEPT and r["metrics"]]
    sign = -1.0 if contract.goal == "throughput" else 1.0
    return min(kept, key=lambda r: (len(r["slo_violations"]),
                                    sign * _num(search.objective(contract, r["metrics"]))))


def gain(baseline: dict, chosen: dict) -> dict:
    out = {}
    for k in GAIN:
        a, b = _num(baseline["metrics"].get(k)), _num(chosen["metrics"].get(k))
        out[k] = {"defaults": a, "chosen": b, "ratio": (b / a) if a and a == a else None}
    return out


def plot(records: list[dict], front: list[dict], chosen: dict, baseline: dict,
         path: Path, title: str) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for status, marker, color in ((search.KEPT, "o", "tab:blue"),
                                  (search.REJECTED, "x", "tab:red")):
        pts = [r for r in records if r["status"] == status and r.get("metrics")]
        ax.scatter([_num(r["metrics"]["p99_ttft_ms"]) for r in pts],
                   [_num(r["metrics"]["output_throughput"]) for r in pts], marker=marker,
                   color=color, label=f"{status} ({len(pts)})")
    fr = sorted(front, key=lambda r: _num(r["metrics"]["p99_ttft_ms"]))
    ax.plot([_num(r["metrics"]["p99_ttft_ms"]) for r in fr],
            [_num(r["metrics"]["output_throughput"]) for r in fr], "--", color="tab:gray",
            label="Pareto front")
    for r, name, color in ((baseline, "defaults", "black"), (chosen, "chosen", "tab:green")):
        ax.scatter([_num(r["metrics"]["p99_ttft_ms"])], [_num(r["metrics"]["output_throughput"])],
                   s=160, facecolors="none", edgecolors=color, linewidths=2, label=name)
    ax.set_xlabel("TTFT p99 (ms)")
    ax.set_ylabel("output tok/s")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def kb_record(kb_dir: Path, started: str, contract, baseline: dict, records: list[dict],
              chosen: dict, report_path: Path, target_desc: str) -> Path:
    """kb/tune/<date>-<contract>.jsonl: one line a candidate (candidate, before / after, kept
    or rejected, why) and a last line for the choice; an index line in kb/README.md."""
    d = kb_dir / "tune"
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{started}-{contract.name}.jsonl"
    lines = []
    for r in [baseline] + records:
        lines.append({"contract": contract.name, "trial": r.get("trial", 0),
                      "candidate": r["changed"], "before": baseline["metrics"],
                      "after": r.get("metrics"), "kept": r["status"] == search.KEPT,
                      "why": r["why"], "numerics": {k: v for k, v in r["numerics"].items()
                                                    if k != "gate"} | {
                          "gate_passed": (r["numerics"]["gate"] or {}).get("passed")}})
    lines.append({"contract": contract.name, "chosen": chosen["label"],
                  "changed": chosen["changed"], "report": str(report_path)})
    path.write_text("".join(json.dumps(x, sort_keys=True, default=str) + "\n" for x in lines))
    index = kb_dir / "README.md"
    rel = path.relative_to(kb_dir).as_posix()
    if index.is_file():  # one line per run, replaced when a resumed run ends
        g = gain(baseline, chosen)["output_throughput"]["ratio"]
        line = (f"- [{rel}]({rel}): `tailored tune` of contract {contract.name} on "
                f"{target_desc}: {len(records)} candidates, "
                f"{sum(r['status'] == search.REJECTED for r in records)} rejected; chose "
                f"{', '.join(f'{k}={v}' for k, v in chosen['changed'].items()) or 'the defaults'}"
                + (f" (output tok/s x{g:.2f})" if g else ""))
        kept = [ln for ln in index.read_text().splitlines() if f"[{rel}]" not in ln]
        index.write_text("\n".join(kept).rstrip("\n") + "\n\n" + line + "\n")
    return path


def write_report(path: Path, *, contract, manifest: dict, space: dict, baseline: dict,
                 records: list[dict], complete: bool, profile_path: Path | None,
                 plot_path: Path | None) -> dict:
    allr = [baseline | {"trial": 0}] + records
    front = pareto(allr)
    chosen = choose(contract, allr)
    rep = {"schema": SCHEMA, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "contract": contract.model_dump(mode="json"), "contract_sha256": contract.sha256(),
           "manifest": manifest, "space": space, "complete": complete,
           "trials": allr, "pareto_front": [r["trial"] for r in front],
           "chosen": {"trial": chosen["trial"], "label": chosen["label"],
                      "candidate": chosen["candidate"], "changed": chosen["changed"],
                      "metrics": chosen["metrics"], "slo_met": not chosen["slo_violations"],
                      "slo_violations": chosen["slo_violations"]},
           "defaults": {"candidate": baseline["candidate"], "metrics": baseline["metrics"]},
           "gain": gain(baseline, chosen),
           "profile": str(profile_path) if profile_path else None,
           "plot": str(plot_path) if plot_path else None}
    path.write_text(json.dumps(rep, indent=1, default=str))
    return rep
