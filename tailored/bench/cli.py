"""`tailored bench`: benchmark an OpenAI-compatible server, compare results, roofline numbers.

    tailored bench [run] --base-url http://127.0.0.1:8000 --concurrency 1,32 --num-prompts 16,256 \\
        --input-len 1024 --output-len 512 --ignore-eos --out result.json
    tailored bench --compare A.json B.json            # ratio table A/B (vllm bench JSONs work too)
    tailored bench roofline --preset full --precision bf16|fp8 --batch 1 [--ctx-len N]
    tailored bench summary --results-dir DIR [--latest bench/results/latest.json]
    tailored bench load --results-dir DIR [--card H100 --commit SHA] [--latest latest.json]
    tailored bench peers --results-dir DIR [--precision fp8] [--latest latest.json]
    tailored bench --plot OUT.png --results-dir DIR | --latest bench/results/latest.json
    tailored bench --plot OUT.png --plot-kind cdf|goodput --plot-inputs A.json B.json ...

`tailored bench ...` and `python -m tailored.bench ...` are the same command.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

MODES = ("run", "compare", "roofline", "summary", "load", "peers", "plot")


def _csv_ints(s: str) -> list[int]:
    try:
        vals = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {s!r}")
    return vals


def _id_range(s: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in s.split(","))
    except ValueError:
        raise SystemExit(f"tailored bench: --token-id-range must be LO,HI, got {s!r}") from None
    if not 0 <= lo < hi:
        raise SystemExit(f"tailored bench: --token-id-range needs 0 <= LO < HI, got {s!r}")
    return lo, hi


def _json_arg(s: str) -> dict:
    """A JSON object, inline or @path."""
    text = Path(s[1:]).read_text() if s.startswith("@") else s
    try:
        v = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
    if not isinstance(v, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return v


def configure_parser(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from tailored.bench import workloads
    from tailored.bench.roofline import DEFAULT_HBM_BW

    p.add_argument(
        "mode",
        nargs="?",
        choices=MODES,
        default=None,
        help="run (default), compare, roofline, summary, load (the load sweep's section of "
        "latest.json), peers (tailored vs SGLang vs vLLM: its `peers` section) or plot",
    )
    g = p.add_argument_group("run: load generation against --base-url")
    g.add_argument(
        "--base-url",
        default="http://127.0.0.1:8000",
        help="server root or .../v1 (default http://127.0.0.1:8000)",
    )
    g.add_argument("--model", default=None, help="model name (default: first of GET /v1/models)")
    g.add_argument(
        "--concurrency",
        type=_csv_ints,
        default=None,
        help="requests in flight, comma list for a sweep (e.g. 1,32; default 1); with "
        "--request-rate the cap in flight",
    )
    g.add_argument(
        "--num-prompts",
        type=_csv_ints,
        default=None,
        help="requests per run: one value or one per concurrency (default 16 at c=1, 8 x c above)",
    )
    g.add_argument(
        "--input-len",
        type=int,
        default=1024,
        help="random prompts: exact prompt length in tokens (sent as token ids)",
    )
    g.add_argument(
        "--output-len",
        type=int,
        default=None,
        help="max_tokens (default 512; prompt files: the line's max_tokens or 512)",
    )
    g.add_argument(
        "--prompt-file",
        nargs="+",
        default=None,
        metavar="JSONL",
        help="prompt files instead of random tokens: lines {prompt} -> /v1/completions,"
        " {messages} -> /v1/chat/completions",
    )
    g.add_argument(
        "--ignore-eos",
        action="store_true",
        help="send ignore_eos=true (vLLM extension) so every output has max_tokens",
    )
    g.add_argument(
        "--token-id-range",
        default="0,248044",
        metavar="LO,HI",
        help="random prompt token ids are drawn from [LO, HI) (default: the regular "
        "Qwen3.6 vocabulary 0..248043; a smaller model needs its own range)",
    )
    g.add_argument("--temperature", type=float, default=0.0, help="default 0 (greedy)")
    g.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    g.add_argument(
        "--num-warmups",
        type=int,
        default=None,
        help="warm-up requests before each run (default: = concurrency)",
    )
    g.add_argument("--request-timeout", type=float, default=1800.0, help="seconds per request")
    g.add_argument(
        "--extra-body",
        type=_json_arg,
        default=None,
        help="JSON object merged into every request body",
    )
    g.add_argument("--out", default=None, help="write the result JSON here")
    g.add_argument("--label", default=None, help="label stored in the result")
    g.add_argument(
        "--checkpoint-dir",
        default=None,
        help="fingerprint this checkpoint dir into the manifest (and use its config "
        "for the roofline)",
    )
    g.add_argument(
        "--engine-config",
        type=_json_arg,
        default=None,
        help="server/engine settings for the manifest: JSON or @file",
    )
    g.add_argument(
        "--precision",
        choices=("bf16", "fp8"),
        default=None,
        help="also report the achieved roofline fraction of every run at this precision",
    )
    g.add_argument("--save-requests", action="store_true", help="keep per-request timings")
    g.add_argument("--no-uvloop", action="store_true", help="plain asyncio even if uvloop exists")

    workloads.add_arguments(p)

    g = p.add_argument_group("compare")
    g.add_argument(
        "--compare",
        nargs=2,
        metavar=("A", "B"),
        default=None,
        help="print A, B and A/B for every metric of the runs both files have",
    )

    g = p.add_argument_group("roofline")
    g.add_argument("--preset", choices=("full", "tiny"), default="full")
    g.add_argument("--config-dir", default=None, help="read config.json here instead of --preset")
    g.add_argument("--batch", type=_csv_ints, default=[1], help="decode batch size(s)")
    g.add_argument("--ctx-len", type=int, default=0, help="context tokens per sequence")
    g.add_argument(
        "--hbm-bw",
        type=float,
        default=DEFAULT_HBM_BW,
        help=f"HBM bandwidth in B/s (default {DEFAULT_HBM_BW:g}, measured on our H200)",
    )
    g.add_argument(
        "--measured-tpot-ms",
        type=float,
        default=None,
        help="report the achieved fraction for this decode step time",
    )
    g.add_argument(
        "--measured-tok-s",
        type=float,
        default=None,
        help="report the achieved fraction for this output rate (c=1)",
    )
    g.add_argument("--json", action="store_true", help="print JSON")

    g = p.add_argument_group("summary, load and plot (side-by-side results)")
    g.add_argument(
        "--results-dir",
        default=None,
        help="summary: folder with tailored-{bf16,fp8}.json and vllm-{bf16,fp8}.json; load and "
        "--plot: folder with the load sweep's {tailored,vllm}-PREC-cC.json and -long-N.json",
    )
    g.add_argument(
        "--latest",
        default=None,
        help="summary and load write their section into this latest.json (other sections "
        "stay); --plot without --results-dir reads its `load` section",
    )
    g.add_argument(
        "--plot",
        default=None,
        metavar="OUT.png",
        help="draw output tok/s and TTFT p50 against concurrency for both engines (needs "
        "matplotlib: the `plot` extra); precision from --precision (default fp8)",
    )
    g.add_argument(
        "--plot-kind",
        choices=("load", "cdf", "goodput"),
        default="load",
        help="--plot draws the load sweep (default), latency CDFs (TTFT, ITL) per engine or "
        "goodput against request rate per engine",
    )
    g.add_argument(
        "--plot-inputs",
        nargs="+",
        default=None,
        metavar="JSON",
        help="cdf / goodput: result files, one line each (default with --results-dir: its "
        "ENGINE-PREC-WORKLOAD.json peers files of --plot-workload)",
    )
    g.add_argument("--plot-workload", default="chat-mix",
                   help="cdf / goodput with --results-dir: the workload's files (default "
                   "%(default)s)")
    g.add_argument("--plot-point", default=None, metavar="c=N|rate=R",
                   help="cdf: the run to draw (default: each file's last)")
    g.add_argument("--card", default=None, help="load/plot: the GPU to state (default: its name)")
    g.add_argument(
        "--commit",
        default=None,
        help="load/plot: the tailored commit to state (default: the one the results recorded)",
    )
    g.add_argument("--note", default=None, help="load: a note stored with the section")
    return p


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register `bench` on the `tailored` CLI's subparsers."""
    p = subparsers.add_parser(
        "bench",
        help="benchmark an OpenAI-compatible server; roofline",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    return configure_parser(p)


def _model_config(args):
    from tailored.bench import roofline
    from tailored.config import ModelConfig

    d = args.config_dir or args.checkpoint_dir
    if d:
        return ModelConfig.from_dir(d)
    return roofline.preset_model_config(args.preset)


def cmd_roofline(args) -> int:
    from tailored.bench import roofline

    cfg = _model_config(args)
    prec = args.precision or "bf16"
    out = []
    for b in args.batch:
        cost = roofline.step_cost(cfg, prec, b, args.ctx_len)
        item = cost.to_dict(args.hbm_bw)
        if args.measured_tpot_ms or args.measured_tok_s:
            item["achieved"] = roofline.roofline_fraction(
                cfg,
                prec,
                tpot_ms=args.measured_tpot_ms,
                tokens_per_s=None if args.measured_tpot_ms else args.measured_tok_s,
                batch=b,
                ctx_len=args.ctx_len,
                hbm_bw=args.hbm_bw,
            )
        out.append(item)
        if not args.json:
            print(roofline.format_report(cost, args.hbm_bw))
            if "achieved" in item:
                a = item["achieved"]
                print(
                    f"{'achieved':<28}  {100 * a['fraction']:.1f}% of the step floor "
                    f"({a['floor_ms']:.3f} ms / measured {a['measured_step_ms']:.3f} ms); "
                    f"weights only {100 * a['weights_only_fraction']:.1f}%"
                )
            print()
    if args.json:
        print(json.dumps(out if len(out) > 1 else out[0], indent=1))
    return 0


def cmd_compare(args) -> int:
    from tailored.bench.results import format_compare

    print(format_compare(*args.compare))
    return 0


def cmd_summary(args) -> int:
    from tailored.bench import sidebyside

    if not args.results_dir:
        print("tailored bench summary: --results-dir is required", file=sys.stderr)
        return 2
    argv = [args.results_dir, "--hbm-bw", str(args.hbm_bw)]
    if args.latest:
        argv += ["--latest", args.latest]
    return sidebyside.main(argv)


def _load_section(args):
    """The load section from --results-dir (assembled) or --latest (read); None after an error
    message."""
    from tailored.bench import loadsweep

    try:
        if args.results_dir:
            return loadsweep.assemble(
                args.results_dir,
                precision=args.precision or "fp8",
                card=args.card,
                commit=args.commit,
                note=args.note,
            )
        if args.latest and args.mode != "load":
            return loadsweep.load_section(args.latest)
    except (loadsweep.NoLoadResults, OSError, ValueError) as e:
        print(f"tailored bench: {e}", file=sys.stderr)
        return None
    print(f"tailored bench {args.mode or 'plot'}: give --results-dir DIR"
          + ("" if args.mode == "load" else " or --latest FILE"), file=sys.stderr)
    return None


def cmd_load(args) -> int:
    from tailored.bench import loadsweep

    load = _load_section(args)
    if load is None:
        return 2
    print(loadsweep.format_load(load))
    if args.latest:
        p = loadsweep.update_latest(args.latest, load)
        print(f"wrote the load section into {p}", file=sys.stderr)
    elif args.json:
        print(json.dumps(load, indent=1))
    return 0


def cmd_peers(args) -> int:
    from tailored.bench import peers

    if not args.results_dir:
        print("tailored bench peers: --results-dir is required", file=sys.stderr)
        return 2
    try:
        section = peers.assemble(args.results_dir, precision=args.precision or "fp8",
                                 card=args.card, commit=args.commit, note=args.note)
    except (peers.NoPeerResults, OSError, ValueError) as e:
        print(f"tailored bench peers: {e}", file=sys.stderr)
        return 2
    print(peers.format_peers(section))
    if args.latest:
        print(f"wrote the peers section into {peers.update_latest(args.latest, section)}",
              file=sys.stderr)
    elif args.json:
        print(json.dumps(section, indent=1))
    return 0


def _plot_latency(args) -> int:
    from tailored.bench import peers, plot, plotlatency

    inputs = args.plot_inputs
    if not inputs and args.results_dir:
        try:
            found = peers.find_files(args.results_dir, args.precision or "fp8")
        except peers.NoPeerResults as e:
            print(f"tailored bench --plot: {e}", file=sys.stderr)
            return 2
        inputs = [p for (_, tag), p in sorted(found.items()) if tag == args.plot_workload]
    if not inputs:
        print("tailored bench --plot: give --plot-inputs FILE... (or --results-dir DIR with "
              "peers files)", file=sys.stderr)
        return 2
    try:
        if args.plot_kind == "cdf":
            p = plotlatency.plot_cdfs(inputs, args.plot, point=args.plot_point, title=args.note)
        else:
            p = plotlatency.plot_goodput(inputs, args.plot, title=args.note)
    except plot.PlotUnavailable as e:
        print(f"tailored bench: {e}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as e:
        print(f"tailored bench --plot: {e}", file=sys.stderr)
        return 2
    print(f"wrote {p} ({p.stat().st_size:,} bytes)", file=sys.stderr)
    return 0


def cmd_plot(args) -> int:
    from tailored.bench import plot

    if args.plot_kind != "load":
        return _plot_latency(args)
    load = _load_section(args)
    if load is None:
        return 2
    try:
        p = plot.plot_load(load, args.plot)
    except plot.PlotUnavailable as e:
        print(f"tailored bench: {e}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"tailored bench --plot: {e}", file=sys.stderr)
        return 2
    print(f"wrote {p} ({p.stat().st_size:,} bytes)", file=sys.stderr)
    return 0


def cmd_run(args) -> int:
    from tailored.bench import loadgen, results, roofline, workloads

    wl = workloads.resolve(args)
    rates = args.request_rate
    concs = args.concurrency or ([0] if rates else [1])
    nps = args.num_prompts or (
        [64] if rates else [loadgen.default_num_prompts(c) for c in concs])
    base = loadgen.Workload(
        base_url=args.base_url,
        model=args.model,
        input_len=args.input_len,
        output_len=args.output_len,
        ignore_eos=args.ignore_eos,
        temperature=args.temperature,
        seed=args.seed,
        prompt_files=tuple(args.prompt_file or ()),
        num_warmups=args.num_warmups,
        request_timeout_s=args.request_timeout,
        extra_body=args.extra_body or {},
        token_id_range=_id_range(args.token_id_range),
        slo_ttft_ms=args.slo_ttft_ms,
        slo_itl_ms=args.slo_itl_ms,
        random_text=args.random_text,
    )
    if wl == "agent-mix":
        return workloads.cmd_agent(args, base)
    runs = loadgen.run_sweep(
        base,
        concs,
        nps,
        keep_requests=args.save_requests,
        use_uvloop=not args.no_uvloop,
        log=loadgen.stderr_log,
        rates=rates,
    )
    if args.precision:
        cfg = _model_config(args)
        out_len = args.output_len or loadgen.DEFAULT_OUTPUT_LEN
        for r in runs:
            if r["completed"] and r["p50_tpot_ms"] == r["p50_tpot_ms"]:  # not NaN
                r["roofline"] = roofline.roofline_fraction(
                    cfg,
                    args.precision,
                    tpot_ms=r["p50_tpot_ms"],
                    batch=r["max_concurrency"],
                    ctx_len=args.input_len + out_len // 2,
                    hbm_bw=args.hbm_bw,
                )
                print(
                    f"c={r['max_concurrency']}: {100 * r['roofline']['fraction']:.1f}% of the "
                    f"{args.precision} roofline (floor {r['roofline']['floor_ms']:.3f} ms/step "
                    f"at {args.hbm_bw / 1e12:.2f} TB/s, measured TPOT p50 "
                    f"{r['p50_tpot_ms']:.3f} ms)",
                    file=sys.stderr,
                )
    workload = base.describe()
    workload.pop("concurrency")
    workload.pop("num_prompts")
    steps = rates or concs
    workload.update(
        concurrency=concs, num_prompts=nps if len(nps) == len(steps) else nps * len(steps),
        workload=wl, request_rate=[workloads.arrivals.rate_label(r) for r in rates or []]
        or "inf", arrivals="poisson" if rates else "closed-loop",
    )
    manifest = results.build_manifest(
        base_url=args.base_url,
        checkpoint_dir=args.checkpoint_dir,
        engine_config=args.engine_config,
        server_label=args.label,
    )
    res = results.make_result(args.label, manifest, workload, runs)
    if args.out:
        p = results.write_result(args.out, res)
        print(f"wrote {p}", file=sys.stderr)
    hdr = (
        f"{'conc':>4} {'done':>9} {'out tok/s':>10} {'req/s':>7} {'TTFT p50':>9} {'p99':>8} "
        f"{'TPOT p50':>9} {'p99':>7} {'ITL p50':>8} {'p99':>7} {'E2E p50':>9}"
    )
    print(hdr)
    for r in runs:
        print(
            f"{r['max_concurrency']:>4} {r['completed']:>4}/{r['num_prompts']:<4} "
            f"{r['output_throughput']:>10.1f} {r['request_throughput']:>7.3f} "
            f"{r['p50_ttft_ms']:>9.1f} {r['p99_ttft_ms']:>8.1f} {r['p50_tpot_ms']:>9.2f} "
            f"{r['p99_tpot_ms']:>7.2f} {r['p50_itl_ms']:>8.2f} {r['p99_itl_ms']:>7.2f} "
            f"{r['p50_e2el_ms']:>9.0f}"
        )
        print(workloads.goodput_line(r))
        for e in r["errors"]:
            print(f"     failed x{e['count']}: {e['error']}")
    return 0 if all(r["failed"] == 0 for r in runs) else 1


def run(args) -> int:
    mode = args.mode or ("compare" if args.compare else "plot" if args.plot else "run")
    for flag, its_mode in (("compare", "compare"), ("plot", "plot")):
        if getattr(args, flag) and mode != its_mode:
            print(f"tailored bench: --{flag} cannot be combined with mode {mode}", file=sys.stderr)
            return 2
    if mode == "compare" and not args.compare:
        print("tailored bench compare: give --compare A.json B.json", file=sys.stderr)
        return 2
    if mode == "plot" and not args.plot:
        print("tailored bench plot: give --plot OUT.png", file=sys.stderr)
        return 2
    args.mode = mode
    return {
        "run": cmd_run,
        "compare": cmd_compare,
        "roofline": cmd_roofline,
        "summary": cmd_summary,
        "load": cmd_load,
        "peers": cmd_peers,
        "plot": cmd_plot,
    }[mode](args)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="tailored bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    configure_parser(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
