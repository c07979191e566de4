"""`tailored tune CONTRACT`: search the engine's configuration for a deployment contract
(docs/tune.md).

    tailored tune contract.yaml --out tune-out/          # study.db, report.json, tune.png,
                                                         # profile.yaml, logs/, bench/, gate/
    tailored tune contract.yaml --out tune-out/          # again: continues where it stopped
    tailored serve CKPT --profile tune-out/profile.yaml
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from tailored.tune.contract import load_contract

REPO = Path(__file__).resolve().parents[2]


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("tune", help="search the engine's configuration for a deployment "
                                    "contract; writes a profile for `serve --profile`",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("contract", help="the deployment contract (YAML, docs/tune.md)")
    p.add_argument("--out", default=None, help="output folder; rerunning with the same one "
                   "continues the search (default: tune-<contract name>)")
    p.add_argument("--trials", type=int, default=None,
                   help="candidates besides the defaults (default: the contract's "
                        "search.trials)")
    p.add_argument("--stop-after", type=int, default=None, metavar="N",
                   help="measure at most N candidates in this invocation, then write the "
                        "report of what is done (rerun to continue) (default: no limit)")
    p.add_argument("--kb", default=None, metavar="DIR",
                   help="the knowledge base the run's record goes to: DIR/tune/, and an index "
                        "line in DIR/README.md if there is one; give the checkout's kb/ to "
                        "keep the record with the project (default: OUT/kb, nothing written "
                        "outside OUT)")
    p.add_argument("--contract-tests", action="store_true",
                   help="before the search, run the tests marked with the contracts the space "
                        "can touch (docs/contracts.md); options whose contracts fail are "
                        "left out (default: off)")
    p.add_argument("--startup-timeout", type=float, default=1800.0,
                   help="seconds a candidate's server may take to answer /health "
                        "(default: %(default)s)")
    p.add_argument("--list-space", action="store_true",
                   help="print the space for this contract and exit")
    return p


def _target(contract):
    import torch

    from tailored.config import ModelConfig
    from tailored.stack import embedded_checkpoint
    from tailored.tune.space import Target

    embedded = contract.checkpoint in (None, "nano")
    ckpt = embedded_checkpoint() if embedded else Path(contract.checkpoint)
    if not (ckpt / "config.json").is_file():
        raise ValueError(f"checkpoint: {ckpt} has no config.json; fix: the checkpoint "
                         "directory, or leave it out for the embedded nano model")
    mc = ModelConfig.from_dir(ckpt)
    if contract.precision and contract.precision != mc.precision:
        raise ValueError(f"precision: the contract says {contract.precision}, {ckpt} is "
                         f"{mc.precision}; fix: precision: {mc.precision}")
    on_gpu = not embedded and torch.cuda.is_available()
    gpu_name = torch.cuda.get_device_name() if on_gpu else "cpu"
    from tailored.tune.profile import same_gpu

    if not same_gpu(contract.gpu, gpu_name):
        raise ValueError(f"gpu: the contract is for {contract.gpu!r}, this machine runs on "
                         f"{gpu_name!r}; fix: tune on that machine, or gpu: "
                         f"{'cpu' if gpu_name == 'cpu' else gpu_name.split()[-1]}")
    target = Target(on_gpu=on_gpu, has_mtp=mc.mtp_num_hidden_layers > 0,
                    model_dtype="bfloat16" if on_gpu else "float32")
    return ckpt, embedded, mc, target, gpu_name


def _contract_tests(space, log) -> None:
    from tailored.tune import invariants

    names = invariants.touched(list(space.choices))
    if not names:
        return
    for name in names:
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--contract",
               name, str(REPO / "tests")]
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
        last = (r.stdout.strip().splitlines() or ["?"])[-1]
        log(f"contract {name}: {last}")
        if r.returncode not in (0, 5):  # 5: no test collected
            dropped = [o for o, cs in invariants.TOUCHED_BY.items() if name in cs
                       and o in space.choices]
            for o in dropped:
                space.choices.pop(o)
            log(f"contract {name} fails its tests: {', '.join(dropped) or 'nothing'} left "
                "out of the space")


def run(args) -> int:
    from tailored import flags
    from tailored.bench import loadgen
    from tailored.bench.results import build_manifest, checkpoint_fingerprint
    from tailored.tokenizer import load_tokenizer
    from tailored.tune import profile as prof, report, search, space as sp
    from tailored.tune.preflight import preflight

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    import logging

    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per probe request otherwise

    contract = load_contract(args.contract)
    if args.trials is not None:
        contract = contract.model_copy(update={"search": contract.search.model_copy(
            update={"trials": args.trials})})
    ckpt, embedded, mc, target, gpu_name = _target(contract)
    space = sp.build_space(contract, target)
    preflight(contract, sp.tunable_switches())  # before any server starts
    if args.list_space:
        print(json.dumps(space.describe(), indent=1, default=str))
        return 0
    try:
        import optuna  # noqa: F401
    except ImportError:
        raise ValueError("tailored tune needs optuna: pip install 'tailored[tune]'") from None
    if args.contract_tests:
        _contract_tests(space, log)
    out = Path(args.out or f"tune-{contract.name}")
    hi = min(load_tokenizer(ckpt).vocab_size, loadgen.REGULAR_TOKEN_IDS[1])
    ctx = search.Context(contract, space, ckpt, hi, out, target.on_gpu,
                         startup_timeout_s=args.startup_timeout, embedded=embedded)
    max_len = contract.memory.max_model_len or (
        contract.traffic.input_tokens + contract.traffic.output_tokens + 256
        if contract.traffic.prompts == "random" else None)
    if max_len:
        ctx.extra_serve_args += ["--max-model-len", str(max_len)]
    ctx.extra_serve_args += ["--gpu-memory-utilization", f"{contract.memory.gpu_memory_utilization:g}"]
    log(f"tune {contract.name}: {len(space.choices)} options searched "
        f"({', '.join(space.choices) or 'none'}), {contract.search.trials} candidates, "
        f"goal {contract.goal}, numerics may change: {contract.numerics.may_change}; out {out}")
    try:
        baseline, records, started, complete = search.run_search(
            ctx, stop_after=args.stop_after, log=log)
    except KeyboardInterrupt:
        kb_arg = f" --kb {args.kb}" if args.kb else ""
        log(f"interrupted: rerun `tailored tune {args.contract} --out {out}{kb_arg}` to "
            "continue")
        return 130
    fp = checkpoint_fingerprint(ckpt)
    manifest = build_manifest(base_url=None, checkpoint_dir=None, engine_config=None,
                              server_label=None)
    manifest.update(checkpoint=fp, precision=mc.precision, gpu=gpu_name,
                    switches=flags.current().snapshot(), optuna=_version("optuna"),
                    serve_args=ctx.extra_serve_args)
    allr = [baseline | {"trial": 0}] + records
    chosen = report.choose(contract, allr)
    profile = prof.make_profile(
        contract.name,
        # the contract's memory settings, as every candidate was served with them
        engine={"max_model_len": max_len,
                "gpu_memory_utilization": contract.memory.gpu_memory_utilization}
        | sp.engine_options(chosen["candidate"]),
        switches=sp.switches_of(chosen["candidate"]), checkpoint=fp, precision=mc.precision,
        gpu=contract.gpu, contract={"name": contract.name, "sha256": contract.sha256()},
        measured={"chosen": chosen["metrics"], "defaults": baseline["metrics"],
                  "trial": chosen["trial"]})
    profile_path = prof.write_profile(out / "profile.yaml", profile)
    plot_path = report.plot(allr, report.pareto(allr), chosen, baseline, out / "tune.png",
                            f"tailored tune {contract.name} on {gpu_name}: "
                            f"{len(records)} candidates")
    rep = report.write_report(out / "report.json", contract=contract, manifest=manifest,
                              space=space.describe(), baseline=baseline, records=records,
                              complete=complete, profile_path=profile_path,
                              plot_path=plot_path)
    kb = report.kb_record(Path(args.kb) if args.kb else out / "kb", started, contract, baseline, records, chosen,
                          out / "report.json", gpu_name)
    g = rep["gain"]
    log(f"chose trial {chosen['trial']} ({', '.join(f'{k}={v}' for k, v in chosen['changed'].items()) or 'the defaults'}): "
        f"output tok/s {g['output_throughput']['defaults']:.1f} -> "
        f"{g['output_throughput']['chosen']:.1f}, TTFT p99 {g['p99_ttft_ms']['defaults']:.1f} "
        f"-> {g['p99_ttft_ms']['chosen']:.1f} ms; SLOs {'met' if rep['chosen']['slo_met'] else 'NOT met'}")
    log(f"wrote {profile_path}, {out / 'report.json'}, {plot_path}, {kb}"
        + ("" if complete else f" ({len(records)}/{contract.search.trials} candidates: rerun "
                               "to continue)"))
    # a run whose chosen point misses an SLO still writes its profile, but a script can tell
    return 0 if rep["chosen"]["slo_met"] else 1


def _version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None
