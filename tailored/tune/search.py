"""The budgeted search: optuna's TPE sampler (constrained by the contract's SLOs) over the
space, one `measure` per candidate, in a study kept in SQLite so a rerun continues.

Resuming: the study (OUT/study.db) holds every finished trial and its record (user attrs),
and the defaults' measurement (study user attr). A trial that was running when the run was
stopped (Ctrl-C, a kill) is marked failed and its candidate queued again; finished trials are
never measured again. The budget (`search.trials`) counts candidates besides the defaults.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from tailored.tune import measure, space as sp

KEPT, REJECTED = "kept", "rejected"


@dataclass
class Context:
    contract: object
    space: sp.Space
    checkpoint: Path
    token_hi: int
    out: Path
    on_gpu: bool
    startup_timeout_s: float = 1800.0
    bench_timeout_s: float = 3600.0
    gate_timeout_s: float = 3600.0
    embedded: bool = False  # the nano model: `tailored serve` without a checkpoint argument
    extra_serve_args: list[str] = field(default_factory=list)


def objective(contract, m: dict) -> float:
    return m["output_throughput"] if contract.goal == "throughput" else m["p99_ttft_ms"]


def slo_violations(contract, m: dict) -> list[str]:
    out = []
    if m.get("failed"):
        out.append(f"{m['failed']} request(s) failed")
    for key, (op, bound) in contract.slo.bounds().items():
        v = m.get(key)
        if v is None or v != v or (v > bound if op == "<=" else v < bound):
            out.append(f"{key} {v if v is None else round(v, 2)} not {op} {bound:g}")
    return out


def constraint_values(contract, m: dict | None) -> list[float]:
    """optuna's constraints (<= 0 is feasible): each SLO's relative excess."""
    if not m:
        return [1.0]
    vals = [float(bool(m.get("failed")))]
    for key, (op, bound) in contract.slo.bounds().items():
        v = m.get(key)
        if v is None or v != v:
            vals.append(1.0)
        else:
            vals.append((v - bound) / bound if op == "<=" else (bound - v) / bound)
    return vals


def evaluate(ctx: Context, cand: dict, label: str, baseline: dict | None) -> dict:
    """Measure one candidate; the record says kept or rejected, and why."""
    t0 = time.monotonic()
    c = ctx.contract
    defaults = ctx.space.defaults
    rec = {"label": label, "candidate": cand,
           "changed": {k: v for k, v in cand.items() if defaults.get(k, None) != v},
           "status": REJECTED, "why": "", "metrics": None, "slo_violations": [],
           "numerics": {"changes": sp.numerics_changes(cand, defaults, ctx.space.target),
                        "outputs_differ": False, "gate": None}}

    def done(status, why):
        rec.update(status=status, why=why, seconds=round(time.monotonic() - t0, 1))
        return rec

    refused = sp.refusals(cand)
    if refused:
        return done(REJECTED, "refused before start: " + "; ".join(refused))
    if rec["numerics"]["changes"] and not c.numerics.may_change:
        return done(REJECTED, f"changes numerics ({', '.join(rec['numerics']['changes'])}); "
                              "the contract has numerics.may_change: false")
    env = measure.child_env(cand)
    args = ([] if ctx.embedded else [str(ctx.checkpoint)]) + ctx.extra_serve_args \
        + sp.serve_args(cand)
    try:
        with measure.Server(args, env, ctx.out / "logs" / f"{label}.log",
                            ctx.startup_timeout_s) as url:
            got = measure.probe(url)
            broken, differs = measure.probe_verdict(got, baseline and baseline.get("probe"))
            rec["probe"] = got
            rec["numerics"]["outputs_differ"] = differs
            if broken:
                return done(REJECTED, "; ".join(broken))
            if differs and not c.numerics.may_change:
                return done(REJECTED, "greedy outputs differ from the defaults' and the "
                                      "contract has numerics.may_change: false")
            rec["metrics"] = measure.run_bench(c, url, ctx.out / "bench" / f"{label}.json",
                                               ctx.token_hi, cand, env, ctx.bench_timeout_s)
    except (measure.CandidateFailed, OSError, ValueError) as e:
        return done(REJECTED, f"did not serve: {e}")
    except Exception as e:  # noqa: BLE001 - a bench timeout, an HTTP error: the candidate fails
        return done(REJECTED, f"failed: {type(e).__name__}: {e}")
    rec["slo_violations"] = slo_violations(c, rec["metrics"])
    if rec["numerics"]["changes"] or differs:
        g = measure.run_gate(c, ctx.checkpoint, cand,
                             ctx.out / "gate" / f"{label}.json", env, ctx.on_gpu,
                             ctx.gate_timeout_s)
        rec["numerics"]["gate"] = g
        if not g["passed"]:
            return done(REJECTED, "accuracy gate breached: " + "; ".join(g["breaches"][:3]))
    return done(KEPT, "SLOs met" if not rec["slo_violations"]
                else "measured; SLOs missed: " + "; ".join(rec["slo_violations"]))


def _status_line(n: int, rec: dict) -> str:
    m = rec.get("metrics") or {}

    def f(k, fmt):
        v = m.get(k)
        return format(v, fmt) if isinstance(v, (int, float)) else "-"

    gate = rec["numerics"]["gate"]
    changed = ", ".join(f"{k}={v}" for k, v in rec["changed"].items()) or "(defaults)"
    return (f"{n:>4} {rec['status']:<8} {f('output_throughput', '9.1f')} "
            f"{f('p50_ttft_ms', '8.1f')} {f('p99_ttft_ms', '8.1f')} {f('p99_itl_ms', '8.1f')} "
            f"{'-' if gate is None else ('pass' if gate['passed'] else 'FAIL'):>5}  {changed}"
            + ("" if rec["status"] == KEPT and not rec["slo_violations"] else f"  [{rec['why']}]"))


HEADER = f"{'#':>4} {'status':<8} {'out tok/s':>9} {'TTFT p50':>8} {'p99':>8} {'ITL p99':>8} {'gate':>5}  candidate"


def run_search(ctx: Context, *, stop_after: int | None = None, log=print) -> tuple:
    """Runs (or continues) the study; returns (baseline record, [trial records])."""
    import optuna
    from tqdm import tqdm

    c = ctx.contract
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    with warnings.catch_warnings():  # optuna 5 deprecates constraints_func (4.x has no other)
        warnings.filterwarnings("ignore", message=".*constraints_func.*")
        sampler = optuna.samplers.TPESampler(
            seed=c.search.seed, n_startup_trials=max(2, min(5, c.search.trials // 3)),
            constraints_func=lambda ft: ft.user_attrs.get("constraints", [1.0]))
    ctx.out.mkdir(parents=True, exist_ok=True)
    study = optuna.create_study(
        study_name=f"{c.name}-{c.sha256()[:12]}", storage=f"sqlite:///{ctx.out / 'study.db'}",
        sampler=sampler, load_if_exists=True,
        direction="maximize" if c.goal == "throughput" else "minimize")
    for t in study.trials:  # stopped mid-measurement: measure it again
        if t.state == optuna.trial.TrialState.RUNNING:
            study.tell(t.number, state=optuna.trial.TrialState.FAIL)
            study.enqueue_trial(t.params)
            log(f"trial {t.number} was interrupted: queued again")
    if "started" not in study.user_attrs:
        study.set_user_attr("started", time.strftime("%Y-%m-%d", time.gmtime()))
    log(HEADER)
    baseline = study.user_attrs.get("baseline")
    if baseline is None:
        baseline = evaluate(ctx, sp.normalize(dict(ctx.space.defaults, **ctx.space.fixed)),
                            "defaults", None)
        if baseline["status"] != KEPT:
            raise RuntimeError(f"the defaults did not measure: {baseline['why']}")
        study.set_user_attr("baseline", baseline)
    else:
        log("resuming: the defaults and "
            f"{sum('record' in t.user_attrs for t in study.trials)} trial(s) already measured")
    log(_status_line(0, baseline))

    def finished():
        return [t for t in study.trials if "record" in t.user_attrs]

    bar = tqdm(total=c.search.trials, initial=min(len(finished()), c.search.trials),
               desc=f"tune {c.name}", unit="trial", leave=False)
    t_end = time.monotonic() + (c.search.time_budget_s or float("inf"))
    ran = 0
    try:
        while len(finished()) < c.search.trials and time.monotonic() < t_end \
                and (stop_after is None or ran < stop_after):
            trial = study.ask()
            cand = ctx.space.suggest(trial)
            prior = next((t.user_attrs["record"] for t in finished()
                          if t.user_attrs["record"]["candidate"] == cand), None)
            if prior is not None:
                rec = dict(prior, label=f"trial-{trial.number}",
                           why=f"same candidate as {prior['label']}: {prior['why']}")
            else:
                try:
                    rec = evaluate(ctx, cand, f"trial-{trial.number}", baseline)
                except KeyboardInterrupt:
                    study.tell(trial, state=optuna.trial.TrialState.FAIL)
                    study.enqueue_trial(trial.params)
                    raise
            trial.set_user_attr("record", rec)
            trial.set_user_attr("constraints", constraint_values(c, rec["metrics"]))
            if rec["status"] == KEPT:
                study.tell(trial, objective(c, rec["metrics"]))
            else:
                study.tell(trial, state=optuna.trial.TrialState.FAIL)
            ran += 1
            bar.update(1)
            bar.clear()
            log(_status_line(trial.number + 1, rec))
    finally:
        bar.close()
    return baseline, [t.user_attrs["record"] | {"trial": t.number + 1} for t in finished()], \
        study.user_attrs["started"], len(finished()) >= c.search.trials


def space_of(ctx: Context) -> dict:
    return ctx.space.describe() | {"target": dataclasses.asdict(ctx.space.target)}
