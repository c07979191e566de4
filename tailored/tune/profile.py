"""Profiles: the configuration `tailored tune` chose, as YAML, and how `tailored serve
--profile FILE` applies it.

    schema: tailored-profile/1
    name: coding-assistant-h200
    sha256: ...                  # over what the profile applies and where it may (below)
    checkpoint: {path: ..., sha256: ...}   # bench's checkpoint fingerprint (results.py)
    precision: fp8
    gpu: H200                    # or cpu
    engine: {max_num_seqs: 4, max_num_batched_tokens: 4096, ...}   # serve options
    switches: {TAILORED_MOE_GEMV_UP_TO: 4}
    contract: {name: ..., sha256: ...}
    measured: {...}              # the chosen trial's metrics, and the defaults'

Applying: each engine option the command line does not give explicitly takes the profile's
value (explicit options win), each switch the environment does not set takes the profile's
(the environment wins). A profile made for another checkpoint (fingerprint), precision or GPU
kind is refused: `ProfileMismatch`, one line naming both sides.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

SCHEMA = "tailored-profile/1"
HASHED = ("engine", "switches", "checkpoint", "precision", "gpu")


class ProfileError(ValueError):
    """An unreadable or malformed profile."""


class ProfileMismatch(ProfileError):
    """A profile made for another checkpoint, precision or GPU kind."""


def profile_hash(p: dict) -> str:
    body = {k: p.get(k) for k in HASHED}
    body["checkpoint"] = (body["checkpoint"] or {}).get("sha256")
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()


def make_profile(name: str, *, engine: dict, switches: dict, checkpoint: dict, precision: str,
                 gpu: str, contract: dict | None = None, measured: dict | None = None) -> dict:
    p = {"schema": SCHEMA, "name": name, "checkpoint": {"path": checkpoint.get("path"),
                                                         "sha256": checkpoint["sha256"]},
         "precision": precision, "gpu": gpu,
         "engine": {k: v for k, v in engine.items() if v is not None},
         "switches": dict(switches), "contract": contract or {}, "measured": measured or {}}
    p["sha256"] = profile_hash(p)
    return p


def write_profile(path: str | Path, p: dict) -> Path:
    import yaml

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(p, sort_keys=False))
    return path


def load_profile(path: str | Path) -> dict:
    try:
        import yaml
    except ImportError:  # pragma: no cover - PyYAML is in the `tune` extra
        raise ProfileError("--profile needs PyYAML: pip install 'tailored[tune]'") from None
    p = Path(path)
    if not p.is_file():
        raise ProfileError(f"--profile {p}: no such file")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise ProfileError(f"--profile {p}: not valid YAML: {e}") from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise ProfileError(f"--profile {p}: not a {SCHEMA} file (written by `tailored tune`)")
    for k, kind in (("name", str), ("checkpoint", dict), ("precision", str), ("gpu", str),
                    ("engine", dict), ("switches", dict)):
        if k not in data:
            raise ProfileError(f"--profile {p}: field {k!r} missing")
        if not isinstance(data[k], kind):  # a hand edit that recomputed the hash
            raise ProfileError(f"--profile {p}: field {k!r} must be a "
                               f"{'mapping' if kind is dict else 'string'}, got "
                               f"{type(data[k]).__name__}")
    bad_types = sorted(k for k, v in data["engine"].items()
                       if v is not None and not isinstance(v, (bool, int, float, str)))
    if bad_types:
        raise ProfileError(f"--profile {p}: engine option(s) {', '.join(bad_types)} must be "
                           "single values")
    if data.get("sha256") != profile_hash(data):
        raise ProfileError(f"--profile {p}: its sha256 does not match its contents (edited by "
                           "hand?): rerun `tailored tune`, or give the options you want "
                           "beside the profile on the command line")
    import dataclasses

    from tailored import flags

    bad = sorted(k for k in data["switches"]
                 if k not in {f.metadata["env"] for f in dataclasses.fields(flags.Flags)})
    if bad:
        raise ProfileError(f"--profile {p}: unknown switch(es) {', '.join(bad)}")
    data["file"] = str(p.resolve())
    return data


def gpu_kind(device: str) -> str:
    """'cpu', or the CUDA device's name (e.g. 'NVIDIA H200')."""
    if not str(device).startswith("cuda"):
        return "cpu"
    import torch

    return torch.cuda.get_device_name(torch.device(device))


def same_gpu(wanted: str, have: str) -> bool:
    w, h = wanted.strip().lower(), have.strip().lower()
    if w == "cpu" or h == "cpu":
        return w == h
    return w in h  # 'H200' matches 'NVIDIA H200'


def check_profile(p: dict, *, checkpoint_dir: Path, precision: str, device_name: str) -> None:
    """Raises ProfileMismatch when `p` was made for another checkpoint, precision or GPU."""
    from tailored.bench.results import checkpoint_fingerprint

    fp = checkpoint_fingerprint(checkpoint_dir)["sha256"]
    if fp != p["checkpoint"].get("sha256"):
        raise ProfileMismatch(
            f"profile {p['name']!r} was made for checkpoint {p['checkpoint'].get('path')} "
            f"(sha256 {str(p['checkpoint'].get('sha256'))[:12]}), this is {checkpoint_dir} "
            f"(sha256 {fp[:12]}): run `tailored tune` for this checkpoint")
    if p["precision"] != precision:
        raise ProfileMismatch(f"profile {p['name']!r} was made for {p['precision']} weights, "
                              f"this checkpoint is {precision}")
    if not same_gpu(p["gpu"], device_name):
        raise ProfileMismatch(f"profile {p['name']!r} was made for GPU kind {p['gpu']!r}, this "
                              f"server runs on {device_name!r}: tune again on this machine")


def explicit_options(parser, argv: list[str]) -> set[str]:
    """The dests `argv` sets explicitly (parsed again with every default a sentinel)."""
    import argparse
    import copy

    p = copy.deepcopy(parser)
    sentinel = object()
    for a in p._actions:
        if a.dest not in ("help",) and not isinstance(a, argparse._HelpAction):
            a.default = sentinel
    ns, _ = p.parse_known_args(argv)
    return {k for k, v in vars(ns).items() if v is not sentinel}


def apply_to_args(args, p: dict, explicit: set[str],
                  types: dict[str, Any] | None = None) -> dict[str, Any]:
    """Set the profile's engine options on `args` where not explicit; returns {applied},
    and stores the kept ones on p['kept']. types: the serve options' argparse types, so a
    number option never takes a string (or a bool) from a profile."""
    applied, kept = {}, {}
    for k, v in p["engine"].items():
        if not hasattr(args, k):
            raise ProfileError(f"profile {p['name']!r}: engine option {k!r} is not a `tailored "
                               "serve` option")
        if k in explicit:
            kept[k] = getattr(args, k)
            continue
        if k == "prefill_graphs" and isinstance(v, bool):
            v = "on" if v else "off"
        if (types or {}).get(k) in (int, float) and v is not None and (
                isinstance(v, bool) or not isinstance(v, (int, float))):
            raise ProfileError(f"profile {p['name']!r}: engine option {k!r} is "
                               f"{type(v).__name__} {v!r}, the option takes a number")
        have = getattr(args, k)  # the option's default: a value of the type it parses to
        if (have is not None and v is not None and type(v) is not type(have)
                and not (isinstance(have, float) and type(v) is int)):
            raise ProfileError(f"profile {p['name']!r}: engine option {k!r} is "
                               f"{type(v).__name__} {v!r}, the option takes a "
                               f"{type(have).__name__}")
        setattr(args, k, v)
        applied[k] = v
    p["kept"] = kept
    return applied


def switches_with(p: dict, switches, set_in_env: frozenset[str]) -> Any:
    """The Flags record with the profile's switches but those the environment sets
    (`flags.set_in_env()`)."""
    import dataclasses

    by_env = {f.metadata["env"]: f.name for f in dataclasses.fields(switches)}
    changes = {by_env[k]: v for k, v in p["switches"].items() if k not in set_in_env}
    return switches.replace(**changes) if changes else switches


def summary(p: dict | None) -> dict | None:
    """What /version, /metrics and manifests carry."""
    if not p:
        return None
    return {"name": p["name"], "sha256": p["sha256"], "file": p.get("file"),
            "engine": p["engine"], "switches": p["switches"]}
