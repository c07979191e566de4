#!/usr/bin/env python3
"""The scheduling variants under closed-loop load in one process (kb/0063, kb/0068): the step
budget (`--prefill-stall-factor`), the mixed-step graphs (`TAILORED_MIXED_GRAPH_TOKENS`) and
the eager fold (`TAILORED_MIXED_EAGER_FROM`) side by side on one model load, so one device
call holds the whole A/B (a served sweep costs a server start a variant).

The real engine, scheduler and runner, no HTTP: c clients, each sending its next prompt (random
ids, ignore_eos, greedy) as soon as its answer ended, as `tailored bench` runs them. Per
(variant, c): output tok/s, TTFT and ITL p50/p99 (ITL pooled over every gap, as
bench/loadgen.py), steps by kind from the engine's stats. A variant is NAME:FACTOR:GRAPH:FOLD,
e.g. `budget+mixed:2.5:1024:0`, with an optional fifth field of switches for its runs,
`TAILORED_NAME=VALUE` joined by `+` (per-step switches only: a layout read at start stays), e.g.
`w8a8:0:0:0:TAILORED_MOE_W8A8_FROM=1024+TAILORED_PREFILL_ATTENTION=fa3`; its mixed graphs
are captured when it first runs (the capture time is printed) and kept for later variants
that name the same limit. Each variant first runs a short round of its own (kernels its
switches reach compile and tune there, outside its timed runs). Ratios between variants
on one card are the result; the served sweep (lab/side_by_side.sh load) stays the record
beside vLLM.

Usage (GPU): python3 lab/engine_load.py /tmp/full-fp8 [--concurrency 64,128]
             [--prompts 256,512] [--variants off:0:0:0,budget:2.5:0:0,budget+mixed:2.5:1024:0]
             [--json F]
CPU dry run: python lab/engine_load.py --nano --concurrency 4 --prompts 8 --input-len 40
             --output-len 8
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import time

import torch

from kernel_bench import engine_stack, manifest

from tailored import flags
from tailored.engine.step_budget import StepBudget
from tailored.engine.types import SamplingParams


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(q / 100 * len(s)))]


def closed_loop(engine, tag: str, c: int, prompts: list[list[int]], out_len: int) -> dict:
    """Run every prompt through `engine` with at most c in flight; the load's numbers."""
    sp = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
    sent, times, done, tokens = {}, {}, 0, 0
    nxt = 0
    t0 = time.perf_counter()
    while done < len(prompts):
        while nxt < len(prompts) and nxt - done < c:
            rid = f"{tag}-{nxt}"
            engine.add_request(rid, prompts[nxt], sp)
            sent[rid], times[rid] = time.perf_counter(), []
            nxt += 1
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            if o.error is not None:
                raise RuntimeError(f"{o.request_id}: {o.error}")
            times[o.request_id] += [now] * len(o.delta_token_ids)
            tokens += len(o.delta_token_ids)
            done += o.finished
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    dur = time.perf_counter() - t0
    ttft = [(t[0] - sent[r]) * 1e3 for r, t in times.items() if t]
    itl = [(b - a) * 1e3 for t in times.values() for a, b in zip(t, t[1:]) if b > a]
    # several tokens in one step's output (drafts) count as one gap and zeros: pooled as
    # bench/loadgen.py pools a stream's chunks, only gaps between outputs
    return {"c": c, "prompts": len(prompts), "tok_s": tokens / dur, "duration_s": dur,
            "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99),
            "itl_p50": pct(itl, 50), "itl_p99": pct(itl, 99)}


def switch_overrides(spec: str) -> dict:
    """{field: value} of `TAILORED_A=x+TAILORED_B=y`, parsed and checked by the switch table."""
    if not spec:
        return {}
    env = dict(p.split("=", 1) for p in spec.split("+"))
    parsed = flags.Flags.from_env(env)
    return {f.name: getattr(parsed, f.name) for f in dataclasses.fields(flags.Flags)
            if f.metadata["env"] in env}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("ckpt", nargs="?", help="config-only checkpoint dir (dummy weights)")
    ap.add_argument("--nano", action="store_true", help="CPU dry run on the embedded model")
    ap.add_argument("--concurrency", default="64,128")
    ap.add_argument("--prompts", default="256,512", help="prompts per concurrency")
    ap.add_argument("--variants", default="off:0:0:0,budget:2.5:0:0,budget+mixed:2.5:1024:0")
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=512)
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if not a.nano and not a.ckpt:
        ap.error("give a checkpoint dir, or --nano for the CPU dry run")
    cs = [int(x) for x in a.concurrency.split(",")]
    ns = [int(x) for x in a.prompts.split(",")]
    variants = []
    for v in a.variants.split(","):
        name, factor, graph, fold, *more = v.split(":")
        variants.append((name, float(factor), int(graph), int(fold),
                         switch_overrides(more[0] if more else "")))
    st = engine_stack(a.ckpt, a.nano, progress=False, max_num_seqs=a.max_num_seqs,
                      max_model_len=a.input_len + a.output_len + 64)
    engine, vocab = st.engine, st.model_config.vocab_size
    kf = engine.runner.kernel  # the kernel path's dispatch (None on the plain path)
    rng = random.Random(a.seed)
    man = manifest(a, "dummy" if not a.nano else "nano") if torch.cuda.is_available() else {
        "workload": vars(a)}
    rows, families = [], {0: []}
    # one short round first: compiles and first-use costs stay out of every variant
    closed_loop(engine, "warm", min(cs), [[rng.randrange(vocab) for _ in range(a.input_len)]
                                         for _ in range(min(cs))], 8)
    for name, factor, graph, fold, switches in variants:
        if kf is not None and graph not in families:
            from tailored.worker.mixed_graphs import mixed_families

            t0 = time.perf_counter()
            with flags.override(mixed_graph_tokens=graph):
                families[graph] = mixed_families(kf)
            print(f"{name}: mixed graphs ({graph} tokens) captured in "
                  f"{time.perf_counter() - t0:.1f} s: "
                  f"{sum(len(m.graphs) for m in families[graph])}", flush=True)
        if kf is not None:
            kf.mixed = families.get(graph, [])
        engine.scheduler.budget = StepBudget(factor, flags.current().min_prefill_chunk)
        engine.timer.notes = engine.scheduler.budget.describe  # the summary's fit line
        with flags.override(mixed_eager_from=fold, **switches):
            closed_loop(engine, f"warm-{name}", min(cs),
                        [[rng.randrange(vocab) for _ in range(a.input_len)]
                         for _ in range(min(cs))], 8)
            for c, n in zip(cs, ns):
                prompts = [[rng.randrange(vocab) for _ in range(a.input_len)] for _ in range(n)]
                engine.timer.reset()
                row = closed_loop(engine, f"{name}-{c}", c, prompts, a.output_len)
                row.update(variant=name, stall_factor=factor, mixed_graph_tokens=graph,
                           mixed_eager_from=fold, switches=switches,
                           steps={k: v.steps for k, v in engine.timer.kinds.items()},
                           timing=engine.timer.summary())
                rows.append(row)
                print(f"{name:>14} c={c:<4} {row['tok_s']:8.0f} tok/s  TTFT p50 "
                      f"{row['ttft_p50']:7.0f} p99 {row['ttft_p99']:7.0f} ms  ITL p50 "
                      f"{row['itl_p50']:6.1f} p99 {row['itl_p99']:6.1f} ms  {row['steps']}\n"
                      f"    {row['timing']}", flush=True)
                if a.json:
                    with open(a.json, "w") as f:
                        json.dump({"manifest": man, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
