#!/usr/bin/env python3
"""Several prompts in one step (kb/0055 §6): the TTFT of K prompts that arrive together (the K
choices of an `n=K` request, or K chats landing in the same few-ms step), with
`TAILORED_PROMPTS_IN_GRAPHS_UP_TO` at each given bound (0: such a step runs the eager forward;
above the step's tokens: each chunk replays its own prefill graph).

In-process, the real engine, scheduler and runner (no HTTP). For each (K, L) of --ks x --lens:
K requests of L random ids each are added, then the engine steps until every one has its first
token; TTFT = add to the last first token. Medians of --reps. Each bound runs in a process of
its own (its switch record parsed from the environment at start, graphs captured under it); the
greedy tokens of every bound are compared.

Usage (GPU): python3 lab/bench_prompts_together.py /tmp/full-fp8 [--bounds 0,2048]
             [--ks 1,2,4] [--lens 128,512,1024] [--reps 5] [--json F]
CPU dry run: python lab/bench_prompts_together.py --nano --lens 16,40 --reps 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from kernel_bench import engine_stack

from tailored import flags
from tailored.engine.types import SamplingParams


def _together(engine, tag: str, prompts: list[list[int]], sp: SamplingParams):
    """(seconds from the first add to the last request's first token, tokens by request)."""
    t0 = time.perf_counter()
    for i, ids in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", ids, sp)
    first, outs, last = set(), {}, None
    while engine.has_unfinished():
        for o in engine.step():
            assert o.error is None, f"{o.request_id}: {o.error}"
            if o.delta_token_ids and o.request_id not in first:
                first.add(o.request_id)
                if len(first) == len(prompts):
                    if torch.cuda.is_available():
                        torch.cuda.synchronize()
                    last = time.perf_counter() - t0
            outs.setdefault(o.request_id, []).extend(o.delta_token_ids)
    return last, [outs[f"{tag}-{i}"] for i in range(len(prompts))]


def _setting(a) -> dict:
    ks = [int(x) for x in a.ks.split(",")]
    lens = [int(x) for x in a.lens.split(",")]
    kw = dict(progress=False, max_model_len=max(lens) + a.tokens + 64, max_num_seqs=max(ks))
    st = engine_stack(a.ckpt, a.nano, **kw)
    engine = st.engine
    vocab = min(st.model_config.vocab_size, 240000)
    g = torch.Generator().manual_seed(0)
    sp = SamplingParams(max_tokens=a.tokens, temperature=0.0, ignore_eos=True)

    def rand(n):
        return torch.randint(0, vocab, (n,), generator=g).tolist()

    for k in ks:  # warm: compiles, the first replay of every graph size used below
        for n in lens:
            _together(engine, f"w{k}-{n}", [rand(n) for _ in range(k)], sp)
    rows, tokens = [], []
    for k in ks:
        for n in lens:
            ts = []
            for r in range(a.reps):
                t, out = _together(engine, f"k{k}-n{n}-r{r}", [rand(n) for _ in range(k)], sp)
                ts.append(1e3 * t)
                tokens.append(out)
            rows.append({"k": k, "len": n, "ttft_ms": statistics.median(ts), "all_ms": ts})
    bound = flags.current().prompts_in_graphs_up_to
    for r in rows:
        print(f"bound {bound:5d}  K={r['k']}  L={r['len']:5d}  TTFT {r['ttft_ms']:8.2f} ms",
              flush=True)
    return {"bound": bound, "rows": rows, "tokens": tokens}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpt", nargs="?", default=None)
    ap.add_argument("--nano", action="store_true", help="the embedded nano model on the CPU")
    ap.add_argument("--bounds", default="0,2048")
    ap.add_argument("--ks", default="1,2,4")
    ap.add_argument("--lens", default="128,512,1024")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=4)
    ap.add_argument("--json", default=None)
    ap.add_argument("--one", action="store_true", help="(internal) one bound; JSON last")
    a = ap.parse_args()
    if a.one:
        print(json.dumps(_setting(a)))
        return
    results, tokens = {}, []
    for b in a.bounds.split(","):
        argv = [x for x in sys.argv[1:]]
        env = dict(os.environ, TAILORED_PROMPTS_IN_GRAPHS_UP_TO=b)
        proc = subprocess.run([sys.executable, __file__, *argv, "--one"], stdout=subprocess.PIPE,
                              text=True, env=env)
        lines = proc.stdout.strip().splitlines()
        print("\n".join(lines[:-1]), flush=True)
        if proc.returncode or not lines:
            raise SystemExit(f"bound {b}: exit {proc.returncode}")
        r = json.loads(lines[-1])
        results[b] = r["rows"]
        tokens.append(r["tokens"])
    same = all(t == tokens[0] for t in tokens)
    print(f"greedy tokens {'equal' if same else 'differ'} across the bounds")
    base = results[a.bounds.split(",")[0]]
    for b, rows in results.items():
        print(f"bound {b:>5}: " + "  ".join(
            f"K{r['k']} L{r['len']} {r['ttft_ms']:.1f} ({r['ttft_ms'] / q['ttft_ms']:.2f}x)"
            for r, q in zip(rows, base)))
    if a.json:
        from tailored.gate.manifest import script_manifest

        with open(a.json, "w") as f:
            json.dump({"manifest": script_manifest(vars(a)), "results": results,
                       "tokens_equal": same}, f, indent=1)


if __name__ == "__main__":
    main()
