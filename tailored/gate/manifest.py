"""What a gate report (or a golden file) was produced from: code, libraries, device, inputs.

checkpoint sha256: over config.json, model.safetensors.index.json (when present) and each
shard's safetensors header (8-byte length + JSON: names, dtypes, shapes, offsets), shards in
name order. It identifies the layout in milliseconds even for 67 GB, but not the values: two
synthetic seeds share it. `data_sample_sha256` adds 16 evenly spaced 4 KiB samples of each
shard's data, enough to tell seeds (or a re-quantization) apart; neither is an integrity check.
"""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from tailored import flags

REPO = Path(__file__).resolve().parents[2]


def git_commit() -> dict:
    """{'commit': sha or None, 'dirty': bool or None}; the `commit` switch (TAILORED_COMMIT)
    wins (CI, GPU copy)."""
    env = flags.current().commit
    if env:
        return {"commit": env, "dirty": None, "from": "TAILORED_COMMIT"}
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                             text=True, timeout=10, check=True).stdout.strip()
        st = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                            capture_output=True, text=True, timeout=10, check=True).stdout
        return {"commit": sha, "dirty": bool(st.strip()), "from": "git"}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None, "from": "unavailable"}


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"cpu: {line.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
    except OSError:
        pass
    return f"cpu: {platform.processor() or platform.machine()} ({os.cpu_count()} cores)"


def _safetensors_header(path: Path) -> bytes:
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return n.to_bytes(8, "little") + f.read(n)


def checkpoint_hashes(ckpt: Path) -> dict:
    ckpt = Path(ckpt)
    h, sample = hashlib.sha256(), hashlib.sha256()
    for name in ("config.json", "model.safetensors.index.json"):
        if (ckpt / name).is_file():
            h.update(name.encode() + b"\0" + (ckpt / name).read_bytes())
    shards = sorted(ckpt.glob("*.safetensors"))
    for shard in shards:
        head = _safetensors_header(shard)
        h.update(shard.name.encode() + b"\0" + head)
        size = shard.stat().st_size
        with open(shard, "rb") as f:
            for i in range(16):
                f.seek(len(head) + (size - len(head)) * i // 16)
                sample.update(f.read(4096))
    return {"path": str(ckpt), "sha256": h.hexdigest(), "shards": len(shards),
            "data_sample_sha256": sample.hexdigest() if shards else None}


def _rel(path: Path) -> str:
    """Repo-relative path when inside the repo (reports and goldens stay machine-independent)."""
    p = Path(path).resolve()
    return str(p.relative_to(REPO)) if p.is_relative_to(REPO) else str(p)


def versions() -> dict:
    try:
        import transformers

        tv = transformers.__version__
    except ImportError:
        tv = None
    return {"python": sys.version.split()[0], "torch": torch.__version__, "transformers": tv,
            "cuda": torch.version.cuda}


def script_manifest(workload: dict) -> dict:
    """The manifest of an in-process bench script's JSON (lab/bench_*.py): its workload
    (the parsed arguments), commit, device and versions."""
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return {"workload": workload, **git_commit(), "device": device_name(dev), **versions()}


def manifest(*, device: torch.device, dtype: str, checkpoint: Path | None, load_format: str,
             seed: int, prompts_path: Path, prompts_sha256: str, prompt_ids_sha256: str,
             extra: dict | None = None) -> dict:
    ck = checkpoint_hashes(checkpoint) if checkpoint is not None else None
    if ck is not None and load_format == "dummy":
        ck.update(sha256=None, data_sample_sha256=None, dummy_seed=seed)  # weights never read
    return {
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **git_commit(),
        **versions(),
        "device": device_name(device),
        "dtype": dtype,
        "checkpoint": ck,
        "load_format": load_format,
        "prompt_set": {"path": _rel(prompts_path), "sha256": prompts_sha256,
                       "ids_sha256": prompt_ids_sha256},
        **(extra or {}),
    }
