#!/usr/bin/env python3
"""When do drafts pay (kb/0062): output tok/s of greedy requests at c = 1, 2, 4 ... with no
drafts, with the MTP head's drafts at a synthetic acceptance, and with prompt lookup that finds
nothing (random weights never repeat), its draft length adaptive (pauses: steps launched ahead
as without drafts) or fixed (every step waits for the previous one's token to look up).

In-process, one stack (dummy weights, 2 drafts, synthetic acceptance --rate, drafting while up
to max(--batches) run); each row switches the scheduler's drafting (engine/drafting.py) on
the same runner, so every row shares weights, graphs and warm-up:
  plain         no drafts (Drafting.on off): decode graphs, async scheduling
  mtp           MTP drafts, adaptive length (the default)
  mtp fixed     MTP drafts, always 2
  lookup        prompt lookup alone, adaptive: finds nothing, pauses
  lookup fixed  prompt lookup alone, always looking: finds nothing, every step synchronous
Each (row, c) runs c requests of --prompt random ids and --tokens greedy tokens, twice (the
first warms up), and reports the second: output tokens / wall time.

Usage (GPU): python3 lab/bench_spec_policy.py /tmp/full-fp8 [--batches 1,2,4]
             [--prompt 512] [--tokens 256] [--rate 0.8] [--json F]
CPU dry run: python lab/bench_spec_policy.py --nano --batches 1,2 --tokens 16 --prompt 32
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import time

from tailored.engine.types import SamplingParams
from tailored.stack import build_stack, embedded_checkpoint

ROWS = {  # Drafting fields, spec_min_acceptance
    "plain": (dict(on=False), 0.5),
    "mtp": (dict(on=True, mtp=True, ngram=False), 0.5),
    "mtp fixed": (dict(on=True, mtp=True, ngram=False), 0.0),
    "lookup": (dict(on=True, mtp=False, ngram=True), 0.5),
    "lookup fixed": (dict(on=True, mtp=False, ngram=True), 0.0),
}


def run(eng, c: int, prompt: int, tokens: int, seed: int) -> float:
    rng = random.Random(seed)
    vocab = min(eng.model_config.vocab_size - 64, 200000)
    for i in range(c):
        eng.add_request(f"r{seed}-{i}", [rng.randrange(64, vocab) for _ in range(prompt)],
                        SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
    t = time.perf_counter()
    n = 0
    while eng.has_unfinished():
        for o in eng.step():
            n += len(o.delta_token_ids)
    return n / (time.perf_counter() - t)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("ckpt", nargs="?")
    ap.add_argument("--nano", action="store_true")
    ap.add_argument("--batches", default="1,2,4")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rate", type=float, default=0.8)
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    kw = dict(num_speculative_tokens=2, spec_synthetic_acceptance=args.rate,
              spec_max_running=max(batches), max_num_seqs=max(batches),
              max_model_len=args.prompt + args.tokens + 16)
    if args.nano:
        st = build_stack(embedded_checkpoint(), device="cpu", dtype="float32", kernels="off",
                         **kw)
    else:  # as `tailored serve` runs on CUDA, without prefill graphs (decode is measured)
        st = build_stack(args.ckpt, load_format="dummy", device="cuda", dtype="bfloat16",
                         max_num_batched_tokens=8192, async_scheduling=True, **kw)
    eng = st.engine
    drafts = eng.scheduler.drafts
    config = drafts.config
    results = []
    for c in batches:
        base = None
        for row in args.rows.split(","):
            fields, ma = ROWS[row]
            for k, v in fields.items():
                setattr(drafts, k, v)
            drafts.config = dataclasses.replace(config, spec_min_acceptance=ma)
            drafts.paces.clear()
            run(eng, c, args.prompt, args.tokens, seed=1)
            before = list(eng.runner.spec_stats)
            tps = run(eng, c, args.prompt, args.tokens, seed=2)
            v, d, k = (a - b for a, b in zip(eng.runner.spec_stats, before))
            base = tps if row == "plain" else base
            rel = f"{tps / base:6.3f}x" if base else ""
            results.append(dict(c=c, row=row, tok_s=tps, verify_steps=v, drafts=d, kept=k))
            print(f"c={c:<3} {row:<13} {tps:9.1f} tok/s {rel}  verify steps {v:6d} drafts "
                  f"{d:6d} kept {k:6d}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
