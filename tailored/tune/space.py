"""The configuration space `tailored tune` searches, and what each point may change.

A candidate is a flat dict: `tailored serve` option names (dests: max_num_seqs, ...) and
`TAILORED_*` switch names. `Space.suggest(trial)` draws one through optuna's define-by-run
API (spec_max_running exists only when drafting is on); `serve_args` / `switch_env` turn it
into a command line and an environment.

Numerics. An engine option changes the output bits only if an invariant of the engine does
not cover it: the token budget (chunked == single-pass prefill), the running-request limit
(a mixed step leaves other slots bit-identical), drafting (greedy with drafts == without),
the prefix cache (a hit decodes as its cold run) and CUDA graphs (replay == eager bitwise) are
covered; the GDN state's storage dtype is not. A switch carries its own `numerics` mark
(tailored/flags.py, docs/switches.md). `numerics_changes` lists a candidate's uncovered
changes; measure.py also checks the covered ones against the defaults' greedy outputs and
treats a candidate whose outputs differ as numerics-changing.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from tailored import flags

# options whose effect on the output an invariant covers (docs/architecture.md#invariants)
COVERED = {
    "max_num_batched_tokens": "chunked-prefill-equals-single-pass",
    "max_num_seqs": "mixed-step-isolation",
    "num_speculative_tokens": "spec-greedy-equals-plain",
    "spec_max_running": "spec-greedy-equals-plain",
    "prefix_cache_entries": "prefix-cache-hit-equals-cold",
    "prefill_graphs": "graph-replay-equals-eager",
    "enforce_eager": "graph-replay-equals-eager",
    # the step budget only sizes prompt chunks (kb/0063)
    "prefill_stall_factor": "chunked-prefill-equals-single-pass",
}
OPTIONS = ("max_num_batched_tokens", "max_num_seqs", "num_speculative_tokens",
           "spec_max_running", "prefix_cache_entries", "prefill_graphs", "enforce_eager",
           "gdn_state_dtype", "prefill_stall_factor")


def _pow2(lo: int, hi: int) -> list[int]:
    out, v = [], 1
    while v <= hi:
        if v >= lo:
            out.append(v)
        v *= 2
    return out


@dataclass(frozen=True)
class Target:
    """What the space depends on besides the contract: device and checkpoint."""

    on_gpu: bool
    has_mtp: bool
    model_dtype: str  # the compute dtype: bfloat16 on a GPU, float32 on the CPU


@dataclass
class Space:
    choices: dict[str, list] = field(default_factory=dict)  # option or switch -> values
    defaults: dict[str, Any] = field(default_factory=dict)  # what `tailored serve` would run
    fixed: dict[str, Any] = field(default_factory=dict)  # pinned by the contract / the target
    target: Target | None = None

    def suggest(self, trial) -> dict[str, Any]:
        cand = dict(self.defaults)
        cand.update(self.fixed)
        for name, values in self.choices.items():
            if name == "spec_max_running" and not cand.get("num_speculative_tokens"):
                continue
            if name == "spec_max_running":  # at most max_num_seqs: draw from those that fit
                values = [v for v in values if v <= cand["max_num_seqs"]] or [1]
                cand[name] = trial.suggest_categorical(
                    f"{name}@{cand['max_num_seqs']}", values)
                continue
            cand[name] = trial.suggest_categorical(name, values)
        return normalize(cand)

    def describe(self) -> dict:
        return {"choices": self.choices, "defaults": self.defaults, "fixed": self.fixed,
                "target": dataclasses.asdict(self.target) if self.target else None}


def normalize(cand: dict[str, Any]) -> dict[str, Any]:
    out = dict(cand)
    if not out.get("num_speculative_tokens"):
        out["num_speculative_tokens"] = 0
        out["spec_max_running"] = None
    elif out.get("spec_max_running") is None:
        out["spec_max_running"] = min(8, out["max_num_seqs"])
    return out


def serve_defaults(target: Target) -> dict[str, Any]:
    """The options `tailored serve` runs with when none is given (cli.cmd_serve)."""
    return {"max_num_batched_tokens": 8192 if target.on_gpu else 2048,
            "max_num_seqs": 64 if target.on_gpu else 16, "num_speculative_tokens": 0,
            "spec_max_running": None, "prefix_cache_entries": 0, "prefill_graphs": "auto",
            "enforce_eager": False, "gdn_state_dtype": "auto", "prefill_stall_factor": 0.0}


def tunable_switches() -> dict[str, dataclasses.Field]:
    return {f.metadata["env"]: f for f in dataclasses.fields(flags.Flags) if f.metadata["tune"]}


def switch_values(f: dataclasses.Field) -> list:
    m = f.metadata
    if f.type in ("bool", bool):
        return [True, False] if f.default else [False, True]
    if f.type in ("int", int):
        vals = {f.default, f.default // 2, f.default * 2} | ({0} if m["lo"] == 0 else set())
        if f.default == 0:  # off by default: try it on at a middling size
            vals.add(min(m["hi"], 2048))
        ok = [v for v in vals if m["lo"] <= v <= m["hi"]
              and not (m["power_of_2"] and v & (v - 1))]
        return [f.default] + sorted(v for v in ok if v != f.default)
    return list(m["choices"] or [f.default])


def build_space(contract, target: Target) -> Space:
    t = contract.traffic
    conc = t.concurrency or 64  # an open loop: up to what the engine runs
    seqs_hi = 256 if target.on_gpu else 64
    choices: dict[str, list] = {
        "max_num_batched_tokens": [2048, 4096, 8192, 16384, 32768] if target.on_gpu
        else [256, 512, 1024, 2048, 4096],
        "max_num_seqs": _pow2(max(1, conc // 4), min(seqs_hi, max(8, 2 * conc))),
        "gdn_state_dtype": ["auto", "float32", "bfloat16"],
    }
    if target.has_mtp:
        choices["num_speculative_tokens"] = [0, 1, 2, 3]
        choices["spec_max_running"] = [1, 2, 4, 8, 16, 32]
    if t.has_shared_prefix:
        choices["prefix_cache_entries"] = [0, 8, 16, 32, 64] if target.on_gpu else [0, 4, 16]
    if target.on_gpu:
        choices["prefill_graphs"] = ["auto", "off"]
        choices["enforce_eager"] = [False, True]
        # the step budget acts where requests decode while prompts arrive (kb/0063: c >= ~32
        # on an H100); 0 = off, today's default
        if conc >= 16:
            choices["prefill_stall_factor"] = [0.0, 2.0, 2.5, 3.0]
    s = contract.search
    if s.options is not None:
        unknown = sorted(set(s.options) - set(OPTIONS))
        if unknown:
            raise ValueError(f"search.options: unknown option(s) {', '.join(unknown)}; fix: "
                             f"choose among {', '.join(OPTIONS)}")
        choices = {k: v for k, v in choices.items() if k in s.options}
    known = tunable_switches()
    names = (list(known) if s.switches == "all" or (s.switches == "auto" and target.on_gpu)
             else [] if s.switches in ("auto", "none") else list(s.switches))
    for n in names:
        if n not in known:
            raise ValueError(f"search.switches: {n} is not a switch tailored tune may search; "
                             "fix: a TAILORED_* name of docs/switches.md outside 'settings'")
        choices[n] = switch_values(known[n])
    fixed = {}
    for k, v in s.fixed.items():
        if k not in OPTIONS and k not in known:
            raise ValueError(f"search.fixed.{k}: not an option or switch tune knows; fix: "
                             f"one of {', '.join(OPTIONS)} or a TAILORED_* name")
        fixed[k] = v
        choices.pop(k, None)
    if not contract.numerics.may_change:  # nothing that surely changes numerics is drawn
        # (each GDN state dtype either resolves as the default's or changes numerics)
        choices.pop("gdn_state_dtype", None)
        choices = {k: v for k, v in choices.items()
                   if k in COVERED or not numerics_changes({k: v[-1]}, {k: v[0]}, target)}
    choices = {k: v for k, v in choices.items() if len(v) > 1}
    return Space(choices, serve_defaults(target), fixed, target)


def resolved_gdn(v: str, target: Target) -> str:
    if v != "auto":
        return v
    return "bfloat16" if target.model_dtype == "bfloat16" else "float32"


def numerics_changes(cand: dict, base: dict, target: Target) -> list[str]:
    """The candidate's changes against `base` that no invariant covers: each may change the
    output bits, so the accuracy gate decides (and the contract must allow it)."""
    out = []
    known = tunable_switches()
    for k, v in cand.items():
        if base.get(k, v) == v and k in base:
            continue
        if k == "gdn_state_dtype":
            if resolved_gdn(v, target) != resolved_gdn(base.get(k, "auto"), target):
                out.append(k)
        elif k in known:
            if known[k].metadata["numerics"] and v != known[k].default:
                out.append(k)
    return out


def refusals(cand: dict) -> list[str]:
    """Static rules: configurations known to break a named contract (invariants.py), refused
    before anything starts. Each entry: 'contract-name: why'."""
    out = []
    n = cand.get("num_speculative_tokens") or 0
    if n and cand.get("spec_max_running") and cand["spec_max_running"] > cand["max_num_seqs"]:
        out.append("config-consistent: spec_max_running above max_num_seqs")
    need = cand["max_num_seqs"] * (1 + n)
    if cand["max_num_batched_tokens"] < need:
        out.append(f"step-budget-covers-decode: a step of {cand['max_num_seqs']} running "
                   f"requests x {1 + n} tokens needs max_num_batched_tokens >= {need}")
    if cand.get("spec_synthetic_acceptance") is not None:
        out.append("spec-greedy-equals-plain: synthetic acceptance is for benchmarks only")
    return out


def serve_args(cand: dict) -> list[str]:
    """`tailored serve` options of a candidate (its engine options; switches go to the env)."""
    out = []
    for k in OPTIONS:
        v = cand.get(k)
        if v is None or k not in cand:
            continue
        opt = "--" + k.replace("_", "-")
        if isinstance(v, bool):
            out += [opt] if v else []
        else:
            out += [opt, str(v)]
    return out


def switch_env(cand: dict) -> dict[str, str]:
    return {k: (str(int(v)) if isinstance(v, bool) else str(v))
            for k, v in cand.items() if k.startswith(flags.PREFIX)}


def engine_options(cand: dict) -> dict:
    return {k: cand[k] for k in OPTIONS if k in cand}


def switches_of(cand: dict) -> dict:
    return {k: v for k, v in cand.items() if k.startswith(flags.PREFIX)}
