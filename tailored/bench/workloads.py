"""`tailored bench` options for the traffic shapes beside random prompts (docs/benchmarks.md
#workloads): the chat mix (a committed prompt file), the agent mix (agentmix.py), Poisson
request-rate sweeps (arrivals.py) and goodput under an SLO (goodput.py).

    tailored bench --workload chat-mix --request-rate 1,2,4,inf --num-prompts 100
    tailored bench --workload agent-mix --agent-system-prompts 4 --agent-conversations 32 \\
        --agent-turns 6 --concurrency 16 --out agent.json
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from tailored.bench import agentmix, arrivals, goodput, loadgen, results

CHAT_MIX = Path(__file__).resolve().parents[2] / "bench" / "prompts" / "chat-mix.jsonl"
WORKLOADS = ("random", "prompt-file", "chat-mix", "agent-mix")


def _rates(s: str) -> list[float]:
    try:
        return arrivals.parse_rates(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _slo_ms(s: str) -> float:
    """An SLO bound in milliseconds: a finite number > 0."""
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {s!r}") from None
    if not (v > 0 and v != float("inf")):
        raise argparse.ArgumentTypeError(f"must be a finite number of milliseconds > 0, got {s}")
    return v


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workloads, arrivals and goodput (docs/benchmarks.md#workloads)")
    g.add_argument("--workload", choices=WORKLOADS, default=None,
                   help="random token ids (default without --prompt-file), prompt-file, "
                        "chat-mix (bench/prompts/chat-mix.jsonl: 100-4,000 tokens in, 50-1,000 "
                        "out, lognormal) or agent-mix (multi-turn conversations over shared "
                        "long system prompts with tools)")
    g.add_argument("--request-rate", type=_rates, default=None, metavar="R[,R2,...]",
                   help="Poisson arrivals at R requests/s (inf: all at once), one run per rate; "
                        "--concurrency then caps the requests in flight (default: no cap); "
                        "the arrival times follow --seed")
    g.add_argument("--slo-ttft-ms", type=_slo_ms, default=goodput.DEFAULT_TTFT_MS,
                   help="goodput counts requests with TTFT <= this (default %(default)g)")
    g.add_argument("--slo-itl-ms", type=_slo_ms, default=goodput.DEFAULT_ITL_MS,
                   help="... and time per output token <= this (default %(default)g); the run's "
                        "ITL p99 is checked against it too")
    g.add_argument("--random-text", action="store_true",
                   help="random prompts as text of exactly --input-len Qwen3.6 tokens instead "
                        "of token ids (gateways such as SMG take text prompts only)")
    d = agentmix.AgentMix()
    g.add_argument("--agent-system-prompts", type=int, default=d.system_prompts,
                   help="agent mix: distinct system prompts (default %(default)s)")
    g.add_argument("--agent-conversations", type=int, default=d.conversations,
                   help="agent mix: conversations, spread over the system prompts "
                        "(default %(default)s); --concurrency = conversations at once")
    g.add_argument("--agent-turns", type=int, default=d.turns,
                   help="agent mix: turns per conversation (default %(default)s)")
    g.add_argument("--agent-system-tokens", type=int, default=d.system_tokens,
                   help="agent mix: tokens of each system prompt, tools aside "
                        "(default %(default)s)")
    g.add_argument("--agent-tool-tokens", type=int, default=d.tool_tokens,
                   help="agent mix: tokens of each tool result (default %(default)s)")
    g.add_argument("--agent-source", default=None, metavar="JSONL",
                   help="agent mix: prompt file whose text builds the prompts (default: the "
                        "chat mix)")


def resolve(args) -> str:
    """The workload's name; sets --prompt-file for the chat mix."""
    wl = args.workload or ("prompt-file" if args.prompt_file else "random")
    if wl == "chat-mix":
        if args.prompt_file:
            raise SystemExit("tailored bench: --workload chat-mix brings its own prompt file")
        args.prompt_file = [str(CHAT_MIX)]
    elif wl == "prompt-file" and not args.prompt_file:
        raise SystemExit("tailored bench: --workload prompt-file needs --prompt-file")
    if args.request_rate and args.concurrency and len(args.concurrency) > 1:
        raise SystemExit("tailored bench: with --request-rate, --concurrency is one cap")
    return wl


def agent_mix_of(args) -> agentmix.AgentMix:
    return agentmix.AgentMix(
        system_prompts=args.agent_system_prompts, conversations=args.agent_conversations,
        turns=args.agent_turns, system_tokens=args.agent_system_tokens,
        tool_tokens=args.agent_tool_tokens, max_tokens=args.output_len or 128, seed=args.seed,
        source=args.agent_source or str(CHAT_MIX))


def cmd_agent(args, base: loadgen.Workload) -> int:
    """The agent mix: one run (its conversations), a result file like the others'."""
    mix = agent_mix_of(args)
    if args.num_warmups is None:
        base.num_warmups = 2
    base.concurrency = args.concurrency[0] if args.concurrency else 0
    if args.request_rate:
        raise SystemExit("tailored bench: the agent mix sends turns as answers end; "
                         "--request-rate does not apply")
    if not args.no_uvloop:
        loadgen.stderr_log(f"event loop: {loadgen.install_uvloop()}")
    run = asyncio.run(agentmix.run_agent_mix(base, mix, keep_requests=args.save_requests,
                                             log=loadgen.stderr_log))
    workload = {**base.describe(), **mix.describe()}
    workload.update(dataset="agent-mix", prompt_files=[], output_len=mix.max_tokens)
    manifest = results.build_manifest(base_url=args.base_url, checkpoint_dir=args.checkpoint_dir,
                                      engine_config=args.engine_config, server_label=args.label)
    res = results.make_result(args.label, manifest, workload, [run])
    if args.out:
        print(f"wrote {results.write_result(args.out, res)}", file=sys.stderr)
    a = run["agent"]
    print(f"{'turn':>4} {'done':>9} {'TTFT p50':>9} {'p99':>8} {'prompt tok':>11} "
          f"{'cached tok':>11}")
    for t in a["per_turn"]:
        print(f"{t['turn']:>4} {t['completed']:>4}/{t['requests']:<4} {t['p50_ttft_ms']:>9.1f} "
              f"{t['p99_ttft_ms']:>8.1f} {t['prompt_tokens']:>11} {t['cached_tokens']:>11}")
    print(f" all {run['completed']:>4}/{run['num_prompts']:<4} {run['p50_ttft_ms']:>9.1f} "
          f"{run['p99_ttft_ms']:>8.1f} {a['prompt_tokens']:>11} {a['cached_tokens']:>11}  "
          f"({100 * a['cached_fraction']:.1f} % cached"
          f"{'' if a['cached_tokens_reported'] else ', the server reports no cached_tokens'})")
    print(goodput_line(run))
    for e in run["errors"]:
        print(f"     failed x{e['count']}: {e['error']}")
    return 0 if run["failed"] == 0 else 1


def goodput_line(r: dict) -> str:
    slo = r["slo"]
    rate = r.get("request_rate")
    head = f"rate {rate}/s: " if rate not in (None, "inf") else ""
    return (f"     {head}goodput {r['request_goodput']:.3f} req/s, {r['output_goodput']:.1f} "
            f"out tok/s ({r['good_requests']}/{r['num_prompts']} within TTFT <= "
            f"{slo['ttft_ms']:g} ms and TPOT <= {slo['itl_ms']:g} ms; p99 SLO "
            f"{'met' if r['slo_p99_met'] else 'NOT met'})")
