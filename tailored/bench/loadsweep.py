"""The load sweep side by side: the `load` section of `bench/results/latest.json`.

Input: a folder of per-point `tailored bench` results, as `lab/side_by_side.sh load|long` writes
them (one run per file):

    {tailored,vllm}-PREC-cC.json          c = 1, 8, 32, 64, 128: random 1024 in / 512 out
    {tailored,vllm}-PREC-long-N.json      one prompt of N tokens, one output token
    {tailored,vllm}-long-N.json           (the same, as the 2026-12-07 H100 run named them)

Output, per concurrency: both engines' output tok/s, TTFT p50/p99, ITL p50/p99 (and TPOT p50)
with `ratio` = tailored / vllm (for the latencies lower is better, so < 1 is a win); per long
prompt both TTFTs and their ratio; the manifest of each engine's runs condensed (commit as
recorded, GPU, driver, CUDA, torch, Triton, checkpoint, engine config, switches) and the
workload. Only what the files carry: a value they lack is null, a point one engine lacks has
nulls on that side and no ratio. `card` and `commit` may be stated by the caller (a run's
README); without them they come from the GPU name and the recorded commit.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from tailored.bench.results import load_runs, put_section, ratio, read_section

SCHEMA = "tailored-load/1"
ENGINES = ("tailored", "vllm")
# (key in the load section, key of the run dict)
POINT_METRICS = (
    ("output_tok_s", "output_throughput"),
    ("ttft_p50_ms", "p50_ttft_ms"),
    ("ttft_p99_ms", "p99_ttft_ms"),
    ("itl_p50_ms", "p50_itl_ms"),
    ("itl_p99_ms", "p99_itl_ms"),
    ("tpot_p50_ms", "p50_tpot_ms"),
)
LONG_METRICS = (("ttft_p50_ms", "p50_ttft_ms"), ("ttft_p99_ms", "p99_ttft_ms"))
WORKLOAD_KEYS = ("input_len", "output_len", "ignore_eos", "temperature", "seed", "num_warmups",
                 "dataset", "token_id_range", "request_rate", "streaming")
CARDS = ("GH200", "GB200", "H200", "H100", "H20", "B200", "B100", "A100", "L40S", "L4")


class NoLoadResults(ValueError):
    """The folder holds no load-sweep result file."""


def _num(x):
    """A finite number or None (the files carry NaN where a metric has no sample)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return None if math.isnan(x) or math.isinf(x) else x


def find_files(results_dir: str | Path, precision: str) -> dict[str, dict[str, dict[int, Path]]]:
    """{engine: {"sweep": {concurrency: path}, "long": {prompt tokens: path}}}."""
    d = Path(results_dir)
    if not d.is_dir():
        raise NoLoadResults(f"{d} is not a folder")
    out: dict[str, dict[str, dict[int, Path]]] = {}
    for e in ENGINES:
        sweep, long_ = {}, {}
        for p in d.glob(f"{e}-{precision}-c*.json"):
            m = re.fullmatch(rf"{e}-{re.escape(precision)}-c(\d+)\.json", p.name)
            if m:
                sweep[int(m.group(1))] = p
        for pattern in (f"{e}-long-*.json", f"{e}-{precision}-long-*.json"):  # old name first
            for p in d.glob(pattern):
                m = re.fullmatch(rf"{e}-(?:{re.escape(precision)}-)?long-(\d+)\.json", p.name)
                if m:
                    long_[int(m.group(1))] = p
        out[e] = {"sweep": dict(sorted(sweep.items())), "long": dict(sorted(long_.items()))}
    if not any(f for e in out.values() for f in e.values()):
        raise NoLoadResults(
            f"no load-sweep results in {d}: expected {{tailored,vllm}}-{precision}-cC.json or "
            f"{{tailored,vllm}}-[{precision}-]long-N.json (lab/side_by_side.sh load|long)")
    return out


def _read(path: Path, concurrency: int | None) -> tuple[dict, dict]:
    """(header, the run at that concurrency or the file's only run)."""
    header, runs = load_runs(path)
    if concurrency is not None:
        for r in runs:
            if r.get("max_concurrency") == concurrency:
                return header, r
    if len(runs) != 1:
        raise ValueError(f"{path}: {len(runs)} runs and none at concurrency {concurrency}")
    return header, runs[0]


def _precision_of(checkpoint: dict | None) -> str | None:
    if not checkpoint:
        return None
    q = checkpoint.get("quantization_config") or {}
    return "fp8" if q.get("quant_method") == "fp8" else ("bf16" if not q else q.get("quant_method"))


SETTINGS = ("--max-model-len", "--max-num-seqs", "--max-num-batched-tokens",
            "--gpu-memory-utilization")


def server_settings(engine_config: dict | None) -> dict[str, str | None]:
    """The engine limits in the recorded server command (None where it has no command)."""
    cmd = (engine_config or {}).get("command") if isinstance(engine_config, dict) else None
    words = str(cmd).split() if cmd else []
    out: dict[str, str | None] = {}
    for flag in SETTINGS:
        val = None
        for i, w in enumerate(words):
            if w == flag and i + 1 < len(words):
                val = words[i + 1]  # the last one wins, as argparse does
            elif w.startswith(flag + "="):
                val = w.split("=", 1)[1]
        out[flag[2:].replace("-", "_")] = val
    return out


def condensed_manifest(header: dict) -> dict[str, Any]:
    """The facts of one result's manifest that a reader of the load section needs."""
    m = header.get("manifest") or {}
    gpu = m.get("gpu") or {}
    gpus = gpu.get("gpus") or []
    g0 = gpus[0] if gpus else {}
    server = m.get("server") or {}
    models = (server.get("models") or {}).get("data") or [{}]
    cfg = m.get("engine_config")
    ck = m.get("checkpoint")
    return {
        "commit": m.get("commit"),
        "gpu": g0.get("name"),
        "gpu_count": len(gpus) if gpus else None,
        "gpu_memory": g0.get("memory"),
        "driver": g0.get("driver"),
        "driver_cuda": gpu.get("driver_cuda"),
        "cuda": m.get("cuda"),
        "torch": m.get("torch"),
        "triton": m.get("triton"),
        "packages": m.get("packages"),
        "server_version": (server.get("version") or {}).get("version"),
        "served_model": models[0].get("id"),
        "owned_by": models[0].get("owned_by"),
        "checkpoint": None if not ck else {
            "path": ck.get("path"), "sha256": ck.get("sha256"),
            "quantization_config": ck.get("quantization_config")},
        "precision": _precision_of(ck),
        "engine_config": cfg,
        "switches": cfg.get("env_switches") if isinstance(cfg, dict) else None,
        "settings": server_settings(cfg),
        "platform": (m.get("host") or {}).get("platform"),
        "client": m.get("client"),
    }


def _max_model_len(header: dict) -> int | None:
    data = (((header.get("manifest") or {}).get("server") or {}).get("models") or {}).get("data")
    return (data or [{}])[0].get("max_model_len")


def _engine_manifest(headers: dict[str, list[dict]]) -> dict[str, Any] | None:
    """One engine's condensed manifest; keys that differ between its files are listed."""
    every = headers["sweep"] + headers["long"]
    if not every:
        return None
    cms = [condensed_manifest(h) for h in every]
    out = dict(cms[0])
    out["differs_between_points"] = sorted(
        k for k in out if any(json.dumps(c[k], sort_keys=True) != json.dumps(out[k],
                                                                             sort_keys=True)
                              for c in cms))
    out["max_model_len"] = {
        mode: sorted({v for h in headers[mode] if (v := _max_model_len(h)) is not None}) or None
        for mode in ("sweep", "long")}
    dates = sorted(h["manifest"]["date"] for h in every if (h.get("manifest") or {}).get("date"))
    out["dates"] = [dates[0], dates[-1]] if dates else None
    return out


def _card(gpu_name: str | None) -> str | None:
    if not gpu_name:
        return None
    for c in CARDS:
        if re.search(rf"\b{c}\b", gpu_name):
            return c
    return gpu_name


def _short_commit(commit: dict | None) -> str | None:
    if not commit or not commit.get("commit"):
        return None
    return commit["commit"][:7] + ("-dirty" if commit.get("dirty") else "")


def _pair(values: dict[str, Any]) -> dict[str, Any]:
    t, v = values.get("tailored"), values.get("vllm")
    return {"tailored": t, "vllm": v, "ratio": ratio(t, v)}


def assemble(results_dir: str | Path, *, precision: str = "fp8", card: str | None = None,
             commit: str | None = None, note: str | None = None) -> dict[str, Any]:
    """The `load` section from a folder of per-point results (NoLoadResults when it has none)."""
    files = find_files(results_dir, precision)
    headers: dict[str, dict[str, list[dict]]] = {e: {"sweep": [], "long": []} for e in ENGINES}
    sweep: dict[int, dict[str, tuple[Path, dict]]] = {}
    longs: dict[int, dict[str, tuple[Path, dict]]] = {}
    for e in ENGINES:
        for c, p in files[e]["sweep"].items():
            h, r = _read(p, c)
            headers[e]["sweep"].append(h)
            sweep.setdefault(c, {})[e] = (p, r)
        for n, p in files[e]["long"].items():
            h, r = _read(p, None)
            headers[e]["long"].append(h)
            longs.setdefault(n, {})[e] = (p, r)

    def point(label: str, value: int, by: dict, metrics) -> dict[str, Any]:
        """One point: both engines' prompt and failure counts, each metric as a pair with
        its ratio, the files it came from (by: engine -> (path, run))."""
        pt: dict[str, Any] = {label: value}
        pt["num_prompts"] = {e: by[e][1].get("num_prompts") if e in by else None for e in ENGINES}
        pt["failed"] = {e: by[e][1].get("failed") if e in by else None for e in ENGINES}
        for key, run_key in metrics:
            pt[key] = _pair({e: _num(by[e][1].get(run_key)) for e in by})
        pt["files"] = {e: by[e][0].name if e in by else None for e in ENGINES}
        return pt

    points = [point("concurrency", c, sweep[c], POINT_METRICS) for c in sorted(sweep)]
    long_points = [point("prompt_tokens", n, longs[n], LONG_METRICS) for n in sorted(longs)]

    manifests = {e: _engine_manifest(headers[e]) for e in ENGINES}
    first = next(m for m in (manifests["tailored"], manifests["vllm"]) if m)
    recorded = (manifests["tailored"] or {}).get("commit")
    workload = {}
    for mode in ("sweep", "long"):
        h = next((hs[mode][0] for hs in headers.values() if hs[mode]), None)
        wl = (h or {}).get("workload") or {}
        keys = [k for k in WORKLOAD_KEYS if not (mode == "long" and k == "input_len")]
        workload[mode] = {k: wl.get(k) for k in keys} if h else None
    return {
        "schema": SCHEMA,
        "card": card or _card(first["gpu"]),
        "card_source": "stated" if card else "manifest (gpu name)",
        "precision": precision,
        "commit": commit or _short_commit(recorded),
        "commit_source": "stated" if commit else "manifest (tailored runs)",
        "vllm_version": (manifests["vllm"] or {}).get("server_version"),
        "date": first["dates"][0][:10] if first["dates"] else None,
        "note": note,
        "ratio": "tailored / vllm (for TTFT, ITL and TPOT lower is better: < 1 is a win)",
        "results_dir": str(results_dir),  # `files` below are names in this folder
        "points": points,
        "long_prompts": long_points,
        "workload": workload,
        "manifest": manifests,
    }


def update_latest(path: str | Path, load: dict[str, Any]) -> Path:
    """Put `load` into the latest.json at `path`, keeping every other key it has."""
    return put_section(path, "load", load)


def load_section(path: str | Path) -> dict[str, Any]:
    """The load section of a latest.json (or a file that is one)."""
    return read_section(path, "load", SCHEMA, NoLoadResults, "tailored bench load")


def format_load(load: dict[str, Any]) -> str:
    def f(x, nd=0):
        return "—" if x is None else f"{x:,.{nd}f}"

    def r(x):
        return "—" if x is None else f"{x:.2f}×"

    head = (f"{load['card']}, {load['precision']}, tailored {load['commit']} vs vLLM "
            f"{load.get('vllm_version') or '?'} (ratio = tailored / vLLM)")
    cols = (f"{'c':>4} {'tok/s t':>9} {'tok/s v':>9} {'ratio':>6}  {'TTFT p50 t/v ms':>17} "
            f"{'TTFT p99 t/v':>15} {'ITL p50 t/v':>13} {'ITL p99 t/v':>13}")
    lines = [head, cols]
    for p in load["points"]:
        def tv(k, nd=0, p=p):
            return f"{f(p[k]['tailored'], nd)}/{f(p[k]['vllm'], nd)}"

        lines.append(f"{p['concurrency']:>4} {f(p['output_tok_s']['tailored']):>9} "
                     f"{f(p['output_tok_s']['vllm']):>9} {r(p['output_tok_s']['ratio']):>6}  "
                     f"{tv('ttft_p50_ms'):>17} {tv('ttft_p99_ms'):>15} "
                     f"{tv('itl_p50_ms', 1):>13} {tv('itl_p99_ms'):>13}")
    for lp in load["long_prompts"]:
        t = lp["ttft_p50_ms"]
        lines.append(f"one prompt of {lp['prompt_tokens']:,} tokens: TTFT {f(t['tailored'])} / "
                     f"{f(t['vllm'])} ms, ratio {r(t['ratio'])}")
    return "\n".join(lines)
