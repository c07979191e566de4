"""Autotuned launch configs saved per GPU, so a server start does not re-tune (kb/0020).

Every autotuned launcher (`fp8_linear`, the MoE expert GEMMs) tunes each new
key (shape, row bucket, dtypes) the first time it sees it, at warm-up before graph capture. With
FP8 weights that is ~500 benchmarks over ~200 compiles: the FP8 server took 4 min 16 s to
capture its decode graphs on a fresh H200, past the side-by-side script's timeout.

Here launchers `register` their Triton autotuner under a name; a table of the choices (JSON:
name → [{key, kwargs, num_warps, num_stages}]) pre-fills each autotuner's cache, so known keys
launch at once and only unknown keys benchmark. Entries apply only on the GPU model they were
measured on and only when the config is still one of the launcher's candidates (a stale table
falls back to tuning, never to a config the kernel no longer offers).

  TAILORED_TUNING=PATH    table to load (default: the one of tailored/kernels/tuned*.json
                          measured on this GPU model, e.g. tuned.json (H200) beside
                          tuned-h100.json; "off" loads none)
  TAILORED_TUNING_DUMP=PATH   after warm-up (stack.build_stack), write every choice made so far

Source: Triton's `Autotuner.cache` (triton/runtime/autotuner.py, 3.6), a dict from the key tuple
(values of `key` args, then str(dtype) of each tensor argument) to the chosen `triton.Config`.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from tailored import flags

log = logging.getLogger("tailored.tuning")

DEFAULT_TABLE = Path(__file__).with_name("tuned.json")
_REGISTRY: dict = {}  # name -> triton Autotuner
_TABLE: dict | None = None


def _device_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def _config_id(kwargs: dict, num_warps: int, num_stages: int) -> tuple:
    return tuple(sorted(kwargs.items())), int(num_warps), int(num_stages)


def shipped_table(gpu: str, directory: Path = DEFAULT_TABLE.parent) -> Path:
    """The shipped table measured on `gpu` (a `torch.cuda.get_device_name()`): the first of
    directory's tuned*.json (sorted) whose "gpu" is that name, else tuned.json (whose GPU
    check then says which GPU it is for). One file per GPU model, so a dump from another card
    is added beside the others, never over them."""
    for path in sorted(directory.glob("tuned*.json")):
        try:
            if json.loads(path.read_text()).get("gpu") == gpu:
                return path
        except (OSError, ValueError, AttributeError):
            continue
    return directory / DEFAULT_TABLE.name


def _load_table() -> dict:
    """The table for this GPU: {name: [entry]}; {} when off, absent, unreadable or measured on
    another GPU model."""
    global _TABLE
    if _TABLE is not None:
        return _TABLE
    env = flags.current().tuning
    path = None if env == "off" else Path(env) if env else (
        shipped_table(_device_name()) if _device_name() != "cpu" else DEFAULT_TABLE)
    _TABLE = {}
    if path is None or not path.is_file():
        if env and env != "off":
            log.warning("TAILORED_TUNING=%s: no such file; tuning at warm-up", env)
        return _TABLE
    try:
        raw = json.loads(path.read_text())
        gpu = raw["gpu"]
        tables = raw["launchers"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("tuning table %s unreadable (%s); tuning at warm-up", path, e)
        return _TABLE
    if gpu != _device_name():
        log.info("tuning table %s is for %s, this is %s: tuning at warm-up", path, gpu,
                 _device_name())
        return _TABLE
    _TABLE = tables
    return _TABLE


def register(name: str, tuner):
    """Record a Triton autotuner under `name` and pre-fill its cache from the table. Returns
    the tuner (so a launcher can `return register(name, triton.autotune(...)(kernel))`)."""
    import triton

    _REGISTRY[name] = tuner
    entries = _load_table().get(name, [])
    offered = {_config_id(c.kwargs, c.num_warps, c.num_stages) for c in tuner.configs}
    used = 0
    for ent in entries:
        try:
            cid = _config_id(ent["kwargs"], ent["num_warps"], ent["num_stages"])
            key = tuple(ent["key"])
        except (KeyError, TypeError, AttributeError):
            continue
        if cid in offered:
            tuner.cache[key] = triton.Config(dict(ent["kwargs"]), num_warps=ent["num_warps"],
                                             num_stages=ent["num_stages"])
            used += 1
    if entries:
        log.info("tuning table: %d of %d %s configs apply", used, len(entries), name)
    return tuner


def table() -> dict:
    """Every registered autotuner's choices so far, in the table format (see module doc)."""
    out = {}
    for name, tuner in sorted(_REGISTRY.items()):
        rows = []
        for key, cfg in tuner.cache.items():
            rows.append({"key": list(key), "kwargs": dict(cfg.kwargs),
                         "num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
        if rows:
            out[name] = sorted(rows, key=lambda r: json.dumps(r["key"]))
    return out


def dump(path: str | os.PathLike, manifest: dict | None = None) -> int:
    """Write `table()` with the GPU name (and a manifest) to path; returns the entry count.
    An existing table of the same GPU at path is merged (this process's choices win per key,
    its manifest's fields too; the old manifest's other fields stay), so a bf16 and an FP8
    server start can fill one file."""
    import triton

    tabs = table()
    man = dict(manifest or {})
    try:
        old = json.loads(Path(path).read_text())
        if old.get("gpu") == _device_name():
            # keep the old table's provenance (its source, hand edits) beside this start's
            man = {**old.get("manifest", {}), **man}
            for name, rows in old.get("launchers", {}).items():
                mine = {json.dumps(r["key"]) for r in tabs.get(name, [])}
                keep = [r for r in rows if json.dumps(r["key"]) not in mine]
                tabs[name] = sorted(keep + tabs.get(name, []), key=lambda r: json.dumps(r["key"]))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass  # no table there yet (or not one of ours): write a fresh one
    doc = {"gpu": _device_name(), "triton": triton.__version__, "manifest": man,
           "launchers": tabs}
    Path(path).write_text(json.dumps(doc, indent=1) + "\n")
    return sum(len(v) for v in tabs.values())


def dump_if_requested(manifest: dict | None = None) -> None:
    """The `tuning_dump` switch (TAILORED_TUNING_DUMP=PATH): write the table there (called
    once warm-up is done)."""
    path = flags.current().tuning_dump
    if path:
        n = dump(path, manifest)
        log.info("wrote %d tuned launch configs to %s", n, path)
