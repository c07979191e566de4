"""Result files: manifest + workload + runs as JSON, and the `--compare` ratio table.

File layout (schema "tailored-bench/1"):

    {"schema": "tailored-bench/1", "label": ..., "date": ISO-8601 UTC,
     "manifest": {commit, gpu, driver, cuda, torch, triton, vllm, checkpoint, engine_config,
                  server, client, host, ...},
     "workload": {...every Workload field...},
     "runs": [{"max_concurrency": 1, "output_throughput": ..., "p50_ttft_ms": ..., ...}, ...]}

Run keys follow `vllm bench serve` (output_throughput, request_throughput, {mean,median,std,p50,
p90,p99}_{ttft,tpot,itl,e2el}_ms, completed, failed, duration, ...), so `load_runs` also reads the
baseline kit's raw vLLM JSONs (one run each) and `--compare` works across both clients.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import platform
import socket
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

from tailored import flags

SCHEMA = "tailored-bench/1"
REPO_ROOT = Path(__file__).resolve().parents[2]

# (key, label, higher is better)
COMPARE_ROWS: list[tuple[str, str, bool]] = [
    ("output_throughput", "output tok/s", True),
    ("request_throughput", "requests/s", True),
    ("mean_ttft_ms", "TTFT mean ms", False),
    ("p50_ttft_ms", "TTFT p50 ms", False),
    ("p90_ttft_ms", "TTFT p90 ms", False),
    ("p99_ttft_ms", "TTFT p99 ms", False),
    ("mean_tpot_ms", "TPOT mean ms", False),
    ("p50_tpot_ms", "TPOT p50 ms", False),
    ("p90_tpot_ms", "TPOT p90 ms", False),
    ("p99_tpot_ms", "TPOT p99 ms", False),
    ("p50_itl_ms", "ITL p50 ms", False),
    ("p90_itl_ms", "ITL p90 ms", False),
    ("p99_itl_ms", "ITL p99 ms", False),
    ("p50_e2el_ms", "E2E p50 ms", False),
    ("p99_e2el_ms", "E2E p99 ms", False),
]


# ---------------------------------------------------------------------------------------------
# manifest
# ---------------------------------------------------------------------------------------------
def _run(cmd: list[str], cwd: Path | None = None, timeout: float = 10.0) -> str | None:
    try:
        p = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            cwd=cwd,
            timeout=timeout,
            check=False,
            env={**os.environ, "GIT_OPTIONAL_LOCKS": "0"},
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return p.stdout.strip() if p.returncode == 0 else None


def git_commit() -> dict[str, Any]:
    """The `commit` switch (TAILORED_COMMIT) wins (trees copied without .git); else `git
    rev-parse HEAD` (read-only)."""
    env = flags.current().commit
    if env:
        return {"commit": env, "source": "TAILORED_COMMIT"}
    head = _run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT)
    if not head:
        return {"commit": None, "source": "unknown (no git and no TAILORED_COMMIT)"}
    dirty = _run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT)
    return {"commit": head, "source": "git", "dirty": bool(dirty)}


def gpu_info() -> dict[str, Any] | None:
    """nvidia-smi facts when the tool is there (name, driver, memory, CUDA version of the driver)."""
    q = _run(
        [
            "nvidia-smi",
            "--query-gpu=name,driver_version,memory.total,pci.bus_id",
            "--format=csv,noheader",
        ]
    )
    if not q:
        return None
    gpus = []
    for line in q.splitlines():
        parts = [s.strip() for s in line.split(",")]
        if len(parts) >= 3:
            gpus.append(
                {
                    "name": parts[0],
                    "driver": parts[1],
                    "memory": parts[2],
                    "bus_id": parts[3] if len(parts) > 3 else None,
                }
            )
    cuda = None
    head = _run(["nvidia-smi"]) or ""
    if "CUDA Version:" in head:
        cuda = head.split("CUDA Version:")[1].split()[0].strip("|").strip()
    return {"gpus": gpus, "driver_cuda": cuda}


def package_versions(
    names=(
        "torch",
        "triton",
        "vllm",
        "transformers",
        "httpx",
        "tailored",
        "flash-linear-attention",
        "fla-core",
        "uvloop",
    ),
) -> dict[str, str]:
    """Installed distribution versions (no import: torch's version string carries +cuXXX)."""
    out = {}
    for n in names:
        try:
            out[n] = metadata.version(n)
        except metadata.PackageNotFoundError:
            continue
    return out


def torch_cuda() -> str | None:
    try:
        import torch  # only for its CUDA build string
    except ImportError:  # pragma: no cover
        return None
    return getattr(torch.version, "cuda", None)


def checkpoint_fingerprint(path: str | Path, full_limit: int = 256 * 1024**2) -> dict[str, Any]:
    """sha256 over (relative name, size, content) of every file of a checkpoint dir.

    Files up to `full_limit` bytes are hashed whole; larger ones (weight shards) by size plus
    their first and last MiB, so a 67 GB checkpoint is fingerprinted in seconds.
    """
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"checkpoint dir {root} does not exist")
    h = hashlib.sha256()
    files = sorted(p for p in root.rglob("*") if p.is_file())
    sampled = 0
    for p in files:
        rel = p.relative_to(root).as_posix()
        size = p.stat().st_size
        h.update(f"{rel}\0{size}\0".encode())
        with open(p, "rb") as f:
            if size <= full_limit:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
            else:
                sampled += 1
                h.update(f.read(1 << 20))
                f.seek(size - (1 << 20))
                h.update(f.read(1 << 20))
    cfg = root / "config.json"
    quant = None
    if cfg.is_file():
        try:
            c = json.loads(cfg.read_text())
            quant = c.get("quantization_config") or (c.get("text_config") or {}).get(
                "quantization_config"
            )
        except json.JSONDecodeError:
            pass
    return {
        "path": str(root.resolve()),
        "sha256": h.hexdigest(),
        "files": len(files),
        "bytes": sum(p.stat().st_size for p in files),
        "sampled_files": sampled,
        "method": f"sha256(name, size, content); files > {full_limit} B: first+last MiB",
        "quantization_config": quant,
    }


def server_info(base_url: str, timeout: float = 5.0) -> dict[str, Any]:
    """What the server says about itself: /v1/models and (vLLM) /version."""
    import httpx

    from tailored.bench.loadgen import api_root

    root = api_root(base_url)
    out: dict[str, Any] = {"base_url": root}
    with httpx.Client(timeout=timeout, trust_env=False) as c:
        for key, path in (("models", "/v1/models"), ("version", "/version")):
            try:
                r = c.get(root + path)
                if r.status_code == 200:
                    out[key] = r.json()
            except (httpx.HTTPError, ValueError):
                pass
    return out


def build_manifest(
    *,
    base_url: str | None = None,
    checkpoint_dir: str | None = None,
    engine_config: dict | None = None,
    server_label: str | None = None,
    extra: dict | None = None,
) -> dict[str, Any]:
    pk = package_versions()
    m: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "gpu": gpu_info(),
        "packages": pk,
        "torch": pk.get("torch"),
        "triton": pk.get("triton"),
        "cuda": torch_cuda() if "torch" in pk else None,
        "host": {
            "hostname": socket.gethostname(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
        },
        "client": {
            "name": "tailored bench",
            "version": pk.get("tailored", "unknown"),
            "httpx": pk.get("httpx"),
            "python": platform.python_version(),
        },
        "server_label": server_label,
        "engine_config": engine_config,
        "checkpoint": checkpoint_fingerprint(checkpoint_dir) if checkpoint_dir else None,
    }
    if base_url:
        m["server"] = server_info(base_url)
    if extra:
        m.update(extra)
    return m


# ---------------------------------------------------------------------------------------------
# files
# ---------------------------------------------------------------------------------------------
def make_result(label: str | None, manifest: dict, workload: dict, runs: list[dict]) -> dict:
    return {
        "schema": SCHEMA,
        "label": label,
        "date": manifest.get("date"),
        "manifest": manifest,
        "workload": workload,
        "runs": runs,
    }


def _json_default(o):
    if isinstance(o, float):  # pragma: no cover - floats serialise natively
        return o
    if isinstance(o, (set, tuple)):
        return list(o)
    return str(o)


def write_result(path: str | Path, result: dict) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(result, indent=1, default=_json_default, allow_nan=True) + "\n")
    return p


def write_latest(path: str | Path, data: dict,
                 keep: tuple[str, ...] = ("load", "peers")) -> Path:
    """Write `bench/results/latest.json`; sections named in `keep` that the file has and `data`
    lacks stay (the side by side's summary drops neither the load sweep's nor the peers')."""
    p = Path(path)
    out = dict(data)
    if keep and p.is_file():
        try:
            old = json.loads(p.read_text())
        except json.JSONDecodeError:
            old = {}
        out.update({k: old[k] for k in keep if k in old and k not in out})
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(out, indent=1) + "\n")
    return p


def put_section(path: str | Path, name: str, section: dict[str, Any]) -> Path:
    """Put `section` under `name` into the latest.json at `path`, keeping every other key it
    has (the load sweep's `load`, the peers run's `peers`)."""
    p = Path(path)
    old = json.loads(p.read_text()) if p.is_file() else {}
    return write_latest(p, {**old, name: section}, keep=())


def read_section(path: str | Path, name: str, schema: str, missing: type[Exception],
                 command: str) -> dict[str, Any]:
    """The `name` section of a latest.json at `path`, or the file itself when it is one (its
    "schema" is `schema`); `missing` (naming `command`, which writes it) when it has none."""
    d = json.loads(Path(path).read_text())
    if d.get("schema") == schema:
        return d
    if name not in d:
        raise missing(f"{path} has no `{name}` section ({command} --latest ...)")
    return d[name]


def load_runs(path: str | Path) -> tuple[dict, list[dict]]:
    """(header, runs) from a tailored result or a raw `vllm bench serve` JSON (one run)."""
    d = json.loads(Path(path).read_text())
    if d.get("schema", "").startswith("tailored-bench/"):
        return d, list(d["runs"])
    if "output_throughput" in d and "max_concurrency" in d:  # vllm bench serve --save-result
        header = {
            "label": d.get("label"),
            "client": "vllm bench serve",
            "workload": {k: d.get(k) for k in ("num_prompts", "request_rate", "model_id")},
        }
        return header, [d]
    raise ValueError(f"{path}: neither a tailored bench result nor a vllm bench serve JSON")


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    try:
        return a / b
    except TypeError:
        return None


def compare(a_path: str | Path, b_path: str | Path) -> list[dict[str, Any]]:
    """Rows (concurrency, metric, A, B, A/B, A better?) for runs present in both files.

    a_better: True/False when A is strictly better/worse on that metric, None on a tie."""
    _, a_runs = load_runs(a_path)
    _, b_runs = load_runs(b_path)
    b_by_c = {r.get("max_concurrency"): r for r in b_runs}
    rows = []
    for ra in a_runs:
        c = ra.get("max_concurrency")
        rb = b_by_c.get(c)
        if rb is None:
            continue
        for key, label, higher in COMPARE_ROWS:
            va, vb = ra.get(key), rb.get(key)
            if va is None or vb is None:
                continue
            r = ratio(va, vb)
            rows.append(
                {
                    "concurrency": c,
                    "key": key,
                    "metric": label,
                    "a": va,
                    "b": vb,
                    "ratio": r,
                    "a_better": None if r is None or r == 1 else (r > 1) == higher,
                }
            )
    return rows


def format_compare(a_path: str | Path, b_path: str | Path) -> str:
    rows = compare(a_path, b_path)
    if not rows:
        return f"no common concurrency levels between {a_path} and {b_path}"
    out = [
        f"A = {a_path}",
        f"B = {b_path}",
        "",
        f"{'conc':>4}  {'metric':<14} {'A':>12} {'B':>12} {'A/B':>8}",
    ]
    last_c = None
    for r in rows:
        if last_c is not None and r["concurrency"] != last_c:
            out.append("")
        last_c = r["concurrency"]
        rr = "n/a" if r["ratio"] is None else f"{r['ratio']:.3f}"
        mark = "" if r["a_better"] is None else ("  A better" if r["a_better"] else "")
        out.append(
            f"{r['concurrency']:>4}  {r['metric']:<14} {r['a']:>12.2f} {r['b']:>12.2f} "
            f"{rr:>8}{mark}"
        )
    return "\n".join(out)
