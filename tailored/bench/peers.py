"""tailored beside SGLang and vLLM on the traffic users run: the `peers` section of
`bench/results/latest.json` (issue 57).

Input: a folder of `tailored bench` results, one file per engine, precision and workload, as
`lab/peers.sh` writes them:

    ENGINE-PREC-random.json      random 1024 in / 512 out, c = 1, 32, 128
    ENGINE-PREC-chat-mix.json    the chat mix at Poisson rates (one run each)
    ENGINE-PREC-agent-mix.json   the agent mix (one run)
    ENGINE-PREC-long-N.json      one prompt of N tokens (one run each file)

ENGINE: tailored, sglang (0.5.17), vllm (0.25.1, the baseline kit) or vllm026 (0.26.0, the
newest vLLM on the GPU machine's torch 2.11; optional).

Output, per workload and point (a run: `c=32`, `rate=4`, `all`, `N tokens`): each engine's
output tok/s, TTFT p50/p99, ITL p50/p99 and goodput (requests and output tokens per second
within the run's SLO), the best peer (the best of the others on that metric) and the
ratio tailored / best peer (for TTFT and ITL lower is better: < 1 is a win). The chat mix also
gets a point `max`: each engine's highest goodput over its rates. Then the issue's targets,
each met or not, and each engine's manifest condensed. Only what the files carry: a value
they lack is null and gives no ratio.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from tailored.bench.loadsweep import condensed_manifest
from tailored.bench.results import load_runs, put_section, ratio, read_section

SCHEMA = "tailored-peers/1"
ENGINES = ("tailored", "sglang", "vllm", "vllm026")
PEERS = ENGINES[1:]
WORKLOADS = ("random", "chat-mix", "agent-mix", "long")
# (section key, run key, higher is better)
METRICS = (
    ("output_tok_s", "output_throughput", True),
    ("ttft_p50_ms", "p50_ttft_ms", False),
    ("ttft_p99_ms", "p99_ttft_ms", False),
    ("itl_p50_ms", "p50_itl_ms", False),
    ("itl_p99_ms", "p99_itl_ms", False),
    ("goodput_req_s", "request_goodput", True),
    ("goodput_tok_s", "output_goodput", True),
)
HIGHER = {k: h for k, _, h in METRICS}
# issue 57's targets: (workload, point or None for every point, metric, bound, "min"|"max")
TARGETS = (
    ("random", "c=1", "output_tok_s", 1.5, "min"),
    ("random", "c=32", "output_tok_s", 1.5, "min"),
    ("random", "c=128", "output_tok_s", 1.3, "min"),
    ("chat-mix", "max", "goodput_req_s", 1.5, "min"),
    ("agent-mix", "all", "ttft_p50_ms", 0.5, "max"),
    ("long", None, "ttft_p50_ms", 0.7, "max"),
)
FILE_RE = re.compile(r"(tailored|sglang|vllm|vllm026)-(\w+?)-(random|chat-mix|agent-mix|long-(\d+))"
                     r"\.json")


class NoPeerResults(ValueError):
    """The folder holds no peers result file."""


def num(x) -> float | None:
    """A finite number or None (result files carry NaN where a metric has no sample)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return None if math.isnan(x) or math.isinf(x) else float(x)


def point_name(workload: str, run: dict, long_tokens: int | None = None) -> str:
    if workload == "long":
        return f"{long_tokens} tokens"
    if workload == "agent-mix":
        return "all"
    rate = run.get("request_rate", "inf")
    if rate not in (None, "inf") and num(rate) is not None:
        return f"rate={num(rate):g}"
    return f"c={run.get('max_concurrency')}"


def find_files(results_dir: str | Path, precision: str) -> dict[tuple[str, str], Path]:
    """{(engine, workload file tag): path}; tags: random, chat-mix, agent-mix, long-N."""
    d = Path(results_dir)
    if not d.is_dir():
        raise NoPeerResults(f"{d} is not a folder")
    out = {}
    for p in sorted(d.glob("*.json")):
        m = FILE_RE.fullmatch(p.name)
        if m and m.group(2) == precision:
            out[(m.group(1), m.group(3))] = p
    if not out:
        raise NoPeerResults(f"no peers results in {d}: expected ENGINE-{precision}-WORKLOAD.json "
                            f"(ENGINE {', '.join(ENGINES)}; WORKLOAD random, chat-mix, "
                            f"agent-mix, long-N; lab/peers.sh)")
    return out


def compare(values: dict[str, float | None], higher: bool) -> dict[str, Any]:
    """The engines' values, the best peer and tailored / best peer."""
    peers = [(e, values.get(e)) for e in PEERS if values.get(e) is not None]
    best = (max if higher else min)(peers, key=lambda ev: ev[1]) if peers else None
    return {**{e: values.get(e) for e in ENGINES}, "best_peer": best[0] if best else None,
            "ratio": ratio(values.get("tailored"), best[1]) if best else None}


def _point(name: str, runs: dict[str, tuple[Path, dict]]) -> dict[str, Any]:
    pt: dict[str, Any] = {"point": name}
    pt["num_prompts"] = {e: runs[e][1].get("num_prompts") if e in runs else None
                         for e in ENGINES}
    pt["failed"] = {e: runs[e][1].get("failed") if e in runs else None for e in ENGINES}
    for key, run_key, higher in METRICS:
        pt[key] = compare({e: num(r.get(run_key)) for e, (_, r) in runs.items()}, higher)
    pt["files"] = {e: runs[e][0].name if e in runs else None for e in ENGINES}
    return pt


def _max_goodput(points: list[dict]) -> dict[str, Any]:
    """Each engine's highest goodput over the rate points (the chat mix's headline)."""
    pt: dict[str, Any] = {"point": "max", "of": [p["point"] for p in points]}
    for key in ("goodput_req_s", "goodput_tok_s"):
        best = {}
        for e in ENGINES:
            vals = [p[key][e] for p in points if p[key][e] is not None]
            best[e] = max(vals) if vals else None
        pt[key] = compare(best, True)
    return pt


def assemble(results_dir: str | Path, *, precision: str = "fp8", card: str | None = None,
             commit: str | None = None, note: str | None = None) -> dict[str, Any]:
    files = find_files(results_dir, precision)
    headers: dict[str, list[dict]] = {e: [] for e in ENGINES}
    # workload -> point name -> engine -> (path, run); insertion order = the files' run order
    table: dict[str, dict[str, dict[str, tuple[Path, dict]]]] = {w: {} for w in WORKLOADS}
    for (engine, tag), path in sorted(files.items(), key=lambda kv: _order(kv[0][1])):
        header, runs = load_runs(path)
        headers[engine].append(header)
        workload = "long" if tag.startswith("long-") else tag
        n = int(tag[5:]) if workload == "long" else None
        for r in runs:
            table[workload].setdefault(point_name(workload, r, n), {})[engine] = (path, r)
    workloads: dict[str, Any] = {}
    for w in WORKLOADS:
        if not table[w]:
            continue
        points = [_point(name, by) for name, by in table[w].items()]
        if w == "chat-mix" and any(p["point"].startswith("rate=") for p in points):
            points.append(_max_goodput([p for p in points if p["point"].startswith("rate=")]))
        workloads[w] = {"points": points, "workload": _workload_of(table[w])}
    manifests = {e: condensed_manifest(headers[e][0]) if headers[e] else None for e in ENGINES}
    first = next((m for m in manifests.values() if m), {})
    return {
        "schema": SCHEMA,
        "precision": precision,
        "card": card or first.get("gpu"),
        "commit": commit or ((manifests["tailored"] or {}).get("commit") or {}).get("commit"),
        "date": min((h.get("date") or "" for hs in headers.values() for h in hs), default=None)
        or None,
        "note": note,
        "ratio": "tailored / the best of the peers at each point (TTFT, ITL: lower is "
                 "better, < 1 is a win; throughput, goodput: > 1 is a win)",
        "results_dir": str(results_dir),
        "workloads": workloads,
        "targets": targets(workloads),
        "manifest": manifests,
    }


def _order(tag: str) -> tuple[int, int]:
    base = "long" if tag.startswith("long-") else tag
    return WORKLOADS.index(base), int(tag[5:]) if base == "long" else 0


def _workload_of(by_point: dict[str, dict[str, tuple[Path, dict]]]) -> dict[str, Any] | None:
    """The first file's workload description (the engines ran the same one)."""
    for by in by_point.values():
        for path, _ in by.values():
            header, _ = load_runs(path)
            wl = header.get("workload") or {}
            return {k: wl.get(k) for k in ("workload", "dataset", "input_len", "output_len",
                                           "ignore_eos", "temperature", "seed", "arrivals",
                                           "request_rate", "concurrency", "num_prompts",
                                           "slo_ttft_ms", "slo_itl_ms") if k in wl}
    return None


def targets(workloads: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for w, point, metric, bound, kind in TARGETS:
        for p in (workloads.get(w) or {}).get("points", []):
            if point is not None and p["point"] != point:
                continue
            r = p[metric]["ratio"]
            met = None if r is None else (r >= bound if kind == "min" else r <= bound)
            out.append({"workload": w, "point": p["point"], "metric": metric, "bound": bound,
                        "kind": kind, "ratio": r, "best_peer": p[metric]["best_peer"],
                        "met": met})
    return out


def update_latest(path: str | Path, peers: dict[str, Any]) -> Path:
    """Put `peers` into the latest.json at `path`, keeping every other key it has."""
    return put_section(path, "peers", peers)


def format_peers(s: dict[str, Any]) -> str:
    def f(x, nd=0):
        return "—" if x is None else f"{x:,.{nd}f}"

    shown = [e for e in ENGINES if e != "vllm026" or any(
        p[k].get(e) is not None for b in s["workloads"].values() for p in b["points"]
        for k, _, _ in METRICS if k in p)]
    lines = [f"{s.get('card') or '?'}, {s['precision']}: tailored vs SGLang vs vLLM "
             f"(ratio = tailored / best peer)",
             f"{'workload':<10} {'point':<13} {'metric':<14} "
             + " ".join(f"{e:>10}" for e in shown) + f" {'ratio':>7}"]
    for w, block in s["workloads"].items():
        for p in block["points"]:
            for key, _, _ in METRICS:
                if key not in p:
                    continue
                v = p[key]
                nd = 2 if key.startswith("goodput_req") else (1 if "itl" in key else 0)
                r = "—" if v["ratio"] is None else f"{v['ratio']:.2f}×"
                lines.append(f"{w:<10} {p['point']:<13} {key:<14} "
                             + " ".join(f"{f(v[e], nd):>10}" for e in shown) + f" {r:>7}")
    for t in s["targets"]:
        sym = "≥" if t["kind"] == "min" else "≤"
        verdict = {True: "met", False: "NOT met", None: "no data"}[t["met"]]
        r = "—" if t["ratio"] is None else f"{t['ratio']:.2f}×"
        lines.append(f"target {t['workload']} {t['point']} {t['metric']}: {r} {sym} "
                     f"{t['bound']}× vs {t['best_peer'] or '?'}: {verdict}")
    return "\n".join(lines)


def load_section(path: str | Path) -> dict[str, Any]:
    """The peers section of a latest.json (or a file that is one)."""
    return read_section(path, "peers", SCHEMA, NoPeerResults, "tailored bench peers")
